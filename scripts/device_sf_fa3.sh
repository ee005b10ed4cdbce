#!/usr/bin/env bash
# NEXT.md item 3 on ONE H200: Self-Forcing (Wan 2.1 VAE) with `--attention fa3` (FlashAttention-3 FP8, per-head
# scales, through cadence/kernels/fa3_adapter.py) beside the same command with the attention `auto` picks, in
# one call on one GPU: the commands of scripts/device_families.sh PART=cadence ONLY=self-forcing-wan (40 chunks,
# no prompt change, --kv-fp8 --fp8 --compile --decoder-fast compile), random weights. ~4 minutes.
# The reference side is not re-run: docs/perf/reference/2026-12-02/reference/self-forcing-wan.json (compiled,
# default mode: 16.7 fps run / 17.8 steady).
# Usage (repo root; carry the FA3 wheel: .whl/fa3_fwd-*.whl):  CADENCE_GIT=<sha> bash scripts/device_sf_fa3.sh
# Outputs: $OUT/sf-fa3.tgz (perf/cadence/self-forcing-wan-{fa3,auto}/pipeline/*.json); a line per run last.
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
SITE=/tmp/attn_site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/fa3_fwd-*.whl 2>&1 | tail -2
export PYTHONPATH=$PYTHONPATH:$SITE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; from cadence.kernels import fa3_adapter as f; print("torch", torch.__version__, "| fa3:", f.why_not(torch.device("cuda"), 128, True) or "importable")'
C="python3 scripts/reference_cadence_run.py bench pipeline --device cuda:0 --decode-device same --compile"
C="$C --model self-forcing --fp8 --kv-fp8 --decoder wan --decoder-fast compile --chunks 40 --shape-change-every 0"
run 160 C-self-forcing-wan-fa3 $C --attention fa3 --out-dir "$PERF/cadence/self-forcing-wan-fa3"
run 150 C-self-forcing-wan-auto $C --out-dir "$PERF/cadence/self-forcing-wan-auto"
tar -czf "$OUT/sf-fa3.tgz" -C "$OUT" perf 2>/dev/null
python3 - "$PERF" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("cadence/*/pipeline/*.json")):
    d = json.loads(f.read_text()); r = d["results"]
    att = "fa3" if "--attention fa3" in (d.get("command") or "") else "auto"
    print(f"{f.parent.parent.name}: {r['fps']:.1f} fps, latency p50/p99 {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} ms, "
          f"diff {r['diffusion_ms']:.0f} dec {r['decode_ms']:.0f} ms, miss {r['deadline_misses']}/{r['chunks']}, "
          f"ttff {r['ttff_ms']:.0f} ms, attention {att}, peak {r.get('peak_mem_process_gib', r.get('peak_mem_gib'))} GiB")
PY
echo "=== done in ${SECONDS}s"
