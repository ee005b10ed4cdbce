#!/usr/bin/env bash
# Issue 29 on ONE H200: every model family side by side with its authors' own code, random weights both sides,
# the same decoder class both sides (the Wan 2.1 VAE; TAEHV in the taew2_1 layout for the TAEHV rows), each
# family at its own geometry. Usage (repo root):
#   CADENCE_GIT=<sha> PART=ref|cadence|serve [ONLY="name ..."] [BUDGET_S=540] bash scripts/device_families.sh
# Carry: .ref (scripts/reference_checkouts.sh, ~3.5 MB), .whl_ref (~11 MB: diffusers, ftfy, fastapi, pydantic,
# dotenv, easydict, loguru, pyloudnorm, soxr, ...: what the references import and the GPU machine lacks; soxr
# for Cadence's flashtalk); PART=serve also .whl_serve (~42 MB: aiortc, av, uvicorn, cryptography, ...).
#   PART=ref      the references, one process each (scripts/reference_*_bench.py), in this order, <= 540 s:
#                 self-forcing (demo loop, torch.compile default mode, Wan VAE then TAEHV, ~120 s),
#                 causvid (eager bf16, its end decode, ~35 s), longlive (eager bf16, peft LoRA, 12 blocks,
#                 one switch + re-cache, ~45 s), krea-14b eager (6 blocks, ~70 s), flashtalk eager (3 clips,
#                 ~70 s), then krea-14b with its DO_COMPILE (whatever budget is left, <= 200 s). Cut: the
#                 demo's max-autotune (over 400 s of autotuning) -> default mode; LongLive's 240-frame example
#                 -> 36 latent frames; Krea's 9-block default -> 6; FlashTalk's compile (COMPILE_MODEL) does
#                 not fit after the others (FLASHTALK_COMPILE=1 runs it instead of the eager one).
#   PART=cadence  `cadence bench pipeline --model <family> --device cuda:0 --decode-device same` with the fast
#                 flags of the Self-Forcing side-by-side (--kv-fp8 --fp8 --compile, --decoder-fast compile),
#                 through scripts/reference_cadence_run.py (the bench's own peak over its stream, as the
#                 references' over their runs; the process's peak beside it), <= 540 s:
#                 self-forcing-wan (~100 s), self-forcing-taehv (--taehv-weights: Self-Forcing's own TAEHV class,
#                 random, ~70 s), causvid (~80 s), longlive (a new prompt of the same length every 10 chunks,
#                 --prompt-switch-every: its re-cache timed alone, ~100 s), krea-14b (naive cache, no graphs: its rebuild needs them, ~120 s), flashtalk (~100 s).
#   PART=serve    `cadence bench serve --model self-forcing --device cuda` (aiortc client on loopback, the
#                 served engine) with the Wan VAE, then TAEHV (taew2_1 layout), 20 s each, <= 240 s.
# Each part prints its own call's table; merge both calls' perf/ folders and run scripts/reference_table.py on
# the merge for the pairs and ratios. Flag spellings are today's (8a099b2); the recipe work may rename them.
# ONLY limits a part to some names (ref: self-forcing causvid longlive krea-14b flashtalk; cadence:
# self-forcing-wan self-forcing-taehv causvid longlive krea-14b flashtalk; serve: serve-wan serve-taehv).
# SMOKE=1: the same commands on this CPU at the tiny configurations (references --small; Cadence --preset
# tiny with the part's flags; no torch.compile), to prove the script runs: REFPY=dir of the references' extra
# packages.
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}; PART=${PART:-ref}; SMOKE=${SMOKE:-0}; ONLY=${ONLY:-}
[[ $PART == serve ]] && BUDGET_S=${BUDGET_S_SERVE:-${BUDGET_S}}
source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...
want() { [[ -z $ONLY || " $ONLY " == *" $1 "* ]]; }
if [[ $SMOKE == 1 ]]; then  # a shared 2-core CPU: the GPU limits x SMOKE_SCALE (a timeout there proves nothing)
  eval "$(declare -f run | sed '1s/^run/_gpu_run/')"
  run() { local limit=$1; shift; _gpu_run $((limit * ${SMOKE_SCALE:-5})) "$@"; }
fi

