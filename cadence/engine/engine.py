"""The engine: one stream at a time, chunk k decoding while chunk k+1 diffuses. Every caller drives it.

    eng = build_engine(get_preset("character"), "cpu")       # cadence.engine.build: model + fast paths
    eng.warm_up()                                           # every step shape once, before any user
    eng.open(image, "a person talking", seed=0)
    eng.submit(0, audio_window)                             # chunk 0's diffusion, now, in this thread
    for r in eng.collect(block=True):                       # decoded chunks, in order
        show(r.frames)                                      # uint8 [T, H, W, 3]
    eng.end_stream()

    for r in eng.stream(image, prompt, audio, num_chunks=200):  # the same loop as a generator
        writer.write(r.frames)

``cadence serve``'s worker processes (:mod:`cadence.engine.worker`), ``cadence bench pipeline``,
``cadence generate`` and ``cadence eval`` all run this class: the step + decode loop exists here only.

Who runs what:

* **Diffusion** (``Session.step``, through a :class:`~cadence.runtime.graphs.GraphRunner` that replays
  CUDA graphs in steady state) runs in the caller's thread, on the caller's current stream of the
  diffusion device. After each step a CUDA event is recorded and the latent goes into a bounded queue
  (``PipelineConfig.queue_depth``): when decode falls behind, ``submit`` blocks instead of running ahead
  without limit. On CUDA the next chunk's step is launched once the device has finished all but
  ``steps_in_flight - 1`` earlier steps, so a chunk's latency is its own work, not time queued behind
  earlier launches.
* **Decode** runs in one thread per stream (``PipelineConfig.overlap``; off: right after each step in the
  caller's thread, the serial reference). On CUDA it has its own stream on the decode device (a separate
  GPU, or the diffusion GPU when the placement says 'same'); that stream waits on the step's event (no
  host sync between the stages), the latent is copied to the decode device non-blocking when it differs
  (issued from a hand-off stream on the diffusion device, so the copy never queues behind the next
  chunk's diffusion), the session's streaming decoder turns it into uint8 frames. On the CPU the two
  threads overlap through torch's GIL-free kernels (each at ``torch.get_num_threads()`` intra-op threads).
* **Frames** land in the caller's buffer when ``submit(out=...)`` gives one (the server's shared-memory
  slot, a writer's array), else in one of ``host_buffers`` pinned host buffers (CUDA; lent until the next
  ``collect``) or a new tensor (CPU).
* **Delivery**: ``collect()`` returns finished chunks in order; or ``on_chunk`` (a callback) receives each
  one on the decode thread as soon as it is ready (the worker process answers from there, while its main
  thread already waits for the next request).

Sessions: with ``PipelineConfig.reuse_session`` (the default) one :class:`~cadence.engine.session.Session`
object serves every stream, reset in place (same cache buffers), so the CUDA graphs captured once (in
``warm_up``) replay for every later user. ``preopen`` opens the next stream ahead (the reference image's
latent, the prompt's K/V, the sink pass); an ``open`` with the same key and prompt then only re-seeds it.
``warm_up`` runs throwaway streams through every step shape (ring filling, graph warm-up, capture,
replay) and the decoder, measures the chunk latency and the sustained chunk interval, and on the CPU
picks the intra-op thread count that sustains the faster rate.

Errors: an error in the decode thread is re-raised by the next ``submit`` / ``collect`` (or, with
``on_chunk``, delivered as a result with ``error`` set). Shutdown: ``end_stream`` stops and joins the
decode thread (queued work is dropped); ``close`` also frees the kept session, its graphs and buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cadence.config import PipelineConfig, Placement, resolve_placement
from cadence.engine.messages import ChunkTimings
from cadence.engine.reports import StreamReport
from cadence.engine.session import StreamGenerator, StreamSession
from cadence.errors import InputError
from cadence.runtime.graphs import GraphRunner

if TYPE_CHECKING:
    from cadence.engine.warmup import WarmupReport

log = logging.getLogger("cadence.engine")

_POLL_S = 0.05  # how often blocked queue operations look at the other side's health


def process_rss_mb() -> float | None:
    """This process's resident set size in MB (Linux ``/proc/self/statm``: one small read, ~10 us),
    or None where there is no /proc."""
    import os

    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class ChunkResult:
    """A finished chunk. ``frames`` uint8 [T, H, W, 3] in host memory (a pinned buffer of the engine's ring
    on CUDA, valid until the next ``collect``: clone it to keep it), or None when they were written into
    the caller's ``out``; ``latents`` [C, F, h, w] on the diffusion device; ``tag`` is what the caller
    passed to ``submit``; ``error`` is set (and frames None) when the chunk's decode failed (``on_chunk``
    delivery only: ``collect`` raises instead)."""

    index: int
    frames: torch.Tensor | None
    latents: torch.Tensor | None
    timings: ChunkTimings
    tag: object = None
    error: str | None = None
    buffer: int | None = None  # the pinned ring slot holding ``frames`` (returned at the next collect)
    audio: torch.Tensor | None = (
        None  # the chunk's audio window (``stream`` fills it in: the caller's samples)
    )


@dataclass
class _Job:
    index: int
    latents: torch.Tensor
    t_plan: float
    t_recv: float
    ready_event: object | None  # CUDA event recorded after the step (None on CPU)
    diff_events: tuple | None  # CUDA (start, end) events around the step
    diffusion_ms: float  # host clock (CPU) or -1 until read from the events
    step: str
    out: torch.Tensor | None  # the caller's host buffer for the frames, or None
    tag: object
    pixels: torch.Tensor | None = None  # the step's own frames (a session that ``yields_pixels``): no decode


class _Stop:
    pass


_STOP = _Stop()


def shorten_switch_interval(ms: float) -> bool:
    """Lower Python's thread switch interval to ``ms`` (``PipelineConfig.gil_switch_ms``; never raise it,
    0: leave it) with one log line the first time. Process-wide and kept: a CUDA stream's decode thread
    can hold the GIL in a launch that waits for room in the device's queue, and the diffusion thread then
    waits up to the interval to launch its next step. Returns whether it changed the interval."""
    if ms <= 0 or sys.getswitchinterval() <= ms / 1e3:
        return False
    old = sys.getswitchinterval()
    sys.setswitchinterval(ms / 1e3)
    log.info(
        "engine: thread switch interval %.2f -> %.2f ms (the diffusion thread's launches wait at most this "
        "for a decode thread holding the GIL)",
        old * 1e3,
        ms,
    )
    return True


class DecodeWorker:
    """The engine's decode thread, kept across its streams: each stream's decode stage
    (``_Decoder._main``) runs on it in turn. One thread per engine, not one per stream, because state
    PyTorch keeps per thread is worth keeping: cuDNN's execution plans (a thread-local cache; with
    ``cudnn.benchmark`` a new thread timed every conv shape again at the start of every stream: measured in
    docs/perf/pipeline/NOTES.md) and the thread's CUDA device. The thread holds no reference to the engine;
    ``Engine.close`` (or the engine's garbage collection) ends it."""

    def __init__(self, name: str = "cadence-decode"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=DecodeWorker._loop, args=(self._calls,), name=name, daemon=True)
        self.thread.start()

    @staticmethod
    def _loop(calls: queue.SimpleQueue) -> None:
        while True:
            fn = calls.get()
            if fn is None:
                return
            fn()  # _Decoder._main: captures its own errors
            del fn  # drop the stream's decoder (and its session) while idle

    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, fn: Callable[[], None]) -> None:
        if not self.thread.is_alive():
            raise RuntimeError("the decode worker is closed")
        self._calls.put(fn)

    def close(self, timeout: float = 30.0) -> None:
        """End the thread once the call running now returns (the stream's decoder must be stopped first)."""
        self._calls.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)


