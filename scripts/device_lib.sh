# Shared by the scripts/device_*.sh plans (sourced, not run): the environment every plan needs (the
# checkout importable, unbuffered output, NVLink multicast off), $OUT/perf, and run().
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-/tmp/out}; PERF="$OUT/perf"; mkdir -p "$PERF"

# run LIMIT_S NAME CMD...: run CMD under timeout, capped by what is left of BUDGET_S; skip it when
# less than 20 s are left. Progress lines (steps:/chunks:) and torchrun's OMP banner are dropped; the
# last 80 lines of each command are kept.
run() {
  local limit=$1 name=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if (( left < 20 )); then echo "=== SKIP $name (budget: ${left}s left)"; return 0; fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit}s, t=${SECONDS}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | grep -v -e '^steps:' -e 'chunks:' -e 'OMP_NUM_THREADS' -e '^\*\*\*\*' | tail -n 80
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}