if [[ $SMOKE == 1 ]]; then
  export PYTHONPATH=${REFPY:-/tmp/refs_local}:$PWD
  DEV=cpu; SMALL=--small; COMPILE=; REP=1  # no torch.compile here: it would time inductor's C++ builds
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  site=/tmp/refpy; whl=(.whl_ref/*.whl)
  if [[ $PART == serve ]]; then
    whl=(.whl_serve/*.whl .whl_ref/{fastapi,starlette,pydantic,pydantic_core,annotated_types,typing_inspection}-*.whl)
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site "${whl[@]}" 2>&1 | tail -2
  export PYTHONPATH=$site:$PWD
  DEV=cuda; SMALL=; COMPILE=--compile; REP=2
fi
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
GIT=${CADENCE_GIT:-$(git rev-parse --short HEAD 2>/dev/null)}
REFS=$PERF/reference; mkdir -p "$REFS"

if [[ $PART == ref ]]; then
  R="python3 scripts"
  want self-forcing && run 200 R-self-forcing $R/reference_self_forcing_bench.py --ref .ref/Self-Forcing $SMALL \
    --device $DEV --decoder both $COMPILE --compile-mode default --repeats $REP --out "$REFS/self-forcing-{decoder}.json"
  want causvid && run 70 R-causvid $R/reference_causvid_bench.py --ref .ref/CausVid $SMALL --device $DEV \
    --repeats $REP --out "$REFS/causvid.json"
  want longlive && run 90 R-longlive $R/reference_longlive_bench.py --ref .ref/LongLive $SMALL --device $DEV \
    --blocks 12 --switch 18 --repeats $REP --out "$REFS/longlive.json"
  want krea-14b && run 110 R-krea-14b-eager $R/reference_krea_bench.py --ref .ref/realtime-video $SMALL \
    --device $DEV --blocks 6 --repeats $REP --out "$REFS/krea-14b-eager.json"
  if want flashtalk; then
    if [[ ${FLASHTALK_COMPILE:-0} == 1 ]]; then FC=$COMPILE; FN=flashtalk; else FC=; FN=flashtalk-eager; fi
    run 130 R-flashtalk $R/reference_flashtalk_bench.py --ref .ref/SoulX-FlashTalk $SMALL --device $DEV $FC \
      --clips 3 --repeats $REP --out "$REFS/$FN.json"
  fi
  want krea-14b && run 200 R-krea-14b-compile $R/reference_krea_bench.py --ref .ref/realtime-video $SMALL \
    --device $DEV $COMPILE --blocks 6 --repeats $REP --out "$REFS/krea-14b.json"
elif [[ $PART == cadence ]]; then
  C="python3 scripts/reference_cadence_run.py bench pipeline"
  if [[ $SMOKE == 1 ]]; then  # the part's flags on the tiny preset (the families' geometries are GPU-sized)
    F="--preset tiny --device cpu --decode-device same --no-graphs"
    TAEHV=/tmp/taew2_1_random.pth; FAST=; FP8=; TAIL="--chunks 3 --no-prewarm"
  else
    F="--device cuda:0 --decode-device same --compile"
    TAEHV=/tmp/taew2_1_random.pth; FAST="--decoder-fast compile"; FP8="--fp8"; TAIL=
  fi
  python3 scripts/reference_taehv_weights.py --ref .ref/Self-Forcing --out $TAEHV
  fam() { [[ $SMOKE == 1 ]] && echo "" || echo "--model $1"; }
  want self-forcing-wan && run 130 C-self-forcing-wan $C $F $(fam self-forcing) $FP8 --kv-fp8 --decoder wan $FAST \
    --chunks 40 --shape-change-every 0 --out-dir "$PERF/cadence/self-forcing-wan" $TAIL
  want self-forcing-taehv && run 100 C-self-forcing-taehv $C $F $(fam self-forcing) $FP8 --kv-fp8 --decoder taehv \
    --taehv-weights $TAEHV --chunks 40 --shape-change-every 0 --out-dir "$PERF/cadence/self-forcing-taehv" $TAIL
  want causvid && run 100 C-causvid $C $F $(fam causvid) $FP8 --kv-fp8 --decoder wan $FAST --chunks 30 \
    --shape-change-every 0 --out-dir "$PERF/cadence/causvid" $TAIL
  want longlive && run 130 C-longlive $C $F $(fam longlive) $FP8 --kv-fp8 --decoder wan $FAST --chunks 40 \
    --shape-change-every 0 --prompt-switch-every 10 --out-dir "$PERF/cadence/longlive" $TAIL
  # Krea's rebuild runs on the naive cache only (the ring is refused): no CUDA graphs, no FP8 K/V
  want krea-14b && run 150 C-krea-14b $C $F $(fam krea-14b) $FP8 --cache naive --decoder wan $FAST --chunks 16 \
    --shape-change-every 0 --out-dir "$PERF/cadence/krea-14b" $TAIL
  # a clip session: the engine turns graphs, the ring, FP8 K/V and the decoder choice off with one note each
  want flashtalk && run 150 C-flashtalk $C $F $(fam flashtalk) $FP8 --chunks 6 --shape-change-every 0 \
    --out-dir "$PERF/cadence/flashtalk" $TAIL
elif [[ $PART == serve ]]; then
  python3 -c 'import aiortc, av, fastapi, uvicorn; print("serve packages ok")' || { echo "=== no serve packages"; exit 1; }
  python3 scripts/reference_taehv_weights.py --ref .ref/Self-Forcing --out /tmp/taew2_1_random.pth
  S="python3 -m cadence bench serve --sessions 1 --speak-every 2 --out-dir $PERF --seconds ${SERVE_SECONDS:-20}"
  [[ $SMOKE == 1 ]] && S="$S --device cpu --preset tiny --start-timeout 600" || S="$S --device cuda --model self-forcing --compile"
  want serve-wan && run 120 S-self-forcing-wan $S --decoder wan
  want serve-taehv && run 110 S-self-forcing-taehv $S --decoder taehv --taehv-weights /tmp/taew2_1_random.pth
fi
echo "=== done in ${SECONDS}s"
[[ $PART != serve ]] && python3 scripts/reference_table.py "$PERF" --git "$GIT" --command "PART=$PART bash scripts/device_families.sh"
ls -R "$PERF" | head -40
