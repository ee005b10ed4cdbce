#!/usr/bin/env bash
# One device call for issue 18 (a conversational turn) on nvidia-h200 (one GPU).
# Usage on the device machine (repo root, with .whl/ carried):
#   CADENCE_GIT=<sha> BUDGET_S=400 bash scripts/device_turn.sh
# `cadence bench turn` starts its own server (the talk agent against the scripted stand-in endpoint: no
# LLM, no TTS) and an aiortc client whose microphone speaks --turns times: W1.3 with the engine's fast
# path (compile), then the shipped character on the GPU. JSON under $OUT/perf/turn.
set -uo pipefail
BUDGET_S=${BUDGET_S:-400}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import aiortc, av, fastapi, uvicorn, httpx; print("serve packages ok")' \
  || { echo "=== the serve packages did not import: stopping"; exit 1; }
B="python3 -m cadence bench turn --device cuda --out-dir $PERF"
run 260 w1.3-compile $B --preset w1.3 --turns 6 --compile
run 100 character $B --preset character --turns 5
echo "=== done in ${SECONDS}s"
