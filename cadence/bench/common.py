"""Shared pieces of the benchmarks: device description, timing, JSON records (docs/benchmarks.md)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cadence.bench.results import RESULTS_DIR
from cadence.telemetry.devices import cpu_info, device_kind

REPO = Path(__file__).resolve().parents[2]

# Ceilings measured on the H200s (docs/benchmarks.md), TFLOP/s: used for the floor and efficiency.
CEILING = {"fp8_gemm": 1200.0, "fp8_attn": 1000.0, "bf16_gemm": 790.0, "bf16_attn": 540.0}


def git_commit() -> str:
    """The checkout's commit; CADENCE_GIT overrides it (device copies of the tree carry no .git)."""
    if os.environ.get("CADENCE_GIT"):
        return os.environ["CADENCE_GIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("CADENCE_GIT", "unknown")


def device_name(device: torch.device, world: int = 1) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{world}x {name}" if world > 1 else name
    import platform

    cpu = cpu_info()
    isa = cpu.get("torch_cpu_capability")
    what = ", ".join(x for x in (platform.machine(), f"{os.cpu_count()} cores", isa) if x)
    return f"{cpu.get('model', 'CPU')} ({what})"


def command_line() -> str:
    return "cadence " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "cadence"


class Timer:
    """Times a callable with CUDA events (device) or the host clock (CPU): warm-up, then repetitions."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(
        self, fn: Callable[[], object], warmup: int, iters: int, progress: str | None = None
    ) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        times: list[float] = []
        for i in range(iters):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            if progress:
                print(
                    f"\r{progress}: {i + 1}/{iters} ({times[-1]:.1f} ms)", end="", file=sys.stderr, flush=True
                )
        if progress:
            print(file=sys.stderr)
        return times


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))])


def record(
    bench: str,
    preset: str,
    tp: int,
    device: torch.device,
    shape: dict,
    results: dict,
    variant: str | None = None,
    out_dir: str | Path | None = None,
    world: int = 1,
    extra: dict | None = None,
    headline: str = "",
    command: str | None = None,
) -> Path:
    """Write <out_dir>/<bench>/<date>-<kind>-<preset>-tp<N>[-variant].json and a line in <out_dir>/README.md.
    ``out_dir`` defaults to ./cadence-results (``results_dir``); an existing file is never overwritten (the
    name gets -2, -3, ...)."""
    base = Path(out_dir) if out_dir else Path.cwd() / RESULTS_DIR
    date = _dt.date.today().isoformat()
    kind = device_kind(device, world)
    stem = f"{date}-{kind}-{preset}-tp{tp}" + (f"-{variant}" if variant else "")
    path = base / bench / f"{stem}.json"
    k = 2
    while path.exists():
        path = base / bench / f"{stem}-{k}.json"
        k += 1
    name = path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": bench,
        "preset": preset,
        "tp": tp,
        "device": device_name(device, world),
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "git": git_commit(),
        "command": command or command_line(),
        "shape": shape,
        "results": results,
    }
    if extra:
        doc.update(extra)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    readme = base / "README.md"
    if not readme.exists():
        readme.write_text(
            "# Performance records\n\nOne line per benchmark run: date, device, command, headline.\n\n"
        )
    with readme.open("a") as fh:
        fh.write(
            f"- {date} | {doc['device']} | `{doc['command']}` | {headline} | [{bench}/{name}]({bench}/{name})\n"
        )
    return path


def print_table(rows: list[tuple[str, str]], title: str) -> None:
    w = max(len(k) for k, _ in rows)
    print(title)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")


def add_size_flags(p) -> None:
    """``--height`` / ``--width``: another frame size for the benchmark's engine (a smoke run of a big model's
    shape, or of a family's tiny fixture, on the CPU)."""
    p.add_argument("--height", type=int, default=None, help="another frame height (a smoke run on the CPU)")
    p.add_argument("--width", type=int, default=None, help="another frame width")


def size_overrides(args) -> dict:
    """The ``stream`` overrides of :func:`add_size_flags`' words ({} when none was given)."""
    return {k: getattr(args, k) for k in ("height", "width") if getattr(args, k, None)}
