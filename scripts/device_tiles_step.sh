#!/usr/bin/env bash
# The tile-flag kernel's defaults (per operand type) recorded by bench fused, then the W14 and W57 TP=2
# chunk steps (ring, FP8, graphs, compile) with --comm two_shot vs --comm tiles: does the kernel work
# inside the captured, compiled step, and what does it change end to end?
# Usage on the device machine (repo root): CADENCE_GIT=<sha> bash scripts/device_tiles_step.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
TR="torchrun --standalone --nproc_per_node 2"
run 90 fused-tiles $TR -m cadence bench fused --modes two_shot,tiles --sweep-mode tiles --out-dir "$PERF"
STEP="-m cadence bench step --tp 2 --cache ring --kv-fp8 --graphs --fp8 --compile --warmup 3 --iters 12 --profile-iters 2 --out-dir $PERF"
for comm in two_shot tiles; do
  run 100 "w14-$comm" $TR $STEP --preset w14 --layers 10 --comm $comm | grep -vE "^\[rank1\]|DEBUG"
done
for comm in two_shot tiles; do
  run 110 "w57-$comm" $TR $STEP --preset w57 --layers 8 --comm $comm | grep -vE "^\[rank1\]|DEBUG"
done
echo "=== done in ${SECONDS}s"
