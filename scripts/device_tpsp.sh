#!/usr/bin/env bash
# Issue 27 items 1, 2 and 5 on ONE H200 (nvidia-h200), <= 5 minutes: the per-rank step of W57 at TP=1, TP=2
# and TP=4 (emulated: rank 0 built and run exactly as apply_tp shards it, every collective a local stand-in
# whose time is estimated from measured 2x H200 link figures), each TP size with and without sequence
# parallelism, then W14 TP=2 (emulated) and W1.3; all with the FP8 K/V ring, FP8 linears, compiled
# elementwise ops and CUDA graphs; the split of the graph-replayed step per part against its floor.
#   1 W57 TP=4 emulated            4 W57 TP=2 emulated + SP       7 W1.3 TP=1 (10 of 30 layers)
#   2 W57 TP=4 emulated + SP       5 W57 TP=1                     8 W14 TP=1 (10 of 40; skipped if the
#   3 W57 TP=2 emulated            6 W14 TP=2 emulated (10 of 40)   budget is spent)
# W57 runs 12 of its 60 layers, scaled to 60 (as today's bench does; stated in every JSON).
# Usage (repo root):  CADENCE_GIT=<sha> bash scripts/device_tpsp.sh          (BUDGET_S=290 by default)
#                     SMOKE=1 bash scripts/device_tpsp.sh                     (the same commands on the CPU
#                                                                              at the tiny preset)
# Expected: ~4-4.5 min (the first run ~60 s while the compile caches are cold, the others ~25-35 s). Prints each
# run's table, then one summary table per shape; JSON under $OUT/perf/step/, all of it in $OUT/tpsp.tgz.
set -uo pipefail
BUDGET_S=${BUDGET_S:-290}
SMOKE=${SMOKE:-0}
source "$(dirname "$0")/device_lib.sh"  # env, $OUT/$PERF, run LIMIT_S NAME CMD...

FAST="--cache ring --kv-fp8 --fp8 --fused-quant --compile --graphs"
STEP="python3 -m cadence bench step $FAST --warmup 2 --iters 8 --profile-iters 1 --out-dir $PERF"
W57="--preset w57 --layers 12"; W14="--preset w14 --layers 10"; W13="--preset w1.3 --layers 10"
EMU="--emulate --comm two_shot"  # two-shot: what the measured chooser table picks at every FP8 shape
if [[ "$SMOKE" == 1 ]]; then
  STEP="python3 -m cadence bench step $FAST --device cpu --warmup 0 --iters 1 --profile-iters 1 --out-dir $PERF"
  W57="--preset tiny"; W14="--preset tiny"; W13="--preset tiny"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
fi

run 90 w57-tp4-emu $STEP $W57 --tp 4 $EMU
run 60 w57-tp4-emu-sp $STEP $W57 --tp 4 $EMU --sequence-parallel
run 60 w57-tp2-emu $STEP $W57 --tp 2 $EMU
run 60 w57-tp2-emu-sp $STEP $W57 --tp 2 $EMU --sequence-parallel
run 60 w57-tp1 $STEP $W57
run 50 w14-tp2-emu $STEP $W14 --tp 2 $EMU
run 50 w1.3-tp1 $STEP $W13
run 45 w14-tp1 $STEP $W14
echo "=== done in ${SECONDS}s"

python3 - "$PERF" <<'PY'
import json, pathlib, sys

runs = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("step/*.json")):
    d = json.loads(f.read_text())
    runs.append((d, d["results"]))
parts = ("linear", "quant", "attention", "cache", "elementwise", "comm")
for preset in dict.fromkeys(d["preset"] for d, _ in runs):
    print(f"\n## {preset}: per rank, per chunk, ms (scaled to all layers); measured / floor")
    print("| run | step | split | compute | comm est | step est | " + " | ".join(parts) + " | floor (all) |")
    print("| --- " * (7 + len(parts)) + "|")
    for d, r in runs:
        if d["preset"] != preset:
            continue
        name = f"tp{d['tp']}" + (" emu" if r.get("emulated") else "") + (" sp" if r.get("sequence_parallel") else "")
        s, fl = r["split"], r["floors"]
        cells = [f"{s[p + '_ms']:.1f} / {fl[p]:.1f}" for p in parts]
        if r.get("emulated"):
            cells[-1] = f"{s['comm_ms']:.1f} stand-ins / {fl['comm']:.1f}"
        est = r.get("step_estimate_ms")
        print(f"| {name} | {r['step_ms']:.1f} ({r['step_mode']}) | {r['split_mode']} | {r['compute_ms']:.1f} | "
              f"{r.get('comm_estimate_ms') or 0:.1f} | {est if est is None else round(est, 1)} | "
              + " | ".join(cells) + f" | {fl['step']:.1f} |")
    by = {(d["tp"], bool(r.get("sequence_parallel"))): r for d, r in runs if d["preset"] == preset}
    for tp in sorted({k[0] for k in by}):
        a, b = by.get((tp, False)), by.get((tp, True))
        if a and b:
            print(f"  SP at TP={tp}: compute {b['compute_ms'] - a['compute_ms']:+.1f} ms, elementwise "
                  f"{b['split']['elementwise_ms'] - a['split']['elementwise_ms']:+.1f}, quant "
                  f"{b['split']['quant_ms'] - a['split']['quant_ms']:+.1f}, comm estimate "
                  f"{b['comm_estimate_ms'] - a['comm_estimate_ms']:+.1f} (RS/AG as symm-mem halves: "
                  f"{b['comm_estimate']['total_ms_symm_halves'] - a['comm_estimate']['total_ms_symm_halves']:+.1f}), "
                  f"step estimate {b['step_estimate_ms'] - a['step_estimate_ms']:+.1f} ms")
for d, r in runs:
    g = r.get("graph_split") or {}
    if not g.get("used"):
        print(f"note {d['preset']} tp{d['tp']}: split {r['split_mode']} ({g.get('reason', 'no graphs')})")
PY
tar czf "$OUT/tpsp.tgz" -C "$OUT" perf && ls -la "$OUT"
