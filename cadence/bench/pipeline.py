"""`cadence bench pipeline`: the overlapped diffusion + decode pipeline, sustained, against the deadline.

    cadence bench pipeline --preset tiny --chunks 12                  # CPU smoke test, seconds
    cadence bench pipeline --device cuda                              # bare: what a bare `cadence serve` runs
    cadence bench pipeline --model krea-14b --device cuda             # the recipe picks Krea's naive cache
    cadence bench pipeline --preset w1.3 --chunks 200                 # one H200: decode on its own stream
    cadence bench pipeline --preset w14 --chunks 200 --decode-gpu 1   # 2x H200 (= --decode-device cuda:1)
    cadence bench pipeline --preset w14 --no-graphs --shape-change-every 5
    cadence bench pipeline --model longlive --device cuda --shape-change-every 0 --prompt-switch-every 10
    cadence bench pipeline --model self-forcing --weights W.pt --lora L.safetensors:0.8   # as serve / generate
    cadence bench pipeline --preset w1.3 --chunks 60 --decoder taehv --kv-fp8 --fp8 --compile --window 4

Up to three runs in one process, one model: (1) a steady stream; (2) the same stream with the conditioning
length (prompt tokens) changing every ``--shape-change-every`` chunks, cycling through a few lengths,
which exercises the graph runner's fallback, LRU and recapture bounds; (3) with ``--prompt-switch-every N``,
a new prompt of the same length every N chunks (no step changes shape, so the family's prompt-switch rule is
timed alone: LongLive's re-cache, a plain swap elsewhere; ``prompt_switch_run``: the latency of the chunks a
switch lands on against the chunks between). Each run records the peak GPU memory allocated over its stream
(``peak_mem_gib``, ``torch.cuda.max_memory_allocated`` of the diffusion device; null on the CPU). Per run: sustained fps (video
frames per second between the first and the last steady-state chunk's frames being ready) and, as a
separate figure, chunk latency p50/p99 (diffusion start -> frames in host memory); a deadline miss is a
chunk whose frames are ready after their playout time (chunk 0's diffusion start + ``--lead-ms`` + i chunks
of media; ``latency_over_chunk_rate`` keeps the old count of latencies above one chunk),
time to first frame, and the per-stage medians (diffusion, decode, host copy). Steady state = chunks
after the ring has filled plus one warm-up / capture chunk (all chunks are in ``per_chunk``).
Results per docs/benchmarks.md (bench "pipeline"); a PNG of the per-chunk timeline beside the JSON when
matplotlib is importable. Imports only torch (+ matplotlib if present).

It measures the engine ``cadence serve`` runs: the words go through the same flag set
(``cadence.engine.flags``) into the same ``EngineSpec``, resolved for the device by the same recipe
(``cadence.engine.recipe``: the fast path on CUDA, the family's rules; the default model is the shipped
character, the default decode placement the diffusion GPU) and built by ``build_engine(recipe)``: the same step
+ decode loop, the same warm-up. The recipe is printed first (stderr) and recorded in the JSON (``recipe``).
This benchmark's own words: ``--cache naive|ring`` (naive also turns FP8 K/V and graphs off unless asked),
``--window N``, ``--layers N`` (in the variant name), ``--height`` / ``--width`` (a smaller frame: smoke runs of
a family's tiny fixture on the CPU), the queues and the lead.

Time to first frame: ``ttff_ms`` is the timed stream's, from its start (the session's opening: prompt K/V,
the reference image's encode and sink pass) to the first chunk's frames in host memory. With ``--warmup``
(alias ``--prewarm``, the default) the engine's warm-up (``Engine.warm_up``: every step shape, the decoder, the graph
captures) runs first and the timed stream reuses its session and graphs, as a server would; the
warm-up's first stream's ttff, the process's first, is ``ttff_cold_ms``. With ``--no-warmup`` the timed
stream is the first and ``ttff_cold_ms`` equals ``ttff_ms``. Latency is reported twice: ``chunk_p50_ms``
/ ``chunk_p99_ms`` from the back-to-back stream (chunks queue behind each other: throughput conditions)
and ``chunk_paced_ms`` (the warm-up's paced chunks: one chunk at a time, as a live server's chunks come
a chunk period apart).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from cadence.bench.common import add_size_flags, median, p99, print_table, record, size_overrides
from cadence.bench.pipeline_clips import add_clip_flags, split_row
from cadence.bench.results import add_record_flags, results_dir
from cadence.config import PipelineConfig
from cadence.engine.flags import add_engine_flags, spec_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    """The benchmark's own flags, then the engine-flag set every entry point shares (``cadence.engine.flags``:
    the same words give ``cadence serve``'s engine)."""
    p = argparse.ArgumentParser(prog="cadence bench pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=200)
    p.add_argument(
        "--device", default=None, help="diffusion device: cuda[:N] | cpu (default: cuda:0 if present)"
    )
    p.add_argument(
        "--shape-change-every",
        type=int,
        default=10,
        help="second run: change the conditioning length every K chunks (0: skip that run)",
    )
    p.add_argument(
        "--prompt-switch-every",
        type=int,
        default=0,
        help="third run: a new prompt of the SAME conditioning length every K chunks (no step changes shape: "
        "the family's prompt-switch rule alone is timed, e.g. LongLive's re-cache; default 0: skip that run)",
    )
    p.add_argument(
        "--cache",
        default=None,
        choices=["ring", "naive"],
        help="the self-attention cache (default: the recipe's: the ring with FP8 K/V or graphs, on CUDA; "
        "naive on the CPU and for Krea's rebuild); naive also turns FP8 K/V and graphs off unless asked",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="run this many transformer layers (stated in the JSON)"
    )
    p.add_argument(
        "--window", type=int, default=None, help="override stream.window_chunks (chunks a query sees)"
    )
    add_size_flags(p)
    p.add_argument("--max-graphs", type=int, default=4)
    p.add_argument("--queue-depth", type=int, default=2)
    p.add_argument(
        "--steps-in-flight",
        type=int,
        default=1,
        help="diffusion steps launched ahead of the device (1: plan after the previous step ends)",
    )
    p.add_argument(
        "--gil-switch-ms",
        type=float,
        default=PipelineConfig.gil_switch_ms,
        help="Python's thread switch interval while a CUDA decode thread runs (PipelineConfig.gil_switch_ms; "
        "0: leave Python's 5 ms)",
    )
    p.add_argument(
        "--lead-ms",
        type=float,
        default=None,
        help="planning lead for the deadline: chunk i's frames are due lead + i chunks after chunk 0's "
        "diffusion start (default: as cadence serve's auto lead, the warm-up's paced chunk latency x 1.15 "
        "+ 20 ms, at least one chunk of media)",
    )
    add_clip_flags(p)  # --clip-attention, --clip-encode (cadence.bench.pipeline_clips)
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="decode right after each step in the same thread (the serial reference)",
    )
    add_engine_flags(
        p
    )  # --model/--preset, the files, the fast path, --decode-device/--decode-gpu, --tp, --warmup
    add_record_flags(p)
    a = p.parse_args(argv)
    if a.chunks < 2:
        p.error(f"--chunks must be >= 2, got {a.chunks}")
    if a.window is not None and a.window < 1:
        p.error(f"--window must be >= 1, got {a.window}")
    if a.shape_change_every < 0:
        p.error(f"--shape-change-every must be >= 0, got {a.shape_change_every}")
    if a.prompt_switch_every < 0:
        p.error(f"--prompt-switch-every must be >= 0, got {a.prompt_switch_every}")
    if a.tp < 1:
        p.error(f"--tp must be >= 1, got {a.tp}")
    return a


