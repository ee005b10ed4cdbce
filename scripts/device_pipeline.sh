#!/usr/bin/env bash
# One device call for issue 5 (the real-time chunk pipeline), session 3: W1.3 on ONE H200 (a 1- or
# 2-GPU machine; only cuda:0 is used), <= ~6 minutes in all.
# Usage on the device machine (repo root):  CADENCE_GIT=<sha> bash scripts/device_pipeline.sh
# Order: the GPU tests of the pipeline / graphs / prewarm (short; a failure shows early), then
# `cadence bench pipeline --preset w1.3 --chunks 60` (decode = TAEHV on a 2nd stream of the same GPU,
# prewarm on: the JSON has the warm ttff_ms and the cold ttff_cold_ms) in these variants:
#   A  baseline as last session: --kv-fp8 (FP8 K/V ring, Triton FP8 attention); + the shape-change run
#   B  A + --fp8 (FP8 block linears)
#   D  B with bf16 K/V (cuDNN SDPA reads the ring; the FP8 kernel is 0.87x cuDNN)
#   C  A + --fp8 --compile (torch.compile of the per-block elementwise regions)
# Each command runs under `timeout`, capped by what is left of BUDGET_S (scripts/device_lib.sh); a
# short table at the end; everything in one tarball $OUT/pipeline.tgz (the device returns <= 8 files).
set -uo pipefail
BUDGET_S=${BUDGET_S:-345}; CHUNKS=${CHUNKS:-60}

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPUs")'
python3 -c 'import cadence.runtime.compile as c; print("compile module:", [n for n in dir(c) if n.startswith("apply")])' \
  2>&1 | tail -n 1
run 80 gpu-tests python3 -m pytest -q -p no:cacheprovider -x tests/test_prewarm.py tests/test_engine.py tests/test_graphs.py
B="python3 -m cadence bench pipeline --preset w1.3 --chunks $CHUNKS --device cuda:0 --decode-device same --decoder taehv --out-dir $PERF"
run 95 A-base-kvfp8 $B --kv-fp8 --shape-change-every 10
run 65 B-kvfp8-fp8 $B --kv-fp8 --fp8 --shape-change-every 0
run 65 D-kvbf16-fp8 $B --fp8 --shape-change-every 0
run 150 C-kvfp8-fp8-compile $B --kv-fp8 --fp8 --compile --shape-change-every 0
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'EOF'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    r = json.loads(f.read_text())["results"]
    sc = r.get("shape_change_run")
    rows.append((f.stem.split("-tp1-")[-1], r["fps"], r["diffusion_ms"], r["decode_ms"], r["chunk_p99_ms"],
                 100 * r["deadline_miss_rate"], r["ttff_ms"], r.get("ttff_cold_ms", float("nan")),
                 r.get("open_ms") or float("nan"), r.get("first_chunk_diffusion_ms", float("nan")),
                 f"{sc['fps']:.1f}/{sc['chunk_p99_ms']:.0f}" if sc else "-"))
print(f"{'variant':44} {'fps':>5} {'diff':>6} {'dec':>5} {'p99':>6} {'miss%':>5} {'ttff':>6} {'cold':>6} "
      f"{'open':>5} {'1st':>6} shape-chg fps/p99")
for v in rows:
    print(f"{v[0]:44} {v[1]:5.1f} {v[2]:6.1f} {v[3]:5.1f} {v[4]:6.1f} {v[5]:5.1f} {v[6]:6.0f} {v[7]:6.0f} "
          f"{v[8]:5.0f} {v[9]:6.1f} {v[10]}")
EOF
tar czf "$OUT/pipeline.tgz" -C "$OUT" perf && ls -R "$PERF"
