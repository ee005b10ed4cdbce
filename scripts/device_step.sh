#!/usr/bin/env bash
# One device call for the engine-core baseline: GPU tests, then `cadence bench step` at W14, W57, W1.3.
# Usage on the device machine (repo root):  CADENCE_GIT=<sha> bash scripts/device_step.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/perf"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -5
for p in ${PRESETS:-w14 w57 w1.3}; do
  python3 -m cadence bench step --preset "$p" --cache naive --dtype bf16 --png --out-dir "$OUT/perf" 2>&1 \
    | grep -v '^steps:' | tee "$OUT/step-$p.log"
done
ls -R "$OUT"
