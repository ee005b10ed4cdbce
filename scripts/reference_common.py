"""What the side-by-side reference harnesses share (scripts/reference_*_bench.py; not part of Cadence).

Each harness drives one model family's own code, imported from a checkout of its repository (never copied;
scripts/reference_checkouts.sh makes the checkouts), with random weights, through the block (or clip) loop
its authors' inference script runs, and writes one JSON in the schema of docs/perf/reference/*.json. This
module holds the parts that are not the families' code: the argument set every harness takes, a clock that
is CUDA events on a GPU and host clocks on the CPU, wrappers that time a callable without changing what it
computes, the peak-memory reading and the summary every JSON carries:

* ``fps_video``: video frames delivered / wall time of the whole timed run (loop start -> the last frames on
  the host), as a viewer of that run sees it;
* ``fps_steady``: frames of a steady block / the median wall time of the blocks after the first (for the
  references that decode at the end, that decode's time is spread over the blocks: ``fps_steady_rule``);
* ``ttff_ms``: loop start -> the first frames on the host (the whole run where the authors' script decodes
  only at the end: then ``first_latents_ms`` is when the first block's latents existed);
* ``block_ms`` and per-phase lists (CUDA-event spans on a GPU), ``peak_mem_gib`` (``torch.cuda.
  max_memory_allocated`` over the runs, weights resident; the build's own peak is ``peak_mem_build_gib``;
  ``bench pipeline``'s side is read by scripts/reference_cadence_run.py over its whole process),
  ``first_run_s`` (the untimed first run: compilation and warm-up).

The first of ``--repeats`` runs absorbs compilation and is reported apart; the fastest of the others is the
result (all runs are kept under ``runs``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))


def base_parser(doc: str, ref_help: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--ref", required=True, type=Path, help=ref_help)
    ap.add_argument("--commit", default="", help="the checkout's commit (read from .git or its COMMIT file)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=2, help="whole runs; the first is untimed warm-up")
    ap.add_argument("--small", action="store_true", help="CPU smoke test at a tiny random configuration")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    return ap


def checkout_commit(ref: Path, given: str, from_git: str) -> str:
    """The checkout's commit: from git, else the argument, else the COMMIT file scripts/reference_checkouts.sh
    writes."""
    if from_git:
        return from_git
    if given:
        return given
    f = ref / "COMMIT"
    return f.read_text().strip() if f.is_file() else ""


def sync(dev: str) -> None:
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize(dev)


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU (read after a sync), host clocks on the CPU."""

    def __init__(self, dev: str):
        self.cuda = str(dev).startswith("cuda")

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class Spans:
    """Named (start, end) marks around calls, read as milliseconds once the device is synced."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.items: list[tuple[str, object, object, dict]] = []

    def wrap(self, name: str, fn, info=None):
        """``fn`` with a span recorded around every call (``info(args, kwargs)`` adds fields to it); the
        arguments and the result pass through unchanged."""

        def timed(*args, **kwargs):
            a = self.clock.mark()
            out = fn(*args, **kwargs)
            self.items.append((name, a, self.clock.mark(), info(args, kwargs) if info else {}))
            return out

        return timed

    def read(self) -> list[dict]:
        return [dict(name=n, ms=self.clock.ms(a, b), start=a, **i) for n, a, b, i in self.items]

    def clear(self) -> None:
        self.items.clear()


_BUILD_PEAK: dict = {}


def peak_mem_gib(dev: str) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if str(dev).startswith("cuda") else None


def built(dev: str) -> None:
    """Call once the model is built: the build's peak is kept apart (``peak_mem_build_gib``: a 14B made in
    float32 and cast to bf16 peaks at twice its weights) and the counter restarts, so ``peak_mem_gib`` is the
    runs' peak with the weights resident."""
    if str(dev).startswith("cuda"):
        _BUILD_PEAK[str(dev)] = peak_mem_gib(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def device_name(dev: str) -> str:
    return torch.cuda.get_device_name(dev) if str(dev).startswith("cuda") else "cpu"


def run_repeats(one_run, repeats: int) -> tuple[list[dict], float]:
    """``one_run(r)`` ``repeats`` times; the runs and the first one's wall time (compilation, warm-up)."""
    runs, first_s = [], None
    for r in range(repeats):
        t = time.perf_counter()
        res = one_run(r)
        if r == 0:
            first_s = time.perf_counter() - t
        runs.append(res)
        print(
            f"run {r}: {res['frames']} frames in {res['total_s']:.2f} s = {res['fps_video']:.1f} fps; steady "
            f"{res['fps_steady']:.1f} fps (block {res['block_ms_median_steady']:.1f} ms); ttff "
            f"{res['ttff_ms']:.0f} ms",
            flush=True,
        )
    return runs, first_s


def stream_result(blocks: list[dict], total_s: float, ttff_s: float, steady_frames: int, **extra) -> dict:
    """One run's figures from its per-block records (``wall_ms``, ``frames``, phase spans)."""
    steady = [b["wall_ms"] for b in blocks[1:]] or [blocks[0]["wall_ms"]]
    med = statistics.median(steady)
    frames = sum(b["frames"] for b in blocks)
    return dict(
        blocks=blocks,
        frames=frames,
        total_s=total_s,
        ttff_ms=ttff_s * 1e3,
        fps_video=frames / total_s,
        block_ms_median_steady=med,
        fps_steady=steady_frames / (med / 1e3),
        **extra,
    )


def summary(meta: dict, runs: list[dict], first_run_s: float, dev: str, phases: tuple[str, ...]) -> dict:
    """The JSON of docs/perf/reference/: ``meta`` (reference, commit, harness, dtype, compile, attention,
    decoder, geometry, ...) + the fastest timed run's figures + every run."""
    timed = runs[1:] or runs
    best = min(timed, key=lambda x: x["total_s"])
    b = best["blocks"]
    skip = {"blocks", "frames", "total_s", "fps_video", "fps_steady", "ttff_ms"}
    extras = {k: v for k, v in best.items() if k not in skip and k not in meta}
    out = dict(meta)
    out.update(
        device=device_name(dev),
        torch=torch.__version__,
        first_run_s=first_run_s,
        fps_video=best["fps_video"],
        fps_steady=best["fps_steady"],
        ttff_ms=best["ttff_ms"],
        block_ms=[x["wall_ms"] for x in b],
        **{f"{p}_ms": [x.get(f"{p}_ms", 0.0) for x in b] for p in phases},
        finite=all(x["finite"] for x in b),
        peak_mem_gib=peak_mem_gib(dev),
        peak_mem_build_gib=_BUILD_PEAK.get(str(dev)),
        **extras,
    )
    out["runs"] = runs
    return out


def report(s: dict, label: str, out: Path | None) -> None:
    mem = f"{s['peak_mem_gib']:.1f} GiB" if s.get("peak_mem_gib") is not None else "n/a (CPU)"
    print(
        f"reference {label}: fps {s['fps_video']:.1f} (video) / {s['fps_steady']:.1f} (steady), ttff "
        f"{s['ttff_ms']:.0f} ms, blocks " + " ".join(f"{x:.0f}" for x in s["block_ms"]) + f" ms; peak {mem}; "
        f"first run {s['first_run_s']:.1f} s; attention {s.get('attention')}; finite {s['finite']}",
        flush=True,
    )
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(s, indent=1, default=str))
        print(f"wrote {out}")


