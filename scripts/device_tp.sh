#!/usr/bin/env bash
# One device call for issue 4 (TP + fused row-parallel all-reduce) on nvidia-h200-x2.
# Usage on the device machine (repo root, PYTHONPATH=. and $OUT set):
#     CADENCE_GIT=<sha> bash scripts/device_tp.sh
# Order: 20-second smoke tests first (a failure shows early), then `cadence bench fused` (all
# shapes, bf16 + FP8; writes the chooser table that comm=auto then reads), then `bench step`
# at W14 TP=2 (bf16 + nccl vs FP8 + auto) and W57 TP=2 with reduced layers (scaled; stated in
# the JSON). Every command runs under `timeout`, and the script skips what no longer fits its
# overall budget (BUDGET_S, default 400 s). Logs go to stdout; result files (<= 8) under $OUT/perf.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TORCH_NCCL_ASYNC_ERROR_HANDLING=1
OUT=${OUT:-/tmp/out}; PERF="$OUT/perf"; mkdir -p "$PERF"
BUDGET_S=${BUDGET_S:-400}
W14_LAYERS=${W14_LAYERS:-10}; W57_LAYERS=${W57_LAYERS:-8}
TR="torchrun --standalone --nproc_per_node 2"

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version(), torch.cuda.device_count(), "GPUs")'
python3 - <<'PY'
import torch
try:
    import torch.distributed._symmetric_memory  # noqa: F401  (registers the fused ops)
except Exception as e:
    print("symmetric memory import failed:", e)
for n in ["two_shot_all_reduce_", "two_shot_all_reduce_out", "one_shot_all_reduce",
          "fused_matmul_reduce_scatter", "fused_scaled_matmul_reduce_scatter"]:
    try:
        print(" ", n, getattr(torch.ops.symm_mem, n).default._schema)
    except Exception as e:
        print(" ", n, "MISSING", type(e).__name__)
PY

# 1. smoke (~20 s each): TP parity on the tiny model (comm auto, then two_shot), tiny fused bench
run 90 smoke-tp-auto $TR tests/tp_worker.py bf16 auto
run 60 smoke-tp-two_shot $TR tests/tp_worker.py bf16 two_shot
run 90 smoke-fused-tiny $TR -m cadence bench fused --tiny --no-record --reps 20 --warmup 5

# 1b. the one-launch FP8 activation quantisation vs eager (one GPU is enough; parity + timing)
run 90 bench-quant python3 -m cadence bench fused --quant --out-dir "$PERF"

# 2. the fused benchmark, all shapes (W57 / W14 at 748 tokens, W1.3 at 4680), bf16 + FP8
run 180 bench-fused $TR -m cadence bench fused --reps 100 --warmup 20 --out-dir "$PERF"
TABLE=$(ls -t "$PERF"/fused/chooser-*-tp2.json 2>/dev/null | head -1)
if [[ -n "$TABLE" ]]; then export CADENCE_FUSED_TABLE="$TABLE"; echo "chooser table: $TABLE"; fi

# 3. the step at TP=2: W14 bf16 + nccl vs FP8 + auto; W57 FP8 + auto and bf16 + nccl (reduced layers)
STEP="-m cadence bench step --tp 2 --cache ring --warmup 3 --iters 15 --profile-iters 2 --out-dir $PERF"
run 120 step-w14-bf16-nccl $TR $STEP --preset w14 --layers "$W14_LAYERS" --comm nccl
run 120 step-w14-fp8-auto $TR $STEP --preset w14 --layers "$W14_LAYERS" --fp8 --comm auto
run 120 step-w57-fp8-auto $TR $STEP --preset w57 --layers "$W57_LAYERS" --fp8 --comm auto
run 120 step-w57-fp8-auto-torchquant $TR $STEP --preset w57 --layers "$W57_LAYERS" --fp8 --comm auto --fp8-quant torch
run 120 step-w57-bf16-nccl $TR $STEP --preset w57 --layers "$W57_LAYERS" --comm nccl

echo "=== done in ${SECONDS}s"
tar czf "$OUT/tp.tgz" -C "$OUT" perf && ls -R "$PERF"
