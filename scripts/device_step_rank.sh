#!/usr/bin/env bash
# Issue 36 on ONE H200 (nvidia-h200), two calls (CALL=1 | 2, default 2), <= 5.5 / 4 minutes: every kernel of the graph-replayed W57 TP=4 rank
# named (`bench step --profile`), before and after the TP fusions of this branch (the q/k norm sums reduced
# together and one-shot, the row-parallel bias in rank 0's GEMM epilogue; "before" = their reference paths by
# environment), W14 TP=2, and FlashTalk's clip step on one GPU and as rank 0 of 2 and 4 (emulated).
#   1 W57 TP=4 emu, after, --profile     3 W14 TP=2 emu, after, --profile     5 FlashTalk TP=4 emu --profile
#   2 W57 TP=4 emu, before, --profile    4 FlashTalk TP=2 emu --profile       6 FlashTalk TP=1 --profile
# W57 runs 12 of 60 layers, W14 10 of 40, FlashTalk 8 of 40 (scaled; stated in every JSON).
# Usage (repo root): CADENCE_GIT=<sha> bash scripts/device_step_rank.sh   (BUDGET_S=320; SMOKE=1: the CPU, tiny)
set -uo pipefail
BUDGET_S=${BUDGET_S:-320}
SMOKE=${SMOKE:-0}
source "$(dirname "$0")/device_lib.sh"  # env, $OUT/$PERF, run LIMIT_S NAME CMD...

FAST="--cache ring --kv-fp8 --fp8 --compile --graphs"
STEP="python3 -m cadence bench step --warmup 2 --iters 10 --profile-iters 1 --profile --out-dir $PERF"
W57="--preset w57 --layers 12"; W14="--preset w14 --layers 10"; FT="--model flashtalk --layers 8 --fp8 --compile"
EMU="--emulate --comm two_shot"
BEFORE="env CADENCE_TP_BIAS=after CADENCE_TP_QK_PAIR=0 CADENCE_TP_SMALL_COMM=nccl"
if [[ "$SMOKE" == 1 ]]; then
  STEP="python3 -m cadence bench step --device cpu --warmup 0 --iters 1 --profile-iters 1 --profile --out-dir $PERF"
  W57="--preset tiny"; W14="--preset tiny"; FT=""  # (FlashTalk at full size does not fit a CPU test)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
fi

if [[ "${CALL:-2}" == 1 ]]; then  # call 1 (2026-12-03): as run then
  run 80 w57-tp4-after $STEP $FAST $W57 --tp 4 $EMU
  run 60 w57-tp4-before $BEFORE $STEP $FAST $W57 --tp 4 $EMU
  run 50 w14-tp2-after $STEP $FAST $W14 --tp 2 $EMU
  if [[ -n "$FT" ]]; then
    run 50 flashtalk-tp2 $STEP $FT --tp 2 --emulate --comm two_shot --iters 4
    run 45 flashtalk-tp4 $STEP $FT --tp 4 --emulate --comm two_shot --iters 4
    run 45 flashtalk-tp1 $STEP $FT --iters 3
  fi
else  # call 2: the graph-replayed profile (call 1's fell back to the eager step), FlashTalk graphed too
  run 70 w57-tp4-after $STEP $FAST $W57 --tp 4 $EMU
  run 50 w57-tp4-before $BEFORE $STEP $FAST $W57 --tp 4 $EMU
  if [[ -n "$FT" ]]; then
    run 45 flashtalk-tp4 $STEP $FT --graphs --tp 4 --emulate --comm two_shot --iters 4
    run 45 flashtalk-tp2 $STEP $FT --graphs --tp 2 --emulate --comm two_shot --iters 3
    run 50 flashtalk-tp1 $STEP $FT --graphs --iters 2 --warmup 1
  fi
  run 40 w14-tp2-after $STEP $FAST $W14 --tp 2 $EMU
fi
echo "=== done in ${SECONDS}s"
python3 scripts/step_rank_summary.py "$PERF"
tar -C "$OUT" -czf "$OUT/step_rank.tgz" perf && rm -rf "$PERF"  # one file back (the tool returns a few files)
