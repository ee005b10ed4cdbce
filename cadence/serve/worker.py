"""Model work in a worker process, one per GPU group (on the CPU: one per worker slot).

The web process never runs the model: each group owns a process started with ``spawn`` that builds
the generator once (so a new session's first frame costs a chunk, not a model build) and serves one
session at a time. Messages are tuples over a ``multiprocessing`` pipe:

    web -> worker   ("open", sid, image float32 [3,H,W] | None, prompt, seed)
                    ("chunk", sid, index, audio float32 [samples_per_chunk], t_plan, slot | None)
                    ("close", sid)            ("stop",)
    worker -> web   ("ready", info)           ("opened", sid, ms, preopened)        ("closed", sid)
                    ("chunk", sid, index, frames uint8 [F,H,W,3] | None, timings dict)
                    ("dropped", sid, index, slot)   (a chunk of a session already closed)
                    ("error", sid | None, message[, slot])

Every geometry follows the engine config (preset + ``ServeConfig.overrides``): F = frames per chunk
(4 at tiny/W14/W57, 12 at W1.3), samples_per_chunk = 48000 x F / fps, H x W the preset's size.

Frames: pickled through the pipe they cost, measured on this 2-core CPU (spawned process, one chunk
each way), 24-39 ms per W1.3 chunk (12 x 480 x 832 x 3 = 14.4 MB, every 500 ms: on the critical path
of every chunk, and the reader thread competes with the event loop for the GIL while it rebuilds it) against
2-4 ms through shared memory (write + the web side's copy out). So frames of 1 MiB and more go through
a :class:`FrameRing` (``ServeConfig.frame_transport='auto'``): the web side creates a few slots of one
chunk each (``max_in_flight + 1``) in one ``multiprocessing.shared_memory`` segment, hands a free slot
with every chunk request, the worker writes the frames there (on CUDA: the device-to-host copy lands
in the slot directly) and answers with ``frames=None`` and ``timings["slot"]``; the reader thread copies
the chunk out and frees the slot. A request without a free slot falls back to the pipe. The segment
is unlinked when the group stops (and re-created on restart). The tiny presets' 196 KB chunks stay
on the pipe (~0.4 ms round trip).

The engine's fast path (:class:`Engine`, options from ``cadence.serve.config.resolve_engine_options``)
is applied from outside to the built model: the TAEHV decoder and the ring cache with FP8 K/V through
config overrides, ``apply_fp8`` on the model, opt-in ``apply_compile`` (torch.compile of the
per-block elementwise math), and a :class:`~cadence.runtime.graphs.GraphRunner`.
With graphs on, every session of the worker runs on ONE ring cache (``Session.reset`` on one session
object: the ring's buffers are allocated once and addressed by device tensors), so the steady-state graph captured during
the warm-up is replayed by every later session: a capture costs ~2.5 chunks of time at W1.3 (978 ms in
``docs/perf/pipeline``) and would otherwise make every session miss a deadline once its window fills. Before "ready", on CUDA, a
throwaway warm-up session runs ``window_chunks + 2`` chunks (first chunk, ring filling, steady
eager, capture, replay) and the decoder, so Triton compiles, autotuning, cuDNN setup and the capture
happen before any user; the ready info carries its timings, and ``steady_chunk_ms`` (the worker time
of one steady chunk) from which the web side sizes its planning lead. Times are ``time.monotonic()``
(one system-wide clock, the same as asyncio's loop clock), so the web process can compare them.

The next session is opened ahead: at start (after any warm-up) and whenever the worker goes idle after
a close, it runs the open of a session with the default face and prompt (``Engine.preopen``: the
reference latent, the prompt's cross-attention K/V and the sink pass). A session that brings no image
and the default prompt then only re-seeds it (``Session.reseed``: the stream is exactly a fresh open's),
so its time to first frame is the first chunk's; others open as before (the default face's latent stays
remembered by the generator either way).

On the web side, :class:`WorkerGroup` wraps one process: a writer thread (so a blocked pipe never
stalls the event loop), a reader thread that hands messages to the event loop, and restart/stop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

from cadence.net import free_port
from cadence.serve.config import DEFAULT_PROMPT

log = logging.getLogger("cadence.serve")


def process_rss_mb() -> float | None:
    """This process's resident set size in MB (Linux ``/proc/self/statm``: one small read, ~10 us),
    or None where there is no /proc."""
    import os

    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


# ---- frames through shared memory ------------------------------------------------------------------

class FrameRing:
    """``slots`` buffers of one chunk's frames (uint8 ``shape`` = [F, H, W, 3]) in one shared-memory
    segment. The web side creates it (``create``) and owns the free list; the worker attaches by name
    (``attach``) and writes the slot it is told to. ``unlink`` (owner) / ``close`` release it."""

    def __init__(self, shm: shared_memory.SharedMemory, shape: tuple[int, ...], slots: int, owner: bool):
        self.shm, self.shape, self.slots, self.owner = shm, tuple(int(x) for x in shape), int(slots), owner
        self.slot_bytes = int(np.prod(self.shape))
        self._free: list[int] = list(range(self.slots))
        self._lock = threading.Lock()
        self._closed = False

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, shape: tuple[int, ...], slots: int) -> FrameRing:
        if slots < 1:
            raise ValueError(f"a frame ring needs >= 1 slot, got {slots}")
        size = int(np.prod(shape)) * slots
        return cls(shared_memory.SharedMemory(create=True, size=size), shape, slots, owner=True)

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], slots: int) -> FrameRing:
        try:  # Python >= 3.13: the creator's resource tracker alone owns the segment
            shm = shared_memory.SharedMemory(name=name, track=False)
        except TypeError:  # 3.11/3.12: the spawned child shares the parent's tracker (registering is a no-op)
            shm = shared_memory.SharedMemory(name=name)
        return cls(shm, shape, slots, owner=False)

    def view(self, slot: int) -> np.ndarray:
        if not 0 <= slot < self.slots:
            raise ValueError(f"frame slot {slot} out of range 0..{self.slots - 1}")
        return np.ndarray(self.shape, np.uint8, self.shm.buf, offset=slot * self.slot_bytes)

    def acquire(self) -> int | None:
        """A free slot for the next chunk request (None: all in use; the chunk then uses the pipe)."""
        with self._lock:
            return self._free.pop(0) if self._free and not self._closed else None

    def release(self, slot: int | None) -> None:
        if slot is None:
            return
        with self._lock:
            if 0 <= slot < self.slots and slot not in self._free:
                self._free.append(slot)

    def read(self, slot: int) -> np.ndarray:
        """A copy of the frames in ``slot`` (the slot can be reused at once)."""
        v = self.view(slot)
        out = v.copy()
        del v
        return out

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Detach (and, for the owner, unlink) the segment. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.shm.close()
        except BufferError:  # pragma: no cover - a view still exported (a bug): keep the mapping, still unlink
            log.warning("frame ring %s: a view is still in use at close", self.name)
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


# ---- the engine in the worker process ----------------------------------------------------------------

class Engine:
    """The generator with the serving fast path applied, a graph runner and (with graphs) one reused session;
    opens sessions and runs one chunk (step + decode + frames to host) with timings.

    Runs anywhere torch runs; the worker process uses it, and tests use it in-process on the CPU."""

    def __init__(self, preset: str, device: str, seed: int = 0, options: dict | None = None,
                 graph_capture=None, tp=None):
        import torch

        from cadence.config import get_preset
        from cadence.engine.generate import build_generator

        opts = dict(options or {})
        self.notes: list[str] = list(opts.get("notes", ()))
        self.device = device
        self.cuda = str(device).startswith("cuda")
        cfg = get_preset(preset)
        if opts.get("overrides"):
            cfg = cfg.with_overrides(**opts["overrides"])
        stream: dict = {}
        if opts.get("kv_fp8"):
            stream.update(cache="ring", kv_fp8=True)
        if opts.get("graphs") and cfg.stream.cache != "ring":
            stream["cache"] = "ring"  # graphs need the ring cache's fixed addresses
        if stream:
            cfg = cfg.with_overrides(stream=stream)
        if opts.get("decoder") and opts["decoder"] != cfg.vae.decoder:
            cfg = cfg.with_overrides(vae={"decoder": opts["decoder"]})
        self.cfg = cfg
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.gen = build_generator(cfg, device=device, dtype=self.dtype, seed=seed)
        self.applied = {"decoder": cfg.vae.decoder, "cache": cfg.stream.cache, "kv_fp8": cfg.stream.kv_fp8,
                        "dtype": str(self.dtype).replace("torch.", ""), "fp8_linears": 0, "graphs": False,
                        "tp": 1}
        self.tp = tp  # cadence.parallel.TPInfo of this rank's group (a tensor-parallel worker group), or None
        if tp is not None and tp.world_size > 1:
            from cadence.parallel import apply_tp

            comm = opts.get("comm") or "auto"
            apply_tp(self.gen.model, tp.group, comm=comm)  # every rank built the same weights: shard them
            self.applied.update(tp=tp.world_size, comm=comm)
            if graph_capture is None and self.cuda:
                from cadence.parallel.graphs import agreeing_capture

                graph_capture = agreeing_capture(tp.group)  # every rank captures a step, or none does
        if opts.get("fp8_linears"):
            from cadence.quant.fp8 import apply_fp8

            try:
                self.applied["fp8_linears"] = apply_fp8(self.gen.model)
            except Exception as e:  # the reference linears stay (apply_fp8 swaps modules one by one)
                self._note(f"fp8_linears: could not apply ({type(e).__name__}: {e}): plain linears")
        self.applied["compile"] = "off"
        if opts.get("compile"):  # after the FP8 swap (apply_compile's order); compiles on first use (warm-up)
            try:
                from cadence.runtime.compile import apply_compile
            except ImportError as e:
                self._note(f"compile: not available in this engine ({e}): plain elementwise ops")
            else:
                rep = apply_compile(self.gen.model)
                self.applied["compile"] = rep.describe()
                if not rep.enabled:
                    self._note(f"compile: {rep.describe()}")
        self.runner = None
        self._sess = None  # with graphs: the one session object, reset stream after stream
        self._ready = None  # (key, prompt, session) opened ahead by preopen
        self.last_open_preopened = False
        self.reuse: str | None = None
        if opts.get("graphs"):
            from cadence.runtime.graphs import GraphRunner

            fill = bool(opts.get("capture_filling"))  # + one graph per ring-fill stage
            self.runner = GraphRunner(enabled=True, max_graphs=4 + (cfg.stream.window_chunks if fill else 0),
                                      capture_filling=fill, capture=graph_capture)
            self.reuse = "session"
            self.applied["graphs"] = True
        self.applied["capture_filling"] = bool(self.runner is not None and self.runner.capture_filling)
        self.applied["reuse"] = self.reuse
        lh, lw = cfg.stream.height, cfg.stream.width
        self.frame_shape = (cfg.video_frames_per_chunk, lh, lw, 3)
        self.samples_per_chunk = cfg.audio_samples_per_chunk

    def _note(self, text: str) -> None:
        self.notes.append(text)
        log.warning("worker: %s", text)

    # ---- sessions -------------------------------------------------------------------------------
    def preopen(self, image, prompt: str, key) -> float:
        """Open the next session ahead of time (between sessions, at start): the sink pass and the prompt's
        K/V for ``image`` / ``prompt``, kept under ``key``. An ``open`` with the same key then only
        re-seeds it (``Session.reseed``: the same stream a fresh open gives). Returns the ms it took."""
        t = time.monotonic()
        self._ready = None
        sess = self.open(image, prompt, 0)
        self._ready = (key, prompt, sess)
        return (time.monotonic() - t) * 1e3

    def open(self, image, prompt: str, seed: int, key=None):
        """A new stream. With graphs on, every stream is the same session object reset in place
        (``Session.reset``: the same ring cache buffers), so the graphs captured once (in the warm-up)
        stay valid for every user; without graphs, a new session. ``key`` (with the prompt) names a
        session ``preopen`` made ready: then it is only re-seeded."""
        ready, self._ready = self._ready, None
        self.last_open_preopened = key is not None and ready is not None and ready[:2] == (key, prompt)
        if self.last_open_preopened:
            ready[2].reseed(seed)
            return ready[2]
        ready = None  # a new session below: let the one opened ahead (its cache) go first
        if self.reuse == "session":
            if self._sess is None:
                self._sess = self.gen.session(image, prompt, seed=seed)
            else:
                self._sess.reset(image, prompt, seed)
            return self._sess
        return self.gen.session(image, prompt, seed=seed)

    def close(self, sess) -> None:
        if self.cuda and self.reuse is None:  # the session's cache goes: give its memory back
            import torch

            torch.cuda.empty_cache()

    def run_chunk(self, sess, audio: np.ndarray, out: np.ndarray | None = None,
                  decode: bool = True) -> tuple[np.ndarray | None, dict]:
        """One chunk: step (graph replay where possible) + decode + frames to the host, into ``out``
        (a shared-memory slot) or a new array. Returns ``(frames or None when written to out, timings)``.
        ``decode=False``: the step only (the follower ranks of a tensor-parallel group: rank 0 decodes)."""
        import torch

        if audio.shape != (self.samples_per_chunk,):
            raise ValueError(f"a chunk's audio must be {self.samples_per_chunk} samples, got {list(audio.shape)}")
        t_recv = time.monotonic()
        a = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32)).to(self.gen.model.device)
        if self.cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
        lat = sess.step(a, runner=self.runner)
        if self.cuda:
            ev[1].record()
        t_step = time.monotonic()
        step = self.runner.last if self.runner is not None else "eager"  # (an empty runner is falsy: len 0)
        if not decode:
            if self.cuda:
                ev[1].synchronize()
            t_done = time.monotonic()
            return None, {"t_recv": t_recv, "t_done": t_done, "step": step, "work_ms": (t_done - t_recv) * 1e3}
        frames = sess.decode(lat)
        if self.cuda:
            ev[2].record()
        if out is not None:
            torch.from_numpy(out).copy_(frames)  # device -> the shared slot (synchronous)
            result = None
        else:
            result = frames.cpu().numpy()
        t_done = time.monotonic()
        if self.cuda:
            diffusion_ms, decode_ms = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
        else:
            diffusion_ms, decode_ms = (t_step - t_recv) * 1e3, (t_done - t_step) * 1e3
        return result, {"t_recv": t_recv, "t_done": t_done, "diffusion_ms": diffusion_ms, "decode_ms": decode_ms,
                        "work_ms": (t_done - t_recv) * 1e3, "step": step, "memory": self.memory()}

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` on this rank or, in a tensor-parallel group, on any rank (one tiny all-reduce), so
        that every rank takes the same branch of a start-up step that runs collectives."""
        if self.tp is None:
            return flag
        from cadence.parallel.graphs import all_ranks_ok

        return not all_ranks_ok(not flag, group=self.tp.group)

    def memory(self) -> dict:
        """The worker's memory now, in MB: host RSS and, on CUDA, what torch has allocated on this device
        (no sync: the caching allocator's counter). A stream that leaks shows as growth chunk after chunk
        (``cadence.serve.timeline``)."""
        import torch

        mem = {"rss_mb": process_rss_mb()}
        if self.cuda:
            mem["cuda_mb"] = torch.cuda.memory_allocated(self.gen.model.device) / 2 ** 20
        return mem

    def warm_up(self, image, chunks: int = 0, decode: bool = True) -> dict:
        """Throwaway sessions of ``chunks`` chunks (0 = window_chunks + 2): every step shape (first
        chunk, ring filling, steady, capture, replay) and the decoder run once before any user. With
        ``capture_filling`` a second session follows (each fill stage is warmed eagerly in the first,
        captured in the second), so that users' sessions replay every step.

        Reports the last session's per-chunk times (what a user's session will look like, but for the
        last session's chunk 0 in single-session mode, which pays the cold start), ``steady_chunk_ms``
        (the last non-capture chunk: the auto lead is sized from it) and ``slowest_chunk_ms`` (the
        slowest chunk a user's session will run, captures and the cold chunk 0 left out).

        A chunk slower than its media makes the worker slower than real time there. When one session
        has such chunks, one more session is run to tell one-time work (a kernel compiled on first use:
        W14 TP=2 on 2x H200 ran its 21st chunk, a graph replay, in 671 ms once and ~130 ms after) from
        chunks that are slow in every session; only the latter are a note (each session underruns
        there, whatever the lead). ``first_stream_chunk_ms`` keeps the first session's times then."""
        import torch

        from cadence.runtime.graphs import filling_shares_steady_graph

        n = chunks or self.cfg.stream.window_chunks + 2
        g = torch.Generator().manual_seed(0)
        audio = (0.1 * torch.randn(self.samples_per_chunk, generator=g)).numpy()
        buf = np.empty(self.frame_shape, np.uint8)
        chunk_ms = self.cfg.video_frames_per_chunk / self.cfg.stream.fps * 1e3

        def stream():
            t = time.monotonic()
            sess = self.open(image, "warm-up", 0)
            open_ms = (time.monotonic() - t) * 1e3
            per, steps = [], []
            for _ in range(n):
                _, tm = self.run_chunk(sess, audio, out=buf, decode=decode)
                per.append(tm["work_ms"])
                steps.append(tm["step"])
            self.close(sess)
            return open_ms, per, steps

        def user_chunks(per, steps, first):  # (index, ms, step) of what a user's session runs
            return [(i, ms, st) for i, (ms, st) in enumerate(zip(per, steps, strict=True))
                    if i >= first and st != "capture"]

        streams = 1 + (self.runner.warmup if self.runner is not None and self.runner.capture_filling else 0)
        t0 = time.monotonic()
        for k in range(streams):
            if k and filling_shares_steady_graph(self._sess):
                streams = k  # nothing more to capture
                break
            open_ms, per, steps = stream()
        first = 0 if streams > 1 else 1  # a single session's chunk 0 is the cold one
        out = {}
        slow = [i for i, ms, _ in user_chunks(per, steps, first) if ms > chunk_ms]
        if streams == 1 and self._any_rank(bool(slow)):  # every rank of a TP group runs the same sessions
            once = (per, steps)
            open_ms, per, steps = stream()
            streams, first = 2, 0
            out["first_stream_chunk_ms"] = [round(x, 1) for x in once[0]]
            gone = [i for i in slow if per[i] <= chunk_ms]
            if gone:
                self._note(f"warm-up: chunk(s) {gone} took up to {max(once[0][i] for i in gone):.0f} ms in the "
                           f"first session only (one-time work); {max(per[i] for i in gone):.0f} ms in the next")
        user = user_chunks(per, steps, first) or [(i, ms, st) for i, (ms, st) in enumerate(zip(per, steps))]
        steady = [ms for ms, st in zip(per, steps, strict=True) if st != "capture"]
        slowest = max(ms for _, ms, _ in user)
        if slowest > chunk_ms:
            late = [(ms, st) for _, ms, st in user if ms > chunk_ms]
            filling = any(st == "eager:ring_filling" for _, st in late)
            self._note(f"warm-up: {len(late)} chunk(s) of a session take up to {slowest:.0f} ms, longer than a "
                       f"chunk's {chunk_ms:.0f} ms of media: expect underruns there in every session"
                       + (" (eager ring-filling steps: --capture-filling captures them)" if filling else ""))
        return {"ms": round((time.monotonic() - t0) * 1e3, 1), "open_ms": round(open_ms, 1), "chunks": n,
                "streams": streams, "chunk_ms": [round(x, 1) for x in per], "steps": steps,
                "steady_chunk_ms": round(steady[-1] if steady else per[-1], 1),
                "slowest_chunk_ms": round(slowest, 1), "media_chunk_ms": round(chunk_ms, 1),
                **out, "graphs": vars(self.runner.stats) if self.runner is not None else None}


