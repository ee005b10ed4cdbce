"""Model work in a worker process, one per GPU group (on the CPU: one per worker slot).

The web process never runs the model: each group owns a process started with ``spawn`` that builds
the generator once (so a new session's first frame costs a chunk, not a model build) and serves one
session at a time. Messages are tuples over a ``multiprocessing`` pipe:

    web -> worker   ("open", sid, image float32 [3,H,W] | None, prompt, seed)
                    ("chunk", sid, index, audio float32 [samples_per_chunk], t_plan)
                    ("close", sid)            ("stop",)
    worker -> web   ("ready", info)           ("opened", sid, ms)        ("closed", sid)
                    ("chunk", sid, index, frames uint8 [F,H,W,3], timings dict)
                    ("error", sid | None, message)

Frames come back pickled through the pipe (196 KB per chunk at the tiny preset); large presets
would move them through shared memory instead. Times are ``time.monotonic()`` (one system-wide
clock, the same as asyncio's loop clock), so the web process can compare them.

On the web side, :class:`WorkerGroup` wraps one process: a writer thread (so a blocked pipe never
stalls the event loop), a reader thread that hands messages to the event loop, and restart/stop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("cadence.serve")


# ---- the worker process ---------------------------------------------------------------------------

def worker_main(conn, preset: str, device: str, threads: int, seed: int) -> None:  # pragma: no cover - other process
    """Entry point of the worker process (spawned: imports torch here, never in the web process's loop)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops us cleanly
    import torch

    from cadence.config import get_preset
    from cadence.engine.generate import build_generator
    from cadence.media.image import default_reference_image

    if threads > 0:
        torch.set_num_threads(threads)
    cfg = get_preset(preset)
    t = time.monotonic()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = build_generator(cfg, device=device, dtype=dtype, seed=seed)
    default_image = default_reference_image(cfg.stream.height, cfg.stream.width)
    conn.send(("ready", {"preset": cfg.name, "device": device, "build_ms": (time.monotonic() - t) * 1e3,
                         "threads": torch.get_num_threads()}))
    sess = None
    sid_open = None
    with torch.no_grad():
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            try:
                if kind == "stop":
                    return
                if kind == "open":
                    _, sid, image, prompt, sseed = msg
                    t = time.monotonic()
                    img = default_image if image is None else torch.from_numpy(image)
                    sess = gen.session(img, prompt, seed=sseed)
                    sid_open = sid
                    conn.send(("opened", sid, (time.monotonic() - t) * 1e3))
                elif kind == "chunk":
                    _, sid, index, audio, t_plan = msg
                    if sid != sid_open or sess is None:
                        continue  # a chunk for a session already closed: drop it
                    t_recv = time.monotonic()
                    lat = sess.step(torch.from_numpy(audio).to(gen.model.device))
                    t_step = time.monotonic()
                    frames = sess.decode(lat).cpu().numpy()
                    t_done = time.monotonic()
                    conn.send(("chunk", sid, index, frames, {
                        "t_plan": t_plan, "t_recv": t_recv, "t_done": t_done,
                        "diffusion_ms": (t_step - t_recv) * 1e3, "decode_ms": (t_done - t_step) * 1e3}))
                elif kind == "close":
                    _, sid = msg
                    if sid == sid_open:
                        sess, sid_open = None, None
                        if device.startswith("cuda"):
                            torch.cuda.empty_cache()
                    conn.send(("closed", sid))
                else:
                    conn.send(("error", None, f"unknown message {kind!r}"))
            except (EOFError, OSError, BrokenPipeError):
                return
            except Exception as e:
                sid = msg[1] if len(msg) > 1 else None
                if kind == "open":
                    sess, sid_open = None, None
                try:
                    conn.send(("error", sid, f"{type(e).__name__}: {e}"))
                except (EOFError, OSError):
                    return


# ---- the web side ---------------------------------------------------------------------------------

class WorkerGroup:
    """One worker process (one GPU group) seen from the event loop.

    ``on_message(msg)`` is called on the event loop for every message from the worker; a worker
    that dies is reported as ``("died", None, reason)``. Sending never blocks the loop.
    """

    def __init__(self, index: int, preset: str, device: str = "cpu", threads: int = 1, seed: int = 0):
        self.index, self.preset, self.device, self.threads, self.seed = index, preset, device, threads, seed
        self.proc: mp.process.BaseProcess | None = None
        self.conn = None
        self.ready = asyncio.Event()
        self.info: dict = {}
        self.session_id: str | None = None  # the session holding this group
        self.on_message: Callable[[tuple], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
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
        parent, child = ctx.Pipe(duplex=True)
        self.conn = parent
        self.ready.clear()
        self._outq = queue.SimpleQueue()
        self.proc = ctx.Process(target=worker_main, args=(child, self.preset, self.device, self.threads, self.seed),
                                name=f"cadence-worker-{self.index}", daemon=True)
        self.proc.start()
        child.close()
        conn, outq = parent, self._outq
        self._threads = [
            threading.Thread(target=self._reader, args=(conn,), name=f"cadence-worker-{self.index}-reader", daemon=True),
            threading.Thread(target=self._writer, args=(conn, outq), name=f"cadence-worker-{self.index}-writer",
                             daemon=True),
        ]
        for t in self._threads:
            t.start()

    def send(self, msg: tuple) -> None:
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
        loop = self._loop
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError, TypeError, ValueError):
                if not self._stopping:
                    _call(loop, self._dispatch, ("died", None, "the worker process exited"))
                return
            _call(loop, self._dispatch, msg)

    def _dispatch(self, msg: tuple) -> None:
        if msg[0] == "ready":
            self.info = msg[1]
            self.ready.set()
            log.info("worker %d ready (pid %s): %s", self.index, self.pid, self.info)
            return
        if msg[0] == "died":
            self.ready.clear()
        if self.on_message is not None:
            self.on_message(msg)

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the process to exit, then terminate/kill it if it does not; join the pipe threads."""
        self._stopping = True
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
