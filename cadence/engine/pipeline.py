"""The real-time chunk pipeline: chunk k decodes while chunk k+1 diffuses.

    pipe = ChunkPipeline(gen, PipelineConfig(decode_device="cuda:1"))
    for out in pipe.stream(image, "a person talking", audio, num_chunks=200):
        encoder.push(out.frames)        # uint8 [T, H, W, 3], pinned host memory on CUDA
        print(out.timings.latency_ms)

Who runs what:

* **Diffusion** (``Session.step``, through a :class:`~cadence.runtime.graphs.GraphRunner` that replays
  CUDA graphs in steady state) runs in the caller's thread, on the caller's current stream of the
  diffusion device. After each step a CUDA event is recorded and the latent goes into a bounded
  queue (``queue_depth``): when decode falls behind, the diffusion loop blocks instead of running
  ahead without limit. The next chunk is planned once the device has finished the previous step
  (``steps_in_flight``), so chunk latency is measured from when its work can actually start.
* **Decode** runs in one worker thread. On CUDA it has its own stream on the decode device (a
  separate GPU, or the diffusion GPU when placement says 'same'); that stream waits on the step's
  event (no host sync between the stages), the latent is copied to the decode device non-blocking
  when it differs (issued from a hand-off stream on the diffusion device, so the copy never queues
  behind the next chunk's diffusion work), the session's streaming decoder turns it into uint8
  frames, and those are copied into one of ``host_buffers`` preallocated pinned host buffers. The
  worker waits for that copy (its own thread, off the diffusion path) and hands the chunk over in
  order. The session's decoder state is only ever touched by this thread.
* On the CPU the same structure runs with plain tensors and host clocks: decode overlaps diffusion
  through torch's GIL-free kernels.

Timings per chunk (:class:`ChunkTimings`): ``diffusion_ms`` (CUDA events around the step on the
diffusion stream; host clock on CPU), ``decode_ms`` and ``host_copy_ms`` (events on the decode
stream; host clock on CPU), ``latency_ms`` from the chunk's plan time (when the diffusion loop
started it) to its frames being ready in host memory; the run's time to first frame is in
``ChunkPipeline.last_run["ttff_ms"]`` and on every chunk (``ttff_ms``).

Time to first frame and reuse: ``ttff_ms`` runs from the ``stream`` call (the session's opening included)
to the first chunk's frames in host memory. ``prewarm()`` runs a throwaway stream over every step shape
first; with ``PipelineConfig.reuse_session`` (default) the pipeline keeps the session (reset in place by
each stream: same cache buffers), its captured CUDA graphs and the pinned buffers, so later streams pay
neither first-shape work nor captures. ``close()`` frees them. One stream at a time per pipeline.

Shutdown: ``stream`` is a generator; closing it early (``break``, ``close()``, garbage collection),
an exception in the diffusion loop, or one in the decode thread all stop and join the worker; an
error in the worker is re-raised in the caller's thread.

Frames lifetime on CUDA: a yielded chunk's ``frames`` is a pinned buffer of the ring; it is handed
back to the decoder when the consumer asks for the next chunk. ``.clone()`` it to keep it longer.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from cadence.config import PipelineConfig, Placement, resolve_placement
from cadence.engine.generate import ChunkOutput, Session, StreamGenerator
from cadence.errors import InputError
from cadence.runtime.graphs import GraphRunner, filling_shares_steady_graph

_POLL_S = 0.05  # how often blocked queue operations look at the other side's health


@dataclass
class ChunkTimings:
    """Per-chunk stage times in milliseconds (and host-clock seconds since the run started)."""

    diffusion_ms: float
    decode_ms: float
    host_copy_ms: float
    latency_ms: float  # plan time -> frames ready in host memory
    plan_s: float  # when the diffusion loop started this chunk (seconds since the run started)
    ready_s: float  # when its frames were ready
    step: str = ""  # what the graph runner did: "replay", "capture", "eager:<reason>"


@dataclass
class PipelineOutput(ChunkOutput):
    timings: ChunkTimings | None = None
    ttff_ms: float = 0.0  # the run's time to first frame (same on every chunk)


@dataclass
class _Job:
    index: int
    latents: torch.Tensor
    plan_s: float
    ready_event: object | None  # CUDA event recorded after the step (None on CPU)
    diff_events: tuple | None  # CUDA (start, end) events around the step
    diffusion_ms: float  # host clock (CPU) or -1 until read from the events
    step: str


@dataclass
class _Done:
    job: _Job
    frames: torch.Tensor
    decode_ms: float
    host_copy_ms: float
    ready_s: float
    buffer: int | None  # pinned ring slot, returned when the consumer moves on


class _Stop:
    pass


_STOP = _Stop()


class _DecodeWorker:
    """The decode thread: latents in (bounded queue), frames out (in order), errors captured."""

    def __init__(self, session, placement: Placement, cfg: PipelineConfig, t0: float,
                 buffers: list[torch.Tensor]):
        self.sess, self.placement, self.cfg, self.t0 = session, placement, cfg, t0
        self.inq: queue.Queue = queue.Queue(maxsize=cfg.queue_depth)
        self.outq: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.diff_dev = torch.device(placement.diffusion_device)
        self.dec_dev = torch.device(placement.decode_device)
        self.dec_cuda = self.dec_dev.type == "cuda"
        self.diff_cuda = self.diff_dev.type == "cuda"
        # the pinned ring (CUDA decode only; the pipeline allocates it up front, never inside the loop)
        self.buffers = buffers
        self.free: queue.Queue = queue.Queue()
        for i in range(len(buffers)):
            self.free.put(i)
        self.thread = threading.Thread(target=self._main, name="cadence-decode", daemon=True)
        # the session is open (sink latent computed on the diffusion device's current stream): the
        # decoder's priming, issued from the decode thread on its own streams, waits for this
        self.opened: torch.cuda.Event | None = None
        if self.diff_cuda:
            self.opened = torch.cuda.Event()
            self.opened.record(torch.cuda.current_stream(self.diff_dev))

    # ---- caller side ----------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, job: _Job) -> None:
        """Hand a latent to the decoder; blocks while `queue_depth` chunks are in flight."""
        while True:
            self.raise_if_failed()
            if not self.thread.is_alive():
                raise RuntimeError("the decode thread stopped unexpectedly")
            try:
                self.inq.put(job, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        while True:
            self.raise_if_failed()
            try:
                self.inq.put(_STOP, timeout=_POLL_S)
                return
            except queue.Full:
                if not self.thread.is_alive():
                    return

    def get(self, block: bool) -> _Done | None:
        """The next decoded chunk (None when none is ready and not blocking, or the worker ended)."""
        while True:
            self.raise_if_failed()
            try:
                item = self.outq.get(timeout=_POLL_S) if block else self.outq.get_nowait()
            except queue.Empty:
                if not block:
                    return None
                if not self.thread.is_alive() and self.outq.empty():
                    self.raise_if_failed()
                    return None
                continue
            if item is _STOP:
                return None
            return item

    def release(self, buffer: int | None) -> None:
        if buffer is not None:
            self.free.put(buffer)

    def close(self, timeout: float = 30.0) -> None:
        """Stop and join the thread (drops queued work); safe to call more than once."""
        self.stop.set()
        while True:  # unblock a worker waiting for input
            try:
                self.inq.get_nowait()
            except queue.Empty:
                break
        try:
            self.inq.put_nowait(_STOP)
        except queue.Full:
            pass
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        if self.thread.is_alive():  # pragma: no cover - a decode call that never returns
            raise RuntimeError(f"the decode thread did not stop within {timeout} s")

    # ---- worker side ----------------------------------------------------------------------------
    def _take(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return _STOP

    def _main(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                if self.dec_cuda:
                    torch.cuda.set_device(self.dec_dev)
                self._loop()
        except BaseException as e:
            self.error = e
        finally:
            self.outq.put(_STOP)

    def _loop(self) -> None:
        dec_stream = torch.cuda.Stream(device=self.dec_dev) if self.dec_cuda else None
        if self.diff_cuda:
            # the stream on the diffusion device that waits for each step and issues the latent's
            # hand-off (the decode stream itself when decode shares that GPU)
            handoff = dec_stream if self.dec_dev == self.diff_dev else torch.cuda.Stream(device=self.diff_dev)
        else:
            handoff = None
        # prime the decoder with the sink latent now, while the first chunk diffuses (the first chunk's
        # decode is on the time-to-first-frame path; the prime is not); ordered after the session's open
        if self.diff_cuda and self.dec_cuda:
            handoff.wait_event(self.opened)
            with torch.cuda.stream(handoff), torch.cuda.stream(dec_stream):
                self.sess.prime_decoder()
        else:  # host decode: a CUDA sink latent's copy to the host orders itself after the open
            self.sess.prime_decoder()
        while True:
            job = self._take(self.inq)
            if job is _STOP:
                return
            done = self._decode(job, dec_stream, handoff)
            if done is None:  # stopping
                return
            self.outq.put(done)

    def _decode(self, job: _Job, dec_stream, handoff) -> _Done | None:
        lat = job.latents
        if self.diff_cuda and self.dec_cuda:
            handoff.wait_event(job.ready_event)
            lat.record_stream(handoff)  # the caller drops it: keep the allocator off it until used
            with torch.cuda.stream(handoff), torch.cuda.stream(dec_stream):
                lat = lat.to(self.dec_dev, non_blocking=True)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record(dec_stream)
                frames = self.sess.decode(lat)
                ev[1].record(dec_stream)
                slot = self._take(self.free)
                if slot is _STOP:
                    return None
                buf = self.buffers[slot]
                buf.copy_(frames, non_blocking=True)
                ev[2].record(dec_stream)
            ev[2].synchronize()
            ready = time.perf_counter()
            d0, d1 = job.diff_events
            job.diffusion_ms = d0.elapsed_time(d1)
            return _Done(job, buf, ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]), ready - self.t0, slot)
        # host decode (CPU everywhere, or CUDA diffusion with decode on the CPU)
        if self.diff_cuda:
            job.ready_event.synchronize()
            d0, d1 = job.diff_events
            job.diffusion_ms = d0.elapsed_time(d1)
            lat = lat.to("cpu")
        t0 = time.perf_counter()
        frames = self.sess.decode(lat)
        t1 = time.perf_counter()
        if frames.device.type != "cpu":  # pragma: no cover - a decoder that answers on a device
            frames = frames.cpu()
        t2 = time.perf_counter()
        return _Done(job, frames, (t1 - t0) * 1e3, (t2 - t1) * 1e3, t2 - self.t0, None)


class ChunkPipeline:
    """Overlapped diffusion + decode for one generator (one stream at a time).

    With ``PipelineConfig.reuse_session`` (the default) the pipeline keeps one session, its graph
    runner and the pinned frame buffers between ``stream`` calls: each stream resets that session in
    place (same cache buffers, so the CUDA graphs captured by earlier streams replay for it) instead
    of allocating and capturing again. ``prewarm`` runs a throwaway stream through every step shape
    so that the first real stream pays none of the first-shape work. ``close`` frees it all.
    """

    def __init__(self, gen: StreamGenerator, cfg: PipelineConfig | None = None, placement: Placement | None = None,
                 graph_capture=None):
        """`placement` defaults to ``resolve_placement(cfg, torch.cuda.device_count())``; the generator's
        model must live on its diffusion device. `graph_capture` injects a capture function into the
        graph runner (tests)."""
        self.gen = gen
        self.cfg = cfg or PipelineConfig()
        if self.cfg.diffusion_devices == ("auto",):  # 'auto' diffuses where the built model lives
            mdev = gen.model.device
            self.cfg = dataclasses.replace(self.cfg, diffusion_devices=(
                "cpu" if mdev.type == "cpu" else f"cuda:{mdev.index if mdev.index is not None else 0}",))
        ndev = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.placement = placement or resolve_placement(self.cfg, ndev)
        mdev = gen.model.device
        want = torch.device(self.placement.diffusion_device)
        if mdev.type != want.type or (want.type == "cuda" and mdev.index != want.index):
            raise InputError(f"the model is on {mdev} but the placement diffuses on {want}: build the generator "
                             f"on {want} (or pick diffusion_devices=('{mdev}',))")
        self.graph_capture = graph_capture
        self.runner: GraphRunner | None = None  # the last stream's runner (kept with reuse_session)
        self.session: Session | None = None  # the kept session (reuse_session)
        self._buffers: list[torch.Tensor] = []  # the pinned ring (kept with reuse_session)
        self._streaming = False
        self.last_run: dict = {}
        self.prewarmed: dict | None = None  # the prewarm stream's last_run, once it ran

    def _runner(self) -> GraphRunner:
        c = self.cfg
        extra = self.gen.cfg.stream.window_chunks if c.capture_filling else 0  # one graph per fill stage
        return GraphRunner(enabled=c.graphs, max_graphs=c.max_graphs + extra, warmup=c.graph_warmup,
                           max_captures_per_key=c.max_captures_per_key, capture=self.graph_capture,
                           capture_filling=c.capture_filling)

    # ---- resources kept between streams ----------------------------------------------------------------
    def _open(self, image: torch.Tensor, prompt, seed: int) -> tuple[Session, str]:
        """The stream's session and runner: the kept ones reset in place, or new ones."""
        pl = self.placement
        if self.cfg.reuse_session and self.session is not None and self.runner is not None:
            self.session.reset(image, prompt, seed)
            return self.session, "reused"
        self._drop_session()
        self.session = self.gen.session(image, prompt, seed, decode_device=pl.decode_device)
        self.runner = self._runner()
        return self.session, "new"

    def _pinned(self, frame_shape: tuple[int, ...]) -> list[torch.Tensor]:
        if torch.device(self.placement.decode_device).type != "cuda":
            return []
        if not self._buffers or tuple(self._buffers[0].shape) != frame_shape:
            self._buffers = [torch.empty(frame_shape, dtype=torch.uint8, pin_memory=True)
                             for _ in range(self.cfg.host_buffers)]
        return self._buffers

    def _drop_session(self) -> None:
        if self.runner is not None:
            self.runner.clear()
        self.session = None

    def close(self) -> None:
        """Free what is kept between streams: the session's graphs, its cache, the pinned buffers."""
        if self._streaming:
            raise RuntimeError("close() while a stream is running: close or exhaust the stream first")
        self._drop_session()
        self._buffers = []

    def __enter__(self) -> "ChunkPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- pre-warm ---------------------------------------------------------------------------------------
    def warm_chunks(self) -> int:
        """Chunks that run every step shape of a stream once: W - 1 while the ring fills, the first
        steady step's ``graph_warmup`` eager run(s), the capture, one replay (which is also the first
        chunk whose sink moves under the 'follow' policy)."""
        return self.cfg.prewarm_chunks or self.gen.cfg.stream.window_chunks + self.cfg.graph_warmup + 1

    def prewarm(self, image: torch.Tensor | None = None, prompt: str | torch.Tensor = "prewarm",
                chunks: int | None = None, seed: int = 0) -> dict:
        """Run a throwaway stream (random reference image and audio unless given) through the pipeline
        before the first real one: every step shape (the sink pass, the first chunk, each ring-filling
        step, the steady step's warm-up, capture and replay) and the decoder (priming and a chunk) run
        once, so Triton compiles and autotuning, cuDNN/cuBLAS plan selection, lazy CUDA/library state
        and the graph captures are paid here. With ``reuse_session`` the session, its captured graphs
        and the pinned buffers are kept, and the next stream resets that session and replays them;
        without it only the process-wide warm state remains. Outputs are discarded; the next stream's
        output is the same as without prewarm (same seed, same frames). Returns the throwaway stream's
        ``last_run`` (its ``ttff_ms`` is the cold time to first frame) with ``prewarm_s``."""
        cfg = self.gen.cfg
        n = chunks or self.warm_chunks()
        if image is None:
            g = torch.Generator().manual_seed(12345)
            image = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
        audio = 0.1 * torch.randn(n * cfg.audio_samples_per_chunk, generator=torch.Generator().manual_seed(6789))
        t0 = time.perf_counter()
        # every fill stage occurs once per stream: with capture_filling (and a kept session) the stages
        # need graph_warmup eager streams, then one that captures them
        streams = 1 + (self.cfg.graph_warmup if self.cfg.capture_filling and self.cfg.reuse_session else 0)
        first = None
        ran = 0
        while ran < streams:
            for _ in self.stream(image, prompt, audio, n, seed=seed):
                pass
            ran += 1
            first = first or dict(self.last_run)
            if filling_shares_steady_graph(self.session):
                break  # nothing more to capture
        if torch.device(self.placement.diffusion_device).type == "cuda":
            torch.cuda.synchronize(self.placement.diffusion_device)
        info = dict(first, prewarm_s=time.perf_counter() - t0, prewarm_chunks=n, prewarm_streams=ran,
                    graphs=self.last_run.get("graphs"))
        self.prewarmed = info
        return info

    # ---- the stream -------------------------------------------------------------------------------------
    @torch.no_grad()
    def stream(self, image: torch.Tensor, prompt: str | torch.Tensor, audio: torch.Tensor, num_chunks: int,
               seed: int = 0, prompts: Mapping[int, str | torch.Tensor] | None = None) -> Iterator[PipelineOutput]:
        """Like ``StreamGenerator.stream`` (same seed, same latents and frames), overlapped. `prompts`
        maps a chunk index to a new prompt (string or embedding [L, text_dim], L <= text_len) that
        takes effect from that chunk: the conditioning changes mid-stream.

        Time to first frame (``ttff_ms``): from this call (the generator's first ``next``) to the first
        chunk's frames being in host memory, what a viewer waits after pressing start: the session's
        opening (prompt K/V, the reference image's VAE encode and sink pass; ``open_ms``) plus the
        first chunk's diffusion, decode and copy. One stream at a time per pipeline."""
        t0 = time.perf_counter()
        cfg = self.gen.cfg
        if num_chunks <= 0:
            raise InputError(f"number of chunks must be positive, got {num_chunks}")
        spc = cfg.audio_samples_per_chunk
        if audio.ndim != 1 or audio.numel() < num_chunks * spc:
            raise InputError(f"audio must be mono with >= {num_chunks * spc} samples for {num_chunks} chunks, "
                             f"got shape {list(audio.shape)}")
        if self._streaming:
            raise RuntimeError("this pipeline is already running a stream (one at a time)")
        self._streaming = True
        try:
            yield from self._stream(t0, image, prompt, audio, num_chunks, seed, prompts)
        finally:
            self._streaming = False

    def _stream(self, t0: float, image, prompt, audio, num_chunks: int, seed: int, prompts) -> Iterator[PipelineOutput]:
        gen, cfg = self.gen, self.gen.cfg
        spc = cfg.audio_samples_per_chunk
        pl = self.placement
        diff_cuda = torch.device(pl.diffusion_device).type == "cuda"
        reuse = self.cfg.reuse_session
        try:
            sess, how = self._open(image, prompt, seed)
        except InputError:  # checked before anything is touched: the kept session stays as it was
            raise
        except BaseException:
            self._drop_session()  # a reset that failed half-way: start the next stream afresh
            raise
        runner = self.runner
        graphs_kept = len(runner)
        open_ms = (time.perf_counter() - t0) * 1e3
        audio_dev = audio[: num_chunks * spc].float().to(gen.model.device)
        frame_shape = (cfg.video_frames_per_chunk, cfg.stream.height, cfg.stream.width, 3)
        buffers = self._pinned(frame_shape)
        if not reuse:
            self._buffers = []
        worker = _DecodeWorker(sess, pl, self.cfg, t0, buffers)
        worker.start()
        lent: int | None = None  # the pinned slot the consumer holds
        emitted = 0
        ttff = None
        self.last_run = {"placement": pl.describe(), "chunks": 0, "session": how, "open_ms": open_ms,
                         "graphs_at_start": graphs_kept, "prewarmed": self.prewarmed is not None}
        stats0 = vars(runner.stats).copy()
        stats0["eager_reasons"] = dict(runner.stats.eager_reasons)

        def emit(d: _Done) -> PipelineOutput:
            nonlocal emitted, ttff
            if d.job.index != emitted:  # one worker, FIFO queues: cannot happen unless broken
                raise RuntimeError(f"decode returned chunk {d.job.index}, expected {emitted}")
            emitted += 1
            if ttff is None:
                ttff = d.ready_s * 1e3
                self.last_run["ttff_ms"] = ttff
                self.last_run["first_chunk"] = {"diffusion_ms": d.job.diffusion_ms, "decode_ms": d.decode_ms,
                                                "host_copy_ms": d.host_copy_ms, "plan_ms": d.job.plan_s * 1e3,
                                                "step": d.job.step}
            i = d.job.index
            t = ChunkTimings(d.job.diffusion_ms, d.decode_ms, d.host_copy_ms, (d.ready_s - d.job.plan_s) * 1e3,
                             d.job.plan_s, d.ready_s, d.job.step)
            self.last_run["chunks"] = emitted
            return PipelineOutput(index=i, latents=d.job.latents, frames=d.frames, audio=audio[i * spc:(i + 1) * spc],
                                  timings=t, ttff_ms=ttff)

        def drain(block: bool):
            """Yield the decoded chunks that are ready (all remaining ones when `block`); hand the
            consumer's previous pinned slot back as each new one is lent out."""
            while (d := worker.get(block=block)) is not None:
                yield lend(d)

        def lend(d: _Done) -> PipelineOutput:
            nonlocal lent
            out = emit(d)
            worker.release(lent)
            lent = d.buffer
            return out

        in_flight: list = []  # ready events of launched steps (CUDA), oldest first
        keep = False
        try:
            for i in range(num_chunks):
                if prompts and i in prompts:
                    sess.set_prompt(prompts[i])
                # pacing: plan chunk i once the device has finished all but steps_in_flight - 1 earlier
                # steps (a host wait between steps, never inside one)
                while len(in_flight) >= self.cfg.steps_in_flight:
                    in_flight.pop(0).synchronize()
                plan = time.perf_counter() - t0
                if diff_cuda:
                    d0, d1, ready = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                                     torch.cuda.Event())
                    d0.record()
                    lat = sess.step(audio_dev[i * spc:(i + 1) * spc], runner=runner)
                    d1.record()
                    ready.record()
                    job = _Job(i, lat, plan, ready, (d0, d1), -1.0, runner.last)
                    in_flight.append(ready)
                else:
                    lat = sess.step(audio_dev[i * spc:(i + 1) * spc], runner=runner)
                    job = _Job(i, lat, plan, None, None, (time.perf_counter() - t0 - plan) * 1e3, runner.last)
                worker.submit(job)
                # the first chunk decodes with the device to itself when first_chunk_alone (time to first
                # frame); later ones overlap the next chunk's diffusion
                if i == 0 and self.cfg.first_chunk_alone and (d := worker.get(block=True)) is not None:
                    yield lend(d)
                yield from drain(block=False)
            worker.finish()
            yield from drain(block=True)
            worker.raise_if_failed()
            if emitted != num_chunks:
                raise RuntimeError(f"the pipeline produced {emitted} of {num_chunks} chunks")
            st = vars(runner.stats).copy()
            st["eager_reasons"] = {k: v - stats0["eager_reasons"].get(k, 0)
                                   for k, v in runner.stats.eager_reasons.items()
                                   if v != stats0["eager_reasons"].get(k, 0)}
            for k in ("captures", "replays", "eager", "evictions", "capture_failures"):
                st[k] -= stats0[k]
            st["kept"] = len(runner)
            self.last_run.update(wall_s=time.perf_counter() - t0, graphs=st)
            keep = True
        except GeneratorExit:  # the consumer stopped early: the session is reset by the next stream anyway
            keep = True
            raise
        finally:
            worker.close()
            if not (reuse and keep):  # an error (or reuse off): nothing of this session is kept
                self._drop_session()
