#!/usr/bin/env bash
# What the fused FP8 producers gain on ONE H200 (docs/perf/fp8/NOTES.md "GPU parity of the fused producers"
# has the predictions), <= ~5 minutes: the graph-replayed step of W57 at TP=4 (emulated rank 0, two-shot) and
# TP=1, each with and without --fused-quant (TP=4 twice each, alternating, for the rerun spread), with the FP8
# K/V ring, FP8 linears, compiled elementwise ops and CUDA graphs; then the producers alone (bench linears'
# producer section at the W57 shapes: eager / compiled + the separate quantisation / Triton fused / compiled
# fused).
# Usage (repo root, device machine):  CADENCE_GIT=<sha> bash scripts/device_fused_quant_bench.sh  (BUDGET_S=330)
#                                      SMOKE=1 bash scripts/device_fused_quant_bench.sh  (tiny preset, CPU)
# Outputs: every JSON in $OUT/fqbench.tgz (perf/fq*/ and perf/plain*/: one folder per run, as the step
# record's name does not say fused or not); the summary table last.
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
SMOKE=${SMOKE:-0}
source "$(dirname "$0")/device_lib.sh"  # env, $OUT/$PERF, run LIMIT_S NAME CMD...
FAST="--cache ring --kv-fp8 --fp8 --compile --graphs"
STEP="python3 -m cadence bench step $FAST --warmup 2 --iters 8 --profile-iters 1"
W57="--preset w57 --layers 12"; EMU="--emulate --comm two_shot"
LIN="--presets w57:1,4 --sweep none --no-chunk --no-tiles"
if [[ "$SMOKE" == 1 ]]; then
  export TRITON_INTERPRET=1
  STEP="python3 -m cadence bench step $FAST --device cpu --warmup 0 --iters 1 --profile-iters 1"
  W57="--preset tiny"; LIN="--tiny --sweep none --no-chunk --no-tiles"
else
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
fi
run 100 w57-tp4-fq $STEP --fused-quant $W57 --tp 4 $EMU --out-dir "$PERF/fq-tp4"
run 60 w57-tp4-plain $STEP $W57 --tp 4 $EMU --out-dir "$PERF/plain-tp4"
run 60 w57-tp4-fq2 $STEP --fused-quant $W57 --tp 4 $EMU --out-dir "$PERF/fq-tp4-2"
run 60 w57-tp4-plain2 $STEP $W57 --tp 4 $EMU --out-dir "$PERF/plain-tp4-2"
run 60 w57-tp1-fq $STEP --fused-quant $W57 --out-dir "$PERF/fq-tp1"
run 60 w57-tp1-plain $STEP $W57 --out-dir "$PERF/plain-tp1"
left=$((BUDGET_S - SECONDS - 10))
run $((left + 5)) producers python3 -m cadence bench linears $LIN --budget-s "$left" --out-dir "$PERF/producers"
tar -czf "$OUT/fqbench.tgz" -C "$OUT" perf 2>/dev/null
echo "=== summary (ms per step, from each run's JSON; split = the graph-replayed instrumented step's parts)"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
print(f"{'run':13s} {'step':>8s} {'graph':>8s} {'quant':>7s} {'linears':>8s} {'elemwise':>8s}  fused producers")
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/step/*.json")):
    r = json.loads(p.read_text()).get("results", {})
    sp = r.get("split_graph") or r.get("split") or {}
    fq = (r.get("fused_quant") or {}).get("describe", "off")
    f = lambda v: f"{v:8.2f}" if isinstance(v, (int, float)) else f"{'-':>8s}"
    print(f"{p.parent.parent.name:13s} {f(r.get('step_ms'))} {f(r.get('step_graph_ms'))} {f(sp.get('quant_ms'))[1:]} "
          f"{f(sp.get('linear_ms'))} {f(sp.get('elementwise_ms'))}  {fq[:90]}")
PY
echo "=== done in ${SECONDS}s"