def perturb_(module: torch.nn.Module, std: float = 0.05) -> None:
    """N(0, std^2) added to every parameter in place (Wan zero-initialises its output head and some
    projections; random weights should exercise every product). Parameter by parameter, on the parameter's
    own device and dtype, so a 14B model on the GPU needs no second copy."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * std)


class PassLog:
    """A span around every call of an ``nn.Module`` (forward pre / post hooks), keyed by a keyword argument
    of the call (``current_start``: which block a model pass belongs to). For the references whose own loop
    runs a whole video in one call (no host sync between blocks): the block boundaries come from these
    device-side marks, read after the run."""

    def __init__(self, clock: Clock, module: torch.nn.Module, key: str = "current_start"):
        self.clock, self.key, self.items, self._open = clock, key, [], []
        self.tag = None  # set while a call should not count as a block's pass (LongLive's re-cache)
        self.tagged: list[tuple] = []
        self._h = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, mod, args, kwargs):
        self._open.append(self.clock.mark())

    def _post(self, mod, args, kwargs, out):
        span = (kwargs.get(self.key), self._open.pop(), self.clock.mark())
        (self.tagged if self.tag else self.items).append(span if not self.tag else (self.tag, *span[1:]))

    def blocks(self) -> list[list[tuple]]:
        """The passes grouped by key, in call order: one list of (start mark, end mark) per block."""
        groups: dict = {}
        for k, a, b in self.items:
            groups.setdefault(k, []).append((a, b))
        return list(groups.values())

    def clear(self) -> None:
        self.items.clear()
        self.tagged.clear()


def end_decoded_blocks(
    clock: Clock,
    groups: list,
    decode: tuple,
    t0,
    host_ms: float,
    frames: list[int],
    before: dict | None = None,
):
    """Per-block records for a reference that decodes the whole video after its block loop: each block's
    device span (its first pass -> the next block's first pass, the last block -> the decode's start: the
    passes, the re-noising and the cache writes between them), its passes (the last one of a block is the
    clean cache pass), and an equal share of the end decode and the host copy (``wall_ms`` = span + share:
    what the block costs a viewer of the whole video). ``before``: {block: (name, start, end)}, work the
    loop does before that block's first pass (LongLive's re-cache after a prompt switch): it starts the
    block's span and is reported as ``<name>_ms``."""
    before = before or {}
    starts = [before[i][1] if i in before else g[0][0] for i, g in enumerate(groups)] + [decode[0]]
    share = (clock.ms(*decode) + host_ms) / len(groups)
    out = []
    for i, g in enumerate(groups):
        span = clock.ms(starts[i], starts[i + 1])
        out.append(
            dict(
                block=i,
                frames=frames[i],
                wall_ms=span + share,
                diffusion_ms=span,
                denoise_ms=sum(clock.ms(a, b) for a, b in g[:-1]),
                cache_pass_ms=clock.ms(*g[-1]),
                decode_ms=share,
                from_start_ms=clock.ms(t0, g[-1][1]),
            )
        )
        if i in before:
            out[-1][f"{before[i][0]}_ms"] = clock.ms(*before[i][1:])
    return out


def random_wan_vae(WanVAE_, dim: int = 96):
    """Wan 2.1's VAE (z 16, the family's geometry; ``dim`` 96 as released) in the reference's own ``WanVAE_``
    class with PyTorch's default init: what its ``_video_vae`` builds before loading ``Wan2.1_VAE.pth``."""
    torch.manual_seed(1)
    return WanVAE_(
        dim=dim,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
    ).eval()


class CudaOnCpu(torch.overrides.TorchFunctionMode):
    """CPU smoke runs only: a reference that builds tensors with a hard-coded ``device="cuda"`` gets them on
    the CPU (no effect on a GPU run, where it is not installed)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)
