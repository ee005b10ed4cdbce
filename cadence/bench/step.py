"""`cadence bench step`: the steady-state chunk step (window full), timed and broken down.

    cadence bench step --preset w14 --cache naive --dtype bf16
    cadence bench step --preset w57 --layers 30      # W57 does not fit one H200 in bf16: run 30 of
                                                     # its 60 layers and scale (stated in the JSON)
    torchrun --nproc_per_node 2 -m cadence bench step --preset w14 --tp 2 --fp8 --comm auto
    cadence bench step --preset w57 --layers 12 --tp 4 --emulate --sequence-parallel --cache ring \
        --kv-fp8 --fp8 --compile --graphs          # rank 0 of four, on one GPU

The words: ``--model`` / ``--preset`` (default tiny; random weights at its geometry) and a step's fast path
(:data:`FAST_FIELDS`) come from the one engine-flag set (``cadence.engine.flags``: each ``FastPath`` field's
docstring is its help) and are resolved by the recipe (``cadence.engine.recipe.resolve``) as ``cadence serve``
resolves them, printed first and recorded (``recipe``): a bare command times the step a bare ``cadence serve``
runs on the same device (on CUDA the ring cache with FP8 K/V, FP8 linears and CUDA graphs). Another path is
asked for in words: ``--no-kv-fp8 --no-fp8`` (the bf16 reference step), ``--cache naive`` (the baseline cache,
kept whatever else is asked; no graphs). The rest is this benchmark's own.

Tensor parallel (``--tp N``, under ``torchrun --nproc_per_node N``): every rank builds only its
shard (the model is constructed on ``meta``, sharded with ``apply_tp`` there, then allocated with
``to_empty`` on its GPU and randomly initialised, so no rank ever holds the full model), draws
the same inputs, and rank 0 prints and records. ``--fp8`` swaps the block linears for FP8 ones
(``apply_fp8``, after sharding); ``--comm`` picks the row-parallel all-reduce mode
(cadence.parallel.fused: auto | nccl | two_shot | one_shot | rs_ag | chunkedN). ``comm_ms`` is the
"allreduce" region (every collective: row-parallel sums, the q/k norms' small sums, sequence
parallelism's gathers and reduce-scatters); modes whose GEMM and collective are one call ("rs_ag",
"chunked") are reported as ``linear_comm_ms``. The floors are per rank (``cadence.bench.floors``: the
block linears and attention divide by N, the replicated parts do not).

``--emulate`` (with ``--tp N``, no torchrun): this process is rank ``--emulate-rank`` (0) of an N-rank
group, on one device (``cadence.parallel.emulate.EmulatedGroup``): the rank's shard built exactly as a
real rank builds it, the same FP8 linears, compiled ops, cache and graphs, every collective replaced by
a local stand-in with its output shape. The JSON then carries the collective list per chunk, the comm
estimate from measured link figures, the per-rank compute (the step less its stand-ins) and the step
estimate (compute + comm, no overlap); what emulation cannot see is listed in that module's docstring.
``--sequence-parallel`` (``--tp N``, real or emulated): ``apply_tp(..., sequence_parallel=True)``
(``cadence.parallel.sp``). Every TP run (real or emulated) records its collectives and the estimate, so
a real TP=2 run checks the estimate against the measured comm.

One step = the passes of one chunk (plus the clean pass if the config commits that way) through a
cache holding the sink and a full window of random K/V, with random weights initialised on the
device. Reported (docs/benchmarks.md): step median / p99 (CUDA events), the split into attention, cache
upkeep, linear layers, FP8 quantisation, comm and elementwise (from separately instrumented steps:
region events per layer; ``cadence.bench.step_report`` lists the fields), each part beside its floor,
TFLOP per chunk, the floor (FP8 ceilings, as docs/benchmarks.md defines it; the bf16 floor too),
efficiency, peak memory, and whether the step made a host sync (checked with torch's sync debug
mode on CUDA).

CUDA graphs (``--graphs``, the default on CUDA with the ring cache; ``--no-graphs`` to skip): after
the eager timing, the instrumented split (eager: its region events need the host) and the sync
check, the same session's step is timed again with its passes (every pass, every layer, every
collective) replayed from one CUDA graph per rank (``cadence.runtime.graphs.GraphRunner``; under TP
the capture is agreed across the group by ``cadence.parallel.graphs.agreeing_capture``: every rank
replays or none does). ``step_ms`` is then the graphed median (``step_mode``: "graph"), with
``step_eager_ms``, ``step_graph_ms`` and ``graph_speedup`` beside it. A capture that fails (e.g. a
comm mode that cannot be captured) falls back to eager on every rank with one warning line; on the
CPU (or the naive cache) ``--graphs`` logs one line and times the eager step only. With graphs the split
is that of the graph-replayed step (``measure_graph_split``: timing events captured into one more graph;
``split_mode`` "graph"), the eager steps' split beside it (``split_eager``: launch gaps included);
``--no-graph-split`` skips it.

``--fp8`` records ``fp8_counts`` (``cadence.quant.fp8.fp8_report``): how many FP8 linears ran
``torch._scaled_mm`` on every call, how many fell back (and why), the shapes refused.
``--compile`` calls ``cadence.runtime.compile.apply_compile(model)`` after TP and FP8 (a clear error
when this checkout has no such module).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from cadence.bench.common import Timer, median, record
from cadence.bench.floors import chunk_flops  # noqa: F401  (re-exported: the whole chunk's FLOPs)
from cadence.bench.results import add_record_flags, results_dir
from cadence.bench.step_profile import primed_stream as _primed_stream
from cadence.bench.step_report import REGIONS  # noqa: F401
from cadence.bench.step_report import split_regions as _split_regions
from cadence.config import CadenceConfig
from cadence.engine.flags import add_fast_path_flags, add_model_flags
from cadence.engine.recipe import EngineRecipe
from cadence.engine.spec import FastPath
from cadence.errors import InputError, UsageParser
from cadence.model.families import KVStream
from cadence.telemetry.spans import SpanRecorder


def fill_cache_random(cache, cfg: CadenceConfig, model, gen: torch.Generator) -> None:
    """Fill a cache's window with random K/V, as if window_chunks - 1 chunks had been made."""
    from cadence.cache.ring import RingCache

    m, s = cfg.model, cfg.stream
    if isinstance(cache, RingCache):
        for layer in range(m.num_layers):
            for buf, sc in ((cache.k[layer], cache.k_scale[layer]), (cache.v[layer], cache.v_scale[layer])):
                r = torch.randn(buf.shape, generator=gen, device=model.device, dtype=torch.bfloat16)
                if buf.dtype == torch.float8_e4m3fn:
                    buf.copy_((r * 100).clamp(-448, 448).to(buf.dtype))
                    sc.fill_(1.0 / 100)
                else:
                    buf.copy_(r)
        cache._chunks = s.window_chunks - 1  # the next chunk fills the window: steady state
        return
    shape = (1, cfg.tokens_per_chunk, model.blocks[0].self_attn.heads, m.head_dim)
    for layer in range(m.num_layers):
        cache.past[layer].clear()
        for j in range(s.window_chunks - 1):
            k = torch.randn(shape, generator=gen, device=model.device, dtype=model.dtype)
            v = torch.randn(shape, generator=gen, device=model.device, dtype=model.dtype)
            start = s.sink_frames + j * s.latent_frames_per_chunk
            cache.past[layer].append((k, v, start, s.latent_frames_per_chunk))


