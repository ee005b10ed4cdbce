"""The engine's warm-up and what it measures: :func:`warm_up` (``Engine.warm_up`` runs it) -> :class:`WarmupReport`.

Throwaway streams before any user: every step shape (the sink pass, the first chunk, each ring-filling step,
the steady step's warm-up, capture and replay) and the decoder run once, so Triton compiles and autotuning,
cuDNN/cuBLAS plan selection, lazy library state and the graph captures are paid here; the kept session
(``PipelineConfig.reuse_session``) and its graphs then serve every user.

What a server needs is measured on the way (``cadence.serve`` sizes its planning lead with it):

* ``steady_chunk_ms``: the latency of one chunk when chunks come one at a time (a paced stream run until the
  window is full, its last two chunks: a query's attention grows while the window fills, so earlier chunks
  are faster than steady ones; measured figures in docs/perf/pipeline/NOTES.md);
* ``interval_ms``: the sustained time per chunk back to back (decode overlapped with the next diffusion; real
  time needs it below ``media_chunk_ms``);
* ``slowest_chunk_ms`` over what a user's stream runs (captures left out). A stream with chunks slower than
  their media runs once more, to tell one-time work (a kernel compiled on first use: docs/perf/serve/NOTES.md)
  from chunks slow in every stream; only the latter are a note.

On the CPU with ``threads=0`` and more than two cores it times 1 and 2 intra-op threads and keeps the faster
sustained rate; on two cores (or in a tensor-parallel group, whose ranks are processes sharing the cores)
each thread of the engine takes one (two each oversubscribe the cores: docs/perf/serve/NOTES.md); ``threads``
> 0 keeps that count; the GPU leaves torch's default. Under tensor parallelism every rank runs the same
streams (``decode=False`` on followers: steps only) and agrees on the branches (one tiny all-reduce).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from cadence.engine.messages import ChunkTimings
from cadence.engine.reports import Report
from cadence.runtime.graphs import filling_shares_steady_graph

startup_log = logging.getLogger("cadence.startup")


@dataclass
class WarmupReport(Report):
    """What a warm-up ran and measured (times in ms), read by attribute; ``as_dict()`` is what travels (the
    worker's ready info, JSON records: ``cadence.engine.reports``)."""

    OPTIONAL = ("thread_trials", "first_stream_chunk_ms")

    media_chunk_ms: float
    """One chunk of media (the deadline)."""
    chunks: int
    """Chunks of each throwaway stream."""
    fill_streams: int = 0
    """Streams that ran the ring-filling stages (2 with ``capture_filling``: warm-up, then capture)."""
    first_stream_ttff_ms: float | None = None
    """The process's first time to first frame (the first stream's)."""
    threads: int = 0
    """torch intra-op threads kept."""
    interval_ms: float | None = None
    """Sustained time per chunk, back to back."""
    repeat_stream: bool = False
    """Whether one more stream ran to tell one-time work from slow chunks."""
    steady_chunk_ms: float | None = None
    """One chunk's latency when chunks come one at a time, window full."""
    slowest_chunk_ms: float | None = None
    ms: float = 0.0
    """The whole warm-up."""
    streams: int = 0
    """Throwaway streams run."""
    chunk_ms: list[float] = field(default_factory=list)
    """Per chunk of the last measured stream: the worker's time."""
    steps: list[str] = field(default_factory=list)
    """Per chunk of that stream: what the graph runner did."""
    diffusion_ms: float | None = None
    decode_ms: float | None = None
    graphs: dict = field(default_factory=dict)
    """The graph runner's counts (``GraphStats``)."""
    notes: list[str] = field(default_factory=list)
    """The engine's notes so far (the warm-up's own included)."""
    thread_trials: dict | None = None
    """CPU: the sustained interval per thread count tried."""
    first_stream_chunk_ms: list[float] | None = None
    """With ``repeat_stream``: the first stream's per-chunk times."""


@torch.no_grad()
def warm_up(eng, image: torch.Tensor | None, chunks: int, decode: bool, threads: int | None) -> WarmupReport:
    """Run ``eng``'s throwaway streams and measure them (see the module docstring)."""
    cfg = eng.gen.cfg
    n = chunks or eng.warm_chunks()
    if image is None:
        g = torch.Generator().manual_seed(12345)
        image = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    g = torch.Generator().manual_seed(6789)
    audio = 0.1 * torch.randn(max(n, 6) * cfg.audio_samples_per_chunk, generator=g)
    media_ms = cfg.chunk_seconds * 1e3
    t_start = time.monotonic()
    rep = WarmupReport(media_chunk_ms=round(media_ms, 1), chunks=n)
    runs = [0]

    def run(k: int, pace: bool) -> list[ChunkTimings]:
        runs[0] += 1
        if decode:
            out = [r.timings for r in eng.stream(image, "warm-up", audio, k, seed=0, pace=pace)]
        else:
            out = _steps_only(eng, image, audio, k)
        # each phase said as it ends (the first stream is where kernels compile: minutes on a cold GPU)
        startup_log.info(
            "warm-up: stream %d (%d chunks) done at %.1f s", runs[0], k, time.monotonic() - t_start
        )
        return out

    # the thread count first when nothing needs timing, so that every stream below runs (and measures, and
    # creates its per-thread-count kernels at) the count users get (docs/perf/soak/NOTES.md: the sustained
    # interval was once measured at 2 threads for a worker that then served at 1)
    trial = _fixed_threads(eng, threads, rep)
    per, ran = _fill_streams(eng, run, n, rep, decode)
    steady = _thread_trial(run, n, rep) if trial else None
    # the sustained interval, as a user's stream will run: the thread trial's, the first stream's when it
    # ran nothing but user steps (the CPU: no captures), else one more stream
    if (
        steady is None
        and rep.threads == torch.get_num_threads()
        and len(per) >= 3
        and not any(t.step == "capture" or t.step.startswith("eager:warmup") for t in per)
    ):
        steady = per
    if steady is None:
        steady = run(max(n, 4), pace=False)
    rep.interval_ms = _r(_interval_ms(steady))
    per, user = _repeat_if_slow(eng, run, n, per, ran, media_ms, rep)
    # the latency of one chunk when chunks come one at a time, once the window is full (chunk 0, which opens
    # the stream, never counts)
    fill = eng.gen.rules.stream.fill_chunks(cfg.stream.window_chunks)
    paced = run(fill + 2, pace=True)
    lat = [t.work_ms for t in paced[max(1, fill) :]] or [t.work_ms for t in paced]
    rep.steady_chunk_ms = _r(statistics.median(lat))
    rep.slowest_chunk_ms = _r(max(t.work_ms for _, t in user))
    _slow_notes(eng, user, media_ms, rep)
    rep.ms = _r((time.monotonic() - t_start) * 1e3)
    rep.streams = runs[0]
    rep.chunk_ms = [round(t.work_ms, 1) for t in per]
    rep.steps = [t.step for t in per]
    rep.diffusion_ms = _r(statistics.median(t.diffusion_ms for t in steady))
    rep.decode_ms = _r(statistics.median(t.decode_ms for t in steady))
    rep.graphs = dataclasses.asdict(eng.runner.stats)
    rep.notes = list(eng.notes)
    return rep


def _fill_streams(eng, run, n: int, rep: WarmupReport, decode: bool) -> tuple[list[ChunkTimings], int]:
    """The first stream(s): every fill stage occurs once per stream, so with ``capture_filling`` (and a kept
    session) the stages need ``graph_warmup`` eager streams, then one that captures them."""
    streams = 1 + (eng.cfg.graph_warmup if eng.runner.capture_filling and eng.cfg.reuse_session else 0)
    per: list[ChunkTimings] = []
    ran = 0
    for k in range(streams):
        if k and filling_shares_steady_graph(eng.session):
            break  # nothing more to capture
        per = run(n, pace=False)
        ran += 1
        rep.fill_streams = ran
        if k == 0:
            rep.first_stream_ttff_ms = _r(eng.last_run.ttff_ms) if decode else None
    return per, ran


def _fixed_threads(eng, threads: int | None, rep: WarmupReport) -> bool:
    """Set the CPU's intra-op thread count where it needs no timing (see the module docstring): ``threads`` >
    0, a tensor-parallel rank or a machine of two cores (1). Returns whether a timed trial must choose."""
    rep.threads = torch.get_num_threads()
    if eng.cuda:
        return False
    if threads:
        torch.set_num_threads(threads)
        rep.threads = threads
        return False
    if eng.tp is not None or (os.cpu_count() or 1) <= 2:
        # TP ranks are processes sharing the cores; on two cores the diffusion and the decode thread take one
        # each (2 intra-op threads each oversubscribe the cores: docs/perf/serve/NOTES.md, session 7)
        torch.set_num_threads(1)
        rep.threads = 1
        return False
    return True


def _thread_trial(run, n: int, rep: WarmupReport) -> list[ChunkTimings]:
    """CPU with more than two cores: time 1 and 2 intra-op threads back to back, keep the faster sustained
    interval; returns the winner's timings."""
    trials: dict[str, float] = {}
    timings: dict[str, list[ChunkTimings]] = {}
    for k in (1, 2):
        torch.set_num_threads(k)
        run(2, pace=False)  # settle (thread pool start, caches)
        timings[str(k)] = run(max(n, 6), pace=False)
        trials[str(k)] = _r(_interval_ms(timings[str(k)]))
    best = min(trials, key=lambda k: trials[k])
    torch.set_num_threads(int(best))
    rep.threads, rep.thread_trials = int(best), trials
    return timings[best]


def _repeat_if_slow(eng, run, n: int, per, ran: int, media_ms: float, rep: WarmupReport):
    """One more stream when the first had chunks slower than their media (every rank agrees): a chunk slow
    only once was one-time work (a note says so). Returns (the stream measured, its user chunks)."""
    first = 0 if ran > 1 else 1  # a lone stream's chunk 0 is the cold one
    user = [(i, t) for i, t in enumerate(per) if i >= first and t.step != "capture"] or list(enumerate(per))
    slow = [i for i, t in user if t.work_ms > media_ms]
    if not (ran == 1 and _any_rank(eng, bool(slow))):
        return per, user
    once = per
    per = run(n, pace=False)
    rep.repeat_stream = True
    rep.first_stream_chunk_ms = [round(t.work_ms, 1) for t in once]
    gone = [i for i in slow if per[i].work_ms <= media_ms]
    if gone:
        eng._note(
            f"warm-up: chunk(s) {gone} took up to {max(once[i].work_ms for i in gone):.0f} ms in "
            f"the first stream only (one-time work); {max(per[i].work_ms for i in gone):.0f} ms in the next"
        )
    return per, [(i, t) for i, t in enumerate(per) if t.step != "capture"] or list(enumerate(per))


def _slow_notes(eng, user, media_ms: float, rep: WarmupReport) -> None:
    late = [t for _, t in user if t.work_ms > media_ms]
    if late:
        filling = any(t.step == "eager:ring_filling" for t in late)
        eng._note(
            f"warm-up: {len(late)} chunk(s) of a stream take up to {rep.slowest_chunk_ms:.0f} ms, longer than a "
            f"chunk's {media_ms:.0f} ms of media: expect underruns there in every stream"
            + (" (eager ring-filling steps: --capture-filling captures them)" if filling else "")
        )
    if rep.interval_ms is not None and rep.interval_ms > media_ms:
        eng._note(
            f"warm-up: this {'GPU' if eng.cuda else 'CPU'} sustains one chunk per {rep.interval_ms:.0f} ms, "
            f"slower than the {media_ms:.0f} ms of media each chunk holds: streams will show fewer fresh "
            "frames per second (audio stays whole)"
        )


def _steps_only(eng, image: torch.Tensor, audio: torch.Tensor, n: int) -> list[ChunkTimings]:
    """A follower rank's warm-up stream: the same steps, no decode."""
    spc = eng.samples_per_chunk
    eng.open(image, "warm-up", 0, decode=False)
    out = []
    try:
        for i in range(n):
            t = time.monotonic()
            eng.submit(i, audio[i * spc : (i + 1) * spc], decode=False)
            done = time.monotonic()
            out.append(
                ChunkTimings(
                    work_ms=(done - t) * 1e3, t_plan=t, t_recv=t, t_done=done, step=eng.runner.last or "eager"
                )
            )
    finally:
        eng.end_stream()
    return out


def _any_rank(eng, flag: bool) -> bool:
    """``flag`` on this rank or, in a tensor-parallel group, on any rank (one tiny all-reduce), so that every
    rank takes the same branch of a start-up step that runs collectives."""
    if eng.tp is None:
        return flag
    from cadence.parallel.graphs import all_ranks_ok

    return not all_ranks_ok(not flag, group=eng.tp.group)


def _interval_ms(timings: list[ChunkTimings]) -> float | None:
    """Sustained ms per chunk of a back-to-back stream: between the first and the last chunk's frames being
    ready, leaving out the first chunk (it decodes alone) when there are enough."""
    t = timings[1:] if len(timings) >= 3 else timings
    if len(t) < 2:
        return t[0].work_ms if t else None
    return (t[-1].t_done - t[0].t_done) * 1e3 / (len(t) - 1)


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)
