"""The web side of a worker group: :class:`WorkerGroup`, one group's processes seen from the event loop.

The model runs in worker processes (``cadence.engine.worker``: rank 0, plus the follower ranks of a
tensor-parallel group), started here with ``spawn``; this module imports no torch (the web process never
does). Messages are the dataclasses of :mod:`cadence.engine.messages`: a writer thread sends requests
(so a blocked pipe never stalls the event loop), a reader thread receives replies, copies a chunk's frames
out of its shared-memory slot (``cadence.engine.shm.FrameRing``) and hands the reply to the event loop;
a worker that dies is reported as :class:`~cadence.engine.messages.Died`. ``restart`` replaces a dead or
stuck group; ``stop`` ends it, bounded.

The session manager gets its groups from a *source* (the ``GroupSource`` of :mod:`cadence.serve.ports`):
:class:`LocalGroups` (this machine's groups: the default) or, with ``cadence serve --ray``,
``cadence.fleet.frontend.FleetGroups`` (groups of a Ray fleet, each seen through a ``RayGroup``). A
:class:`WorkerGroup` is that module's ``GroupPort`` (and ``SessionGroup``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable

from cadence.engine.messages import ChunkDone, ChunkRequest, Died, Dropped, Error, Ready, Stop, WorkerInfo
from cadence.engine.recipe import WorkerSpec
from cadence.engine.shm import FrameRing
from cadence.net import free_port
from cadence.serve.lines import worker_ready_line
from cadence.serve.pacing import LatencyProfile

log = logging.getLogger("cadence.serve")


def _spawned(entry: str, *args) -> None:  # pragma: no cover - runs in the child process
    """The spawned process's target: imports ``cadence.engine.worker`` (and torch) only there."""
    getattr(importlib.import_module("cadence.engine.worker"), entry)(*args)