def layers_that_fit(cfg: CadenceConfig, dtype: torch.dtype, device: torch.device, tp: int = 1) -> int:
    """Largest layer count whose weights + cache (+ working room) fit the device's free memory
    (with `tp` ranks each holding 1/tp of the block weights and of the cache)."""
    if device.type != "cuda":
        return cfg.model.num_layers
    m = cfg.model
    el = torch.tensor([], dtype=dtype).element_size()
    per_layer_params = (
        4 * m.dim**2 * 2
        + 2 * m.dim * m.ffn_dim
        + (4 * m.dim**2 if m.audio_every else 0) / max(m.audio_every, 1)
    )
    cache = 2 * cfg.kv_tokens * m.dim * el
    free, _ = torch.cuda.mem_get_info(device)
    room = free - 20 * 2**30  # activations, concatenated windows, allocator slack
    return max(1, min(m.num_layers, int(room // ((per_layer_params * el + cache) / max(tp, 1)))))


def _sync_check(device: torch.device, fn) -> bool | str | None:
    """False when `fn()` made no host sync (torch's sync debug mode, CUDA), else the error's first
    line; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def graphs_unavailable_reason(device: torch.device, cache: str) -> str | None:
    """Why the graphed measurement cannot run here (None: it can be tried)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (step on {device.type})"
    if cache != "ring":
        return f"CUDA graphs need the ring cache (got {cache}: host-side state per chunk)"
    return None


def measure_graphed(
    sess,
    audio,
    device: torch.device,
    warmup: int,
    iters: int,
    group=None,
    progress: str | None = None,
    capture=None,
) -> dict:
    """Time the same session's step with its passes (every pass, every layer) replayed from one CUDA
    graph per rank (``cadence.runtime.graphs.GraphRunner``; the capture agreed across the TP group by
    ``cadence.parallel.graphs.agreeing_capture``: every rank captures or none does). The first call
    runs eagerly (the runner's warm-up), the second captures, the rest replay. A failed capture falls
    back to eager on every rank with one warning line (the runner's), never a crash: then ``used`` is
    False and ``times`` are eager times. `capture` overrides the local capture (tests)."""
    from cadence.parallel.graphs import agreeing_capture
    from cadence.runtime.graphs import GraphRunner

    stream = _primed_stream(sess, audio, device) if capture is None and device.type == "cuda" else None
    runner = GraphRunner(
        max_graphs=1,
        warmup=1,
        max_captures_per_key=1,
        capture=agreeing_capture(group, capture=capture, stream=stream),
    )
    timer = Timer(device)
    out: list = []

    def step():
        x = sess.step(audio, runner=runner)
        out[:] = [x]
        return x

    times = timer.run(
        step, warmup + 2, iters, progress=progress
    )  # +2: the runner's eager warm-up, the capture
    used = runner.stats.captures > 0 and runner.last == "replay"
    res = {
        "times": times,
        "used": used,
        "captures": runner.stats.captures,
        "replays": runner.stats.replays,
        "capture_failures": runner.stats.capture_failures,
        "eager_reasons": dict(runner.stats.eager_reasons),
        "last": runner.last,
        "output_finite": bool(torch.isfinite(out[0]).all()) if out else None,
    }
    if used:
        res["host_sync_in_step"] = _sync_check(device, step)
        res["rounds"] = _eager_graph_rounds(sess, audio, timer, runner)
    runner.clear()
    return res


def _eager_graph_rounds(sess, audio, timer, runner, n_rounds: int = 5) -> dict | None:
    """The graph speedup from interleaved rounds (``cadence.bench.rounds``): one eager step, one replayed
    step, alternating, `n_rounds` rounds; the ratio eager / graph per round, its median and min-max."""
    from cadence.bench.rounds import compare, interleave

    times = interleave(
        {
            "eager": lambda: timer.run(lambda: sess.step(audio), 0, 1)[0],
            "graph": lambda: timer.run(lambda: sess.step(audio, runner=runner), 0, 1)[0],
        },
        n_rounds,
    )
    r = compare(times, "eager", "graph")
    return r.as_dict() if r is not None else None


def measure_graph_split(
    sess, audio, device: torch.device, group=None, replays: int = 3, capture=None
) -> dict:
    """The region split of the graph-replayed step: the step captured once more, with a span recorder
    active during the capture only (``SpanRecorder(in_graph=True)``: its events are event-record nodes of
    the graph, re-recorded at every replay), then replayed `replays` times, the split read after each.
    GPU time per region without launch gaps (the eager split has them); the events themselves cost a
    little (``total_ms`` against the plain graphed step says how much). Where the capture cannot be made
    (a torch without external events, any capture error) ``used`` is False with the reason, never a crash.
    `capture` replaces the CUDA capture (tests)."""
    from cadence.parallel.graphs import agreeing_capture
    from cadence.runtime.graphs import GraphRunner, cuda_capture

    rec = SpanRecorder(device, in_graph=True)
    stream = None
    if capture is None:
        if device.type != "cuda":
            return {"used": False, "reason": f"needs CUDA graphs (step on {device.type})"}
        stream = _primed_stream(sess, audio, device)

    def local(fn):
        with rec:
            return capture(fn) if capture is not None else cuda_capture(fn, stream)

    runner = GraphRunner(
        max_graphs=1, warmup=1, max_captures_per_key=1, capture=agreeing_capture(group, capture=local)
    )
    timer = Timer(device)
    for _ in range(2):  # the runner's eager warm-up, then the capture (and its first replay)
        sess.step(audio, runner=runner)
    if not runner.stats.captures:
        runner.clear()
        return {"used": False, "reason": f"capture failed ({runner.last})"}
    splits, totals = [], []
    try:
        for _ in range(max(1, replays)):
            totals.append(timer.run(lambda: sess.step(audio, runner=runner), 0, 1)[0])
            splits.append(rec.totals())
    except RuntimeError as e:  # events a replay did not record usably: no graph split, the eager one stays
        runner.clear()
        why = f"reading the in-graph events failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        logging.getLogger(__name__).warning("graph split: %s; the split is the eager one", why)
        return {"used": False, "reason": why}
    runner.clear()
    return {
        "used": True,
        "region": _split_regions(splits),
        "total_ms": median(totals),
        "regions": rec.counts(),
    }


@torch.no_grad()
def measure_step(
    cfg: CadenceConfig,
    model,
    device: torch.device,
    warmup: int,
    iters: int,
    profile_iters: int = 3,
    progress: str | None = "steps",
    graphs: bool = False,
    group=None,
    collectives: bool = False,
    graph_split: bool = True,
    profile: dict | None = None,
) -> dict:
    """Time the steady-state chunk step of `cfg` (its cache choice) on a built model: median over
    `iters` uninstrumented eager steps, the region split from `profile_iters` instrumented ones (eager:
    the region events need the host), a host-sync check (CUDA), and with `graphs` the same step
    replayed from a CUDA graph (:func:`measure_graphed`; ``graph`` in the result, None without) and, with
    `graph_split`, its region split (:func:`measure_graph_split`). `collectives`: one more eager step with
    every collective recorded (``log``: a ``cadence.parallel.group.CollectiveLog``). `group`: the group
    whose ranks must agree on a graph capture (None: this process alone). `profile` ({"scale", "floors",
    "replays"}): every kernel of the step named (``cadence.bench.step_profile``; ``profile`` in the result)."""
    from cadence.engine.session import StreamGenerator
    from cadence.parallel.group import CollectiveLog

    gen = StreamGenerator(cfg, model)
    g = torch.Generator(device=device).manual_seed(1)
    image = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g, device=device) * 2 - 1
    sess = gen.session(image, "benchmark prompt", seed=0)
    fill_cache_random(sess.cache, cfg, model, g)
    audio = torch.randn(cfg.audio_samples_per_chunk, generator=g, device=device) * 0.1
    timer = Timer(device)

    def step():
        return sess.step(audio)

    times = timer.run(step, warmup, iters, progress=progress)
    splits: list[dict[str, float]] = []
    totals: list[float] = []
    for _ in range(profile_iters):
        with SpanRecorder(device) as rec:
            t = timer.run(step, 0, 1)[0]
        splits.append(rec.totals())
        totals.append(t)
    log = None
    if collectives:
        with CollectiveLog() as log:
            step()
    host_sync = _sync_check(device, step)
    graph = (
        measure_graphed(sess, audio, device, warmup, iters, group, progress=progress and "graphed")
        if graphs
        else None
    )
    gsplit = None
    if graph is not None and graph["used"] and graph_split:
        gsplit = measure_graph_split(sess, audio, device, group)
    prof = None
    if profile is not None:
        from cadence.bench.step_profile import profile_step

        use_graphs = bool(graph is not None and graph["used"])
        prof = profile_step(sess, audio, device, model, graphs=use_graphs, group=group, **profile)
    return {
        "profile": prof,
        "times": times,
        "region": _split_regions(splits),
        "totals": totals,
        "host_sync": host_sync,
        "cache_bytes": sess.cache.memory_bytes(),
        "graph": graph,
        "graph_split": gsplit,
        "log": log,
    }


#: The engine-flag set's fields this benchmark takes (``cadence.engine.flags``: each field's docstring is its
#: help); the rest of ``FastPath`` (the decoder, warm-up threads, filling captures) has no part in a step.
FAST_FIELDS = (
    "dtype",
    "kv_fp8",
    "fp8_linears",
    "graphs",
    "compile",
    "comm",
    "attention",
    "gemm",
    "fused_quant",
    "sequence_parallel",
)


def parse(argv: list[str]) -> argparse.Namespace:
    """The benchmark's own flags, then ``--model`` / ``--preset`` and the fast-path flags of a step from the one
    engine-flag set (:data:`FAST_FIELDS`; ``--fp8`` is ``--fp8-linears``' other spelling)."""
    p = UsageParser(prog="cadence bench step", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache",
        default=None,
        choices=["naive", "ring"],
        help="the self-attention cache (default: the recipe's, as cadence serve builds it; naive: the bf16 "
        "baseline; CUDA graphs and the FP8 K/V attention kernel need the ring)",
    )
    p.add_argument("--sink-policy", default=None, choices=["follow", "absolute"], help="default: the model's")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (> 1: run under torchrun --nproc_per_node N, or one rank with --emulate)",
    )
    p.add_argument(
        "--emulate",
        action="store_true",
        help="with --tp N: run one rank of an N-rank group in this process, on one device "
        "(cadence.parallel.emulate: the rank's shard, kernels, FP8 and graphs; every collective a local "
        "stand-in, recorded, and its time estimated from measured link figures)",
    )
    p.add_argument("--emulate-rank", type=int, default=0, help="with --emulate: which rank (default 0)")
    p.add_argument(
        "--fp8-quant",
        default=None,
        choices=["auto", "triton", "torch"],
        help="with --fp8: activation quantisation path (auto: the one-launch Triton kernel on CUDA; "
        "torch: the eager reference; default: $CADENCE_FP8_QUANT or auto)",
    )
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="run this many layers and scale to the preset's count (default: all that fit)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 CUDA, 1 CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 20 CUDA, 5 CPU)")
    p.add_argument(
        "--profile-iters", type=int, default=3, help="instrumented eager steps for the eager split"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="name every kernel of the step (graph-replayed where graphs run): per part count, time, work and "
        "floor (cadence.bench.step_profile); written beside the JSON as <name>-profile.json",
    )
    p.add_argument("--profile-replays", type=int, default=3, help="with --profile: graph replays profiled")
    p.add_argument(
        "--graph-split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with graphs: the split of the graph-replayed step (timing events inside one more captured "
        "graph); the eager split otherwise (default: on)",
    )
    add_record_flags(p)
    p.add_argument("--png", action="store_true", help="also draw the breakdown as a PNG beside the JSON")
    # the engine-flag set: --model/--preset (random weights at its geometry) and a step's fast-path fields,
    # resolved as cadence serve resolves them (--graphs with the naive cache or on the CPU: eager, one log line)
    add_model_flags(p, default="tiny", files=False)
    add_fast_path_flags(p, only=FAST_FIELDS)
    return p.parse_args(argv)


