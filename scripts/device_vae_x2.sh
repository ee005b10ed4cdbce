#!/usr/bin/env bash
# Issue 17 on TWO H200s (nvidia-h200-x2), <= ~9 minutes: diffusion on GPU 0, the full Wan decoder on GPU 1
# (latents handed GPU to GPU, no host trip), the decoder's default fast path (compile + channels-last +
# cudnn.benchmark):
#   A  W14 at 704x1088, 200 chunks   (targets: >= 24 fps, latency p99 <= 250 ms)
#   B  W1.3, 200 chunks              (targets: >= 40 fps, latency p99 <= 450 ms)
#   C  cadence bench serve, W14, --decode-gpu 1, 20 s   (target: >= 23.5 fps)
#   D  issue 15: the Self-Forcing family with its decode on GPU 1, 60 chunks (target: >= 2x Self-Forcing's own
#      compiled code on one GPU: 19.4 fps steady measured in session 10 -> >= 38.8 fps)
# Usage (repo root):  CADENCE_GIT=<sha> bash scripts/device_vae_x2.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}; CHUNKS=${CHUNKS:-200}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P="python3 -m cadence bench pipeline --chunks $CHUNKS --device cuda:0 --decode-gpu 1 --decoder wan --kv-fp8 --fp8 --compile --shape-change-every 0 --out-dir $PERF"
run 170 A-w14-dec1 $P --preset w14
run 170 B-w1.3-dec1 $P --preset w1.3
run 200 C-serve-w14-dec1 python3 -m cadence bench serve --device cuda --sessions 1 --speak-every 2 --preset w14 \
  --decoder wan --decode-gpu 1 --compile --seconds 20 --window-s 5 --out-dir "$PERF"
run 170 D-sf-dec1 $P --model self-forcing --chunks 60
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    r = json.loads(f.read_text())["results"]
    print(f"pipe {f.stem}: {r['fps']:.1f} fps, latency p50/p99 {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} ms, "
          f"diff {r['diffusion_ms']:.0f} dec {r['decode_ms']:.0f} ms, miss {r['deadline_misses']}/{r['chunks']} "
          f"lead {r['lead_ms']:.0f}, ttff {r['ttff_ms']:.0f}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("serve/*.json")):
    print("serve", f.stem, json.loads(f.read_text()).get("headline"))
PY
tar czf "$OUT/vae_x2.tgz" -C "$OUT" perf