# ---- the worker process ---------------------------------------------------------------------------

#: How long a collective of a tensor-parallel worker group waits for a peer rank before failing: a
#: rank that died is noticed (the group then fails and is restarted) instead of hanging for torch's default.
TP_TIMEOUT_S = 300.0


def group_devices(device: str) -> list[str]:
    """A worker group's devices: 'cuda:0' -> one; 'cuda:0+cuda:1' -> a tensor-parallel group of two."""
    return device.split("+")


class _Peers:
    """The control plane of a tensor-parallel worker group. Rank 0 (the process the web side talks to)
    broadcasts every command it runs (open / chunk / close / preopen / stop, with their images and audio)
    over a gloo group; each follower rank runs the same engine calls in the same order, so the
    collectives inside the steps meet; only rank 0 decodes and answers."""

    def __init__(self, info):
        import torch.distributed as dist

        self.info = info
        self.control = info.group if info.backend == "gloo" else dist.new_group(backend="gloo")

    def bcast(self, msg: tuple | None = None) -> tuple:
        import torch.distributed as dist

        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def _tp_join(rank: int, devices: list[str], port: int):  # pragma: no cover - other process
    """Join the group's process group (rank ``rank`` of ``len(devices)``, on ``devices[rank]``)."""
    import os

    from cadence.parallel import init_tp

    dev = devices[rank]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(len(devices)),
                      LOCAL_RANK=str(int(dev.split(":")[1]) if dev.startswith("cuda:") else rank))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback
    return init_tp(backend="gloo" if dev == "cpu" else None, timeout_s=TP_TIMEOUT_S)