def step_spec(args: argparse.Namespace, layers: int | None = None):
    """The ``EngineSpec`` of the words: ``--cache`` (the naive cache keeps its FP8 K/V storage when asked, and
    takes no graphs), ``--sink-policy``, ``layers`` (None: the model's), ``--tp``."""
    from cadence.bench.recipes import part_spec
    from cadence.engine.flags import fast_path_from_args

    fast = fast_path_from_args(args)
    given = {"cache": args.cache, "sink_policy": args.sink_policy}
    stream: dict = {k: v for k, v in given.items() if v is not None}
    if args.cache == "naive":  # the recipe would move FP8 K/V and graphs to the ring: the words say naive
        stream["kv_fp8"] = bool(fast.kv_fp8)
        fast = dataclasses.replace(fast, kv_fp8=False, graphs=False)
    over: dict = {"stream": stream}
    if layers is not None:
        over["model"] = {"num_layers": layers}
    return part_spec(args, over, fast, tp=args.tp)


def build_tp_model(
    cfg: CadenceConfig, device: torch.device, dtype: torch.dtype, group, comm: str, sp: bool = False
):
    """This rank's shard only: construct on meta, apply_tp there, then allocate on `device` and
    initialise randomly (same seed on every rank: replicated weights agree). Falls back to
    building the full model on the device and sharding it if sharding on meta fails. `group`: a
    ProcessGroup or a TPGroup (an emulated rank builds exactly what a real one does)."""
    from cadence.model.dit import WanDiT
    from cadence.model.weights import build_model, init_random
    from cadence.parallel import apply_tp

    try:
        with torch.device("meta"):
            model = WanDiT(cfg, device="meta", dtype=dtype)
        apply_tp(model, group, comm=comm, sequence_parallel=sp)
        model = model.to_empty(device=device)
        model.rope.to(device)
        init_random(model, 0)
        return model.eval().requires_grad_(False), "meta"
    except (NotImplementedError, RuntimeError, TypeError) as e:
        logging.getLogger(__name__).warning("sharding on meta failed (%s): building the full model first", e)
        model = build_model(cfg, device, dtype, seed=0)
        return apply_tp(model, group, comm=comm, sequence_parallel=sp), "full"


