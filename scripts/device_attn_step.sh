#!/usr/bin/env bash
# Issue 27 item 3, the step end to end (one H200, ~4 minutes): after scripts/device_attn.sh's table is adopted,
# the graphed W1.3 step (10 of 30 layers) with the ring's attention backend chosen three ways in ONE run:
# `--attention auto` (the table; per-token FP8 K/V scales), `triton_head` (Cadence's kernel, per-head scales)
# and `fa3` (FlashAttention-3 FP8 through cadence/kernels/fa3_adapter.py, per-head scales); then W57 TP=4
# emulated with fa3 (its auto run: scripts/device_tpsp.sh). First the GPU parity tests of the FP8 GEMM seam
# (the adopted docs/perf/fp8/gemm-nvidia-h200.json makes auto pick the Triton GEMM at some shapes).
# Usage (repo root, .whl carried):  CADENCE_GIT=<sha> BUDGET_S=230 bash scripts/device_attn_step.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-230}
source "$(dirname "$0")/device_lib.sh"
SITE=/tmp/attn_site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/fa3_fwd-*.whl && export PYTHONPATH=$PYTHONPATH:$SITE
run 40 gemm-parity python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py tests/test_fused_quant.py
FAST="--cache ring --kv-fp8 --fp8 --fused-quant --compile --graphs"
STEP="python3 -m cadence bench step $FAST --warmup 2 --iters 8 --profile-iters 1 --out-dir $PERF"
run 60 w1.3-auto $STEP --preset w1.3 --layers 10 --attention auto
run 60 w1.3-triton_head $STEP --preset w1.3 --layers 10 --attention triton_head
run 60 w1.3-fa3 $STEP --preset w1.3 --layers 10 --attention fa3
run 70 w57-tp4-emu-fa3 $STEP --preset w57 --layers 12 --tp 4 --emulate --comm two_shot --attention fa3
echo "=== done in ${SECONDS}s"
