#!/usr/bin/env bash
# One device call for issue 4 (TP step: CUDA graphs, FP8 really on, fused row-parallel all-reduce) on
# nvidia-h200-x2, at most ~7 minutes. Usage on the device machine (repo root, $OUT set):
#     CADENCE_GIT=<sha> bash scripts/device_tp.sh
# Order: a TP smoke test, then `cadence bench fused` (all shapes, bf16 + FP8: re-measures FP8 after the
# per-shape refusal fix and the one-launch quantisation, and regenerates the chooser table that
# comm=auto then reads), then `cadence bench step --tp 2 --cache ring` at W57 (8 of 60 layers) and W14
# (10 of 40), each run timing the eager step AND the step replayed from one CUDA graph per rank (same
# process, same session): bf16 + NCCL, FP8 + auto comm, then FP8 + auto + --compile when
# cadence/runtime/compile.py exists; a TP=1 W14 graphs row for the TP=2 / TP=1 ratio. Every command runs
# under `timeout`, capped by what is left of BUDGET_S (default 400 s; skipped under 20 s). Full logs go
# to $OUT/perf/logs/, a few lines each to stdout, a summary table at the end; $OUT/perf is tarred into
# $OUT/tp.tgz (only 8 files come back) and the summary is also $OUT/summary.md.
set -uo pipefail
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
BUDGET_S=${BUDGET_S:-400}
W14_LAYERS=${W14_LAYERS:-10}; W57_LAYERS=${W57_LAYERS:-8}
TR="torchrun --standalone --nproc_per_node 2"

source "$(dirname "$0")/device_lib.sh"  # env, $OUT/$PERF, run LIMIT_S NAME CMD...
LOGS="$PERF/logs"; mkdir -p "$LOGS"

# logged LIMIT_S NAME CMD...: device_lib's run, its output kept whole in $LOGS/NAME.log; the lines that
# matter (and the rc line) to stdout, so that the summary at the end stays inside the output tail.
logged() {
  local name=$2
  run "$@" > "$LOGS/$name.log" 2>&1
  grep -E '^=== |step \(median\)|eager / graphed|FP8 linears|comm \(all|^  linear |^  other |cuda graphs|capture|rel_err|relative L2|identical on|[Ee]rror|Traceback|FAIL|passed|failed' \
    "$LOGS/$name.log" | grep -v '^=== .*(limit' | tail -n 12
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version(), torch.cuda.device_count(), "GPUs")'

# 1. smoke (~20 s): TP=2 parity on the tiny model with comm auto (bf16), under NCCL + symmetric memory
logged 60 smoke-tp-auto $TR tests/tp_worker.py bf16 auto

# 1b. graph capture under TP at the tiny shape (NCCL norm sums + symm-mem two-shot in one graph): if it
# hangs (rc 124/137), every later step runs with --no-graphs instead of hanging until its own timeout
GRAPHS=--graphs
logged 60 smoke-graphs $TR -m cadence bench step --preset tiny --tp 2 --cache ring --graphs --comm two_shot \
  --warmup 1 --iters 3 --profile-iters 1 --no-record
if grep -qE 'rc=(124|137)' "$LOGS/smoke-graphs.log"; then GRAPHS=--no-graphs; echo "graph smoke hung: --no-graphs from here"; fi

# 2. the fused benchmark, all shapes (W57 / W14 at 748 tokens, W1.3 at 4680), bf16 + FP8; chooser table
logged 130 bench-fused $TR -m cadence bench fused --reps 60 --warmup 10 --out-dir "$PERF"
TABLE=$(ls -t "$PERF"/fused/chooser-*-tp2.json 2>/dev/null | head -1)
if [[ -n "$TABLE" ]]; then export CADENCE_FUSED_TABLE="$TABLE"; echo "chooser table: $TABLE"; fi

# 3. the step at TP=2, eager and graphed in each run
STEP="-m cadence bench step --tp 2 --cache ring $GRAPHS --warmup 3 --iters 12 --profile-iters 2 --out-dir $PERF"
logged 80 step-w57-bf16-nccl $TR $STEP --preset w57 --layers "$W57_LAYERS" --comm nccl
logged 80 step-w57-fp8-auto $TR $STEP --preset w57 --layers "$W57_LAYERS" --fp8 --comm auto
logged 60 step-w14-bf16-nccl $TR $STEP --preset w14 --layers "$W14_LAYERS" --comm nccl
logged 60 step-w14-fp8-auto $TR $STEP --preset w14 --layers "$W14_LAYERS" --fp8 --comm auto
logged 50 step-w14-tp1-bf16 python3 -m cadence bench step --preset w14 --layers "$W14_LAYERS" --cache ring $GRAPHS \
  --warmup 3 --iters 12 --profile-iters 2 --out-dir "$PERF"
if python3 -c 'import cadence.runtime.compile' 2>/dev/null; then
  logged 100 step-w57-fp8-auto-compile $TR $STEP --preset w57 --layers "$W57_LAYERS" --fp8 --comm auto --compile
  logged 80 step-w14-fp8-auto-compile $TR $STEP --preset w14 --layers "$W14_LAYERS" --fp8 --comm auto --compile
else
  echo "=== SKIP --compile runs: cadence/runtime/compile.py is not in this checkout"
fi

echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY' | tee "$OUT/summary.md"
import glob, json, os, sys
perf = sys.argv[1]
print("| run | step eager ms | graphed ms | x | split a/lin/comm/other/upkeep (eager, instr.) | FP8 ran/fell back/of | graphs |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for f in sorted(glob.glob(os.path.join(perf, "step", "*.json"))):
    d = json.load(open(f)); r = d["results"]; g = r.get("graphs") or {}
    c = r.get("fp8_counts")
    name = f"{d['preset']} tp{d['tp']} {'fp8' if r.get('fp8') else 'bf16'} {r.get('comm', '')}" + (" compile" if r.get("compile") else "")
    gm = r.get("step_graph_ms")
    split = "/".join(f"{r.get(k) or 0:.0f}" for k in ("attention_ms", "linear_ms", "comm_ms", "other_ms", "cache_upkeep_ms"))
    print(f"| {name} | {r['step_eager_ms']:.1f} | {gm:.1f} | {r['graph_speedup']:.2f} | {split} |" if gm else
          f"| {name} | {r['step_eager_ms']:.1f} | - | - | {split} |", end="")
    print(f" {c['ran_fp8']}/{c['fell_back']}/{c['fp8_linears']} |" if c else " - |", end="")
    print(f" {'used' if g.get('used') else 'eager: ' + str(g.get('reason'))} |")
for f in sorted(glob.glob(os.path.join(perf, "fused", "*-all-tp2.json"))):
    print("\n| fused shape | dtype | GEMM us (kernel) | all-reduce us | unfused us | best | fused us |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in json.load(open(f))["results"]["shapes"]:
        k = f" ({s['gemm_kernel_us']:.0f})" if s.get("gemm_kernel_us") else ""
        print(f"| {s['name']} {s['m']}x{s['k']}->{s['n']} | {s['dtype']} | {s['gemm_us']:.0f}{k} | {s['allreduce_us']:.0f} | "
              f"{s['unfused_us']:.0f} | {s.get('best_mode')} | {s.get('fused_us') or 0:.0f} |")
PY
ls "$PERF"/step "$PERF"/fused 2>/dev/null | tail -n 20
# only a few files come back: everything in one archive (the perf tree leaves $OUT once archived)
tar czf "$OUT/tp.tgz" -C "$OUT" perf && rm -rf "$PERF" && ls -la "$OUT"