@dataclass
class Setup:
    """Where and what one run of the benchmark measures."""

    device: torch.device
    info: object  # TPInfo of a real rank under torchrun, else None
    group: object  # what apply_tp gets: a ProcessGroup, an EmulatedGroup, or None (TP=1)
    rank0: bool
    recipe: EngineRecipe  # what the words build here (cadence.engine.recipe.resolve), at the layers run
    full: CadenceConfig  # the configuration at the model's own layer count (floors, FLOPs, the record)
    scale: float
    warmup: int
    iters: int
    graphs_asked: bool | None  # --graphs / --no-graphs as given (None: the default)
    fused_quant: object = None  # the FusedQuantReport of apply_fused_quant (FP8 runs), set by _build
    clip: tuple[int, int] | None = (
        None  # a clip family (FlashTalk): (clip frames, motion frames); cadence.bench.step_clip
    )

    @property
    def cfg(self) -> CadenceConfig:
        return self.recipe.config

    @property
    def fast(self) -> FastPath:
        return self.recipe.fast

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.fast.dtype)

    @property
    def cache(self) -> str:
        return self.cfg.stream.cache

    @property
    def kv_fp8(self) -> bool:
        return self.cfg.stream.kv_fp8

    @property
    def fp8(self) -> bool:
        return bool(self.fast.fp8_linears)

    @property
    def tp(self) -> int:
        return self.recipe.tp

    @property
    def emulated(self) -> bool:
        return bool(getattr(self.group, "emulated", False))

    @property
    def layers(self) -> int:
        return self.cfg.model.num_layers