def _start_up(eng: Engine, opts: dict, default_image, decode: bool = True) -> tuple[dict | None, float]:
    """What every rank of a worker runs before serving, in the same order: the warm-up session (when
    asked), then the next default session opened ahead. Returns (warm-up report or None, preopen ms)."""
    warm = eng.warm_up(default_image, int(opts.get("warmup_chunks") or 0), decode=decode) if opts.get("warmup") \
        else None
    return warm, eng.preopen(default_image, DEFAULT_PROMPT, "default")


def _open_command(eng: Engine, sess, image, prompt: str, seed: int, default_image):
    """A worker's 'open' (every rank the same): the current session closed, the new one opened with the
    default face when no image came (then the session opened ahead when it matches)."""
    import torch

    if sess is not None:
        eng.close(sess)
    img = default_image if image is None else torch.from_numpy(image)
    return eng.open(img, prompt, seed, key="default" if image is None else None)


def tp_follower_main(rank: int, preset: str, device: str, threads: int, seed: int,  # pragma: no cover
                     options: dict | None = None) -> None:
    """A follower rank (1..N-1) of a tensor-parallel worker group: builds the same engine shard, runs the
    same start-up (warm-up, session opened ahead), then every command rank 0 broadcasts, without
    decoding; exits on 'stop' (or when a collective times out because rank 0 is gone)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devices = group_devices(device)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {device} rank {rank}]: %(message)s")
    import torch

    from cadence.media.image import default_reference_image
    from cadence.parallel import destroy_tp

    opts = dict(options or {})
    if threads > 0:
        torch.set_num_threads(threads)
    info = _tp_join(rank, devices, opts["tp_port"])
    try:
        peers = _Peers(info)
        eng = Engine(preset, devices[rank], seed, opts, tp=info)
        cfg = eng.cfg
        default_image = default_reference_image(cfg.stream.height, cfg.stream.width)
        sess, sid_open = None, None
        with torch.no_grad():
            _start_up(eng, opts, default_image, decode=False)
            while True:
                msg = peers.bcast()
                kind = msg[0]
                try:
                    if kind == "stop":
                        break
                    if kind == "open":
                        sess, sid_open = _open_command(eng, sess, *msg[2:], default_image), msg[1]
                    elif kind == "chunk":
                        if sess is not None and msg[1] == sid_open:
                            eng.run_chunk(sess, msg[3], decode=False)
                    elif kind == "close":
                        if msg[1] == sid_open:
                            eng.close(sess)
                            sess, sid_open = None, None
                    elif kind == "preopen":
                        eng.preopen(default_image, DEFAULT_PROMPT, "default")
                except Exception as e:  # rank 0 meets the same error on the same input and reports it
                    log.warning("follower rank %d: %s failed (%s: %s)", rank, kind, type(e).__name__, e)
                    if kind == "open":
                        sess, sid_open = None, None
    finally:
        destroy_tp()


def worker_main(conn, preset: str, device: str, threads: int, seed: int,  # pragma: no cover - other process
                options: dict | None = None) -> None:
    """Entry point of the worker process (spawned: imports torch here, never in the web process's loop).
    For a tensor-parallel group ('cuda:0+cuda:1') this is rank 0: it also joins the group's process
    group and broadcasts every command to the follower ranks (``tp_follower_main``)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops us cleanly
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {device}]: %(message)s")
    import torch

    from cadence.media.image import default_reference_image

    opts = dict(options or {})
    for note in opts.get("notes", ()):
        log.warning("worker: %s", note)
    if threads > 0:
        torch.set_num_threads(threads)
    t = time.monotonic()
    ring = None
    devices = group_devices(device)
    peers = None
    try:
        info = _tp_join(0, devices, opts["tp_port"]) if len(devices) > 1 else None
        peers = _Peers(info) if info is not None else None
        eng = Engine(preset, devices[0], seed, opts, tp=info)
        if opts.get("shm"):
            sh = opts["shm"]
            if tuple(sh["shape"]) != eng.frame_shape:
                raise ValueError(f"frame ring shape {sh['shape']} != the engine's {list(eng.frame_shape)}")
            ring = FrameRing.attach(sh["name"], sh["shape"], sh["slots"])
        cfg = eng.cfg
        default_image = default_reference_image(cfg.stream.height, cfg.stream.width)
        build_ms = (time.monotonic() - t) * 1e3
        with torch.no_grad():
            # the next session opened ahead: a session with the default face and prompt (no upload) only
            # re-seeds it; others still find the default face's latent remembered
            warm, preopen_ms = _start_up(eng, opts, default_image)
    except Exception as e:
        conn.send(("error", None, f"worker start failed: {type(e).__name__}: {e}"))
        raise
    conn.send(("ready", {"preset": cfg.name, "device": device, "tp": len(devices), "build_ms": round(build_ms, 1),
                         "threads": torch.get_num_threads(), "fast_path": eng.applied, "notes": eng.notes,
                         "warmup": warm, "preopen_ms": round(preopen_ms, 1), "frame_transport": "shm" if ring is not None else "pipe",
                         "frames_per_chunk": cfg.video_frames_per_chunk,
                         "audio_samples_per_chunk": cfg.audio_samples_per_chunk}))
    sess = None
    sid_open = None

    def tell_peers(msg: tuple) -> None:
        if peers is not None:
            # the followers need the command, not the shared-memory slot rank 0 writes its frames to
            peers.bcast(msg[:5] if msg[0] == "chunk" else msg)

    with torch.no_grad():
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            kind = msg[0]
            slot = None
            try:
                if kind in ("stop", "open", "chunk", "close"):
                    tell_peers(msg)
                if kind == "stop":
                    break
                if kind == "open":
                    sid = msg[1]
                    t = time.monotonic()
                    sess, sid_open = _open_command(eng, sess, *msg[2:], default_image), sid
                    conn.send(("opened", sid, (time.monotonic() - t) * 1e3, eng.last_open_preopened))
                elif kind == "chunk":
                    _, sid, index, audio, t_plan = msg[:5]
                    slot = msg[5] if len(msg) > 5 else None
                    if sid != sid_open or sess is None:  # a chunk for a session already closed: drop it
                        conn.send(("dropped", sid, index, slot))
                        continue
                    out = ring.view(slot) if ring is not None and slot is not None else None
                    frames, tm = eng.run_chunk(sess, audio, out=out)
                    del out
                    tm["t_plan"] = t_plan
                    if frames is None:
                        tm["slot"] = slot
                    elif slot is not None:  # no ring here: the slot was not used
                        conn.send(("dropped", sid, index, slot))
                    conn.send(("chunk", sid, index, frames, tm))
                elif kind == "close":
                    _, sid = msg
                    if sid == sid_open:
                        eng.close(sess)
                        sess, sid_open = None, None
                    conn.send(("closed", sid))
                    if sess is None and not conn.poll():  # idle: open the next default session ahead
                        try:
                            tell_peers(("preopen",))
                            eng.preopen(default_image, DEFAULT_PROMPT, "default")
                        except Exception as e:  # only a head start: the next open works as without it
                            log.warning("worker: could not open the next session ahead (%s: %s)", type(e).__name__, e)
                else:
                    conn.send(("error", None, f"unknown message {kind!r}"))
            except (EOFError, OSError, BrokenPipeError):
                break
            except Exception as e:
                sid = msg[1] if len(msg) > 1 else None
                if kind == "open":
                    sess, sid_open = None, None
                try:
                    conn.send(("error", sid, f"{type(e).__name__}: {e}", slot))
                except (EOFError, OSError):
                    break
    if ring is not None:
        ring.close()
    if peers is not None:
        from cadence.parallel import destroy_tp

        destroy_tp()