def bench_spec(args):
    """The ``EngineSpec`` of the words: the shared flags, plus this benchmark's geometry (``--window``,
    ``--layers``) and cache (``--cache naive``: the baseline, FP8 K/V and graphs off unless asked)."""
    over: dict = {}
    if args.cache:
        over["stream"] = {"cache": args.cache}
    if args.window:
        over.setdefault("stream", {})["window_chunks"] = args.window
    if args.layers:
        over["model"] = {"num_layers": args.layers}
    if size_overrides(args):
        over.setdefault("stream", {}).update(size_overrides(args))
    spec = spec_from_args(args, overrides=over)
    if args.cache == "naive":
        import dataclasses

        off = {k: False for k in ("kv_fp8", "graphs") if getattr(spec.fast, k) is None}
        spec = dataclasses.replace(spec, fast=dataclasses.replace(spec.fast, **off))
    return spec


def playout_misses(timings: list, chunk_ms: float, lead_ms: float) -> list[float]:
    """Per chunk, how late its frames were for their playout (ms; <= 0: on time). Chunk i's frames play at
    ``t0 + lead + i * chunk``, where t0 is chunk 0's diffusion start (``t_plan``) and ``lead`` the configured
    planning lead: the deadline a live stream has, whatever the chunk latency. Late > 0 = a deadline miss."""
    if not timings:
        return []
    t0 = timings[0].t_plan
    return [(x.t_done - t0) * 1e3 - (lead_ms + i * chunk_ms) for i, x in enumerate(timings)]


