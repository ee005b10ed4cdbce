#!/usr/bin/env bash
# Issue 17, session 10 (FP8 convs, delayed activation scaling) on ONE H200, one call of <= ~9.5 minutes:
#   1. scripts/device_vae_fp8_delayed.py: GPU parity of the quantisation (per call / delayed), the image error
#      of a random-weight Wan 2.2 stream (per call vs delayed), the 704x1088 chunk time per scaling, profiles
#   2. `cadence bench pipeline --preset w14` on one GPU (decode on a side stream of the same GPU) with the
#      full Wan decoder, --decoder-fast fp8 (delayed scaling) and --decoder-fast compile
# Usage (repo root):  CADENCE_GIT=<sha> bash scripts/device_vae_fp8_delayed.sh ; results in $OUT/perf + a table
set -uo pipefail
BUDGET_S=${BUDGET_S:-570}; CHUNKS=${CHUNKS:-80}; PIPE_MODES=${PIPE_MODES:-"fp8 compile"}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
run ${FP8_S:-250} fp8-delayed python3 scripts/device_vae_fp8_delayed.py "$PERF/fp8_delayed.json"
P="python3 -m cadence bench pipeline --preset w14 --chunks $CHUNKS --device cuda:0 --decode-device same --decoder wan --kv-fp8 --fp8 --compile --shape-change-every 0 --out-dir $PERF"
for m in $PIPE_MODES; do run ${PIPE_S:-160} "pipe-w14-$m" $P --decoder-fast "$m"; done
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    r = json.loads(f.read_text())["results"]
    print(f"pipe {f.stem}: {r['fps']:.1f} fps, latency p50/p99 {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} ms, "
          f"diff {r['diffusion_ms']:.0f} dec {r['decode_ms']:.0f} ms, ttff {r['ttff_ms']:.0f} (1st decode "
          f"{r.get('first_chunk_decode_ms') or 0:.0f}), miss {r['deadline_misses']}/{r['chunks']}, prewarm {r.get('prewarm_s') or 0:.0f} s")
PY
ls -R "$PERF" | head -20