class _Decoder:
    """A stream's decode stage: on the engine's decode thread (``worker``) or inline in the caller's
    thread (None). Latents in (bounded queue), results out in order (a queue, or the ``deliver``
    callback), errors captured."""

    def __init__(
        self,
        session: StreamSession,
        placement: Placement,
        cfg: PipelineConfig,
        buffers: list[torch.Tensor],
        deliver: Callable[[ChunkResult], None] | None,
        memory: Callable[[], dict],
        worker: DecodeWorker | None,
    ):
        self.sess, self.placement, self.cfg = session, placement, cfg
        self.deliver_cb, self.memory, self.worker = deliver, memory, worker
        self.done = threading.Event()  # set when this stream's decode stage has returned on the worker
        self.inq: queue.Queue = queue.Queue(maxsize=cfg.queue_depth)
        self.outq: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.delivered = 0
        self.first = threading.Event()  # set once the first chunk is delivered
        self.diff_dev = torch.device(placement.diffusion_device)
        self.dec_dev = torch.device(placement.decode_device)
        self.dec_cuda = self.dec_dev.type == "cuda"
        self.diff_cuda = self.diff_dev.type == "cuda"
        self.buffers = buffers  # the pinned ring (CUDA decode, no caller buffer)
        self.free: queue.Queue = queue.Queue()
        for i in range(len(buffers)):
            self.free.put(i)
        # the session is open (sink latent computed on the diffusion device's current stream): the
        # decoder's priming, issued from the decode side on its own streams, waits for this
        self.opened: torch.cuda.Event | None = None
        if self.diff_cuda:
            self.opened = torch.cuda.Event()
            self.opened.record(torch.cuda.current_stream(self.diff_dev))
        self.dec_stream = self.handoff = None
        if worker is None:
            self._setup()

    # ---- caller side ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.worker is not None:
            if self.diff_cuda:
                shorten_switch_interval(self.cfg.gil_switch_ms)
            self.worker.submit(self._main)

    def running(self) -> bool:
        """Whether this stream's decode stage is still on its thread (queued or running)."""
        return not self.done.is_set() and self.worker.alive()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, job: _Job) -> None:
        """Hand a latent to the decoder; blocks while ``queue_depth`` chunks are in flight (threaded), or
        decodes it now (inline)."""
        if self.worker is None:
            self._emit(self._decode(job))
            return
        while True:
            self.raise_if_failed()
            if not self.running():
                raise RuntimeError("the decode thread stopped unexpectedly")
            try:
                self.inq.put(job, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def get(self, block: bool) -> ChunkResult | None:
        """The next decoded chunk (None when none is ready and not blocking, or the stream ended). Chunks
        decoded before a failure come out first; then the failure is raised."""
        while True:
            try:
                item = self.outq.get_nowait()
            except queue.Empty:
                item = None
            if item is None:
                self.raise_if_failed()
            try:
                if item is None:
                    item = self.outq.get(timeout=_POLL_S) if block else self.outq.get_nowait()
            except queue.Empty:
                if not block:
                    return None
                if self.worker is None or (not self.running() and self.outq.empty()):
                    self.raise_if_failed()
                    return None
                continue
            if item is _STOP:
                return None
            return item

    def release(self, buffer: int | None) -> None:
        if buffer is not None:
            self.free.put(buffer)

    def wait_first(self) -> None:
        """Block until the first chunk is delivered (or the decoder failed / stopped)."""
        while not self.first.wait(_POLL_S):
            self.raise_if_failed()
            if self.worker is not None and not self.running():
                self.raise_if_failed()
                return

    def close(self, timeout: float = 30.0) -> list[object]:
        """Stop and join the thread, dropping queued work; returns the tags of the chunks dropped undecoded.
        Safe to call more than once."""
        self.stop.set()
        dropped: list[object] = []
        while True:  # unblock a worker waiting for input
            try:
                job = self.inq.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Job):
                dropped.append(job.tag)
        try:
            self.inq.put_nowait(_STOP)
        except queue.Full:
            pass
        if self.worker is not None and self.worker.thread is not threading.current_thread():
            if not self.done.wait(timeout) and self.worker.alive():  # pragma: no cover - a hung decode call
                raise RuntimeError(f"the decode thread did not stop within {timeout} s")
        return dropped

    # ---- decode side ----------------------------------------------------------------------------
    def _setup(self) -> None:
        """The decode side's streams, and the decoder primed with the sink latent (before the first chunk
        comes: the first chunk's decode is on the time-to-first-frame path; the prime is not)."""
        self.dec_stream = torch.cuda.Stream(device=self.dec_dev) if self.dec_cuda else None
        if self.diff_cuda:
            # the stream on the diffusion device that waits for each step and issues the latent's hand-off
            # (the decode stream itself when decode shares that GPU)
            self.handoff = (
                self.dec_stream if self.dec_dev == self.diff_dev else torch.cuda.Stream(device=self.diff_dev)
            )
        if self.diff_cuda and self.dec_cuda:
            self.handoff.wait_event(self.opened)
            with torch.cuda.stream(self.handoff), torch.cuda.stream(self.dec_stream):
                self.sess.prime_decoder()
        else:  # host decode: a CUDA sink latent's copy to the host orders itself after the open
            self.sess.prime_decoder()

    def _main(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                if self.dec_cuda:
                    torch.cuda.set_device(self.dec_dev)
                self._setup()
                while True:
                    job = self._take(self.inq)
                    if job is _STOP:
                        return
                    res = self._decode(job)
                    if res is None:  # stopping
                        return
                    self._emit(res)
        except BaseException as e:
            self.error = e
            self.first.set()
        finally:
            self.outq.put(_STOP)
            self.done.set()

    def _take(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return _STOP

    def _emit(self, res: ChunkResult) -> None:
        self.delivered += 1
        if self.deliver_cb is not None:  # the frames are valid during the callback only
            try:
                self.deliver_cb(res)
            finally:
                self.release(res.buffer)
        else:
            self.outq.put(res)
        self.first.set()

    def _decode(self, job: _Job) -> ChunkResult | None:
        try:
            return self._decode_job(job)
        except Exception as e:
            if self.deliver_cb is None:
                raise
            log.exception("decode of chunk %d failed", job.index)
            return ChunkResult(
                job.index,
                None,
                job.latents,
                self._timings(job, 0.0, 0.0, time.monotonic()),
                job.tag,
                error=f"{type(e).__name__}: {e}",
            )

    def _timings(self, job: _Job, decode_ms: float, copy_ms: float, t_done: float) -> ChunkTimings:
        return ChunkTimings(
            diffusion_ms=job.diffusion_ms,
            decode_ms=decode_ms,
            host_copy_ms=copy_ms,
            work_ms=(t_done - job.t_recv) * 1e3,
            t_plan=job.t_plan,
            t_recv=job.t_recv,
            t_done=t_done,
            step=job.step,
            memory=self.memory(),
        )

    def _decode_job(self, job: _Job) -> ChunkResult | None:
        # a session whose step yields pixels (a clip-based family) hands over finished frames: they are only
        # moved to the decode device and copied to the host here (``decode`` is the identity then)
        lat = job.latents if job.pixels is None else job.pixels
        if self.diff_cuda and self.dec_cuda:
            self.handoff.wait_event(job.ready_event)
            lat.record_stream(self.handoff)  # the caller drops it: keep the allocator off it until used
            slot = None
            with torch.cuda.stream(self.handoff), torch.cuda.stream(self.dec_stream):
                lat = lat.to(self.dec_dev, non_blocking=True)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record(self.dec_stream)
                frames = lat if job.pixels is not None else self.sess.decode(lat)
                ev[1].record(self.dec_stream)
                if job.out is not None:  # the caller's (pageable) buffer: a synchronous copy
                    job.out.copy_(frames)
                    buf = None
                else:
                    slot = self._take(self.free)
                    if slot is _STOP:
                        return None
                    buf = self.buffers[slot]
                    buf.copy_(frames, non_blocking=True)
                ev[2].record(self.dec_stream)
            ev[2].synchronize()
            t_done = time.monotonic()
            d0, d1 = job.diff_events
            job.diffusion_ms = d0.elapsed_time(d1)
            tm = self._timings(job, ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]), t_done)
            return ChunkResult(job.index, buf, job.latents, tm, job.tag, buffer=slot)
        # host decode (the CPU everywhere, or CUDA diffusion with decode on the CPU)
        if self.diff_cuda:
            job.ready_event.synchronize()
            d0, d1 = job.diff_events
            job.diffusion_ms = d0.elapsed_time(d1)
            lat = lat.to("cpu")
        t0 = time.monotonic()
        frames = lat if job.pixels is not None else self.sess.decode(lat)
        t1 = time.monotonic()
        if frames.device.type != "cpu":  # pragma: no cover - a decoder that answers on a device
            frames = frames.cpu()
        if job.out is not None:
            job.out.copy_(frames)
            frames = None
        t2 = time.monotonic()
        return ChunkResult(
            job.index, frames, job.latents, self._timings(job, (t1 - t0) * 1e3, (t2 - t1) * 1e3, t2), job.tag
        )


