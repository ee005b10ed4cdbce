#!/usr/bin/env bash
# One device call for issue 28 (EngineSpec -> EngineRecipe, one flag set) on ONE H200, <= ~5 minutes.
# Usage on the device machine (repo root):  CADENCE_GIT=<sha> bash scripts/device_recipe.sh
#        on the CPU, to prove the plan runs:  SMOKE=1 bash scripts/device_recipe.sh   (~1 min: the tiny preset
#        stands in for B and C's families, whose 480x832 chunks take minutes each on a CPU; R is the same)
# What it checks on a GPU, the words a new user types (no fast-path flags: the recipe decides):
#   R  `cadence recipe` for the default model, krea-14b, self-forcing and flashtalk on cuda:0 (pure, no model)
#   A  a bare `cadence bench pipeline` (the shipped character, what a bare `cadence serve` builds): FP8 K/V
#      ring, FP8 linears, CUDA graphs, TAEHV, decode on the same GPU
#   B  `cadence bench pipeline --model krea-14b` (bare; it used to exit 2 on the ring cache): the naive cache
#      its rebuild needs, chosen by the recipe; 2 of its 40 layers (the 14B at full width)
#   C  `cadence bench pipeline --model self-forcing` (bare): the recipe's fast path at 4 of 30 layers
# Each command runs under `timeout`, capped by what is left of BUDGET_S (scripts/device_lib.sh); the JSON
# records (each with its "recipe") go to $OUT/perf/pipeline; a short table at the end.
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

if [[ "${SMOKE:-0}" == 1 ]]; then
  DEV=cpu; CHUNKS=4; MODEL_A="--preset tiny"; KREA=0; MODEL_C="--preset tiny --no-warmup --window 2"
else
  DEV=cuda:0; CHUNKS=40; MODEL_A=""; KREA=1; MODEL_C="--model self-forcing --layers 4"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.device_count(), "GPUs")'
run 60 tests python3 -m pytest -q -p no:cacheprovider -x tests/test_recipe.py tests/test_weights_entry.py
for m in character krea-14b self-forcing flashtalk; do
  run 20 "R-$m" python3 -m cadence recipe --model "$m" --device "$DEV"
done
B="python3 -m cadence bench pipeline --device $DEV --shape-change-every 0 --out-dir $PERF"
run 100 A-bare $B $MODEL_A --chunks "$CHUNKS"
if (( KREA )); then
  run 120 B-krea-bare $B --model krea-14b --layers 2 --chunks 8
fi
run 120 C-self-forcing-bare $B $MODEL_C --chunks $((CHUNKS / 2))
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'EOF'
import json, pathlib, sys
print(f"{'record':60} {'cache':>6} {'kvfp8':>5} {'fp8':>4} {'graphs':>6} {'decoder':>7} {'fps':>6} {'p99 ms':>7} notes")
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    d = json.loads(f.read_text())
    r, rec = d["results"], d.get("recipe") or {}
    fast = rec.get("fast", {})
    print(f"{f.stem[:60]:60} {rec.get('cache', '?'):>6} {str(rec.get('kv_fp8')):>5} "
          f"{str(fast.get('fp8_linears')):>4} {str(fast.get('graphs')):>6} {rec.get('decoder', '?'):>7} "
          f"{r['fps']:6.1f} {r['chunk_p99_ms']:7.1f} {'; '.join(rec.get('notes', []))[:80]}")
EOF
ls -R "$PERF"
