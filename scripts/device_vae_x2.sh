#!/usr/bin/env bash
# Issue 17 on TWO H200s (nvidia-h200-x2), <= ~9 minutes: diffusion on GPU 0, the full Wan decoder on GPU 1
# (latents handed GPU to GPU, no host trip), the decoder's default fast path (compile + channels-last +
# cudnn.benchmark):
#   A  W14 at 704x1088, 200 chunks   (targets: >= 24 fps, latency p99 <= 250 ms)
#   B  W1.3, 200 chunks              (targets: >= 40 fps, latency p99 <= 450 ms)
#   C  cadence bench serve, W14, --decode-gpu 1, 20 s   (target: >= 23.5 fps)
#   D  issue 15: the Self-Forcing family with its decode on GPU 1, 60 chunks (target: >= 2x Self-Forcing's own
#      compiled code on one GPU: 19.4 fps steady measured in session 10 -> >= 38.8 fps)
#   A8 as A with --decoder-fast fp8 (the FP8 convs: ~76 ms vs ~80-90 ms per chunk alone)
#   E  issue 18: `cadence bench turn` at W14 TP=2 (needs .whl carried, as C)
#   G  session 11's two unmeasured changes on the layout they are for: W14 as A with Python's 5 ms switch
#      interval (--gil-switch-ms 0) and with 0.5 ms (the default), 120 chunks each (prediction: step 168 ->
#      ~165.5 ms, >= 24 fps at 0.5); then W14 as A with --decoder-fast bench (cuDNN timings kept by the
#      engine's one decode thread: no per-stream stall; decode ~80 ms or less)
#   H  W1.3 on ONE GPU with --decoder-fast bench (runs on nvidia-h200 too; prediction ~30.5 fps, ttff < 0.5 s)
# Usage (repo root):  CADENCE_GIT=<sha> PARTS="A A8 B" bash scripts/device_vae_x2.sh   (one call <= 10 min:
# A, A8, B, D ~2-3 min each with the compile warm-up; C and E start a server)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}; CHUNKS=${CHUNKS:-200}; PARTS=${PARTS:-A A8 B}
if [[ " $PARTS " == *" C "* || " $PARTS " == *" E "* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
want() { [[ " $PARTS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P="python3 -m cadence bench pipeline --chunks $CHUNKS --device cuda:0 --decode-gpu 1 --decoder wan --kv-fp8 --fp8 --compile --shape-change-every 0 --out-dir $PERF"
want A && run 170 A-w14-dec1 $P --preset w14
want A8 && run 170 A8-w14-dec1-fp8 $P --preset w14 --decoder-fast fp8
want B && run 170 B-w1.3-dec1 $P --preset w1.3
want C && run 200 C-serve-w14-dec1 python3 -m cadence bench serve --device cuda --sessions 1 --speak-every 2 \
  --preset w14 --decoder wan --decode-gpu 1 --compile --seconds 20 --window-s 5 --out-dir "$PERF"
want E && run 240 E-turn-w14-tp2 python3 -m cadence bench turn --device cuda --preset w14 --tp 2 --turns 6 \
  --compile --out-dir "$PERF"
want D && run 170 D-sf-dec1 $P --model self-forcing --chunks 60
want G && run 150 G-w14-dec1-gil5 $P --preset w14 --chunks 120 --gil-switch-ms 0 --out-dir "$PERF/gil5"
want G && run 150 G-w14-dec1-gil05 $P --preset w14 --chunks 120 --out-dir "$PERF/gil05"
want G && run 170 G-w14-dec1-bench $P --preset w14 --decoder-fast bench
want H && run 170 H-w1.3-one-bench python3 -m cadence bench pipeline --chunks 120 --device cuda:0 --decode-device same \
  --decoder wan --kv-fp8 --fp8 --compile --shape-change-every 0 --preset w1.3 --decoder-fast bench --out-dir "$PERF"
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("**/pipeline/*.json")):
    r = json.loads(f.read_text())["results"]
    print(f"pipe {f.stem}: {r['fps']:.1f} fps, latency p50/p99 {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} ms, "
          f"diff {r['diffusion_ms']:.0f} dec {r['decode_ms']:.0f} ms, miss {r['deadline_misses']}/{r['chunks']} "
          f"lead {r['lead_ms']:.0f}, ttff {r['ttff_ms']:.0f}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("serve/*.json")):
    print("serve", f.stem, json.loads(f.read_text()).get("headline"))
PY
tar czf "$OUT/vae_x2.tgz" -C "$OUT" perf
