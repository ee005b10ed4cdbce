"""One rank of a tensor-parallel group, emulated in one process on one device.

    group = EmulatedGroup(world=4)                 # this process is rank 0 of four
    apply_tp(model, group, comm="two_shot")        # rank 0's shard, exactly as a real rank builds it
    with CollectiveLog() as log:                   # cadence.parallel.group
        session.step(audio)
    est = comm_estimate(log.summary(), world=4)    # what the links would take, from measured figures

``cadence bench step --tp 4 --emulate`` uses it to measure the per-rank compute of a W57 TP=4 step on one
GPU: the same shards (``apply_tp`` on meta, then this rank's weights allocated and initialised, as a real
rank does), the same FP8 linears, compiled ops, ring cache, CUDA graphs and sequence parallelism. The
group is an object the real TP code path takes (:class:`cadence.parallel.group.TPGroup`); no layer knows
it is emulated, and the model code has no branch for it.

The stand-ins (output shape and dtype of the real collective; a realistic local memory access; values
of the right scale, not the real ones):

============== ============================================ =========================================
collective     the real rank                                 the stand-in (rank r of world w)
============== ============================================ =========================================
all-reduce     t <- sum of every rank's t                    ``t *= w``: one read + write of t, the sum
                                                             of w equal partials (a norm's sum of
                                                             squares gets its real magnitude)
all-gather     out <- every rank's rows, rank order          every slot of out <- this rank's rows: all
                                                             of out written, the part read w times
reduce-scatter out <- sum over ranks of block r of inp       out <- the sum of inp's w blocks: inp read
                                                             once, out written (the local arithmetic of
                                                             a reduce-scatter whose partials were local)
all-to-all     out block j <- rank j's block r of its inp      every block of out <- this rank's block r
(FP8 reduce)   (``comm_fp8``: unrecorded, inside one          of its inp (its shard then sums w equal
               recorded ``two_shot_fp8`` all-reduce)           partials; the all-gather above repeats it)
============== ============================================ =========================================

The symmetric-memory comm modes need peers: on an emulated group every row-parallel all-reduce runs the
plain GEMM and the stand-in, recorded as the mode the real rank would run (the chooser's pick for this
shape and group size, or the forced ``--comm``), which selects its link figures below. So the "tiles"
mode's own GEMM (a Triton kernel, slower than cuBLAS at these shapes) is not what an emulated rank runs.

The comm estimate (:func:`comm_estimate`): every recorded collective timed from :data:`LINKS`, ONE table of
measured all-reduce times on 2x H200 (source in the table), fitted per algorithm as ``t = fixed +
slope x bus bytes``; bus bytes per rank follow the algorithm (nccl-tests' convention: a ring all-reduce
and the two-shot move 2 (w-1)/w of the tensor, a reduce-scatter or an all-gather (w-1)/w, the one-shot
(w-1) x the tensor; all equal to the tensor at w = 2, where the table was measured). Assumed, not
measured (say so when quoting it): the per-GPU link bandwidth and the fixed cost per collective are the
same at 4 GPUs as at 2 (NVSwitch: every GPU has its 18 NVLinks whatever the group size); reduce-scatter
and all-gather cost like NCCL's all-reduce per bus byte, with its fixed cost (conservative: one phase of
it); small messages (the q/k norms' [N, 1] sums) cost the fit's fixed cost (an upper bound: NCCL's
low-latency protocol is not in the fit). Modes without figures (rs_ag, chunked, tiles) are estimated as
two-shot (their measured times at M = 748 were within a few us of it or slower; docs/perf/fused/NOTES.md).
A ``two_shot_fp8`` all-reduce (:mod:`cadence.parallel.comm_fp8`) is priced as built: its all-to-all and
all-gather of e4m3 rows + scales, each at the NCCL fit, plus its local kernels at an HBM rate
(:func:`fp8_reduce_parts`); ``total_ms_fp8`` prices every big all-reduce of any run in that mode and in the
symmetric-memory variants (models, not built). Beside the total, ``total_ms_symm_halves`` prices the reduce-scatters / all-gathers as halves of the
two-shot all-reduce (what they would cost over symmetric memory, by the same model; not built, not
measured).

What emulation does not capture (docs/perf/step/NOTES.md says it with the numbers):
* contention: a real rank's NVLink traffic and its copy engines / reducer SMs share HBM bandwidth and SMs
  with the compute; the stand-ins touch local memory only, and the estimate adds link time serially;
* overlap: the estimate assumes none (a fused GEMM + all-reduce hides part of it: the tile kernel 8-34%);
* skew between ranks: a real collective waits for the slowest rank (launch jitter, a rank with more
  padding rows, a decode thread on rank 0); one rank emulated has no one to wait for;
* the data: another rank's values (the stand-ins make plausible magnitudes, so FP8 scales, softmax and
  GELU see realistic ranges; the results are not those of a real group, and are never checked);
* NCCL's and symmetric memory's own memory, streams and launches (the stand-ins are one kernel each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cadence.parallel.group import TPGroup


class EmulatedGroup(TPGroup):
    """Rank `rank` of a tensor-parallel group of `world`, alone in this process (see the module)."""

    emulated = True
    process_group = None

    def __init__(self, world: int, rank: int = 0):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"emulated group: rank {rank} of world {world} (need 0 <= rank < world, world >= 1)"
            )
        self.world, self.rank = int(world), int(rank)

    def symm_unavailable(self, device: torch.device) -> str | None:
        return "an emulated group has no peers (its collectives are local stand-ins)"

    def _all_reduce(self, t: torch.Tensor) -> None:
        t.mul_(self.world)

    def _all_gather(self, out: torch.Tensor, part: torch.Tensor) -> None:
        out.view(self.world, *part.shape).copy_(part.unsqueeze(0).expand(self.world, *part.shape))

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        torch.sum(inp.view(self.world, *out.shape), dim=0, out=out)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        blk = inp.view(self.world, -1, *inp.shape[1:])[self.rank]
        out.view(self.world, *blk.shape).copy_(blk.unsqueeze(0).expand(self.world, *blk.shape))


# ---- the link figures ------------------------------------------------------------------------------------
LINKS_SOURCE = (
    "all-reduce of bf16 [M, N] tensors on 2x H200 (NVLink NV18, torch 2.11.0+cu130, NCCL 2.28.9), CUDA-graph "
    "timed medians, `cadence bench fused --modes two_shot,tiles` at commit 1e78c56: "
    "docs/perf/fused/2026-11-30-nvidia-h200-x2-all-tp2-tiles.json (its table: docs/perf/fused/NOTES.md, "
    "session 6; the same figures as docs/benchmarks.md's 'Row-parallel projection + all-reduce at M=748', which "
    "were timed eagerly)"
)

#: algorithm -> [(tensor bytes, microseconds)], measured at world = 2 (LINKS_SOURCE). One row per shape of
#: the source file (748 x 8192, 748 x 5120, 4680 x 1536, each under its bf16 and FP8 GEMM).
LINKS: dict[str, list[tuple[int, float]]] = {
    "nccl": [
        (12_255_232, 68.1), (12_255_232, 65.4), (12_255_232, 67.0), (12_255_232, 65.2),
        (7_659_520, 48.2), (7_659_520, 47.9), (7_659_520, 50.8), (7_659_520, 51.5),
        (14_376_960, 73.2), (14_376_960, 72.8), (14_376_960, 75.8), (14_376_960, 74.5),
    ],
    "two_shot": [
        (12_255_232, 44.2), (12_255_232, 44.3), (12_255_232, 44.2), (12_255_232, 44.4),
        (7_659_520, 30.1), (7_659_520, 30.2), (7_659_520, 30.6), (7_659_520, 30.4),
        (14_376_960, 50.8), (14_376_960, 50.8), (14_376_960, 51.0), (14_376_960, 50.9),
    ],
    "one_shot": [
        (12_255_232, 72.9), (12_255_232, 72.9), (12_255_232, 73.4), (12_255_232, 73.5),
        (7_659_520, 48.5), (7_659_520, 48.5), (7_659_520, 49.1), (7_659_520, 49.4),
        (14_376_960, 83.9), (14_376_960, 83.9), (14_376_960, 83.9), (14_376_960, 84.1),
    ],
}  # fmt: skip
LINKS_WORLD = 2
#: comm modes with no figures of their own -> the algorithm whose figures estimate them
ESTIMATED_AS = {"rs_ag": "two_shot", "tiles": "two_shot", "chunked": "two_shot"}


@dataclass(frozen=True)
class LinkFit:
    """``t_us = fixed_us + us_per_mb x bus MB`` for one algorithm, least squares over its LINKS rows."""

    algo: str
    fixed_us: float
    us_per_mb: float
    points: int
    max_residual_us: float

    @property
    def bus_gb_s(self) -> float:
        return 1e3 / self.us_per_mb if self.us_per_mb > 0 else math.inf


def fit(algo: str) -> LinkFit:
    pts = [(b / 1e6 * bus_factor("all_reduce", algo, LINKS_WORLD), t) for b, t in LINKS[algo]]
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    fixed = my - slope * mx
    res = max(abs(fixed + slope * x - y) for x, y in pts)
    return LinkFit(algo, fixed, slope, n, res)


def bus_factor(kind: str, algo: str, world: int) -> float:
    """Bytes a rank moves over its links per byte of the collective's tensor (nccl-tests' convention)."""
    w = world
    if w <= 1:
        return 0.0
    if kind == "all_reduce":
        return float(w - 1) if algo == "one_shot" else 2.0 * (w - 1) / w
    return (w - 1) / w  # reduce-scatter, all-gather


def link_algo(kind: str, algo: str) -> str:
    """Which LINKS row estimates a collective: its own algorithm's, the stand-in's for modes without
    figures, and NCCL's for every reduce-scatter / all-gather (torch.distributed issues those)."""
    if kind != "all_reduce":
        return "nccl"
    base = "chunked" if algo.startswith("chunked") else algo
    return ESTIMATED_AS.get(base, base if base in LINKS else "nccl")


