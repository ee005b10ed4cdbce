#!/usr/bin/env bash
# First device call of the next session (issue 5), nvidia-h200-x2, <= ~6 minutes:
#   1. the CUDA tests not yet run on a GPU: compiled-ops parity inside a captured graph, prewarm on CUDA;
#   2. W14 TP=2 pipeline with --capture-filling (every ring-fill stage captured in a second prewarm
#      stream): are the first 20 chunks of a stream within the 166.7 ms deadline now, and the warm ttff?
#   3. W1.3 on one GPU with --capture-filling (first chunk replayed: ttff).
# Usage on the device machine (repo root):  CADENCE_GIT=<sha> bash scripts/device_capture_filling.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-360}

source "$(dirname "$0")/device_lib.sh"  # run LIMIT_S NAME CMD...

run 60 cuda-tests python3 -m pytest -q -p no:cacheprovider tests/test_compile.py tests/test_prewarm.py -k cuda -rA
TR="torchrun --standalone --nproc_per_node 2"
run 170 w14-tp2-capfill $TR -m cadence bench pipeline --preset w14 --tp 2 --decoder taehv --kv-fp8 --fp8 --compile \
  --capture-filling --chunks 60 --shape-change-every 0 --out-dir "$PERF"
run 110 w13-capfill python3 -m cadence bench pipeline --preset w1.3 --device cuda:0 --decode-device same --decoder taehv \
  --kv-fp8 --fp8 --compile --capture-filling --chunks 40 --shape-change-every 0 --out-dir "$PERF"
echo "=== done in ${SECONDS}s"
python3 - "$PERF" <<'EOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("pipeline/*.json")):
    r = json.loads(f.read_text())["results"]
    print(f"{f.stem[-60:]:60} fps {r['fps']:5.1f} p99 steady {r['chunk_p99_ms']:6.1f} all {r['chunk_p99_ms_all']:6.1f} "
          f"miss all {100 * r['deadline_miss_rate_all']:5.1f}% ttff {r['ttff_ms']:6.0f} cold {r.get('ttff_cold_ms', 0):6.0f}")
EOF
tar czf "$OUT/capfill.tgz" -C "$OUT" perf && rm -rf "$PERF" && ls -la "$OUT"
