#!/usr/bin/env bash
# Issue 15 on ONE H200: the Self-Forcing family side by side with Self-Forcing's own code, both with random
# weights and the full Wan 2.1 VAE decoder on the same GPU, at the family's geometry (480x832, 3 latent
# frames per block, 1000/750/500/250 warped, 16 fps).
#   PART=ref      R1 the reference's demo loop, eager fp16; R2 the same with the demo's torch.compile
#                 (scripts/reference_self_forcing_bench.py; needs .ref/Self-Forcing and .whl_ref/diffusers*.whl
#                 carried: the reference imports diffusers and ftfy, absent on the GPU machine)
#   PART=cadence  C1 `cadence bench pipeline --model self-forcing --decoder wan` (compiled decoder) with a
#                 second run whose prompt changes every 10 chunks; C2 the same with the FP8 decoder;
#                 W the W1.3 preset with the FP8 decoder, 200 chunks (issue 17: >= 30 fps on one GPU)
#   PART=more     C3 the family with bf16 K/V (cuDNN SDPA), W (as in cadence)
#   PART=both     R3 the reference compiled in torch.compile's default mode, then C1 and C2
# Usage (repo root):  CADENCE_GIT=<sha> PART=ref|cadence|both|more bash scripts/device_sf_side_by_side.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}; PART=${PART:-ref}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
REF_COMMIT=${REF_COMMIT:-33593df3e81fa3ec10239271dd2c100facac6de1}
if [[ $PART == ref ]]; then
  python3 -m pip install --no-deps --quiet --target /tmp/refpy .whl_ref/*.whl 2>&1 | tail -2
  R="env PYTHONPATH=/tmp/refpy:. python3 scripts/reference_self_forcing_bench.py --ref .ref/Self-Forcing --commit $REF_COMMIT"
  run 150 R1-ref-eager $R --repeats 2 --out "$PERF/reference/self-forcing-eager.json"
  run 400 R2-ref-compile $R --repeats 3 --compile --out "$PERF/reference/self-forcing-compile.json"
elif [[ $PART == both ]]; then
  # the compiled reference in torch.compile's default mode (the demo's max-autotune did not finish its
  # autotuning in 400 s), then the two Cadence variants, in one call on one GPU
  python3 -m pip install --no-deps --quiet --target /tmp/refpy .whl_ref/*.whl 2>&1 | tail -2
  R="env PYTHONPATH=/tmp/refpy:. python3 scripts/reference_self_forcing_bench.py --ref .ref/Self-Forcing --commit $REF_COMMIT"
  run 200 R3-ref-compile-default $R --repeats 3 --compile --compile-mode default --out "$PERF/reference/self-forcing-compile-default.json"
  P="python3 -m cadence bench pipeline --device cuda:0 --decode-device same --decoder wan --kv-fp8 --fp8 --compile --out-dir $PERF"
  run 180 C1-sf-deccompile $P --model self-forcing --chunks 60 --shape-change-every 10 --decoder-fast compile
  run 180 C2-sf-decfp8 $P --model self-forcing --chunks 60 --shape-change-every 10 --decoder-fast fp8
elif [[ $PART == more ]]; then
  # the family with bf16 K/V (torch SDPA: cuDNN attention) instead of the FP8 ring kernel, and W
  P="python3 -m cadence bench pipeline --device cuda:0 --decode-device same --decoder wan --fp8 --compile --out-dir $PERF"
  run 170 C3-sf-bf16kv $P --model self-forcing --chunks 60 --shape-change-every 0 --decoder-fast compile
  run 200 W-w1.3-decfp8 $P --kv-fp8 --preset w1.3 --chunks 200 --shape-change-every 0 --decoder-fast fp8
else
  P="python3 -m cadence bench pipeline --device cuda:0 --decode-device same --decoder wan --kv-fp8 --fp8 --compile --out-dir $PERF"
  run 190 C1-sf-deccompile $P --model self-forcing --chunks 60 --shape-change-every 10 --decoder-fast compile
  run 190 C2-sf-decfp8 $P --model self-forcing --chunks 60 --shape-change-every 10 --decoder-fast fp8
  run 170 W-w1.3-decfp8 $P --preset w1.3 --chunks 200 --shape-change-every 0 --decoder-fast fp8
fi
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("reference/*.json")):
    r = json.loads(f.read_text())
    print(f"ref {f.stem}: fps {r['fps_video']:.1f} video / {r['fps_steady']:.1f} steady, ttff {r['ttff_ms']:.0f} ms, "
          f"blocks {' '.join(f'{x:.0f}' for x in r['block_ms'])}, decode {sorted(r['decode_ms'])[3]:.0f} ms, "
          f"first run {r['first_run_s']:.0f} s, finite {r['finite']}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    r = json.loads(f.read_text())["results"]
    sc = r.get("shape_change_run") or {}
    print(f"pipe {f.stem}: {r['fps']:.1f} fps, latency p50/p99 {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} ms, "
          f"diff {r['diffusion_ms']:.0f} dec {r['decode_ms']:.0f} ms, miss {r['deadline_misses']}/{r['chunks']} "
          f"lead {r['lead_ms']:.0f}, ttff {r['ttff_ms']:.0f}; prompt-change run: "
          f"{r.get('shape_changes')} changes, miss {sc.get('deadline_misses')}, p99 {sc.get('latency_p99_ms')}")
PY