def estimate_us(kind: str, algo: str, nbytes: int, world: int) -> float:
    """Estimated time of one collective (see the module docstring for what is assumed)."""
    if world <= 1:
        return 0.0
    f = fit(link_algo(kind, algo))
    return f.fixed_us + f.us_per_mb * nbytes / 1e6 * bus_factor(kind, algo, world)


def half_two_shot_us(nbytes: int, world: int) -> float:
    """A reduce-scatter or an all-gather priced as one half of the measured two-shot all-reduce (which is a
    reduce-scatter then an all-gather over peer loads): half its fixed cost, its cost per bus byte. A model
    of what sequence parallelism's collectives would cost over symmetric memory; nothing measured it."""
    f = fit("two_shot")
    return f.fixed_us / 2 + f.us_per_mb * nbytes / 1e6 * bus_factor("all_gather", "two_shot", world)


def measured_range(algo: str) -> tuple[int, int]:
    """Smallest and largest tensor (bytes) of an algorithm's LINKS rows: outside it the fit extrapolates."""
    sizes = [b for b, _ in LINKS[algo]]
    return min(sizes), max(sizes)


def cheapest_all_reduce(nbytes: int, world: int) -> tuple[str, float]:
    """The all-reduce algorithm of the measured table that prices a tensor of `nbytes` lowest, and its us."""
    return min(((a, estimate_us("all_reduce", a, nbytes, world)) for a in LINKS), key=lambda x: x[1])