@dataclass
class StreamState:
    """The running stream's bookkeeping (one per ``open``)."""

    t_open: float  # monotonic time of the open call
    open_ms: float
    how: str  # "new" | "reused" | "preopened"
    submitted: int = 0
    emitted: int = 0
    ttff_ms: float | None = None


class Engine:
    """The generator with its fast paths, a graph runner and (``reuse_session``) one reused session; runs
    one stream at a time: ``open`` / ``submit`` / ``collect`` / ``end_stream`` (or ``stream``), ``warm_up``,
    ``preopen``, ``close``. Build it with :func:`cadence.engine.build.build_engine`."""

    def __init__(
        self,
        gen: StreamGenerator,
        cfg: PipelineConfig | None = None,
        placement: Placement | None = None,
        graph_capture=None,
        applied: dict | None = None,
        tp=None,
        on_chunk: Callable[[ChunkResult], None] | None = None,
    ):
        """`placement` defaults to ``resolve_placement(cfg, torch.cuda.device_count())``; the generator's
        model must live on its diffusion device. `graph_capture` injects a capture function into the graph
        runner (tests; tensor-parallel groups agree on every capture). `applied` records the fast paths the
        builder applied (reported by ``describe``); `tp` is this rank's ``TPInfo`` (a tensor-parallel group)."""
        self.gen = gen
        self.cfg = cfg or PipelineConfig()
        if self.cfg.diffusion_devices == ("auto",):  # 'auto' diffuses where the built model lives
            mdev = gen.model.device
            self.cfg = dataclasses.replace(
                self.cfg,
                diffusion_devices=(
                    "cpu" if mdev.type == "cpu" else f"cuda:{mdev.index if mdev.index is not None else 0}",
                ),
            )
        ndev = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.placement = placement or resolve_placement(self.cfg, ndev)
        mdev = gen.model.device
        want = torch.device(self.placement.diffusion_device)
        if mdev.type != want.type or (want.type == "cuda" and mdev.index != want.index):
            raise InputError(
                f"the model is on {mdev} but the placement diffuses on {want}: build the generator "
                f"on {want} (or pick diffusion_devices=('{mdev}',))"
            )
        self.tp = tp
        self.recipe = None  # the EngineRecipe it was built from (cadence.engine.build sets it)
        self.applied = dict(applied or {})
        self.notes: list[str] = []
        self.on_chunk = on_chunk
        c = self.cfg
        extra = gen.cfg.stream.window_chunks if c.capture_filling else 0  # one graph per fill stage
        self.runner = GraphRunner(
            enabled=c.graphs,
            max_graphs=c.max_graphs + extra,
            warmup=c.graph_warmup,
            max_captures_per_key=c.max_captures_per_key,
            capture=graph_capture,
            capture_filling=c.capture_filling,
        )
        self.session: StreamSession | None = None  # the kept session (reuse_session), or the running stream's
        self._buffers: list[torch.Tensor] = []  # the pinned ring (kept with reuse_session)
        self._dec: _Decoder | None = None
        self._worker: DecodeWorker | None = None  # the decode thread, kept across streams (overlap)
        self._lent: list[int] = []  # pinned slots the consumer holds until its next collect
        self._in_flight: list = []  # ready events of launched steps (CUDA), oldest first
        self._ready: tuple | None = None  # (key, prompt) of the session opened ahead by preopen
        self.state: StreamState | None = None
        self.last_run: StreamReport | None = None  # the last stream's report
        self.warmup_report: WarmupReport | None = None
        self.last_open_preopened = False
        self._streaming = False

    @property
    def cuda(self) -> bool:
        return torch.device(self.placement.diffusion_device).type == "cuda"

    @property
    def frame_shape(self) -> tuple[int, int, int, int]:
        c = self.gen.cfg
        return (c.video_frames_per_chunk, c.stream.height, c.stream.width, 3)

    @property
    def samples_per_chunk(self) -> int:
        return self.gen.cfg.audio_samples_per_chunk

    def _note(self, text: str) -> None:
        self.notes.append(text)
        log.warning("engine: %s", text)

    def memory(self) -> dict:
        """The process's memory now, in MB: host RSS and, on CUDA, torch's allocation on the diffusion device
        (no sync: the caching allocator's counter). A stream that leaks shows as growth chunk after chunk."""
        mem = {"rss_mb": process_rss_mb()}
        if self.cuda:
            mem["cuda_mb"] = torch.cuda.memory_allocated(self.placement.diffusion_device) / 2**20
        return mem

    def cut_in(self) -> tuple[int, int] | None:
        """What the session kind can do for a speech cut-in (``ChunkRequest.rewind``): (the most frames a chunk
        may start before the end of the last one, the frames before that point its motion needs), or None (the
        chunk grid's K/V streams: a chunk always follows the last one)."""
        fn = getattr(self.gen.session_type, "cut_in_frames", None)
        return fn(self.gen) if fn is not None else None

    def describe(self) -> dict:
        """What this engine runs (the fast paths applied, placement, graphs, reuse)."""
        return {
            **self.applied,
            "placement": self.placement.describe(),
            "graphs": self.cfg.graphs,
            "overlap": self.cfg.overlap,
            "reuse": "session" if self.cfg.reuse_session else None,
            "threads": torch.get_num_threads(),
        }

    # ---- sessions -------------------------------------------------------------------------------------
    def _reset_or_new(self, image: torch.Tensor, prompt, seed: int) -> str:
        pl = self.placement
        if self.cfg.reuse_session and self.session is not None:
            try:
                self.session.reset(image, prompt, seed)
            except InputError:  # checked before anything is touched: the kept session stays as it was
                raise
            except BaseException:
                self._drop_session()  # a reset that failed half-way: start the next stream afresh
                raise
            return "reused"
        self._drop_session()
        self.session = self.gen.session(image, prompt, seed, decode_device=pl.decode_device)
        return "new"

    def _drop_session(self) -> None:
        self.runner.clear()  # graphs read the dropped session's cache
        self.session = None
        self._ready = None

    def preopen(self, image: torch.Tensor, prompt: str, key: object) -> float:
        """Open the next stream ahead of time (between streams, at start): the reference latent, the prompt's
        K/V and the sink pass for ``image`` / ``prompt``, kept under ``key``. An ``open`` with the same key
        and prompt then only re-seeds it (``Session.reseed``: the same stream a fresh open gives). Returns
        the ms it took."""
        t = time.monotonic()
        self.end_stream()
        self._ready = None
        self._reset_or_new(image, prompt, 0)
        self._ready = (key, prompt)
        return (time.monotonic() - t) * 1e3

    def open(
        self, image: torch.Tensor | None, prompt, seed: int = 0, key: object = None, decode: bool = True
    ) -> str:
        """Start a stream (ending the running one). ``key`` (with the prompt) names a stream ``preopen``
        made ready: then it is only re-seeded, and ``image`` may be None. ``decode=False``: no decoder
        (the follower ranks of a tensor-parallel group only step). Returns how: "preopened", "reused" (the
        kept session reset in place) or "new"."""
        t0 = time.monotonic()
        self.end_stream()
        ready, self._ready = self._ready, None
        self.last_open_preopened = (
            key is not None
            and ready == (key, prompt)
            and self.session is not None
            and self.session.index == 0
        )
        if self.last_open_preopened:
            self.session.reseed(seed)
            how = "preopened"
        else:
            if image is None:
                raise InputError(
                    "open() needs a reference image unless it opens the stream preopen() made ready"
                )
            how = self._reset_or_new(image, prompt, seed)
        if decode:
            self._dec = _Decoder(
                self.session,
                self.placement,
                self.cfg,
                self._pinned(),
                self.on_chunk,
                self.memory,
                worker=self._decode_worker() if self.cfg.overlap else None,
            )
            self._dec.start()
        self._in_flight = []
        self.state = StreamState(t_open=t0, open_ms=(time.monotonic() - t0) * 1e3, how=how)
        return how

    def _decode_worker(self) -> DecodeWorker:
        """The engine's decode thread (started with its first stream; ended by ``close`` or when the engine
        is collected)."""
        if self._worker is None or not self._worker.alive():
            self._worker = DecodeWorker()
            # a daemon thread: nothing to join at interpreter exit
            weakref.finalize(self, self._worker.close, 5.0).atexit = False
        return self._worker

    def _pinned(self) -> list[torch.Tensor]:
        if torch.device(self.placement.decode_device).type != "cuda":
            return []
        if not self._buffers or tuple(self._buffers[0].shape) != self.frame_shape:
            self._buffers = [
                torch.empty(self.frame_shape, dtype=torch.uint8, pin_memory=True)
                for _ in range(self.cfg.host_buffers)
            ]
        return self._buffers

    # ---- the stream ---------------------------------------------------------------------------------------
    def submit(
        self,
        index: int,
        audio,
        *,
        out: torch.Tensor | np.ndarray | None = None,
        tag: object = None,
        prompt=None,
        t_plan: float | None = None,
        decode: bool = True,
        rewind: int = 0,
    ) -> None:
        """Run chunk ``index``'s diffusion now (this thread) from its audio window (float32
        [audio_samples_per_chunk], numpy or torch) and hand it to the decoder. ``out``: the caller's host
        buffer (uint8 [T, H, W, 3]) for its frames. ``prompt``: a new prompt (string or embedding [L,
        text_dim]) from this chunk on. ``t_plan``: when the caller planned it (monotonic; default now).
        ``decode=False``: the step only (the follower ranks of a tensor-parallel group: rank 0 decodes).
        ``rewind`` > 0: a cut-in (``cut_in``): the chunk starts that many frames before the last one's end."""
        sess, dec, st = self.session, self._dec, self.state
        if st is None or sess is None or (decode and dec is None):
            raise RuntimeError(
                "submit() before open()"
                if st is None
                else "submit() with decode on a stream opened without a decoder"
            )
        spc = self.samples_per_chunk
        if tuple(audio.shape) != (spc,):
            raise InputError(f"a chunk's audio must be {spc} samples, got {list(audio.shape)}")
        if dec is not None:
            dec.raise_if_failed()
        t_recv = time.monotonic()
        if isinstance(audio, np.ndarray):
            audio = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
        a = audio.float().to(sess.model.device)
        if prompt is not None:
            sess.set_prompt(prompt)
        if rewind:
            if not hasattr(sess, "rewind"):
                raise InputError(f"{type(sess).__name__} cannot start a chunk inside the last one (rewind)")
            sess.rewind(int(rewind))
        job = self._step(sess, index, a, t_recv, t_plan, tag)
        st.submitted += 1
        if not decode:
            if job.ready_event is not None:
                job.ready_event.synchronize()
            return
        if out is not None:
            job.out = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
            if tuple(job.out.shape) != self.frame_shape or job.out.dtype != torch.uint8:
                raise InputError(
                    f"out must be uint8 {list(self.frame_shape)}, got {job.out.dtype} {list(job.out.shape)}"
                )
        dec.submit(job)
        # the first chunk decodes with the device to itself (time to first frame); later ones overlap the next
        # chunk's diffusion
        if st.submitted == 1 and self.cfg.first_chunk_alone and self.cfg.overlap:
            dec.wait_first()

    def _step(self, sess, index: int, a: torch.Tensor, t_recv: float, t_plan: float | None, tag) -> _Job:
        """The chunk's diffusion step, paced (launched once the device has finished all but
        ``steps_in_flight - 1`` earlier steps: a host wait between steps, never inside one), timed (CUDA events
        around it; the host clock on the CPU), as the decoder's job."""
        while len(self._in_flight) >= self.cfg.steps_in_flight:
            self._in_flight.pop(0).synchronize()
        t_recv = max(t_recv, time.monotonic()) if self.cuda else t_recv
        plan = t_recv if t_plan is None else t_plan
        if self.cuda:
            d0, d1, ready = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(),
            )
            d0.record()
            lat = sess.step(a, runner=self.runner)
            d1.record()
            ready.record()
            self._in_flight.append(ready)
            job = _Job(
                index, lat, plan, t_recv, ready, (d0, d1), -1.0, self.runner.last or "eager", None, tag
            )
        else:
            lat = sess.step(a, runner=self.runner)
            ms = (time.monotonic() - t_recv) * 1e3
            job = _Job(index, lat, plan, t_recv, None, None, ms, self.runner.last or "eager", None, tag)
        if sess.yields_pixels:  # the step made the frames itself; the latent rides along for the caller
            job.pixels, job.latents = job.latents, sess.last_latent
        if sess.step_label is not None:  # the session says how it stepped (a clip)
            job.step = sess.step_label
        return job

    def collect(self, block: bool = False, n: int | None = None) -> list[ChunkResult]:
        """Finished chunks in order: those ready now, or (``block``) every chunk submitted and not yet
        collected (at most ``n``). Pinned frame buffers handed out by the previous collect go back to the ring."""
        dec, st = self._dec, self.state
        if dec is None or st is None:
            return []
        for b in self._lent:
            dec.release(b)
        self._lent = []
        out: list[ChunkResult] = []
        while n is None or len(out) < n:
            want = block and st.emitted < st.submitted
            r = dec.get(block=want)
            if r is None:
                break
            out.append(self._account(r))
        return out

    def _drain(self) -> list[ChunkResult]:
        """The chunks the decoder finished and nobody collected yet, without raising its error."""
        out = []
        if self._dec is not None:
            while True:
                try:
                    item = self._dec.outq.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, ChunkResult):
                    out.append(self._account(item))
        return out

    def _account(self, r: ChunkResult) -> ChunkResult:
        st = self.state
        if r.index != st.emitted:  # one decoder, FIFO queues: cannot happen unless broken
            raise RuntimeError(f"decode returned chunk {r.index}, expected {st.emitted}")
        st.emitted += 1
        if st.ttff_ms is None:
            st.ttff_ms = (r.timings.t_done - st.t_open) * 1e3
        if r.buffer is not None:
            self._lent.append(r.buffer)
        return r

    def end_stream(self) -> list[object]:
        """Stop the running stream's decoder (dropping queued work) and wait for it; the session stays kept.
        Returns the tags of chunks submitted but dropped before their decode (so a caller can give back
        what it lent with them, such as a shared-memory slot)."""
        dropped: list[object] = []
        if self._dec is not None:
            dec, self._dec = self._dec, None
            dropped = dec.close()
        self._lent = []
        if self._in_flight:
            self._in_flight[-1].synchronize()
            self._in_flight = []
        return dropped

    def close(self) -> None:
        """Free everything kept between streams: the session, its graphs, the pinned buffers."""
        if self._streaming:
            raise RuntimeError("close() while a stream is running: close or exhaust the stream first")
        self.end_stream()
        self._drop_session()
        self._buffers = []
        self.state = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @torch.no_grad()
    def stream(
        self,
        image: torch.Tensor,
        prompt,
        audio: torch.Tensor,
        num_chunks: int,
        seed: int = 0,
        prompts: Mapping[int, object] | None = None,
        pace: bool = False,
    ) -> Iterator[ChunkResult]:
        """``num_chunks`` chunks from ``audio`` (float32 mono 48 kHz, >= num_chunks x audio_samples_per_chunk),
        as a generator: ``open``, then ``submit`` each chunk and yield what is finished, then the rest.
        ``prompts`` maps a chunk index to a new prompt from that chunk on. ``pace``: submit a chunk only once
        the previous one is back (each chunk's latency is then its own work, as on a live server whose chunks
        are a chunk period apart). A yielded chunk's pinned frames stay valid until the next one is asked for.

        ``last_run`` then has the stream's ``ttff_ms`` (from this call to the first chunk's frames in host
        memory: the open, i.e. prompt K/V, reference encode and sink pass, plus the first chunk's diffusion,
        decode and copy), ``open_ms``, how the session was opened and the graph runner's counts."""
        t0 = time.monotonic()
        cfg = self.gen.cfg
        if num_chunks <= 0:
            raise InputError(f"number of chunks must be positive, got {num_chunks}")
        spc = cfg.audio_samples_per_chunk
        if audio.ndim != 1 or audio.numel() < num_chunks * spc:
            raise InputError(
                f"audio must be mono with >= {num_chunks * spc} samples for {num_chunks} chunks, "
                f"got shape {list(audio.shape)}"
            )
        if self._streaming:
            raise RuntimeError("this engine is already running a stream (one at a time)")
        self._streaming = True
        try:
            yield from self._stream(t0, image, prompt, audio, num_chunks, seed, prompts, pace)
        finally:
            self._streaming = False

    def _stream(
        self, t0: float, image, prompt, audio: torch.Tensor, num_chunks: int, seed: int, prompts, pace: bool
    ) -> Iterator[ChunkResult]:
        spc = self.samples_per_chunk
        graphs0 = len(self.runner)
        stats0 = dataclasses.replace(self.runner.stats, eager_reasons=dict(self.runner.stats.eager_reasons))
        callback, self.on_chunk = self.on_chunk, None  # this stream's results are yielded, not delivered
        try:
            how = self.open(image, prompt, seed)
        finally:
            self.on_chunk = callback
        self.state.t_open = t0
        self.last_run = StreamReport(
            placement=self.placement.describe(),
            session=how,
            open_ms=(time.monotonic() - t0) * 1e3,
            graphs_at_start=graphs0,
            warmed_up=self.warmup_report is not None,
        )
        audio_dev = audio[: num_chunks * spc].float().to(self.gen.model.device)
        keep = False
        try:
            for i in range(num_chunks):
                try:
                    self.submit(
                        i, audio_dev[i * spc : (i + 1) * spc], prompt=prompts.get(i) if prompts else None
                    )
                except Exception:  # the decoder failed: what it finished before comes out first, in order
                    yield from self._yield(self._drain(), audio, spc)
                    raise
                yield from self._yield(self.collect(block=pace, n=None), audio, spc)
            while self.state.emitted < num_chunks:
                got = self.collect(block=True, n=1)
                if not got:
                    self._dec.raise_if_failed()
                    raise RuntimeError(f"the engine produced {self.state.emitted} of {num_chunks} chunks")
                yield from self._yield(got, audio, spc)
            keep = True
        except GeneratorExit:  # the consumer stopped early: the next stream resets the session anyway
            keep = True
            raise
        finally:
            st = self.runner.stats
            graphs = {
                "captures": st.captures - stats0.captures,
                "replays": st.replays - stats0.replays,
                "eager": st.eager - stats0.eager,
                "evictions": st.evictions - stats0.evictions,
                "capture_failures": st.capture_failures - stats0.capture_failures,
                "eager_reasons": {
                    k: v - stats0.eager_reasons.get(k, 0)
                    for k, v in st.eager_reasons.items()
                    if v != stats0.eager_reasons.get(k, 0)
                },
                "kept": len(self.runner),
            }
            self.last_run.graphs = graphs
            self.last_run.wall_s = time.monotonic() - t0
            self.last_run.chunks = self.state.emitted if self.state else 0
            self.end_stream()
            if not (
                keep and self.cfg.reuse_session
            ):  # an error (or reuse off): nothing of this session is kept
                self._drop_session()

    def _yield(self, results: list[ChunkResult], audio: torch.Tensor, spc: int) -> Iterator[ChunkResult]:
        for r in results:
            r.audio = audio[r.index * spc : (r.index + 1) * spc]
            if r.index == 0:
                self.last_run.ttff_ms = self.state.ttff_ms
                self.last_run.first_chunk = {
                    "diffusion_ms": r.timings.diffusion_ms,
                    "decode_ms": r.timings.decode_ms,
                    "host_copy_ms": r.timings.host_copy_ms,
                    "step": r.timings.step,
                }
            self.last_run.chunks = self.state.emitted
            yield r

    # ---- warm-up --------------------------------------------------------------------------------------------
    def warm_chunks(self) -> int:
        """Chunks that run every step shape of a stream once: W - 1 while the ring fills, the first steady
        step's ``graph_warmup`` eager run(s), the capture, one replay (also the first chunk whose sink moves
        under the 'follow' policy)."""
        stream = self.gen.rules.stream  # (a clip stream: the first clip, motion = the image, and one more)
        return self.cfg.prewarm_chunks or stream.warm_chunks(
            self.gen.cfg.stream.window_chunks, self.cfg.graph_warmup
        )

    def warm_up(
        self, image: torch.Tensor | None = None, chunks: int = 0, decode: bool = True, threads: int | None = 0
    ) -> WarmupReport:
        """Throwaway streams before any user through every step shape and the decoder, measuring what a server
        needs (the chunk latency when chunks come one at a time, the sustained interval, the slowest chunk;
        on the CPU the thread count): :func:`cadence.engine.warmup.warm_up`. ``chunks``: of each stream (0:
        :meth:`warm_chunks`); ``decode=False``: steps only (a tensor-parallel follower); ``threads`` (CPU):
        keep that many intra-op threads (0: time 1 and 2). The report is kept as ``warmup_report``."""
        from cadence.engine.warmup import warm_up

        self.warmup_report = warm_up(self, image, chunks, decode, threads)
        return self.warmup_report
