#!/usr/bin/env bash
# The FP8 linears on ONE H200 (issue 27 item 4; docs/perf/fp8/NOTES.md has the predictions), ~4 minutes:
#   1. a GPU parity check of the new kernels inside the tiny model (fused FP8 producers + the Triton GEMM,
#      eager and CUDA-graph replay) and of the Triton GEMM's split-K / descriptor configs (~25 s);
#   2. `cadence bench linears`: every per-rank FP8 linear shape of W57 TP=1/2/4, W14 TP=1/2 and W1.3
#      (bf16, cuBLAS rowwise / tensorwise, the separate quantisation, the Triton config sweep), the table
#      FastPath.gemm="auto" reads, the linears of one chunk per preset (CUDA-graphed, ms and TFLOP/s), the
#      tile kernel's GEMM + protocol against an emulated peer, and the fused producers. It stops starting
#      sections at its --budget-s and writes a partial JSON after each one.
# Usage (repo root, device machine):  BUDGET_S=240 CADENCE_GIT=<sha> bash scripts/device_linears.sh
# Outputs: $OUT/perf/linears/<date>-nvidia-h200-all-tp1.json and $OUT/perf/linears/gemm-nvidia-h200.json
# (copy the second to docs/perf/fp8/ for "auto" to use it); the bench's progress log: $OUT/linears.log.
# CPU smoke of the same commands: SMOKE=1 bash scripts/device_linears.sh (tiny preset, Triton interpreter).
set -uo pipefail
BUDGET_S=${BUDGET_S:-240}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
if [[ "${SMOKE:-0}" == 1 ]]; then
  export TRITON_INTERPRET=1
  BENCH=(--presets tiny:1,2 --sweep all)
else
  BENCH=()
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
run 45 gpu-parity python3 -m pytest -q -x -p no:cacheprovider tests/test_fused_quant.py tests/test_fp8_gemm.py \
  -k "tiny_model or failure or cuda_graph or split_k or out_argument or triton_backend"
left=$((BUDGET_S - SECONDS - 15))
run $((left + 10)) bench-linears bash -c "python3 -m cadence bench linears ${BENCH[*]} --budget-s $left \
  --out-dir '$PERF' 2>'$OUT/linears.log'"
tail -n 12 "$OUT/linears.log"
ls "$PERF/linears" 2>/dev/null
echo "=== done in ${SECONDS}s"
