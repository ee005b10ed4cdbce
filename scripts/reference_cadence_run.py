"""Cadence's side of a side-by-side: one ``cadence`` command run in this process, then the process's peak GPU
memory added to the JSON it wrote (not part of Cadence: the plans families-cadence and families-attention of
scripts/device_plans.toml call it).

    python scripts/reference_cadence_run.py bench pipeline --model self-forcing --device cuda:0 ... --out-dir DIR

The reference harnesses (scripts/reference_*_bench.py) record ``torch.cuda.max_memory_allocated`` over their
runs with the weights resident (the build's peak apart); ``bench pipeline`` records the same reading over each
stream (``results.peak_mem_gib``: the counter reset before the stream, the weights resident). This wrapper
keeps that figure and adds the process's peak (build and warm-up included), read after the command in the same
process on every visible GPU, to each JSON the command added under ``--out-dir``: ``results.peak_mem_process_gib``,
``peak_mem_per_gpu_gib``, ``peak_mem_from``; ``peak_mem_gib`` is filled with it only where the command wrote
none (an older ``bench pipeline``). The exit status is the command's."""

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
        res = data.get("results")
        if isinstance(res, dict):
            own = res.get("peak_mem_gib") is not None
            res["peak_mem_process_gib"] = peak
            res["peak_mem_per_gpu_gib"] = peaks
            if own:
                res["peak_mem_from"] = "bench pipeline: torch.cuda.max_memory_allocated over the timed stream"
            else:
                res["peak_mem_gib"] = peak
                res["peak_mem_from"] = (
                    "torch.cuda.max_memory_allocated after the command, same process (scripts/reference_cadence_run.py)"
                )
            f.write_text(json.dumps(data, indent=1))
    print(
        f"peak GPU memory {'n/a (CPU)' if peak is None else f'{peak:.1f} GiB'}; added to {len(new)} JSON file(s)"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