def latency_fields(timings: list, chunk_ms: float, lead_ms: float, skip: int) -> dict:
    """Throughput-independent latency figures of one run: chunk latency (diffusion start -> frames in host
    memory) over the steady chunks, and the deadline misses against the playout schedule over ALL chunks."""
    steady = timings[skip:] if len(timings) - skip >= 2 else timings
    lat = [x.latency_ms for x in steady]
    late = playout_misses(timings, chunk_ms, lead_ms)
    missed = [x for x in late if x > 0]
    return {
        "latency_p50_ms": median(lat),
        "latency_p99_ms": p99(lat),
        "latency_max_ms": max(lat),
        "lead_ms": lead_ms,
        "deadline_misses": len(missed),
        "deadline_miss_rate": len(missed) / len(late),
        "worst_lateness_ms": max(late),
        "first_miss": next((i for i, x in enumerate(late) if x > 0), None),
    }


def summarize(
    outs: list, cfg, deadline_ms: float, skip: int, ttff_ms: float | None = None, lead_ms: float | None = None
) -> dict:
    """The docs/benchmarks.md `pipeline` keys from one run's chunks (`skip`: non-steady chunks at the start).
    Throughput (``fps``) and latency (``latency_*``, diffusion start -> frames on the host) are separate
    figures; ``deadline_miss_rate`` counts chunks ready after their playout time at ``lead_ms`` (default:
    one chunk of media); ``latency_over_chunk_rate`` is the old figure (latency above one chunk)."""
    t = [o.timings for o in outs]
    steady = t[skip:] if len(t) - skip >= 2 else t
    lat = [x.latency_ms for x in steady]
    span = steady[-1].t_done - steady[0].t_done
    frames = cfg.video_frames_per_chunk * (len(steady) - 1)
    return {
        "fps": frames / span if span > 0 else float("nan"),
        "chunk_p50_ms": median(lat),
        "chunk_p99_ms": p99(lat),
        "deadline_ms": deadline_ms,
        **latency_fields(t, deadline_ms, deadline_ms if lead_ms is None else lead_ms, skip),
        "latency_over_chunk_rate": sum(x > deadline_ms for x in lat) / len(lat),
        "ttff_ms": ttff_ms,
        "first_chunk_diffusion_ms": t[0].diffusion_ms,
        "first_chunk_decode_ms": t[0].decode_ms,
        "diffusion_ms": median([x.diffusion_ms for x in steady]),
        "decode_ms": median([x.decode_ms for x in steady]),
        "host_copy_ms": median([x.host_copy_ms for x in steady]),
        "chunks": len(outs),
        "steady_chunks": len(steady),
        "chunk_p99_ms_all": p99([x.latency_ms for x in t]),
        "latency_over_chunk_rate_all": sum(x.latency_ms > deadline_ms for x in t) / len(t),
    }


def run_once(eng, cfg, image, audio, n: int, seed: int, prompts=None) -> list:
    outs = []
    for o in eng.stream(image, "benchmark prompt", audio, n, seed=seed, prompts=prompts):
        o.frames = None  # the pinned buffer goes back to the ring; keep only the numbers
        o.latents = None
        outs.append(o)
    return outs