def fp8_gather_two_shot_us(nbytes: int, world: int) -> float:
    """A MODEL (not built, not measured): a two-shot all-reduce whose all-gather half moves the reduced rows as
    e4m3 bytes + a float32 scale per row instead of bf16 (half the bytes of that half): the two-shot fit's
    fixed cost, its cost per bus byte, the reduce-scatter half as measured. Numerically the sum then carries
    one e4m3 rounding (~2^-4 relative per element), which the residual stream would add up: a quality
    question before any speed."""
    f = fit("two_shot")
    half = nbytes * bus_factor("all_gather", "two_shot", world)
    return f.fixed_us + f.us_per_mb * (half + half / 2) / 1e6


#: HBM read + write rate the FP8 reduce's local kernels are priced at: docs/benchmarks.md's device copy on one
#: H200 (the same figure as cadence.bench.floors.HBM_BYTES_S). An estimate from a bandwidth, not a timing of
#: those kernels (the eager reference path runs several kernels per step, slower than this).
HBM_BYTES_S = 4.2e12


def fp8_reduce_parts(shape, world: int, block: int | None = None, itemsize: int = 2) -> dict:
    """The pieces of one ``two_shot_fp8`` all-reduce (:mod:`cadence.parallel.comm_fp8`) of a [.., N] tensor of
    `itemsize`-byte elements (bf16: 2) over `world` ranks, in us:

    * ``wire_bytes``: the packed e4m3 rows + float32 scales (per half of the two-shot);
    * ``link_symm_us``: those bytes at the two-shot fit (fixed + per bus byte): what a symmetric-memory FP8
      two-shot would move (a model: not built; the fit's cost per byte is the bf16 two-shot's);
    * ``link_nccl_us``: this build's exchanges, an all-to-all and an all-gather of the packed rows, each at the
      NCCL fit with (w-1)/w bus bytes and its own fixed cost (all-to-all priced as a reduce-scatter);
    * ``local_us``: the local kernels at :data:`HBM_BYTES_S`, one pass each: quantise the partial (read bf16,
      write packed), sum + requantise the shard (read the w received shards, write one), dequantise the
      gathered rows (read packed, write bf16); ``quantise_us`` the first alone (what stays if the sum and the
      dequantisation run inside the collective's own kernels, as the bf16 two-shot's adds do);
    * ``as_built_us`` = link_nccl + local; ``symm_us`` = link_symm + local; ``symm_fused_us`` = link_symm +
      quantise (sum and dequantisation in the collective's kernels); ``symm_epilogue_us`` = link_symm (the
      quantisation in the GEMM's epilogue as well)."""
    from cadence.parallel.comm_fp8 import packed_row_bytes

    n = int(shape[-1])
    m = math.prod(int(s) for s in shape[:-1])
    elems, wire = m * n, m * packed_row_bytes(n, block)
    if world <= 1:
        return {"wire_bytes": wire, **dict.fromkeys(("link_symm_us", "link_nccl_us", "local_us"), 0.0),
                **dict.fromkeys(("quantise_us", "as_built_us", "symm_us", "symm_fused_us", "symm_epilogue_us"), 0.0)}  # fmt: skip
    two, nccl = fit("two_shot"), fit("nccl")
    link_symm = two.fixed_us + two.us_per_mb * wire / 1e6 * bus_factor("all_reduce", "two_shot", world)
    half = nccl.fixed_us + nccl.us_per_mb * wire / 1e6 * bus_factor("all_gather", "nccl", world)
    quant = (itemsize * elems + wire) / HBM_BYTES_S * 1e6
    local = quant + (wire + wire / world) / HBM_BYTES_S * 1e6 + (wire + itemsize * elems) / HBM_BYTES_S * 1e6
    return {
        "wire_bytes": wire,
        "link_symm_us": link_symm,
        "link_nccl_us": 2 * half,
        "local_us": local,
        "quantise_us": quant,
        "as_built_us": 2 * half + local,
        "symm_us": link_symm + local,
        "symm_fused_us": link_symm + quant,
        "symm_epilogue_us": link_symm,
    }


