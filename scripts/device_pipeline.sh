#!/usr/bin/env bash
# One device call for issue 5 (pipeline, CUDA graphs, streaming VAE) on nvidia-h200-x2.
# Usage on the device machine (repo root):  CADENCE_GIT=<sha> BUDGET_S=560 bash scripts/device_pipeline.sh
# Order: the GPU tests of the pipeline / graphs / ring (a failure shows early), then
# `cadence bench pipeline` at W1.3 on ONE GPU (decode on its own stream; full Wan VAE, then the
# TAEHV decoder with FP8 K/V), then W14 with decode on the second GPU. Each command runs under
# `timeout`, capped by what is left of BUDGET_S. All results end up in one tarball $OUT/pipeline.tgz
# (the device returns at most 8 files).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; PERF="$OUT/perf"; mkdir -p "$PERF"
BUDGET_S=${BUDGET_S:-560}; CHUNKS=${CHUNKS:-200}

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPUs")'
run 150 gpu-tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_pipeline.py tests/test_graphs.py -x
B="python3 -m cadence bench pipeline --out-dir $PERF"
run 200 w1.3-wan-same $B --preset w1.3 --chunks "$CHUNKS" --decode-device same --decoder wan --shape-change-every 0
run 120 w1.3-taehv-fp8-same $B --preset w1.3 --chunks "$CHUNKS" --decode-device same --decoder taehv --kv-fp8 --shape-change-every 0
run 200 w14-wan-gpu1 $B --preset w14 --chunks "$CHUNKS" --decode-device cuda:1 --decoder wan
echo "=== done in ${SECONDS}s"
tar czf "$OUT/pipeline.tgz" -C "$OUT" perf && ls -R "$PERF"
