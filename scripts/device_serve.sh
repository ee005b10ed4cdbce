#!/usr/bin/env bash
# One device call for issue 6 (the live server) on nvidia-h200 (one GPU).
# Usage on the device machine (repo root, with .whl/ carried):
#   CADENCE_GIT=<sha> BUDGET_S=290 bash scripts/device_serve.sh
# The GPU machine has no internet and no serving packages: the wheels in .whl/ (fastapi, starlette,
# uvicorn, aiortc, av, ...) are installed into /tmp/site first. Then `cadence bench serve` starts its own
# server (one worker process on cuda:0: bf16, TAEHV decoder, ring cache with FP8 K/V, FP8 linears,
# CUDA graphs, a warm-up session before it is ready, frames through shared memory) and one aiortc
# client on loopback: W1.3 (480x832, 12-frame / 500 ms chunks) for 20 s, speech pushed every 3 s (one
# agent audio -> frame latency sample each), then the shipped character, then the CPU serve tests
# of the 12-frame geometry if time is left. Each command runs under
# `timeout`, capped by what is left of BUDGET_S. Everything ends up in $OUT/serve.tgz (the device
# returns at most 8 files).
set -uo pipefail
BUDGET_S=${BUDGET_S:-290}; SECONDS_W13=${SECONDS_W13:-20}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPUs")'
python3 -c 'import aiortc, av, fastapi, uvicorn; print("serve packages ok: aiortc", aiortc.__version__, "av", av.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__)' \
  || { echo "=== the serve packages did not import: stopping"; exit 1; }
B="python3 -m cadence bench serve --device cuda --sessions 1 --speak-every 3 --out-dir $PERF"
run 150 w1.3-compile $B --preset w1.3 --seconds "$SECONDS_W13" --compile
run 120 w1.3 $B --preset w1.3 --seconds "$SECONDS_W13"
run 70 character $B --preset character --seconds 10
run 60 serve-tests python3 -m pytest -q -p no:cacheprovider tests/test_serve_geometry.py -x
echo "=== done in ${SECONDS}s"
tar czf "$OUT/serve.tgz" -C "$OUT" perf && ls -R "$PERF"
