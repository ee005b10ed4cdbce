#!/usr/bin/env bash
# The tile-flag GEMM + all-reduce (mode "tiles", cadence/kernels/gemm_allreduce.py) on 2x H200:
# bench fused at the W57 / W14 / W1.3 row-parallel shapes, two-shot vs tiles (defaults: tensor
# descriptors, flag a quarter into the next tile), bf16 and FP8, graph-timed, parity with NCCL, the
# changing-M sweep in tiles mode (recorded); then variants (printed): pointer loads, flag after the whole
# next tile (8), flag at once (0); then the W14 / W57 TP=2 steps with two-shot vs tiles.
# Usage on the device machine (repo root): CADENCE_GIT=<sha> bash scripts/device_tiles.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
TR="torchrun --standalone --nproc_per_node 2"
F="$TR -m cadence bench fused"
run 90 fused-tiles $F --modes two_shot,tiles --sweep-mode tiles --out-dir "$PERF"
for v in CADENCE_TILES_TMA=0 CADENCE_TILES_FLUSH=8 CADENCE_TILES_FLUSH=0; do
  export "$v"
  run 60 "variant-$v" $F --modes tiles --dtypes fp8 --no-sweep --no-record --reps 50 --warmup 10 \
    | grep -E "^w|tiles:|max relative|===|rror"
  unset "${v%%=*}"
done
STEP="-m cadence bench step --tp 2 --cache ring --kv-fp8 --graphs --fp8 --compile --warmup 3 --iters 12 --profile-iters 2 --out-dir $PERF"
for comm in two_shot tiles; do
  run 100 "w14-$comm" $TR $STEP --preset w14 --layers 10 --comm $comm | grep -E "step \(median\)|eager /|FP8 linears|===|rror"
done
for comm in two_shot tiles; do
  run 110 "w57-$comm" $TR $STEP --preset w57 --layers 8 --comm $comm | grep -E "step \(median\)|eager /|FP8 linears|===|rror"
done
echo "=== done in ${SECONDS}s"
