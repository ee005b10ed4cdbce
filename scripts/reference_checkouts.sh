#!/usr/bin/env bash
# The reference checkouts the side-by-side harnesses import (scripts/reference_*.py; not part of Cadence):
# each family's own code at the commit its fixtures and timings name, source files only (Python, configs,
# shell, README / LICENSE; nothing over 150 kB: no prompt lists, notebooks, weights or wheels), written to
# .ref/<name>/ with the commit in .ref/<name>/COMMIT. Small enough to carry to the GPU machine (~2 MB in all).
# Where it belongs: run by hand before the families-* device plans (scripts/device_plans.toml carry .ref).
#   Usage (repo root):  MIRROR=/path/to/mirrors bash scripts/reference_checkouts.sh
# MIRROR holds one bare git dir per repository, <owner>+<name>/repo (what the session's fetch tool makes);
# with GIT_URL=1 the repositories are cloned from GitHub instead (a machine with internet).
set -euo pipefail
MIRROR=${MIRROR:-/work/.mirror}
DEST=${DEST:-.ref}
# name  owner/repo  commit (why this one)
REFS=(
  "Self-Forcing guandeh17/Self-Forcing 33593df3e81fa3ec10239271dd2c100facac6de1"       # the fixtures' commit
  "CausVid tianweiy/CausVid ca2115039172dfa3a02deee1534408a09680f29f"                  # master (Oct 2025)
  "LongLive NVlabs/LongLive e52d9ef6865d843282a6b5e9d46d03b35f88929d"                  # v1.0, the fixtures'
  "realtime-video krea-ai/realtime-video acf4b7b4e1a3049a0e04782e751d12203334038d"     # the Krea fixture's
  "SoulX-FlashTalk Soul-AILab/SoulX-FlashTalk 688982effe0e77eb21796e3e6848b3792b391c3e" # the fixture's
  "taehv madebyollin/taehv 1f14a568f24bf8811e0a0ac601613e04fc1581e8"                   # the TAEHV fixture's
)
for line in "${REFS[@]}"; do
  read -r name repo commit <<<"$line"
  if [[ ${GIT_URL:-0} == 1 ]]; then
    gd=$(mktemp -d)/repo
    git clone --quiet --bare "https://github.com/$repo" "$gd"
  else
    gd="$MIRROR/${repo/\//+}/repo"
  fi
  rm -rf "${DEST:?}/$name"
  mkdir -p "$DEST/$name"
  mapfile -t paths < <(git --git-dir="$gd" ls-tree -r -l "$commit" 2>/dev/null | awk '$4 != "-" && $4 < 150000 {print $5}' |
    grep -E '(\.py|\.yaml|\.yml|\.sh|\.txt|\.toml|README\.md|LICENSE(\.md)?)$')
  git --git-dir="$gd" archive "$commit" -- "${paths[@]}" | tar -x -C "$DEST/$name"
  echo "$commit" >"$DEST/$name/COMMIT"
  echo "$name $commit: ${#paths[@]} files, $(du -sh "$DEST/$name" | cut -f1)"
done
