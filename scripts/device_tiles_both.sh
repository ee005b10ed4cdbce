#!/usr/bin/env bash
# The tile kernel's two exchange protocols in one call: bench fused (tiles only, FP8 and bf16, all shapes)
# with CADENCE_TILES_PROTOCOL=owner and =both, then the W14 TP=2 step with --comm tiles under "both"
# against two-shot.
set -uo pipefail
BUDGET_S=${BUDGET_S:-240}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
TR="torchrun --standalone --nproc_per_node 2"
for p in both owner; do
  export CADENCE_TILES_PROTOCOL=$p
  run 60 "fused-$p" $TR -m cadence bench fused --modes two_shot,tiles --sweep-mode tiles --out-dir "$PERF/$p" \
    --reps 50 --warmup 10 | grep -E "^w|tiles:|max relative|shape sweep|===|rror"
done
export CADENCE_TILES_PROTOCOL=both
STEP="-m cadence bench step --tp 2 --cache ring --kv-fp8 --graphs --fp8 --compile --warmup 3 --iters 12 --profile-iters 2 --out-dir $PERF"
for comm in two_shot tiles; do
  run 70 "w14-$comm" $TR $STEP --preset w14 --layers 10 --comm $comm | grep -E "step \(median\)|FP8 linears|===|rror"
done
echo "=== done in ${SECONDS}s"
