#!/usr/bin/env bash
# A device call for the live server on 2 GPUs (nvidia-h200-x2), never run yet: W14 (704x1088, 4-frame
# chunks) served by one tensor-parallel worker group of 2 processes ('cuda:0+cuda:1', rank 0 broadcasts
# every command, both ranks step, rank 0 decodes), then W1.3 on the same machine with the session opened
# ahead and filling chunks replaying the steady graph (ttff against the 500 ms / 0.25 s figures).
# Usage on the device machine (repo root, with .whl/ carried):
#   CADENCE_GIT=<sha> BUDGET_S=330 bash scripts/device_serve_tp.sh   (BUDGET_S=530 for the W1.3 soak too)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

python3 -c 'import aiortc, av, fastapi, uvicorn' || { echo "=== the serve packages did not import: stopping"; exit 1; }
B="python3 -m cadence bench serve --device cuda --sessions 1 --speak-every 2 --out-dir $PERF"
run 200 w14-tp2 $B --preset w14 --tp 2 --seconds 20 --compile --window-s 5
run 110 w1.3 $B --preset w1.3 --seconds 15 --compile
# if the budget allows: 2 minutes at W1.3 in 20-s windows (fps, chunk latency, worker RSS and CUDA
# allocation per window: the GPU side of the CPU's 9-minute flat run)
run 200 w1.3-soak $B --preset w1.3 --seconds 120 --compile --window-s 20 --speak-every 5
echo "=== done in ${SECONDS}s"
tar czf "$OUT/serve_tp.tgz" -C "$OUT" perf && ls -R "$PERF"