def draw_timeline(path, runs: dict[str, list], deadline_ms: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), squeeze=False)
    for ax, (name, outs) in zip(axes[:, 0], runs.items()):
        idx = [o.index for o in outs]
        for key, style in (
            ("latency_ms", "-"),
            ("diffusion_ms", "--"),
            ("decode_ms", ":"),
            ("host_copy_ms", "-."),
        ):
            ax.plot(idx, [getattr(o.timings, key) for o in outs], style, label=key.replace("_ms", ""))
        ax.axhline(deadline_ms, color="red", lw=0.8, label=f"deadline {deadline_ms:.1f} ms")
        for o in outs:
            if o.timings.step in ("capture",) or o.timings.step.startswith("eager:warmup"):
                ax.axvline(o.index, color="grey", lw=0.4, alpha=0.5)
        ax.set_title(name)
        ax.set_xlabel("chunk")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def init_tensor_parallel(args):
    """--tp N: join torchrun's group (NCCL on CUDA, gloo on CPU); this rank's TPInfo, or None after
    an `error:` line."""
    import os

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            f"error: --tp {args.tp} runs under torchrun: torchrun --nproc_per_node {args.tp} -m cadence bench "
            f"pipeline ... --tp {args.tp}",
            file=sys.stderr,
        )
        return None
    from cadence.parallel import init_tp

    info = init_tp(backend="gloo" if (args.device or "") == "cpu" or not torch.cuda.is_available() else None)
    if info.world_size != args.tp:
        print(f"error: --tp {args.tp} but torchrun started {info.world_size} ranks", file=sys.stderr)
        return None
    return info


@torch.no_grad()
def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.tp == 1:
        return _main(args, None)
    info = init_tensor_parallel(args)
    if info is None:
        return 2
    try:
        return _main(args, info)
    finally:
        import torch.distributed as dist

        from cadence.parallel import destroy_tp

        if dist.is_initialized():
            dist.barrier()  # rank 0 writes the JSON / PNG while the others wait, then all leave together
        destroy_tp()


