#!/usr/bin/env bash
# The tile-flag GEMM + all-reduce (mode "tiles", cadence/kernels/gemm_allreduce.py) on 2x H200:
# bench fused at the W57 / W14 / W1.3 row-parallel shapes, two-shot (the best mode so far) vs tiles, bf16
# and FP8, graph-timed, parity with NCCL per shape, the changing-M sweep in tiles mode (recorded, with
# TILES_CONFIG); then the same with 128x128x128 (printed); then tile configs at W57 FP8.
# Usage on the device machine (repo root): CADENCE_GIT=<sha> bash scripts/device_tiles.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
TR="torchrun --standalone --nproc_per_node 2 -m cadence bench fused"
export CADENCE_TILES_CONFIG=${TILES_CONFIG:-128x256x128:8:8:3}
run 200 fused-tiles $TR --modes two_shot,tiles --sweep-mode tiles --out-dir "$PERF"
for cfg in 128x128x128:8:8:3 ${EXTRA_CONFIGS:-}; do
  export CADENCE_TILES_CONFIG=$cfg
  run 60 "cfg-$cfg" $TR --modes tiles --no-sweep --no-record --reps 50 --warmup 10 \
    | grep -E "^w|tiles:|max relative|===|rror"
done
unset CADENCE_TILES_CONFIG
echo "=== done in ${SECONDS}s"
