#!/usr/bin/env bash
# Issue 17, session 9 (FP8 convs) on ONE H200, <= ~9 minutes:
#   1. scripts/device_vae_fp8.py: per conv shape of the Wan 2.2 decoder at 704x1088, parity and time of the
#      Triton FP8 kernel and (when the cudnn frontend wheel is carried in .whl_fp8/) cuDNN's FP8 conv fprop,
#      against cuDNN's bf16 conv3d; the image error of a random-weight decoder stream (bf16 / FP8 vs fp32)
#   2. `cadence bench vae --variant 2.2 --height 704 --width 1088 --cudnn-benchmark` with --fast compile and
#      --fast fp8 (CADENCE_CONV_FP8 = each of $FP8_BACKENDS)
# Usage (repo root):  CADENCE_GIT=<sha> bash scripts/device_vae_fp8.sh ; results in $OUT/vae_fp8.tgz + a table
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}; MODES=${MODES:-"compile"}; FP8_BACKENDS=${FP8_BACKENDS:-triton}
PARTS=${PARTS:-layers,stream}; VAE_FLAGS=${VAE_FLAGS:---cudnn-benchmark}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

if ls .whl_fp8/*.whl >/dev/null 2>&1; then  # the cudnn frontend (no internet there)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fp8site .whl_fp8/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fp8site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())'
export CADENCE_FP8_PARTS=$PARTS; [ -n "$PARTS" ] && run ${FP8_S:-220} fp8-layers-stream python3 scripts/device_vae_fp8.py "$PERF/fp8.json"
V="python3 -m cadence bench vae --variant 2.2 --height 704 --width 1088 --chunks 8 --warmup 3 --out-dir $PERF $VAE_FLAGS"
for m in $MODES; do run 150 "vae2.2-$m" $V --fast "$m"; done
for be in $FP8_BACKENDS; do (export CADENCE_CONV_FP8=$be; run 200 "vae2.2-fp8-$be" $V --fast fp8); done
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("vae/*.json")):
    r = json.loads(f.read_text())["results"]
    print(f"vae {r['variant']} {r['height']}x{r['width']} {r.get('fast')}: cudnn.benchmark {r['cudnn_benchmark']}: "
          f"per chunk {r['per_chunk_ms']:.1f} ms p99 {r['per_chunk_p99_ms']:.1f} first {r['first_chunk_ms']:.1f}")
PY
tar czf "$OUT/vae_fp8.tgz" -C "$OUT" perf && ls -R "$PERF" | head -20
