#!/usr/bin/env bash
# Issue 27 item 3 (attention at every serving shape) on ONE H200, ~3.5 minutes (BUDGET_S=240):
#   0. fa3-fwd 0.0.3 and nvidia-cudnn-frontend 1.32.0 from .whl/ into /tmp/attn_site (--no-deps, no index)
#   1. the kernel tests on the GPU: tests/test_ring_kernels.py (every kernel variant against its PyTorch
#      reference with CUDA's casts; the backend and bench tests are CPU logic, run in CI)
#   2. `cadence bench attention --all-shapes --sweep --check --ring-check`: W1.3, W57 TP=4, W14 TP=2,
#      W57 TP=2 / TP=1, W14 TP=1; per shape cuDNN / flash / default SDPA bf16, the Triton kernel (FP8
#      per-token and per-head scales, bf16) over its config space (blocks x warps x stages x key splits,
#      dual blocks, P@V in bf16, warp specialisation), FA3 FP8 / bf16 x num_splits and without seqused_k,
#      cuDNN FP8; every variant's error against float64 (--check: over budget -> rc 1, listed) and a
#      RingCache per backend against the naive float32 cache (--ring-check). All Triton variants compile
#      once first, at a small shape of the same specialisation ("warm-up"), so the per-shape budget
#      (SHAPE_S) only measures. JSON per shape: $OUT/perf/attention/; the auto table built from them:
#      $OUT/perf/attention_table.json (copy to cadence/kernels/attention_table.json to adopt it)
#   3. one table: the best variant per backend per shape (ms, TFLOP/s, speedup vs cuDNN bf16, error)
# Usage (repo root, the lead carries .whl):  CADENCE_GIT=<sha> bash scripts/device_attn.sh
# CPU smoke of the same commands (tiny preset, Triton interpreted):  SMOKE=1 bash scripts/device_attn.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-240}; SHAPE_S=${SHAPE_S:-20}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

SITE=/tmp/attn_site
if ls .whl/fa3_fwd-*.whl .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    .whl/fa3_fwd-*.whl .whl/nvidia_cudnn_frontend-*.whl && export PYTHONPATH=$PYTHONPATH:$SITE
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 - <<'PY'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())
from cadence.kernels import fa3_adapter
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print("fa3:", fa3_adapter.why_not(dev, 128, True) or "importable")
try:
    import cudnn
    print("cudnn frontend:", cudnn.__version__, "backend", cudnn.backend_version())
except Exception as e:
    print("cudnn frontend: not importable", type(e).__name__, e)
PY

if [ "${SMOKE:-0}" = 1 ]; then  # the CPU: tiny preset, the kernels under the interpreter
  export TRITON_INTERPRET=1
  B="python3 -m cadence bench attention --preset tiny --sweep --check --ring-check --iters 1"
  run 120 smoke $B --out-dir "$PERF" --table-out "$PERF/attention_table.json"
else
  run 80 gpu-tests python3 -m pytest -q -p no:cacheprovider tests/test_ring_kernels.py
  run 165 bench python3 -m cadence bench attention --all-shapes --sweep --check --ring-check \
    --shape-budget-s "$SHAPE_S" --out-dir "$PERF" --table-out "$PERF/attention_table.json"
fi
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("attention/*.json")):
    r = json.loads(f.read_text())["results"]
    s = r["shape"]
    print(f"{s['preset']} tp{s['tp']} ({s['heads']} h x {s['q_tokens']} q x {s['kv_tokens']} kv): "
          f"{len(r['variants'])} variants, {len(r['failed'])} failed, {r['skipped_for_time']} skipped for time, "
          f"over budget: {', '.join(r['over_budget']) or 'none'}")
    for fam, b in sorted(r["best"].items(), key=lambda kv: kv[1]["ms"]):
        sp = b["speedup_vs_cudnn_bf16"]
        cfg = ",".join(f"{k}={v}" for k, v in b["config"].items())
        print(f"  {fam:18s} {b['ms']:7.3f} ms {b['tflops']:5.0f} TFLOP/s {sp or 0:5.2f}x err {b['rel_err']:.4f} [{cfg}]")
    for k, c in r.get("ring_check", {}).items():
        if not c["ok"] or k.endswith("auto"):
            print(f"  ring {k}: {c['backend']} max err {c['max_rel_err']:.4f} {'ok' if c['ok'] else 'FAIL'}")
PY
ls "$PERF" "$PERF/attention" 2>/dev/null | head -20
