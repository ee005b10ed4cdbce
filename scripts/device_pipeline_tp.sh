#!/usr/bin/env bash
# One device call for issue 5's W14 target on nvidia-h200-x2: the chunk pipeline with the diffusion
# step tensor-parallel over both GPUs (torchrun, NCCL; every rank decodes TAEHV on a side stream of its
# own GPU), <= ~6 minutes. Usage on the device machine (repo root):
#     CADENCE_GIT=<sha> bash scripts/device_pipeline_tp.sh
# Order: the CUDA tests of the compiled ops and the pipeline; W14 TP=2 FP8 + compile + graphs (100 chunks,
# conditioning length changing every 10 in a second run); W14 TP=2 bf16 + NCCL + graphs (reference
# point); W14 TP=1 FP8 + compile + graphs with TAEHV decode on cuda:1. Table at the end; everything in
# $OUT/pipeline_tp.tgz.
set -uo pipefail
BUDGET_S=${BUDGET_S:-380}

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run 70 gpu-tests python3 -m pytest -q -p no:cacheprovider -x tests/test_compile.py -k cuda
run 60 gpu-tests-pipeline python3 -m pytest -q -p no:cacheprovider -x tests/test_engine.py tests/test_prewarm.py
TR="torchrun --standalone --nproc_per_node 2"
B="-m cadence bench pipeline --preset w14 --decoder taehv --out-dir $PERF"
run 150 w14-tp2-fp8-compile $TR $B --tp 2 --chunks 100 --kv-fp8 --fp8 --compile --shape-change-every 10
run 90 w14-tp2-bf16-nccl $TR $B --tp 2 --comm nccl --chunks 60 --shape-change-every 0
run 90 w14-tp1-fp8-compile-dec1 python3 $B --device cuda:0 --decode-device cuda:1 --chunks 60 --kv-fp8 --fp8 --compile \
  --shape-change-every 0
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'EOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    d = json.loads(f.read_text()); r = d["results"]; sc = r.get("shape_change_run")
    print(f"{f.stem.split('-w14-')[-1]:58} fps {r['fps']:5.1f} diff {r['diffusion_ms']:6.1f} dec {r['decode_ms']:5.1f} "
          f"p50/p99 {r['chunk_p50_ms']:6.1f}/{r['chunk_p99_ms']:6.1f} miss {100 * r['deadline_miss_rate']:5.1f}% "
          f"ttff {r['ttff_ms']:6.0f} cold {r.get('ttff_cold_ms', 0):6.0f}"
          + (f" | shape-change fps {sc['fps']:.1f} p99 {sc['chunk_p99_ms']:.0f} graphs {sc['graphs']}" if sc else ""))
EOF
tar czf "$OUT/pipeline_tp.tgz" -C "$OUT" perf && rm -rf "$PERF" && ls -la "$OUT"