class WorkerGroup:
    """One worker group (one process per device) seen from the event loop.

    ``on_message(msg)`` is called on the event loop for every reply from the worker; a worker that dies is
    reported as ``Died``. Sending never blocks the loop.
    """

    transport_s = 0.0  # the pipe's cost is in the session's latency already (``session.worker_speed``)

    def __init__(
        self,
        index: int,
        spec: WorkerSpec,
        frame_shape: tuple[int, ...] | None = None,
        slots: int = 3,
        shm: bool = False,
    ):
        """``spec``: what the worker builds (``cadence.engine.recipe.WorkerSpec``); with ``shm`` and a
        ``frame_shape`` ([F, H, W, 3]) the frames come back through a :class:`FrameRing` of ``slots`` chunks,
        created here at every start."""
        self.index, self.spec = index, spec
        self.frame_shape = tuple(frame_shape) if frame_shape is not None else None
        self.slots, self.shm = slots, shm
        self.ring: FrameRing | None = None
        self.start_error: str | None = None
        self.proc: mp.process.BaseProcess | None = None
        self.followers: list[mp.process.BaseProcess] = []  # ranks 1..N-1 of a tensor-parallel group
        self.conn = None
        self.ready = asyncio.Event()
        self.info: WorkerInfo | None = None
        self.session_id: str | None = None  # the session holding this group
        self.on_message: Callable[[object], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._watch_stop = threading.Event()
        self._stopping = False
        self.restarts = 0
        # its sessions' chunk latencies, across sessions: a new session's lead covers their tail (pacing.py)
        self.latency_profile = LatencyProfile()

    @property
    def device(self) -> str:
        return self.spec.recipe.device

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def free(self) -> bool:
        return self.ready.is_set() and self.session_id is None and not self._stopping

    def info_dict(self) -> dict:
        return dataclasses.asdict(self.info) if self.info is not None else {}

    def start(self) -> None:
        """Spawn the processes and the pipe threads (returns at once; ``ready`` is set when the model is built
        and warmed up)."""
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        spec = dataclasses.replace(self.spec, shm=None, tp_port=None)
        self.start_error = None
        if self.shm and self.frame_shape is not None:
            self.ring = FrameRing.create(self.frame_shape, self.slots)
            spec = dataclasses.replace(
                spec, shm={"name": self.ring.name, "shape": list(self.frame_shape), "slots": self.slots}
            )
        parent, child = ctx.Pipe(duplex=True)
        self.conn = parent
        self.ready.clear()
        self._outq = queue.SimpleQueue()
        devices = spec.recipe.devices
        if len(devices) > 1:
            spec = dataclasses.replace(spec, tp_port=free_port())
        self.proc = ctx.Process(
            target=_spawned,
            args=("worker_main", child, spec),
            name=f"cadence-worker-{self.index}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        # a tensor-parallel group: the follower ranks, started by us (rank 0 is daemonic: no children)
        fspec = dataclasses.replace(spec, shm=None)
        self.followers = [
            ctx.Process(
                target=_spawned,
                args=("follower_main", r, fspec),
                name=f"cadence-worker-{self.index}-rank{r}",
                daemon=True,
            )
            for r in range(1, len(devices))
        ]
        for p in self.followers:
            p.start()
        self._watch_stop = threading.Event()
        conn, outq = parent, self._outq
        self._threads = [
            threading.Thread(
                target=self._reader, args=(conn,), name=f"cadence-worker-{self.index}-reader", daemon=True
            ),
            threading.Thread(
                target=self._writer,
                args=(conn, outq),
                name=f"cadence-worker-{self.index}-writer",
                daemon=True,
            ),
        ]
        if self.followers:
            self._threads.append(
                threading.Thread(
                    target=self._watch,
                    args=(list(self.followers), self._watch_stop),
                    name=f"cadence-worker-{self.index}-watch",
                    daemon=True,
                )
            )
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
                        _call(self._loop, self._dispatch, Died(f"tensor-parallel rank {r} exited"))
                    return

    def send(self, msg) -> None:
        """Queue a request for the worker; a chunk request is lent a shared-memory slot when one is free."""
        if isinstance(msg, ChunkRequest) and msg.slot is None and self.ring is not None:
            msg = dataclasses.replace(msg, slot=self.ring.acquire())
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
                    _call(loop, self._dispatch, Died("the worker process exited"))
                return
            msg = self.take_frames(ring, msg)
            if msg is not None:
                _call(loop, self._dispatch, msg)

    @staticmethod
    def take_frames(ring: FrameRing | None, msg):
        """On the reader thread: copy a chunk's frames out of its shared-memory slot and free the slot (also
        for dropped chunks and errors that carry one). None = nothing for the event loop."""
        match msg:
            case Dropped(slot=slot):
                if ring is not None:
                    ring.release(slot)
                return None
            case ChunkDone(frames=None, slot=slot):
                if ring is None or slot is None:
                    return Error(msg.sid, f"chunk {msg.index} came back without frames")
                try:
                    frames = ring.read(slot)
                finally:
                    ring.release(slot)
                return dataclasses.replace(msg, frames=frames, slot=None)
            case Error(slot=slot) if slot is not None:
                if ring is not None:
                    ring.release(slot)
                return dataclasses.replace(msg, slot=None)
        return msg

    def _dispatch(self, msg) -> None:
        match msg:
            case Ready(info=info):
                self.info = info
                self.ready.set()
                log.info("%s", worker_ready_line(self.index, self.pid, info))  # (issue 39: one line to read)
                log.debug("worker %d ready: %s", self.index, self.info_dict())
                for note in info.notes:
                    log.info("worker %d: %s", self.index, note)
                return
            case Error(sid=None, message=text) if not self.ready.is_set() and self.start_error is None:
                self.start_error = text
                log.error("worker %d: %s", self.index, text)
            case Died():
                self.ready.clear()
        if self.on_message is not None:
            self.on_message(msg)

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the processes to exit, then terminate/kill them if they do not; join the pipe threads."""
        self._stopping = True
        self._watch_stop.set()
        self.ready.clear()
        proc = self.proc
        if proc is not None:
            self._outq.put(Stop())
            self._outq.put(None)
            deadline = time.monotonic() + timeout
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if (
                proc.is_alive()
            ):  # (the workers ignore SIGTERM: the server, not a signal, decides when they go)
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
        if self.ring is not None:  # the processes and the reader are gone: nothing maps a slot any more
            self.ring.close()
            self.ring = None

    async def restart(self) -> None:
        """Replace a dead or stuck group with fresh processes."""
        await self.stop(timeout=1.0)
        self._stopping = False
        self.session_id = None
        self.restarts += 1
        self.start()


class LocalGroups:
    """The single-machine group source: this machine's :class:`WorkerGroup` processes, one session each, every
    session of class ``session_class`` (``cadence.serve.manager.group_source`` gives ``LiveSession``: the
    media in this process; passed in, so that this module, which a fleet's group actor imports, needs none of
    the session's media code)."""

    fleet = False

    def __init__(self, groups: list[WorkerGroup], session_class):
        self.groups, self.session_class = groups, session_class

    @property
    def recipe(self):
        """What the groups build (each group's own resolution; one model, so one geometry): the first's."""
        return self.groups[0].spec.recipe

    async def start(self, route: Callable, metrics, timeout_s: float) -> None:
        """Start every group; return when all are ready (RuntimeError: one failed, or the timeout). (The
        manager exports this machine's groups to ``metrics`` itself.)"""
        loop = asyncio.get_running_loop()
        for g in self.groups:
            g.on_message = lambda msg, g=g: route(g, msg)
            g.start()
        deadline = loop.time() + timeout_s
        while not all(g.ready.is_set() for g in self.groups):
            failed = [g for g in self.groups if g.start_error]
            if failed:
                raise RuntimeError(
                    "; ".join(f"worker {g.index} ({g.device}): {g.start_error}" for g in failed)
                )
            if loop.time() > deadline:
                raise RuntimeError(f"worker processes not ready within {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await asyncio.gather(*(g.stop() for g in self.groups), return_exceptions=True)

    @contextlib.asynccontextmanager
    async def admission(self):
        """Nothing to do ahead on one machine: ``acquire`` picks a free group synchronously."""
        yield

    def acquire(self) -> WorkerGroup | None:
        for g in self.groups:
            if g.free:
                return g
        return None

    def release(self, group: WorkerGroup, sid: str) -> None:
        if group.session_id == sid:
            group.session_id = None

    def retry_after(self) -> int | None:
        """None: the manager estimates it from its own sessions (they are all the sessions there are)."""
        return None

    def session_factory(self, group: WorkerGroup):
        """Every session here is of the one class the source was built with."""
        return self.session_class


def _call(loop: asyncio.AbstractEventLoop | None, fn, *args) -> None:
    if loop is None or loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed meanwhile
        pass
