#!/usr/bin/env bash
# The tile kernel with its final defaults (pointer loads, flag a quarter into the next tile): bench
# fused recorded, then the W14 TP=2 pipeline (the serve worker's path) with --comm tiles vs two_shot.
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
TR="torchrun --standalone --nproc_per_node 2"
run 80 fused-tiles $TR -m cadence bench fused --modes two_shot,tiles --sweep-mode tiles --out-dir "$PERF"
for comm in tiles two_shot; do
  run 90 "w14-pipeline-$comm" $TR -m cadence bench pipeline --preset w14 --tp 2 --decoder taehv --kv-fp8 --fp8 \
    --compile --chunks 40 --shape-change-every 0 --comm $comm --out-dir "$PERF" \
    | grep -E "fps \(sustained\)|chunk p50|ttff  |diffusion /|graphs  |===|rror"
done
echo "=== done in ${SECONDS}s"
