#!/usr/bin/env bash
# One device call for issue 17 (the full Wan VAE in the live path) on ONE H200, <= ~9 minutes:
#   1. GPU parity of the decoder fast paths (scripts/device_vae_parity.py: bf16 vs the fp32 plain decoder)
#   2. `cadence bench vae`: Wan 2.2 at 704x1088 (one further 4-frame chunk; W14's decoder) and Wan 2.1 at
#      480x832 with 3 latent frames (one further 12-frame chunk; W1.3's decoder), --fast compile | fold
#   3. `cadence bench pipeline --preset w1.3 --decoder wan` on one GPU (decode on a side stream) with the
#      decoder's fast path, 60 chunks
# Usage (repo root):  CADENCE_GIT=<sha> bash scripts/device_vae.sh ; results in $OUT/vae.tgz + a table
set -uo pipefail
BUDGET_S=${BUDGET_S:-520}; CHUNKS=${CHUNKS:-60}; MODES=${MODES:-"compile fold"}; PIPE_MODES=${PIPE_MODES:-fold}
VAE_FLAGS=${VAE_FLAGS:-}  # e.g. --cudnn-benchmark
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPUs")'
run ${PARITY_S:-90} parity python3 scripts/device_vae_parity.py "$PERF/parity.json"
V="python3 -m cadence bench vae --chunks 8 --warmup 3 --out-dir $PERF"
for m in $MODES; do run 100 "vae2.2-$m" $V --variant 2.2 --height 704 --width 1088 --fast "$m" $VAE_FLAGS; done
for m in $MODES; do run 100 "vae2.1-lf3-$m" $V --variant 2.1 --height 480 --width 832 --latent-frames 3 --fast "$m" $VAE_FLAGS; done
P="python3 -m cadence bench pipeline --preset w1.3 --chunks $CHUNKS --device cuda:0 --decode-device same --decoder wan --kv-fp8 --fp8 --compile --shape-change-every 0 --out-dir $PERF"
for m in $PIPE_MODES; do run 200 "pipe-w1.3-$m" $P --decoder-fast "$m"; done
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("vae/*.json")):
    r = json.loads(f.read_text())["results"]
    print(f"vae {r['variant']} {r['height']}x{r['width']} lf{r['latent_frames_per_chunk']} {r.get('fast')}: "
          f"cudnn.benchmark {r['cudnn_benchmark']}: per chunk {r['per_chunk_ms']:.1f} ms p99 {r['per_chunk_p99_ms']:.1f} first {r['first_chunk_ms']:.1f}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    r = json.loads(f.read_text())["results"]
    print(f"pipe {f.stem}: {r['fps']:.1f} fps, latency p50/p99 {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} ms, "
          f"diff {r['diffusion_ms']:.0f} dec {r['decode_ms']:.0f} ms, miss {r['deadline_misses']}/{r['chunks']} "
          f"lead {r['lead_ms']:.0f}, ttff {r['ttff_ms']:.0f} (cold {r['ttff_cold_ms']:.0f}), dec {r['fast'].get('decoder_fast')}")
PY
tar czf "$OUT/vae.tgz" -C "$OUT" perf && ls -R "$PERF" | head -20
