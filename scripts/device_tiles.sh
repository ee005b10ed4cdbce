#!/usr/bin/env bash
# The tile-flag GEMM + all-reduce (mode "tiles", cadence/kernels/gemm_allreduce.py) on 2x H200, first run:
# bench fused at the W57 / W14 / W1.3 row-parallel shapes, two-shot (the best mode so far) vs tiles, bf16
# and FP8, graph-timed, parity with NCCL per shape; the changing-M sweep in tiles mode.
# Usage on the device machine (repo root): CADENCE_GIT=<sha> bash scripts/device_tiles.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
run 90 tiles-smoke torchrun --standalone --nproc_per_node 2 -m cadence bench fused --modes tiles --presets w14 \
  --dtypes fp8,bf16 --no-sweep --no-record --reps 10 --warmup 3 --timing eager
run 240 fused-tiles torchrun --standalone --nproc_per_node 2 -m cadence bench fused --modes two_shot,tiles \
  --sweep-mode tiles --out-dir "$PERF"
echo "=== done in ${SECONDS}s"
