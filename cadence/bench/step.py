"""`cadence bench step`: the steady-state chunk step (window full), timed and broken down.

    cadence bench step --preset w14 --cache naive --dtype bf16
    cadence bench step --preset w57 --layers 30      # W57 does not fit one H200 in bf16: run 30 of
                                                     # its 60 layers and scale (stated in the JSON)
    torchrun --nproc_per_node 2 -m cadence bench step --preset w14 --tp 2 --fp8 --comm auto

Tensor parallel (``--tp N``, under ``torchrun --nproc_per_node N``): every rank builds only its
shard (the model is constructed on ``meta``, sharded with ``apply_tp`` there, then allocated with
``to_empty`` on its GPU and randomly initialised, so no rank ever holds the full model), draws
the same inputs, and rank 0 prints and records. ``--fp8`` swaps the block linears for FP8 ones
(``apply_fp8``, after sharding); ``--comm`` picks the row-parallel all-reduce mode
(cadence.parallel.fused: auto | nccl | two_shot | one_shot | rs_ag | chunkedN). ``comm_ms`` is the
"allreduce" region (row-parallel sums and the q/k norms' small sums); modes whose GEMM and
collective are one call ("rs_ag", "chunked") are reported as ``linear_comm_ms``. The floor divides
by N (BENCHMARKS.md: ~168 ms on 2 GPUs for W57) and ``tflops_per_gpu`` counts 1/N of the FLOPs.

One step = the passes of one chunk (plus the clean pass if the config commits that way) through a
cache holding the sink and a full window of random K/V, with random weights initialised on the
device. Reported (BENCHMARKS.md): step median / p99 (CUDA events), the split into attention, cache
upkeep, linear layers and other (from separately instrumented steps: region events per layer),
TFLOP per chunk, the floor (FP8 ceilings, as BENCHMARKS.md defines it; the bf16 floor too),
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
CPU (or the naive cache) ``--graphs`` logs one line and times the eager step only.

``--fp8`` records ``fp8_counts`` (``cadence.quant.fp8.fp8_report``): how many FP8 linears ran
``torch._scaled_mm`` on every call, how many fell back (and why), the shapes refused.
``--compile`` calls ``cadence.runtime.compile.apply_compile(model)`` after TP and FP8 (a clear error
when this checkout has no such module).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
from pathlib import Path

import torch

from cadence.bench.common import CEILING, Timer, median, p99, print_table, record
from cadence.bench.results import add_record_flags, results_dir
from cadence.config import CadenceConfig, get_preset
from cadence.telemetry.spans import SpanRecorder

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def chunk_flops(cfg: CadenceConfig) -> dict[str, float]:
    """FLOPs of one chunk step (all passes): linear layers and attention, counted from the shapes."""
    m, s = cfg.model, cfg.stream
    d, t = m.dim, cfg.tokens_per_chunk
    frames = s.latent_frames_per_chunk // m.patch[0]
    a = m.audio_tokens_per_frame * frames
    passes = s.passes + (1 if s.commit == "clean_pass" else 0)
    lin = attn = 0.0
    for i in range(m.num_layers):
        lin += 2 * t * d * (3 * d + d)  # qkv + out
        lin += 2 * t * d * (2 * d)  # cross q + out (text K/V once per session: not per chunk)
        lin += 2 * t * d * m.ffn_dim * 2  # ffn in + out
        attn += 4 * t * cfg.kv_tokens * d  # self: QK^T and PV
        attn += 4 * t * m.text_len * d  # cross
        if m.has_audio(i):
            lin += 2 * t * d * 2 * d + 2 * a * d * 2 * d  # audio q/out + audio K/V
            attn += 4 * t * m.audio_tokens_per_frame * d
    patch = m.in_channels * math.prod(m.patch)
    lin += 2 * t * patch * d * 2 + 2 * d * 7 * d  # patch embed, head, time MLP/proj
    if m.audio_every:
        lin += 2 * a * (m.audio_dim * d + d * d)
    return {"linear": lin * passes, "attention": attn * passes, "total": (lin + attn) * passes}


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

    stream = None
    if capture is None and device.type == "cuda":
        # one eager step on the capture stream first: lazy per-stream library state (cuBLAS workspaces)
        stream = torch.cuda.Stream(device=device)
        cur = torch.cuda.current_stream(device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            sess.step(audio)
        cur.wait_stream(stream)
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
    runner.clear()
    return res


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
) -> dict:
    """Time the steady-state chunk step of `cfg` (its cache choice) on a built model: median over
    `iters` uninstrumented eager steps, the region split from `profile_iters` instrumented ones (eager:
    the region events need the host), a host-sync check (CUDA), and with `graphs` the same step
    replayed from a CUDA graph (:func:`measure_graphed`; ``graph`` in the result, None without)."""
    from cadence.engine.session import StreamGenerator

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
    region = {
        k: median([s.get(k, 0.0) for s in splits])
        for k in ("attention", "cache", "linear", "allreduce", "linear_comm")
    }
    host_sync = _sync_check(device, step)
    graph = (
        measure_graphed(sess, audio, device, warmup, iters, group, progress=progress and "graphed")
        if graphs
        else None
    )
    cache_bytes = sess.cache.memory_bytes()
    return {
        "times": times,
        "region": region,
        "totals": totals,
        "host_sync": host_sync,
        "cache_bytes": cache_bytes,
        "graph": graph,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--cache", default="naive", choices=["naive", "ring"])
    p.add_argument("--kv-fp8", action="store_true", help="FP8 K/V (ring: FP8 attention kernel)")
    p.add_argument("--sink-policy", default="follow", choices=["follow", "absolute"])
    p.add_argument("--dtype", default=None, help="bf16 (default on CUDA) | fp32 (default on CPU) | fp16")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks (> 1: run under torchrun --nproc_per_node N)"
    )
    p.add_argument("--fp8", action="store_true", help="FP8 block linears (cadence.quant.fp8.apply_fp8)")
    p.add_argument(
        "--fp8-quant",
        default=None,
        choices=["auto", "triton", "torch"],
        help="with --fp8: activation quantisation path (auto: the one-launch Triton kernel on CUDA; "
        "torch: the eager reference; default: $CADENCE_FP8_QUANT or auto)",
    )
    p.add_argument(
        "--comm",
        default="auto",
        help="row-parallel comm mode with --tp > 1: auto | nccl | two_shot | one_shot | rs_ag | chunkedN",
    )
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="run this many layers and scale to the preset's count (default: all that fit)",
    )
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--profile-iters", type=int, default=3, help="instrumented steps for the breakdown")
    p.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the step replayed from one CUDA graph per rank (all passes, all layers) and "
        "report eager vs graphed (default: on with CUDA and the ring cache; elsewhere --graphs "
        "falls back to eager with one log line)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the per-block elementwise regions (cadence.runtime.compile.apply_compile), "
        "applied after TP and FP8",
    )
    add_record_flags(p)
    p.add_argument("--png", action="store_true", help="also draw the breakdown as a PNG beside the JSON")
    return p.parse_args(argv)


def build_tp_model(cfg: CadenceConfig, device: torch.device, dtype: torch.dtype, group, comm: str):
    """This rank's shard only: construct on meta, apply_tp there, then allocate on `device` and
    initialise randomly (same seed on every rank: replicated weights agree). Falls back to
    building the full model on the device and sharding it if sharding on meta fails."""
    from cadence.model.dit import WanDiT
    from cadence.model.weights import build_model, init_random
    from cadence.parallel import apply_tp

    try:
        with torch.device("meta"):
            model = WanDiT(cfg, device="meta", dtype=dtype)
        apply_tp(model, group, comm=comm)
        model = model.to_empty(device=device)
        model.rope.to(device)
        init_random(model, 0)
        return model.eval().requires_grad_(False), "meta"
    except (NotImplementedError, RuntimeError, TypeError) as e:
        logging.getLogger(__name__).warning("sharding on meta failed (%s): building the full model first", e)
        return apply_tp(build_model(cfg, device, dtype, seed=0), group, comm=comm), "full"


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    try:
        return _run(args)
    finally:
        if args.tp > 1:
            from cadence.parallel import destroy_tp

            destroy_tp()


def _run(args: argparse.Namespace) -> dict:
    from cadence.model.weights import build_model

    info = None
    if args.tp < 1:
        raise SystemExit("error: --tp must be >= 1")
    if args.tp > 1:
        import os

        from cadence.parallel import init_tp
        from cadence.parallel.fused import parse_mode

        parse_mode(args.comm)
        if "WORLD_SIZE" not in os.environ:
            raise SystemExit(
                f"error: --tp {args.tp} runs under torchrun: "
                f"torchrun --nproc_per_node {args.tp} -m cadence bench step ... --tp {args.tp}"
            )
        info = init_tp(backend=None if (args.device or "cuda") != "cpu" else "gloo")
        if info.world_size != args.tp:
            raise SystemExit(f"error: --tp {args.tp} but torchrun started {info.world_size} ranks")
        logging.basicConfig(
            level=logging.WARNING, format=f"[rank{info.rank}] %(levelname)s %(name)s: %(message)s"
        )
        logging.getLogger("cadence.parallel.fused").setLevel(
            logging.INFO if info.rank == 0 else logging.WARNING
        )
        device = info.device
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")
    rank0 = info is None or info.rank == 0
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    full = get_preset(args.preset).with_overrides(
        stream={"cache": args.cache, "kv_fp8": args.kv_fp8, "sink_policy": args.sink_policy}
    )
    layers = args.layers or layers_that_fit(full, dtype, device, args.tp)
    layers = min(layers, full.model.num_layers)
    cfg = full.with_overrides(model={"num_layers": layers})
    scale = full.model.num_layers / layers
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    iters = args.iters if args.iters is not None else (20 if device.type == "cuda" else 5)

    if rank0:
        print(
            f"[bench step] {full.name}: {layers}/{full.model.num_layers} layers, {dtype}, cache={args.cache}, "
            f"{device}"
            + (f", tp={args.tp} comm={args.comm}" if info else "")
            + (", fp8" if args.fp8 else ""),
            file=sys.stderr,
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    built = "full"
    if info is None:
        model = build_model(cfg, device, dtype, seed=0)
    else:
        model, built = build_tp_model(cfg, device, dtype, info.group, args.comm)
    fp8_layers = 0
    if args.fp8:
        from cadence.quant import apply_fp8, set_quant_backend

        if args.fp8_quant:
            set_quant_backend(args.fp8_quant)
        fp8_layers = apply_fp8(model)
    compile_report = None
    if args.compile:
        model, compile_report = apply_compile_or_exit(model)
    fused_quant = None
    if args.fp8:  # as build_engine: the norms / GELU before the FP8 linears emit their FP8 input (CUDA only)
        from cadence.runtime.compile import apply_fused_quant

        fused_quant = apply_fused_quant(model)
    graphs_why = graphs_unavailable_reason(device, args.cache)
    graphs = bool(args.graphs if args.graphs is not None else graphs_why is None)
    if graphs and graphs_why is not None:
        logging.getLogger(__name__).warning("--graphs: %s; timing the eager step only", graphs_why)
        graphs = False
    m = measure_step(
        cfg,
        model,
        device,
        warmup,
        iters,
        args.profile_iters,
        progress="steps" if rank0 else None,
        graphs=graphs,
        group=info.group if info is not None else None,
    )
    times, region, totals, host_sync, cache_bytes = (
        m["times"],
        m["region"],
        m["totals"],
        m["host_sync"],
        m["cache_bytes"],
    )
    graph = m["graph"]
    eager_ms = median(times)
    graph_ms = median(graph["times"]) if graph is not None and graph["used"] else None
    step_ms = graph_ms if graph_ms is not None else eager_ms
    step_times = graph["times"] if graph_ms is not None else times
    fl = chunk_flops(full)
    floor_ms = (
        fl["linear"] / (CEILING["fp8_gemm"] * 1e12) + fl["attention"] / (CEILING["fp8_attn"] * 1e12)
    ) * 1e3
    floor_bf16 = (
        fl["linear"] / (CEILING["bf16_gemm"] * 1e12) + fl["attention"] / (CEILING["bf16_attn"] * 1e12)
    ) * 1e3
    floor_ms, floor_bf16 = floor_ms / args.tp, floor_bf16 / args.tp  # N GPUs share the FLOPs
    s_step = step_ms * scale
    regions_scaled = {k: v * scale for k, v in region.items()}
    instrumented = median(totals) * scale
    # The split comes from the instrumented steps (events around every region add a little time):
    # other = instrumented step - the regions; step_ms itself is the uninstrumented median.
    other = max(instrumented - sum(regions_scaled.values()), 0.0)  # comm regions are 0 at TP=1
    results = {
        "step_ms": s_step,
        "step_p99_ms": p99(step_times) * scale,
        "step_mode": "graph" if graph_ms is not None else "eager",
        "step_eager_ms": eager_ms * scale,
        "step_eager_p99_ms": p99(times) * scale,
        "step_graph_ms": graph_ms * scale if graph_ms is not None else None,
        "step_graph_p99_ms": p99(graph["times"]) * scale if graph_ms is not None else None,
        "graph_speedup": eager_ms / graph_ms if graph_ms is not None else None,
        "graphs": {
            "requested": args.graphs,
            "tried": graph is not None,
            "used": graph_ms is not None,
            "reason": graphs_why if graph is None else (None if graph["used"] else graph["last"]),
            **({k: v for k, v in graph.items() if k != "times"} if graph is not None else {}),
        },
        "compile": compile_info(compile_report) if args.compile else None,
        "attention_ms": regions_scaled["attention"],
        "cache_upkeep_ms": regions_scaled["cache"],
        "linear_ms": regions_scaled["linear"],
        "comm_ms": regions_scaled["allreduce"],
        "linear_comm_ms": regions_scaled["linear_comm"],
        "other_ms": other,
        "instrumented_step_ms": instrumented,
        "tflop_per_chunk": fl["total"] / 1e12,
        "tflop_linear": fl["linear"] / 1e12,
        "tflop_attention": fl["attention"] / 1e12,
        "tflops_per_gpu": fl["total"] / args.tp / (s_step * 1e-3) / 1e12,
        "floor_ms": floor_ms,
        "floor_bf16_ms": floor_bf16,
        "efficiency": floor_ms / s_step,
        "efficiency_vs_bf16_floor": floor_bf16 / s_step,
        "cache": args.cache,
        "kv_fp8": args.kv_fp8,
        "cache_mem_gib": cache_bytes * scale / 2**30,
        "fp8": bool(args.fp8),
        "fused": bool(info is not None and args.comm != "nccl"),
        "dtype": str(dtype).replace("torch.", ""),
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
        "layers_run": layers,
        "layers_full": full.model.num_layers,
        "scaled": scale != 1.0,
        "scale_factor": scale,
        "host_sync_in_step": host_sync,
        "iters": iters,
        "warmup": warmup,
        "raw_step_ms_unscaled": times,
        "raw_graph_step_ms_unscaled": graph["times"] if graph is not None else None,
    }
    if args.fp8:
        from cadence.quant import fp8 as fp8_mod

        results["fp8_layers"] = fp8_layers
        results["fp8_counts"] = fp8_mod.fp8_report(model)
        results["fused_quant"] = {"describe": fused_quant.describe(), "status": fused_quant.status()}
        results["fp8_quant"] = {
            "backend": fp8_mod.quant_backend(),
            "triton_failed": fp8_mod._quant_failed,
            "reference_path_reasons": sorted(fp8_mod._quant_logged),
        }
    if info is not None:
        from cadence.parallel import fused

        results.update(
            {
                "comm": args.comm,
                "comm_decisions": fused.chooser_decisions(),
                "comm_fallbacks": fused.fallback_warnings(),
                "symm_cache": fused.symm_cache_info(),
                "tp_built": built,
            }
        )
        if not rank0:
            return results
    rows = [
        (
            "step (median)",
            f"{s_step:9.2f} ms  [{results['step_mode']}]"
            + (f"   (scaled x{scale:.2f} from {layers} layers)" if scale != 1 else ""),
        ),
        ("step p99", f"{results['step_p99_ms']:9.2f} ms"),
        (
            "eager / graphed",
            f"{results['step_eager_ms']:9.2f} ms / "
            + (
                f"{results['step_graph_ms']:.2f} ms  (x{results['graph_speedup']:.2f})"
                if graph_ms is not None
                else f"n/a ({results['graphs']['reason']})"
            ),
        ),
        *(
            [
                (
                    "FP8 linears",
                    "{fp8_linears}: {ran_fp8} ran FP8, {fell_back} fell back ({mixed} mixed), {unused} unused".format(
                        **results["fp8_counts"]
                    ),
                )
            ]
            if args.fp8
            else []
        ),
        ("attention", f"{results['attention_ms']:9.2f} ms  {results['attention_ms'] / s_step:6.1%}"),
        ("cache upkeep", f"{results['cache_upkeep_ms']:9.2f} ms  {results['cache_upkeep_ms'] / s_step:6.1%}"),
        ("linear", f"{results['linear_ms']:9.2f} ms  {results['linear_ms'] / s_step:6.1%}"),
        *(
            [
                ("comm (all-reduce)", f"{results['comm_ms']:9.2f} ms  {results['comm_ms'] / s_step:6.1%}"),
                (
                    "linear+comm (fused)",
                    f"{results['linear_comm_ms']:9.2f} ms  {results['linear_comm_ms'] / s_step:6.1%}",
                ),
            ]
            if info is not None
            else []
        ),
        ("other", f"{other:9.2f} ms  {other / s_step:6.1%}"),
        ("instrumented step", f"{instrumented:9.2f} ms  (the split above is of this)"),
        ("TFLOP / chunk", f"{results['tflop_per_chunk']:9.2f}  ({results['tflops_per_gpu']:.0f} TFLOP/s)"),
        (
            "floor (FP8) / bf16",
            f"{floor_ms:9.2f} ms / {floor_bf16:.2f} ms  efficiency {results['efficiency']:.1%}",
        ),
        ("peak memory", f"{results['peak_mem_gib']:.1f} GiB" if results["peak_mem_gib"] else "n/a (CPU)"),
        ("host sync in step", str(host_sync)),
    ]
    print_table(
        rows,
        f"bench step: {full.name} tp{args.tp} cache={args.cache}{' fp8 K/V' if args.kv_fp8 else ''} "
        f"{results['dtype']}{' fp8 linears' if args.fp8 else ''}"
        + (f" comm={args.comm}" if info is not None else ""),
    )
    if info is not None:
        for shape, d in results["comm_decisions"].items():
            print(f"  comm {shape}: {d['mode']} ({d['why']})")
    if not args.no_record:
        variant = f"{args.cache}{'-fp8kv' if args.kv_fp8 else ''}-{results['dtype']}"
        if args.fp8:
            variant += "-fp8" + (f"-q{args.fp8_quant}" if args.fp8_quant and args.fp8_quant != "auto" else "")
        if info is not None:
            variant += f"-{args.comm}"
        if graph is not None:
            variant += "-graphs"
        if args.compile:
            variant += "-compile"
        path = record(
            "step",
            full.name,
            args.tp,
            device,
            full.shape_summary(),
            results,
            variant=variant,
            out_dir=results_dir(args),
            world=args.tp,
            command=getattr(args, "command", None),
            headline=f"step {s_step:.1f} ms ({results['step_mode']}"
            + (f", eager {results['step_eager_ms']:.1f} ms" if graph_ms is not None else "")
            + f"), attention {results['attention_ms']:.1f}, cache "
            f"{results['cache_upkeep_ms']:.1f}, linear {results['linear_ms']:.1f} ms"
            + (f" (scaled from {layers} layers)" if scale != 1 else ""),
        )
        print(f"wrote {path}")
        if args.png:
            draw_png(
                path.with_suffix(".png"), results, f"{full.name} step ({results['dtype']}, {args.cache})"
            )
        results["_path"] = str(path)
    return results


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


def compile_info(report) -> dict:
    """JSON for the compile report (after the run: its per-op status says what really compiled)."""
    info: dict = {"applied": True}
    for attr in ("enabled", "reason", "blocks", "norms", "backend"):
        if hasattr(report, attr):
            info[attr] = getattr(report, attr)
    for meth in ("describe", "status"):
        fn = getattr(report, meth, None)
        if callable(fn):
            try:
                info[meth] = fn()
            except Exception as e:  # noqa: BLE001  (a report that cannot describe itself: say so, keep going)
                info[meth] = f"{type(e).__name__}: {e}"
    if report is not None and len(info) == 1:
        info["report"] = repr(report)
    try:
        json.dumps(info)
    except (TypeError, ValueError):
        info = {"applied": True, "report": repr(report)}
    return info


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