def _main(args, info) -> int:
    import logging

    from cadence.engine.build import build_engine
    from cadence.engine.recipe import resolve

    rank0 = info is None or info.rank == 0
    logging.basicConfig(
        level=logging.INFO if rank0 else logging.WARNING,
        format="%(name)s: %(message)s" if info is None else f"[rank{info.rank}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    spec = bench_spec(args)
    if info is not None:
        device = info.device
    else:
        device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda:0")
    # what `cadence serve` builds from the same words on this device (cadence.engine.recipe); under TP every
    # rank decodes its own copy on a side stream of its GPU (the same work on every rank keeps the ranks in
    # step at the all-reduces); only rank 0's frames are used
    recipe = resolve(spec, str(device))
    pcfg = PipelineConfig(
        diffusion_devices=(str(device),),
        decode_device=recipe.decode_device,
        max_graphs=args.max_graphs,
        queue_depth=args.queue_depth,
        steps_in_flight=args.steps_in_flight,
        overlap=not args.no_overlap,
        gil_switch_ms=args.gil_switch_ms,
    )
    if rank0:
        print(recipe.describe().text(), file=sys.stderr)
    eng = build_engine(recipe, device, tp=info, pipeline=pcfg)
    if rank0:
        if info is not None:
            print(
                f"tp: {info.world_size} ranks ({info.backend}), shards built on {eng.applied.get('tp_build')}, "
                f"comm {recipe.fast.comm}",
                file=sys.stderr,
            )
        print(
            f"placement: {eng.placement.describe()}" + "".join(f"; {n}" for n in eng.placement.notes),
            file=sys.stderr,
        )
    try:
        return _measure(args, info, recipe, eng, device, rank0)
    finally:
        # free the kept session and its graphs before the process group goes (graphs that captured
        # NCCL calls keep the communicator busy: destroying it under them hangs at exit)
        eng.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _measure(args, info, recipe, eng, device, rank0) -> int:
    cfg = eng.gen.cfg
    n = args.chunks
    image, audio = _inputs(cfg, n)
    deadline_ms = 1e3 * cfg.chunk_seconds
    skip = min(n - 2, cfg.stream.window_chunks + 1)
    clip_fast = _clip_fast(args, eng)
    if clip_fast is None:
        return 2
    warm = _warm_up(eng, recipe, rank0)
    lead_ms, lead_from = args.lead_ms, "--lead-ms"
    if lead_ms is None:
        paced = warm.steady_chunk_ms if warm else None
        lead_ms = max(deadline_ms, paced * 1.15 + 20) if paced else deadline_ms
        lead_from = "auto (warm-up paced chunk x 1.15 + 20 ms)" if paced else "one chunk"
    run = Run(eng, cfg, image, audio, deadline_ms, skip, lead_ms)
    outs, res = run.steady(n)
    if run.split is not None:
        res["clip_split_ms"], res["clip_split"] = run.split
    res.update(clip_fast)
    res.update(
        lead_from=lead_from,
        prewarm=warm is not None,
        window_chunks=cfg.stream.window_chunks,
        ttff_cold_ms=warm.first_stream_ttff_ms if warm else res["ttff_ms"],
        chunk_paced_ms=warm.steady_chunk_ms if warm else None,
        threads=torch.get_num_threads(),
        overlap=not args.no_overlap,
        switch_interval_ms=round(sys.getswitchinterval() * 1e3, 3),
    )
    # the same reference image again (a returning character: its latent is remembered, no VAE encode)
    run_once(eng, cfg, image, audio, 1, seed=0)
    res.update(ttff_repeat_ms=eng.last_run.ttff_ms, open_repeat_ms=eng.last_run.open_ms)
    if warm:
        w = warm.as_dict()
        res.update(prewarm_s=warm.ms / 1e3, prewarm_chunks=warm.chunks, prewarm_graphs=w["graphs"], warmup=w)
    res.update(
        fast=eng.describe(),
        fp8=bool(recipe.fast.fp8_linears),
        compile=bool(recipe.fast.compile),
        fp8_layers=eng.applied.get("fp8_linears"),
        compile_info=eng.applied.get("compile"),
    )
    runs = {"steady conditioning": outs}
    res["shape_changes"] = 0
    if args.shape_change_every:
        outs2, res["shape_change_run"], res["shape_changes"] = run.shape_changes(n, args.shape_change_every)
        runs[f"conditioning length changes every {args.shape_change_every} chunks"] = outs2
    if args.prompt_switch_every:
        outs3, res["prompt_switch_run"] = run.prompt_switches(
            n, args.prompt_switch_every, recipe.prompt_switch
        )
        runs[f"a new prompt (same length) every {args.prompt_switch_every} chunks"] = outs3
    res["per_chunk"] = per_chunk(outs, getattr(run, "clips", None))
    if info is not None:
        res["tp_comm"] = recipe.fast.comm
    if not rank0:
        return 0
    print_table(
        _rows(res, eng, info, recipe, lead_ms, lead_from, warm),
        f"bench pipeline: {cfg.name}, {n} chunks, {device}, {recipe.fast.dtype}",
    )
    if not args.no_record:
        _record(args, info, recipe, eng, cfg, device, res, runs, deadline_ms, lead_ms)
    return 0


def _clip_fast(args, eng) -> dict | None:
    """``--clip-attention`` and ``--clip-encode`` applied to a clip stream's DiT and codec
    (``cadence.bench.pipeline_clips``), one line each: the JSON's records (``clip_attention``,
    ``clip_encode``; {} for another model at the defaults; None after an ``error:`` line: a candidate asked
    of a model without the seam)."""
    from cadence.bench.pipeline_clips import apply_clip_attention, apply_clip_encode

    if not hasattr(type(eng.gen.model), "clip_attention"):
        asked = [f for f in ("clip_attention", "clip_encode") if getattr(args, f) != "reference"]
        if not asked:
            return {}
        flag = "--" + asked[0].replace("_", "-")
        print(f"error: {flag} is for clip streams (FlashHead), not {eng.gen.cfg.name}", file=sys.stderr)
        return None
    out = {
        "clip_attention": apply_clip_attention(eng, args.clip_attention),
        "clip_encode": apply_clip_encode(eng, args.clip_encode),
    }
    for key, rec in out.items():
        how = (
            f"applied ({rec.get('note', 'as built')})"
            if rec["applied"]
            else f"not applied ({rec.get('why')})"
        )
        print(f"{key.replace('_', ' ')}: {rec['name']}, {how}", file=sys.stderr)
        rec.pop("report", None)
    return out


def _inputs(cfg, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream's reference image and ``n`` chunks of audio (a tone in noise), one seed."""
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    t = torch.arange(n * cfg.audio_samples_per_chunk) / 48_000
    audio = 0.3 * torch.sin(2 * math.pi * 220 * t) + 0.05 * torch.randn(t.shape, generator=g)
    return image, audio


def _warm_up(eng, recipe, rank0: bool):
    """The engine's warm-up (``recipe.warmup``; None without), one line about it on rank 0."""
    if not recipe.warmup:
        return None
    warm = eng.warm_up(chunks=recipe.warmup_chunks, decode=True, threads=recipe.fast.threads)
    if rank0:
        print(
            f"warm-up: {warm.streams} streams in {warm.ms / 1e3:.2f} s, cold ttff "
            f"{warm.first_stream_ttff_ms} ms, paced chunk {warm.steady_chunk_ms} ms, interval "
            f"{warm.interval_ms} ms, threads {warm.threads}",
            file=sys.stderr,
        )
    return warm


def per_chunk(outs: list, clips: list[dict] | None = None) -> list[dict]:
    """Each chunk's stage times and step kind (the JSON's ``per_chunk``), with its clip's phases (``split``, ms)
    when the stream's clips were split."""
    keys = ("diffusion_ms", "decode_ms", "host_copy_ms", "latency_ms")
    rows = [
        dict(i=o.index, **{f: round(getattr(o.timings, f), 3) for f in keys}, step=o.timings.step)
        for o in outs
    ]
    for row, phases in zip(rows, clips or []):
        row["split"] = {k: round(v, 3) for k, v in phases.items()}
    return rows


def _cuda_devices(eng) -> list[torch.device]:
    """The CUDA devices the engine diffuses and decodes on (none on the CPU)."""
    p = eng.placement
    devs = [torch.device(d) for d in dict.fromkeys((p.diffusion_device, p.decode_device))]
    return [d for d in devs if d.type == "cuda"]


def reset_peak_memory(eng) -> None:
    """Start :func:`peak_memory_gib`'s count (``torch.cuda.reset_peak_memory_stats`` on each CUDA device)."""
    for d in _cuda_devices(eng):
        torch.cuda.reset_peak_memory_stats(d)


def peak_memory_gib(eng) -> dict[str, float] | None:
    """The peak GPU memory allocated since :func:`reset_peak_memory` (``torch.cuda.max_memory_allocated``,
    GiB) per CUDA device the engine runs on, by device name; None on the CPU."""
    devs = _cuda_devices(eng)
    return {str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in devs} or None


class Run:
    """The timed streams of one engine: the steady one and the two conditioning-change runs, each summarised
    (:func:`summarize`) with the peak GPU memory over its stream (``peak_mem_gib``: the diffusion device's;
    ``peak_mem_gib_by_device`` too where the decode has a GPU of its own; None on the CPU)."""

    def __init__(self, eng, cfg, image, audio, deadline_ms: float, skip: int, lead_ms: float):
        self.eng, self.cfg, self.image, self.audio = eng, cfg, image, audio
        self.deadline_ms, self.skip, self.lead_ms = deadline_ms, skip, lead_ms
        self.split: tuple[dict, dict] | None = None  # the steady stream's clip split (a clip stream's)

    def stream(self, n: int, prompts=None) -> tuple[list, dict]:
        reset_peak_memory(self.eng)
        outs = run_once(self.eng, self.cfg, self.image, self.audio, n, seed=0, prompts=prompts)
        lr = self.eng.last_run
        res = summarize(outs, self.cfg, self.deadline_ms, self.skip, ttff_ms=lr.ttff_ms, lead_ms=self.lead_ms)
        peak = peak_memory_gib(self.eng)
        res["peak_mem_gib"] = peak[str(torch.device(self.eng.placement.diffusion_device))] if peak else None
        if peak and len(peak) > 1:
            res["peak_mem_gib_by_device"] = peak
        res["graphs"] = lr.graphs
        return outs, res

    def steady(self, n: int) -> tuple[list, dict]:
        """The steady stream: one prompt throughout; a clip stream's phases timed (``split``:
        ``cadence.bench.pipeline_clips.split_summary``) and added to each chunk's ``per_chunk`` entry."""
        from cadence.bench.pipeline_clips import attach_split, detach_split, split_summary

        split = attach_split(self.eng)
        try:
            outs, res = self.stream(n)
        finally:
            detach_split(self.eng)
        if split is not None:
            self.clips = split.take()
            self.split = split_summary(self.clips, outs, self.skip)
        lr = self.eng.last_run
        first = lr.first_chunk or {}
        res.update(session=lr.session, open_ms=lr.open_ms, first_chunk_step=first.get("step"))
        return outs, res

    def shape_changes(self, n: int, k: int) -> tuple[list, dict, int]:
        """The conditioning length cycling every ``k`` chunks (the graph runner's fallback, LRU and recapture
        bounds). Returns (chunks, summary, number of length changes)."""
        L = self.cfg.model.text_len
        lengths = [L, max(1, L // 2), max(1, (3 * L) // 4), max(1, L // 4), L]
        tg = torch.Generator().manual_seed(1)
        embs = {x: torch.randn(x, self.cfg.model.text_dim, generator=tg) for x in set(lengths)}
        prompts = {i: embs[lengths[(i // k) % len(lengths)]] for i in range(k, n, k)}
        changes = sum(
            1 for i in prompts if lengths[(i // k) % len(lengths)] != lengths[(i // k - 1) % len(lengths)]
        )
        outs, sc = self.stream(n, prompts)
        # recovery: diffusion time in the last chunk before each change vs the steady run's median
        before = [outs[i - 1].timings.diffusion_ms for i in prompts if i - 1 >= self.skip]
        sc["diffusion_ms_before_change_p50"] = median(before) if before else None
        sc["every"] = k
        sc["lengths"] = lengths
        return outs, sc, changes

    def prompt_switches(self, n: int, k: int, rule) -> tuple[list, dict]:
        """A new prompt of the same conditioning length (a new random embedding of ``text_len`` tokens) every
        ``k`` chunks: no step changes shape, so what a switch costs is the family's rule alone (``rule``:
        ``Swap`` takes the new cross-attention K/V; LongLive's ``Recache`` first recomputes the recent chunks'
        K/V). ``switch_latency_p50_ms`` (the steady chunks a switch lands on) against ``other_latency_p50_ms``
        (the steady chunks between), ``switch_extra_ms`` their difference."""
        tg = torch.Generator().manual_seed(2)
        m = self.cfg.model
        prompts = {i: torch.randn(m.text_len, m.text_dim, generator=tg) for i in range(k, n, k)}
        outs, ps = self.stream(n, prompts)
        steady = outs[self.skip :]
        at = [o.timings for o in steady if o.index in prompts]
        others = [o.timings.latency_ms for o in steady if o.index not in prompts]
        ps.update(
            every=k, switches=len(prompts), length=m.text_len, rule=repr(rule), switch_chunks=sorted(prompts)
        )
        ps["switch_latency_p50_ms"] = median([t.latency_ms for t in at]) if at else None
        ps["switch_diffusion_p50_ms"] = median([t.diffusion_ms for t in at]) if at else None
        ps["other_latency_p50_ms"] = median(others) if others else None
        ps["switch_extra_ms"] = (
            ps["switch_latency_p50_ms"] - ps["other_latency_p50_ms"] if at and others else None
        )
        return outs, ps


def _rows(res: dict, eng, info, recipe, lead_ms: float, lead_from: str, warm) -> list[tuple[str, str]]:
    """The printed table."""
    rows = [
        ("placement", eng.placement.describe()),
        ("decoder", f"{recipe.config.vae.decoder}, fast path {eng.applied.get('decoder_fast')}"),
        ("fps (sustained)", f"{res['fps']:.1f} (throughput)"),
        (
            "latency p50 / p99 / max",
            f"{res['latency_p50_ms']:.1f} / {res['latency_p99_ms']:.1f} / {res['latency_max_ms']:.1f} ms "
            f"(diffusion start -> frames on host; {res['steady_chunks']} steady chunks)",
        ),
        (
            "deadline misses",
            f"{res['deadline_misses']} of {res['chunks']} ({100 * res['deadline_miss_rate']:.1f}%) at lead "
            f"{lead_ms:.0f} ms ({lead_from}); worst {res['worst_lateness_ms']:+.1f} ms vs playout",
        ),
        (
            "ttff",
            f"{res['ttff_ms']:.1f} ms ({'after prewarm, session ' + str(res['session']) if warm else 'cold'}; "
            f"open {res['open_ms']:.1f} ms, first chunk diffusion {res['first_chunk_diffusion_ms']:.1f} ms); "
            f"cold {res['ttff_cold_ms']:.1f} ms",
        ),
        (
            "ttff, same image again",
            f"{res['ttff_repeat_ms']:.1f} ms (open {res['open_repeat_ms']:.1f} ms: the reference latent is remembered)",
        ),
        (
            "diffusion / decode / host copy",
            f"{res['diffusion_ms']:.1f} / {res['decode_ms']:.1f} / {res['host_copy_ms']:.2f} ms",
        ),
        *([split_row(res["clip_split_ms"])] if "clip_split_ms" in res else []),
        *[_fast_row(res, k) for k in ("clip_attention", "clip_encode") if res.get(k)],
        ("graphs", str(res["graphs"])),
        (
            "peak GPU memory",
            f"{res['peak_mem_gib']:.2f} GiB (over the stream)"
            if res["peak_mem_gib"] is not None
            else "n/a (CPU)",
        ),
    ]
    if "shape_change_run" in res:
        sc = res["shape_change_run"]
        rows.append(
            (
                "shape-change run",
                f"{res['shape_changes']} changes: fps {sc['fps']:.1f}, latency p99 "
                f"{sc['latency_p99_ms']:.1f} ms, deadline miss {100 * sc['deadline_miss_rate']:.1f}%, "
                f"graphs {sc['graphs']}",
            )
        )
    if "prompt_switch_run" in res:
        ps = res["prompt_switch_run"]
        extra = ps["switch_extra_ms"]
        rows.append(
            (
                "prompt-switch run",
                f"{ps['switches']} switches ({ps['rule']}): latency p50 at a switch "
                f"{_ms(ps['switch_latency_p50_ms'])} vs {_ms(ps['other_latency_p50_ms'])} between"
                + (f" ({extra:+.1f} ms)" if extra is not None else "")
                + f", fps {ps['fps']:.1f}, deadline miss {100 * ps['deadline_miss_rate']:.1f}%",
            )
        )
    if info is not None:
        rows.insert(
            1,
            (
                "tensor parallel",
                f"{info.world_size} ranks, comm {recipe.fast.comm}; every rank decodes on a side stream of its GPU",
            ),
        )
    return rows


def _fast_row(res: dict, key: str) -> tuple[str, str]:
    """The printed row of a clip candidate's record (``--clip-attention``, ``--clip-encode``)."""
    r = res[key]
    how = r.get("note", "as built") if r["applied"] else f"not applied, {r.get('why')}"
    return key.replace("_", " "), f"{r['name']}: {how}"


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


def _record(args, info, recipe, eng, cfg, device, res, runs, deadline_ms: float, lead_ms: float) -> None:
    """The JSON record (docs/benchmarks.md bench "pipeline", with the recipe) and the timeline PNG."""
    fast, stream = recipe.fast, cfg.stream
    decoder = cfg.vae.decoder
    variant = "-".join(
        v
        for v in (
            "graphs" if eng.cfg.graphs else "eager",
            f"dec{eng.placement.decode_device.replace(':', '')}",
            stream.cache,
            "kvfp8" if stream.kv_fp8 else "",
            decoder,
            f"dec{fast.decoder_fast}"
            if decoder == "wan" and fast.decoder_fast not in ("off", "compile")
            else "",
            "fp8" if fast.fp8_linears else "",
            "compile" if fast.compile else "",
            "capfill" if fast.capture_filling else "",
            f"attn{args.clip_attention}" if args.clip_attention != "reference" else "",
            "enccompile" if args.clip_encode == "compile" else "",
            f"w{args.window}" if args.window else "",
            "" if recipe.warmup else "noprewarm",
            f"l{args.layers}" if args.layers else "",
            f"{stream.height}x{stream.width}" if args.height or args.width else "",
        )
        if v
    )
    world = len({eng.placement.diffusion_device, eng.placement.decode_device} - {"cpu"}) or 1
    if info is not None:
        world = info.world_size if device.type == "cuda" else 1
        variant += f"-{fast.comm}"
    path = record(
        "pipeline",
        cfg.name,
        recipe.tp,
        device,
        cfg.shape_summary(),
        res,
        variant=variant,
        out_dir=results_dir(args),
        world=world,
        extra={
            "placement": eng.placement.describe(),
            "dtype": fast.dtype,
            "decoder": decoder,
            "layers": cfg.model.num_layers,
            "recipe": recipe.describe().as_dict(),
        },
        headline=f"{res['fps']:.1f} fps, latency p50 {res['latency_p50_ms']:.1f} / p99 "
        f"{res['latency_p99_ms']:.1f} ms, diffusion {res['diffusion_ms']:.1f} / decode {res['decode_ms']:.1f} ms, "
        f"miss {res['deadline_misses']}/{res['chunks']} at lead {lead_ms:.0f} ms, ttff {res['ttff_ms']:.0f} ms "
        f"(cold {res['ttff_cold_ms']:.0f})",
    )
    png = path.with_suffix(".png")
    if draw_timeline(png, runs, deadline_ms):
        print(f"wrote {path} and {png.name}")
    else:
        print(f"wrote {path} (no matplotlib: no PNG)")