def _fp8_alternatives(c: dict, us: float, world: int) -> dict[str, float]:
    """The FP8 reduce's variants for one recorded collective, us each: a ``two_shot_fp8`` all-reduce at its
    variants; any other all-reduce of a 2-D-or-more tensor over 1 MB priced as if it were one; the
    rest (small sums, reduce-scatters, all-gathers) at `us`, as recorded."""
    big = c["kind"] == "all_reduce" and c["nbytes"] > 1_000_000 and len(c["shape"]) >= 2
    if not (big or c["algo"] == FP8_ALGO):
        return dict.fromkeys(FP8_VARIANTS, us)
    parts = fp8_reduce_parts(c["shape"], world, itemsize=_itemsize(c))
    return {k: parts[k + "_us"] for k in FP8_VARIANTS}


def _itemsize(c: dict) -> int:
    return max(c["nbytes"] // max(math.prod(c["shape"]), 1), 1)


FP8_ALGO = "two_shot_fp8"
FP8_VARIANTS = ("as_built", "symm", "symm_fused", "symm_epilogue")


def _row_us(c: dict, world: int) -> tuple[float, str, int]:
    """(us of one, the link figure used, the bytes that figure is applied to) for a recorded collective. A
    ``two_shot_fp8`` all-reduce is priced as this build runs it (``fp8_reduce_parts``' as_built: two NCCL
    exchanges of the packed e4m3 rows + the local kernels)."""
    if c["kind"] == "all_reduce" and c["algo"] == FP8_ALGO:
        parts = fp8_reduce_parts(c["shape"], world, itemsize=_itemsize(c))
        return parts["as_built_us"], "nccl", parts["wire_bytes"]
    return estimate_us(c["kind"], c["algo"], c["nbytes"], world), link_algo(c["kind"], c["algo"]), c["nbytes"]


def _links_used(rows: list[dict]) -> dict:
    """Per link figure used: the fit, the tensor sizes it was measured at, and which collectives fall outside
    that range (their estimate extrapolates the fit)."""
    out = {}
    for a in sorted({r["link_algo"] for r in rows}):
        lo, hi = measured_range(a)
        outside = sorted(
            {
                r["label"]
                for r in rows
                if r["link_algo"] == a and not lo <= r.get("link_bytes", r["nbytes"]) <= hi
            }
        )
        out[a] = {**vars(fit(a)), "measured_bytes": [lo, hi], "extrapolated_for": outside}
    return out


def comm_estimate(summary: list[dict], world: int) -> dict:
    """Estimate the link time of a per-chunk collective list (``CollectiveLog.summary()``): total ms, per
    collective (us each, ms in all), per kind, and the link figures used (``links_used``: the fit per
    algorithm, the sizes it was measured at, and the collectives it is extrapolated for) with their source.
    Alternatives, same list: ``total_ms_symm_halves`` (every reduce-scatter / all-gather priced by
    :func:`half_two_shot_us`), ``total_ms_cheapest`` (every all-reduce in the algorithm the table prices
    lowest for its size), ``total_ms_fp8_gather`` (every all-reduce over 1 MB as :func:`fp8_gather_two_shot_us`,
    a model), ``total_ms_fp8`` (variant -> ms: every all-reduce over 1 MB as a ``two_shot_fp8`` one in each
    variant of :func:`fp8_reduce_parts`; ``fp8`` says which figures those use)."""
    rows, by_kind, alt, cheap, fp8g = [], {}, 0.0, 0.0, 0.0
    fp8 = dict.fromkeys(FP8_VARIANTS, 0.0)
    for c in summary:
        us, la, link_bytes = _row_us(c, world)
        ms = us * c["count"] / 1e3
        lo, hi = measured_range(la)
        rows.append(
            {**c, "link_algo": la, "est_us": us, "est_ms": ms, "link_bytes": link_bytes,
             "extrapolated": not lo <= link_bytes <= hi}
        )  # fmt: skip
        by_kind[c["kind"]] = by_kind.get(c["kind"], 0.0) + ms
        for k, v in _fp8_alternatives(c, us, world).items():
            fp8[k] += v * c["count"] / 1e3
        if c["kind"] != "all_reduce":
            alt += half_two_shot_us(c["nbytes"], world) * c["count"] / 1e3
            cheap, fp8g = cheap + ms, fp8g + ms
            continue
        alt += ms
        cheap += cheapest_all_reduce(c["nbytes"], world)[1] * c["count"] / 1e3
        big = c["nbytes"] > 1_000_000 and c["algo"] != FP8_ALGO
        fp8g += (fp8_gather_two_shot_us(c["nbytes"], world) if big else us) * c["count"] / 1e3
    return {
        "total_ms": sum(r["est_ms"] for r in rows),
        "total_ms_symm_halves": alt,
        "total_ms_cheapest": cheap,
        "total_ms_fp8_gather": fp8g,
        "total_ms_fp8": fp8,
        "fp8": _fp8_figures(),
        "by_kind_ms": by_kind,
        "collectives": rows,
        "fits": {a: vars(fit(a)) for a in sorted({r["link_algo"] for r in rows})},
        "links_used": _links_used(rows),
        "source": LINKS_SOURCE,
        "world": world,
        "assumed": "no overlap with compute; link bandwidth and fixed cost per collective as measured at "
        f"{LINKS_WORLD} GPUs; reduce-scatter / all-gather as NCCL all-reduce per bus byte; a collective "
        "outside its figure's measured sizes (extrapolated) at the fit's fixed cost + slope",
    }


def _fp8_figures() -> dict:
    """What the FP8 reduce's estimates use (``comm_estimate``'s ``fp8``)."""
    from cadence.parallel.comm_fp8 import BLOCK

    return {
        "block": BLOCK,
        "wire": "per token: N e4m3 bytes + 4 N / block bytes of float32 scales, per half",
        "as_built": "all-to-all + all-gather of the packed rows, each at the nccl fit ((w-1)/w bus bytes, "
        "its fixed cost) + local kernels",
        "symm": "the packed rows at the two_shot fit (a symmetric-memory FP8 two-shot: not built) + local "
        "kernels",
        "symm_fused": "two_shot fit at the packed rows + the quantisation pass only (sum and dequantisation "
        "inside the collective's kernels: not built)",
        "symm_epilogue": "two_shot fit at the packed rows alone (quantisation in the GEMM epilogue: not built)",
        "local_kernels": f"bytes read + written at {HBM_BYTES_S / 1e12:.1f} TB/s (HBM copy rate, "
        "docs/benchmarks.md), one pass per step; not timed",
    }


def time_standins(summary: list[dict], device: torch.device, reps: int = 5) -> float | None:
    """Milliseconds the stand-ins of one chunk's collectives take on `device` (each recorded collective's
    stand-in on a tensor of its shape and dtype, as many times as the chunk has it), replayed from a CUDA
    graph: what the emulated step's time contains besides the rank's compute. None off CUDA."""
    if device.type != "cuda" or not summary:
        return None
    world = summary[0]["world"]
    g = EmulatedGroup(world)
    work = []
    for c in summary:
        dt = getattr(torch, c["dtype"])
        shape = tuple(c["shape"])
        full = torch.zeros(shape, dtype=dt, device=device)
        part = torch.zeros((shape[0] // world, *shape[1:]), dtype=dt, device=device) if shape else None
        n = max(int(round(c["count"])), 0)
        kind = "fp8" if c["kind"] == "all_reduce" and c["algo"] == FP8_ALGO else c["kind"]
        work.append((kind, full, part, n))

    def body():
        from cadence.parallel.comm_fp8 import fp8_all_reduce

        for kind, full, part, n in work:
            for _ in range(n):
                if kind == "fp8":  # the FP8 reduce's local arithmetic around the exchanges' stand-ins
                    fp8_all_reduce(full, g)
                elif kind == "all_reduce":
                    g._all_reduce(full)
                elif kind == "all_gather":
                    g._all_gather(full, part)
                else:
                    g._reduce_scatter(part, full)

    body()  # warm-up (allocations, kernels)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    graph.reset()
    return sorted(times)[len(times) // 2]


# ---- per-op shapes (the emulation's fidelity check) ------------------------------------------------------
class OpShapes:
    """Records, for every module call of `model` while active, (qualified name, input shapes, output shape),
    and every ``cache.attend`` call's q / k / v shapes (`cache`: a session's cache, optional). An emulated
    rank and a real one of the same group must record the same list (tests/test_emulate.py)."""

    def __init__(self, model: torch.nn.Module, cache=None):
        self.model, self.cache = model, cache
        self.calls: list[tuple] = []
        self._handles: list = []
        self._attend = None

    def __enter__(self) -> OpShapes:
        for name, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_hook(self._hook(name)))
        if self.cache is not None:
            orig = self.cache.attend

            def attend(layer, q, k, v, commit):
                self.calls.append(("cache.attend", layer, _shapes((q, k, v)), commit))
                return orig(layer, q, k, v, commit)

            self._attend = orig
            self.cache.attend = attend
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._attend is not None:
            del self.cache.attend  # back to the class's method
            self._attend = None

    def _hook(self, name: str):
        def hook(mod, args, out):
            self.calls.append((name, type(mod).__name__, _shapes(args), _shapes(out)))

        return hook


def _shapes(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype).replace("torch.", ""))
    if isinstance(x, (list, tuple)):
        return tuple(_shapes(v) for v in x)
    shape = getattr(x, "shape", None)  # a QuantizedActivation
    return ("quantized", tuple(shape)) if shape is not None else type(x).__name__
