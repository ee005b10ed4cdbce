#!/usr/bin/env bash
# The one engine on the GPUs (issue 14), nvidia-h200-x2. Stage A: the CUDA tests of the engine (decode
# thread on its own stream, pinned ring, graphs replayed for a reset session, the serial order equal to the
# overlapped one), then `cadence bench pipeline` at W1.3 (one GPU) and W14 TP=2 (the served engine, now the
# only one). Stage B: `cadence bench serve` at W14 TP=2 and W1.3 (the worker's busy time per chunk is in each
# session report: worker.work_ms_p50 against serial_ms_p50 = diffusion + decode).
# Usage on the device machine (repo root, .whl carried for stage B):
#   CADENCE_GIT=$(git rev-parse --short=12 HEAD) STAGE=A bash scripts/device_engine.sh   (the device copy of .git is stale)
set -uo pipefail
STAGE=${STAGE:-A}
BUDGET_S=${BUDGET_S:-540}

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
git rev-parse --short HEAD 2>/dev/null || true

if [[ $STAGE == A ]]; then
  run 150 cuda-tests python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_prewarm.py \
    tests/test_gpu.py tests/test_compile.py tests/test_graphs.py -k "cuda or gpu" -rA
  run 130 w13 python3 -m cadence bench pipeline --preset w1.3 --device cuda:0 --decode-device same \
    --decoder taehv --kv-fp8 --fp8 --compile --chunks 40 --shape-change-every 0 --out-dir "$PERF"
  run 230 w14-tp2 torchrun --standalone --nproc_per_node 2 -m cadence bench pipeline --preset w14 --tp 2 \
    --decoder taehv --kv-fp8 --fp8 --compile --chunks 60 --shape-change-every 0 --out-dir "$PERF"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
  python3 -c 'import aiortc, av, fastapi, uvicorn' || { echo "=== the serve packages did not import: stopping"; exit 1; }
  B="python3 -m cadence bench serve --device cuda --sessions 1 --speak-every 2 --out-dir $PERF"
  run 260 w14-tp2-serve $B --preset w14 --tp 2 --seconds 20 --compile --window-s 5
  run 180 w13-serve $B --preset w1.3 --seconds 20 --compile
fi
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'EOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/*.json")):
    d = json.loads(f.read_text()); r = d["results"]
    if d["bench"] == "pipeline":
        print(f"{f.stem[-50:]:50} fps {r['fps']:5.1f} p99 {r['chunk_p99_ms']:6.1f} all {r['chunk_p99_ms_all']:6.1f} "
              f"paced {r.get('chunk_paced_ms')} ttff {r['ttff_ms']:6.0f} cold {r.get('ttff_cold_ms', 0):6.0f} "
              f"diff {r['diffusion_ms']:.1f} dec {r['decode_ms']:.1f}")
    else:
        print(f"{f.stem[-50:]:50} fps {r['fps_mean']} ttff {r['ttff_ms_p50']} agent {r['agent_audio_to_frame_ms_p50']} "
              f"underruns {r['underruns']} misses {r.get('deadline_misses')} audio-only {r.get('chunks_audio_only')} "
              f"worker {r.get('worker_work_ms_p50')} serial {r.get('worker_serial_ms_p50')} "
              f"overlapped {r.get('worker_overlapped_ms_p50')} latency p50 {r.get('chunk_latency_ms_p50')}")
EOF
tar czf "$OUT/engine_$STAGE.tgz" -C "$OUT" perf && ls -R "$PERF" | head -20
