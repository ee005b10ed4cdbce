"""Cadence's side of a side-by-side: one ``cadence`` command run in this process, then the process's peak GPU
memory added to the JSON it wrote (not part of Cadence; scripts/device_families.sh calls it).

    python scripts/reference_cadence_run.py bench pipeline --model self-forcing --device cuda:0 ... --out-dir DIR

``bench pipeline`` records throughput, latency and time to first frames but no memory figure; the reference
harnesses (scripts/reference_*_bench.py) record ``torch.cuda.max_memory_allocated`` over their process
(weights, caches, warm-up and the timed runs). This wrapper reads the same counter after the command, in the
same process, on every visible GPU, and writes it into each JSON the command added under ``--out-dir``
(``results.peak_mem_gib``, ``results.peak_mem_from``), so both sides' peaks are the same reading. The exit
status is the command's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def out_dir(argv: list[str]) -> Path | None:
    for i, a in enumerate(argv):
        if a == "--out-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--out-dir="):
            return Path(a.split("=", 1)[1])
    return None


def main() -> int:
    argv = sys.argv[1:]
    d = out_dir(argv)
    before = set(d.rglob("*.json")) if d and d.exists() else set()
    from cadence.cli import main as cadence

    rc = cadence(argv)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    peaks = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(n)]
    peak = max(peaks) if peaks else None
    new = sorted(set(d.rglob("*.json")) - before) if d and d.exists() else []
    for f in new:
        data = json.loads(f.read_text())
        if isinstance(data.get("results"), dict):
            data["results"]["peak_mem_gib"] = peak
            data["results"]["peak_mem_per_gpu_gib"] = peaks
            data["results"]["peak_mem_from"] = (
                "torch.cuda.max_memory_allocated after the command, same process (scripts/reference_cadence_run.py)"
            )
            f.write_text(json.dumps(data, indent=1))
    print(
        f"peak GPU memory {'n/a (CPU)' if peak is None else f'{peak:.1f} GiB'}; added to {len(new)} JSON file(s)"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