def _check_args(args: argparse.Namespace) -> None:
    from cadence.parallel.fused import parse_mode

    if args.tp < 1:
        raise InputError(f"--tp must be >= 1, got {args.tp}")
    if args.emulate and args.tp < 2:
        raise InputError("--emulate stands in for one rank of a group: give --tp N with N >= 2")
    if args.emulate and not 0 <= args.emulate_rank < args.tp:
        raise InputError(f"--emulate-rank {args.emulate_rank} is outside --tp {args.tp}")
    if args.fast_sequence_parallel and args.tp < 2:
        raise InputError("--sequence-parallel needs tensor parallelism: --tp N with N >= 2")
    try:
        parse_mode(args.fast_comm or "auto")
    except ValueError as e:
        raise InputError(str(e)) from None


def _group(args: argparse.Namespace):
    """(TPInfo of a real rank under torchrun or None, what apply_tp gets: a ProcessGroup, an EmulatedGroup or
    None)."""
    import os

    if args.tp > 1 and args.emulate:
        from cadence.parallel.emulate import EmulatedGroup

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise InputError("--emulate runs one process: start it without torchrun")
        return None, EmulatedGroup(args.tp, args.emulate_rank)
    if args.tp == 1:
        return None, None
    from cadence.parallel import init_tp

    if "WORLD_SIZE" not in os.environ:
        raise InputError(
            f"--tp {args.tp} runs under torchrun: torchrun --nproc_per_node {args.tp} -m cadence bench "
            f"step ... --tp {args.tp} (or emulate one rank on one device: --emulate)"
        )
    info = init_tp(backend=None if (args.device or "cuda") != "cpu" else "gloo")
    if info.world_size != args.tp:
        raise InputError(f"--tp {args.tp} but torchrun started {info.world_size} ranks")
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank{info.rank}] %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("cadence.parallel.fused").setLevel(logging.INFO if info.rank == 0 else logging.WARNING)
    return info, info.group