# ---- the web side ---------------------------------------------------------------------------------

class WorkerGroup:
    """One worker process (one GPU group) seen from the event loop.

    ``on_message(msg)`` is called on the event loop for every message from the worker; a worker
    that dies is reported as ``("died", None, reason)``. Sending never blocks the loop.
    """

    def __init__(self, index: int, preset: str, device: str = "cpu", threads: int = 1, seed: int = 0,
                 options: dict | None = None, frame_shape: tuple[int, ...] | None = None, slots: int = 3):
        """``options``: the engine options the worker applies (``resolve_engine_options``); with
        ``options["frame_transport"] == "shm"`` and a ``frame_shape`` ([F, H, W, 3]) the frames come
        back through a :class:`FrameRing` of ``slots`` chunks, created here at every start."""
        self.index, self.preset, self.device, self.threads, self.seed = index, preset, device, threads, seed
        self.options = dict(options or {})
        self.frame_shape = tuple(frame_shape) if frame_shape is not None else None
        self.slots = slots
        self.ring: FrameRing | None = None
        self.start_error: str | None = None
        self.proc: mp.process.BaseProcess | None = None
        self.followers: list[mp.process.BaseProcess] = []  # ranks 1..N-1 of a tensor-parallel group
        self.conn = None
        self.ready = asyncio.Event()
        self.info: dict = {}
        self.session_id: str | None = None  # the session holding this group
        self.on_message: Callable[[tuple], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._watch_stop = threading.Event()
        self._stopping = False
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def free(self) -> bool:
        return self.ready.is_set() and self.session_id is None and not self._stopping

    def start(self) -> None:
        """Spawn the process and its pipe threads (returns at once; ``ready`` is set when the model is built)."""
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        opts = dict(self.options)
        opts.pop("shm", None)
        self.start_error = None
        if opts.get("frame_transport") == "shm" and self.frame_shape is not None:
            self.ring = FrameRing.create(self.frame_shape, self.slots)
            opts["shm"] = {"name": self.ring.name, "shape": list(self.frame_shape), "slots": self.slots}
        parent, child = ctx.Pipe(duplex=True)
        self.conn = parent
        self.ready.clear()
        self._outq = queue.SimpleQueue()
        devices = group_devices(self.device)
        if len(devices) > 1:
            opts["tp_port"] = free_port()
        self.proc = ctx.Process(target=worker_main,
                                args=(child, self.preset, self.device, self.threads, self.seed, opts),
                                name=f"cadence-worker-{self.index}", daemon=True)
        self.proc.start()
        child.close()
        # a tensor-parallel group: the follower ranks, started by us (rank 0 is daemonic: no children)
        fopts = {k: v for k, v in opts.items() if k != "shm"}
        self.followers = [ctx.Process(target=tp_follower_main,
                                      args=(r, self.preset, self.device, self.threads, self.seed, fopts),
                                      name=f"cadence-worker-{self.index}-rank{r}", daemon=True)
                          for r in range(1, len(devices))]
        for p in self.followers:
            p.start()
        self._watch_stop = threading.Event()
        conn, outq = parent, self._outq
        self._threads = [
            threading.Thread(target=self._reader, args=(conn,), name=f"cadence-worker-{self.index}-reader", daemon=True),
            threading.Thread(target=self._writer, args=(conn, outq), name=f"cadence-worker-{self.index}-writer",
                             daemon=True),
        ]
        if self.followers:
            self._threads.append(threading.Thread(target=self._watch, args=(list(self.followers), self._watch_stop),
                                                  name=f"cadence-worker-{self.index}-watch", daemon=True))
        for t in self._threads:
            t.start()

    def _watch(self, followers: list, stop: threading.Event) -> None:
        """A tensor-parallel group: a follower rank that exits takes the group down at once (rank 0 would
        otherwise wait in a collective until TP_TIMEOUT_S): reported as a dead worker, which the server
        answers by restarting the group (its session, if any, ends with the error)."""
        while not stop.wait(0.2):
            for r, p in enumerate(followers, start=1):
                if not p.is_alive():
                    if not stop.is_set() and not self._stopping:
                        _call(self._loop, self._dispatch, ("died", None, f"tensor-parallel rank {r} exited"))
                    return

    def send(self, msg: tuple) -> None:
        if msg[0] == "chunk" and len(msg) == 5:  # a chunk request: lend it a shared-memory slot if there is one
            msg = (*msg, self.ring.acquire() if self.ring is not None else None)
        self._outq.put(msg)

    def _writer(self, conn, outq: queue.SimpleQueue) -> None:
        while True:
            msg = outq.get()
            if msg is None:
                return
            try:
                conn.send(msg)
            except (OSError, EOFError, BrokenPipeError, ValueError):
                return

    def _reader(self, conn) -> None:
        loop, ring = self._loop, self.ring
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError, TypeError, ValueError):
                if not self._stopping:
                    _call(loop, self._dispatch, ("died", None, "the worker process exited"))
                return
            msg = self._take_frames(ring, msg)
            if msg is not None:
                _call(loop, self._dispatch, msg)

    @staticmethod
    def _take_frames(ring: FrameRing | None, msg: tuple) -> tuple | None:
        """On the reader thread: copy a chunk's frames out of its shared-memory slot and free the slot
        (also for dropped chunks and errors that carry one). None = nothing for the event loop."""
        kind = msg[0]
        if kind == "dropped":
            if ring is not None:
                ring.release(msg[3])
            return None
        if kind == "chunk" and msg[3] is None:
            slot = msg[4].get("slot")
            if ring is None or slot is None:
                return ("error", msg[1], f"chunk {msg[2]} came back without frames")
            try:
                frames = ring.read(slot)
            finally:
                ring.release(slot)
            return ("chunk", msg[1], msg[2], frames, msg[4])
        if kind == "error" and len(msg) > 3:
            if ring is not None:
                ring.release(msg[3])
            return msg[:3]
        return msg

    def _dispatch(self, msg: tuple) -> None:
        if msg[0] == "ready":
            self.info = msg[1]
            self.ready.set()
            log.info("worker %d ready (pid %s): %s", self.index, self.pid, self.info)
            for note in self.info.get("notes") or ():
                log.info("worker %d: %s", self.index, note)
            return
        if msg[0] == "error" and msg[1] is None and not self.ready.is_set() and self.start_error is None:
            self.start_error = msg[2]
            log.error("worker %d: %s", self.index, msg[2])
        if msg[0] == "died":
            self.ready.clear()
        if self.on_message is not None:
            self.on_message(msg)

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the process to exit, then terminate/kill it if it does not; join the pipe threads."""
        self._stopping = True
        self._watch_stop.set()
        self.ready.clear()
        proc = self.proc
        if proc is not None:
            self._outq.put(("stop",))
            self._outq.put(None)
            deadline = time.monotonic() + timeout
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.terminate()
                await asyncio.to_thread(proc.join, 3.0)
            if proc.is_alive():  # pragma: no cover
                proc.kill()
            await asyncio.to_thread(proc.join, 3.0)
        for p in self.followers:  # rank 0 told them to stop; if it could not, they go now
            await asyncio.to_thread(p.join, 5.0)
            if p.is_alive():
                p.kill()
                await asyncio.to_thread(p.join, 3.0)
        self.followers = []
        if self.conn is not None:
            self.conn.close()
        self._outq.put(None)
        for t in self._threads:
            await asyncio.to_thread(t.join, 5.0)
        self._threads = []
        if proc is not None:
            proc.close() if not proc.is_alive() else None
        self.proc = None
        self.conn = None
        if self.ring is not None:  # the process and the reader are gone: nothing maps a slot any more
            self.ring.close()
            self.ring = None

    async def restart(self) -> None:
        """Replace a dead or stuck process with a fresh one."""
        await self.stop(timeout=1.0)
        self._stopping = False
        self.session_id = None
        self.restarts += 1
        self.start()


def _call(loop: asyncio.AbstractEventLoop | None, fn, *args) -> None:
    if loop is None or loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed meanwhile
        pass