def _setup(args: argparse.Namespace) -> Setup:
    from cadence.engine.recipe import resolve

    _check_args(args)
    info, group = _group(args)
    device = (
        info.device
        if info is not None
        else torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda but CUDA is not available")
    full = resolve(step_spec(args), str(device))  # the model's own layer count
    clip, full_cfg = _clip_of(args, full)
    dtype = getattr(torch, full.fast.dtype)
    layers = min(args.layers or layers_that_fit(full_cfg, dtype, device, args.tp), full_cfg.model.num_layers)
    cuda = device.type == "cuda"
    return Setup(
        device=device,
        info=info,
        group=group,
        rank0=info is None or info.rank == 0,
        recipe=resolve(step_spec(args, layers), str(device)),
        full=full_cfg,
        scale=full_cfg.model.num_layers / layers,
        warmup=args.warmup if args.warmup is not None else (3 if cuda else 1),
        iters=args.iters if args.iters is not None else (20 if cuda else 5),
        graphs_asked=args.fast_graphs,
        clip=clip,
    )


def _clip_of(args: argparse.Namespace, full) -> tuple[tuple[int, int] | None, CadenceConfig]:
    """(clip frames, motion frames) of a clip family, None for a K/V stream; and the configuration the floors
    count (a clip family's: the whole clip, ``cadence.bench.step_clip.clip_config``)."""
    from cadence.model.families import ClipStream

    if isinstance(full.stream, ClipStream):
        from cadence.bench.step_clip import clip_config

        clip = (full.stream.clip_frames, full.stream.motion_frames)
        return clip, clip_config(full.config, clip[0])
    if not isinstance(full.stream, KVStream):
        raise InputError(
            f"bench step times a K/V cache's chunk step or a clip; {args.model} streams {full.stream!r}"
        )
    return None, full.config


def _build(args: argparse.Namespace, st: Setup):
    """The model this rank runs, as ``build_engine`` applies the recipe's fast path: built (sharded on meta
    under TP), FP8 linears (with the recipe's GEMM backend), compiled, fused FP8 producers. Returns (model, how
    it was built, FP8 layer count, the compile report)."""
    from cadence.model.weights import build_model

    fast, built = st.fast, "full"
    if st.group is None:
        model = build_model(st.cfg, st.device, st.dtype, seed=0)
    else:
        model, built = build_tp_model(
            st.cfg, st.device, st.dtype, st.group, fast.comm, fast.sequence_parallel
        )
    fp8_layers = 0
    if fast.fp8_linears:
        from cadence.quant import apply_fp8, set_quant_backend

        if args.fp8_quant:
            set_quant_backend(args.fp8_quant)
        fp8_layers = apply_fp8(model, gemm=fast.gemm)
    compile_report = None
    if fast.compile:
        model, compile_report = apply_compile_or_exit(model)
    if fast.fp8_linears and fast.fused_quant:  # as build_engine: the norms / GELU before the FP8 linears
        from cadence.runtime.compile import apply_fused_quant  # emit their FP8 input (CUDA only)

        st.fused_quant = apply_fused_quant(model)
    return model, built, fp8_layers, compile_report


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    try:
        return _run(args)
    finally:
        if args.tp > 1 and not args.emulate:
            from cadence.parallel import destroy_tp

            destroy_tp()


def _run(args: argparse.Namespace) -> dict:
    st = _setup(args)
    fast = st.fast
    if st.rank0:
        print(st.recipe.describe().text(), file=sys.stderr)
        what = ""
        if st.group is not None:
            what = f", tp={args.tp}" + (f" (emulated rank {st.group.rank})" if st.emulated else "")
            what += f" comm={fast.comm}" + (" sequence-parallel" if fast.sequence_parallel else "")
        print(
            f"[bench step] {st.full.name}: {st.layers}/{st.full.model.num_layers} layers, {st.dtype}, "
            f"cache={st.cache}, {st.device}{what}" + (", fp8" if st.fp8 else ""),
            file=sys.stderr,
        )
    if st.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(st.device)
    model, built, fp8_layers, compile_report = _build(args, st)
    graphs_why = graphs_unavailable_reason(st.device, st.cache)
    if st.clip is not None:  # only --graphs asks for the graphed clip (the engine runs clips eagerly)
        graphs_why = None if st.device.type == "cuda" and args.fast_graphs else "a clip step runs eagerly"
    graphs = bool(fast.graphs) and graphs_why is None
    if st.graphs_asked and graphs_why is not None:
        logging.getLogger(__name__).warning("--graphs: %s; timing the eager step only", graphs_why)
    if st.clip is not None:
        from cadence.bench.step_clip import measure_clip

        m = measure_clip(
            st.cfg, model, st.device, st.warmup, st.iters, clip_frames=st.clip[0], motion_frames=st.clip[1],
            profile_iters=args.profile_iters, collectives=st.group is not None, profile=_profile_args(args, st),
            progress="clips" if st.rank0 else None, graphs=graphs_why is None,
        )  # fmt: skip
        return _report(args, st, model, m, graphs_why, built, fp8_layers, compile_report)
    m = measure_step(
        st.cfg,
        model,
        st.device,
        st.warmup,
        st.iters,
        args.profile_iters,
        progress="steps" if st.rank0 else None,
        graphs=graphs,
        group=st.info.group if st.info is not None else None,  # an emulated rank agrees with itself
        collectives=st.group is not None,
        graph_split=args.graph_split,
        profile=_profile_args(args, st),
    )
    return _report(args, st, model, m, graphs_why, built, fp8_layers, compile_report)


def _report(args, st: Setup, model, m: dict, graphs_why, built, fp8_layers, compile_report) -> dict:
    from cadence.bench import step_report as rep

    results = rep.results(args, st, model, m, graphs_why, built, fp8_layers, compile_report)
    if st.info is not None and not st.rank0:
        return results
    rep.print_report(args, st, results)
    if not args.no_record:
        _record(args, st, results)
    return results


def _profile_args(args: argparse.Namespace, st: Setup) -> dict | None:
    """What ``measure_step`` needs for ``--profile`` (None without it): the layer scale and the part floors."""
    if not args.profile:
        return None
    from cadence.bench.floors import part_work

    floors = part_work(st.full, args.tp, bool(st.fast.sequence_parallel), st.fp8, st.kv_fp8)
    return {"scale": st.scale, "floors": floors, "replays": max(1, args.profile_replays)}


def _record(args: argparse.Namespace, st: Setup, results: dict) -> None:
    variant = (
        ("emu-" if st.emulated else "")
        + ("clip-" if st.clip else f"{st.cache}{'-fp8kv' if st.kv_fp8 else ''}-")
        + results["dtype"]
    )
    if st.fp8:
        variant += "-fp8" + (f"-q{args.fp8_quant}" if args.fp8_quant and args.fp8_quant != "auto" else "")
    if st.group is not None:
        variant += f"-{st.fast.comm}" + ("-sp" if st.fast.sequence_parallel else "")
    if results["graphs"]["tried"]:
        variant += "-graphs"
    if st.fast.compile:
        variant += "-compile"
    if st.fast.attention != "auto":  # runs that differ only in the ring's backend must not share a file
        variant += f"-attn{st.fast.attention}"
    s, scale = results["step_ms"], st.scale
    prof = results.pop("profile", None)  # written beside, in its own file; its part times in this one
    if prof is not None:
        results["profile_parts_ms"] = {p: v["ms"] for p, v in prof["parts"].items()}
    path = record(
        "step",
        st.full.name,
        args.tp,
        st.device,
        st.full.shape_summary(),
        results,
        variant=variant,
        out_dir=results_dir(args),
        world=args.tp if st.info is not None else 1,
        command=getattr(args, "command", None),
        extra={"recipe": st.recipe.describe().as_dict()},
        headline=f"step {s:.1f} ms ({results['step_mode']}"
        + (f", eager {results['step_eager_ms']:.1f} ms" if results["step_graph_ms"] is not None else "")
        + f"), attention {results['attention_ms']:.1f}, cache {results['cache_upkeep_ms']:.1f}, linear "
        f"{results['linear_ms']:.1f} ms [{results['split_mode']} split]"
        + (f", comm estimate {results['comm_estimate_ms']:.1f} ms (emulated)" if st.emulated else "")
        + (f" (scaled from {st.layers} layers)" if scale != 1 else ""),
    )
    print(f"wrote {path}")
    if prof is not None:
        results["profile"] = prof
        ppath = path.with_name(path.stem + "-profile.json")
        doc = json.loads(path.read_text())
        doc["bench"], doc["results"] = "step-profile", prof
        doc["step_json"] = path.name
        ppath.write_text(json.dumps(doc, indent=2) + "\n")
        results["_profile_path"] = str(ppath)
        print(f"wrote {ppath}")
    if args.png:
        draw_png(path.with_suffix(".png"), results, f"{st.full.name} step ({results['dtype']}, {st.cache})")
    results["_path"] = str(path)


def apply_compile_or_exit(model):
    """``cadence.runtime.compile.apply_compile(model)`` (imported here, lazily), or a clear error when
    this checkout has no such module. Returns (the model to run: the one it returned if it returned a
    module, else `model`, compiled in place; the report it returned, or None)."""
    try:
        from cadence.runtime.compile import apply_compile
    except ImportError as e:
        raise SystemExit(
            f"error: --compile needs cadence.runtime.compile.apply_compile, which this checkout "
            f"does not have ({e})"
        ) from None
    out = apply_compile(model)
    if isinstance(out, torch.nn.Module):
        return out, None
    return model, out


def draw_png(path: Path, r: dict, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    parts = [
        ("attention", r["attention_ms"]),
        ("cache upkeep", r["cache_upkeep_ms"]),
        ("linear", r["linear_ms"]),
        ("other", r["other_ms"]),
    ]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for name, v in parts:
        ax.barh([0], [v], left=left, label=f"{name} {v:.1f} ms")
        left += v
    ax.axvline(r["floor_ms"], color="k", ls="--", lw=1, label=f"floor {r['floor_ms']:.0f} ms")
    ax.set_yticks([])
    ax.set_xlabel("ms per chunk step")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.55), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.command = "cadence bench step " + " ".join(shlex.quote(a) for a in argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
