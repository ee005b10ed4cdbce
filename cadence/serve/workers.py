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

Groups that share a GPU (``cadence serve --sessions-per-gpu N``; ``cadence.serve.sharing`` has the rules and
the arithmetic): :class:`LocalGroups` starts the first group of each shared GPU alone, checks from its
memory figures that the others fit (one error line, or only those that fit), starts the others (one that runs
out of memory at start anyway, several warm-ups peaking at once, is left out with one line), then lets
the groups of each shared device stream flat out together (:func:`measure_throughput`) and keeps the
sessions admitted on it to what that throughput holds at real time (:class:`SharedDevice`). With ``--mps``
the workers run under a private MPS daemon (``cadence.serve.mps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from cadence.engine.messages import (
    ChunkDone,
    ChunkRequest,
    Closed,
    CloseSession,
    Died,
    Dropped,
    Error,
    Opened,
    OpenSession,
    Ready,
    Stop,
    WorkerInfo,
)
from cadence.engine.placement import Placement, Sharing
from cadence.engine.recipe import WorkerSpec
from cadence.engine.shm import FrameRing
from cadence.engine.spec import DEFAULT_PROMPT
from cadence.errors import one_line, out_of_memory
from cadence.net import free_port
from cadence.serve.lines import worker_ready_line
from cadence.serve.pacing import LatencyProfile
from cadence.serve.sharing import ShareRules, capacity_of, memory_error, memory_fit

log = logging.getLogger("cadence.serve")


def _spawned(entry: str, env: dict, *args) -> None:  # pragma: no cover - runs in the child process
    """The spawned process's target: its own environment (``env``: an MPS daemon's pipe and log folders) set
    before anything imports torch, then ``cadence.engine.worker`` (and torch), only there."""
    os.environ.update(env)
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
        self.env: dict[str, str] = {}  # set in its processes before torch (an MPS daemon's folders)
        self.share: SharedDevice | None = None  # the groups it shares its GPU with, and their capacity

    @property
    def device(self) -> str:
        return self.spec.recipe.device

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def free(self) -> bool:
        """Ready, holding no session, and on a device with room for one more (``SharedDevice.admits``)."""
        return (
            self.ready.is_set()
            and self.session_id is None
            and not self._stopping
            and (self.share is None or self.share.admits(self))
        )

    @property
    def stopping(self) -> bool:
        return self._stopping

    def info_dict(self) -> dict:
        """Its ``WorkerInfo`` as plain data, with ``share`` (the device it shares, its capacity) when shared and
        ``mps``; empty until the group is ready (a fleet's front end reads an empty one as "not up")."""
        if self.info is None:
            return {}
        d = dataclasses.asdict(self.info)
        if self.share is not None:
            d["share"] = self.share.describe()
        d["mps"] = "CUDA_MPS_PIPE_DIRECTORY" in self.env  # its processes are clients of an MPS daemon
        return d

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
            args=("worker_main", dict(self.env), child, spec),
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
                args=("follower_main", dict(self.env), r, fspec),
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
                self.start_error = one_line(text)
                log.error("worker %d: %s", self.index, self.start_error)
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


class SharedDevice:
    """The worker groups placed on one placement that several of them hold (``--sessions-per-gpu``): at most
    ``capacity`` of them hold a session at once (None: every group; ``enforced`` False: measured, not kept to).
    ``measured``: what :func:`measure_throughput` found; ``memory``: the first group's memory figures."""

    def __init__(self, placement: Placement, groups: list[WorkerGroup]):
        self.placement, self.groups = placement, groups
        self.capacity: int | None = None
        self.enforced = True
        self.measured: dict | None = None
        self.memory: dict | None = None
        self.left_out = 0  # further groups that ran out of memory at start (``LocalGroups._leave_out``)

    def busy(self) -> int:
        """Its groups holding a session (or held for one being admitted)."""
        return sum(g.session_id is not None for g in self.groups)

    def room(self) -> bool:
        """Whether one more session may start on it."""
        return self.capacity is None or not self.enforced or self.busy() < self.capacity

    def admits(self, g: WorkerGroup) -> bool:
        """Whether idle group ``g`` counts as free: one of the first ``capacity - busy`` idle groups (so the
        free groups the manager counts are the sessions the device still takes, as its turns need)."""
        if self.capacity is None or not self.enforced:
            return True
        left = self.capacity - self.busy()
        idle = [x for x in self.groups if x.session_id is None and x.ready.is_set() and not x.stopping]
        return left > 0 and g in idle[:left]

    def describe(self) -> dict:
        return {
            "placement": str(self.placement),
            "groups": len(self.groups),
            "capacity": self.capacity,
            "enforced": self.enforced and self.capacity is not None,
            "busy": self.busy(),
            "measured": self.measured,
            "memory": self.memory,
            "left_out": self.left_out,
        }


async def measure_throughput(
    groups: list[WorkerGroup], seconds: float, skip: int = 2, timeout_s: float = 120.0
) -> list[float]:
    """Chunks per second each of ``groups`` makes while all of them stream flat out together: every group
    opens its default session (the one it opened ahead), keeps ``slots - 1`` chunk requests in flight, and
    once every group has ``skip`` chunks back (the first chunks are not steady) the chunks each gets back in
    the next ``seconds`` are counted. Their sessions are closed after. Raises RuntimeError when a group fails
    or the measurement does not finish within ``timeout_s`` (the handlers are restored either way)."""
    loop = asyncio.get_running_loop()
    probes = [_Probe(g, f"capacity-{g.index}") for g in groups]
    try:
        for p in probes:
            p.open()
        t_end = loop.time() + timeout_s
        await _until(lambda: all(p.opened.is_set() for p in probes), probes, t_end, "open its session")
        for p in probes:
            p.run()
        await _until(lambda: all(len(p.done) >= skip for p in probes), probes, t_end, "return its chunks")
        t_a = max(p.done[skip - 1] for p in probes)
        await asyncio.sleep(max(0.0, t_a + seconds - loop.time()))
        t_b = t_a + seconds
        return [sum(t_a < t <= t_b for t in p.done) / seconds for p in probes]
    finally:
        for p in probes:
            p.close()
        with contextlib.suppress(RuntimeError):
            await _until(lambda: all(p.closed.is_set() for p in probes), [], loop.time() + 10.0, "close")
        for p in probes:
            p.restore()


async def _until(cond: Callable[[], bool], probes: list, deadline: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    while not cond():
        failed = [p for p in probes if p.error]
        if failed:
            raise RuntimeError("; ".join(f"worker {p.g.index}: {p.error}" for p in failed))
        if loop.time() > deadline:
            raise RuntimeError(f"a worker did not {what} in time")
        await asyncio.sleep(0.01)


class _Probe:
    """One group's flat-out stream for :func:`measure_throughput` (its replies taken over meanwhile)."""

    def __init__(self, g: WorkerGroup, sid: str):
        self.g, self.sid = g, sid
        self.saved = g.on_message
        self.opened, self.closed = asyncio.Event(), asyncio.Event()
        self.running = False
        self.index = 0
        self.done: list[float] = []
        self.error: str | None = None
        info = g.info
        self.audio = np.zeros(info.audio_samples_per_chunk if info else 0, np.float32)
        self.in_flight = max(1, g.slots - 1)
        g.on_message = self.on_message

    def open(self) -> None:
        self.g.send(OpenSession(self.sid, None, DEFAULT_PROMPT, 0))

    def run(self) -> None:
        self.running = True
        for _ in range(self.in_flight):
            self.request()

    def request(self) -> None:
        self.g.send(ChunkRequest(self.sid, self.index, self.audio, time.monotonic()))
        self.index += 1

    def on_message(self, msg) -> None:
        match msg:
            case Opened(sid=self.sid):
                self.opened.set()
            case ChunkDone(sid=self.sid):
                self.done.append(asyncio.get_running_loop().time())
                if self.running:
                    self.request()
            case Closed(sid=self.sid):
                self.closed.set()
            case Error(sid=sid, message=text) if sid in (self.sid, None):
                self.error = text
            case Died(reason=reason):
                self.error = f"died: {reason}"
                self.closed.set()
                if self.saved is not None:  # the manager restarts it
                    self.saved(msg)

    def close(self) -> None:
        self.running = False
        if self.g.ready.is_set():
            self.g.send(CloseSession(self.sid))
        else:
            self.closed.set()

    def restore(self) -> None:
        self.g.on_message = self.saved


class LocalGroups:
    """The single-machine group source: this machine's :class:`WorkerGroup` processes, one session each, every
    session of class ``session_class`` (``cadence.serve.manager.group_source`` gives ``LiveSession``: the
    media in this process; passed in, so that this module, which a fleet's group actor imports, needs none of
    the session's media code). Groups on one placement (``sharing``) share a :class:`SharedDevice`; ``rules``
    say what is measured and kept to there (``cadence.serve.sharing.ShareRules``)."""

    fleet = False

    def __init__(
        self,
        groups: list[WorkerGroup],
        session_class,
        sharing: Sharing | None = None,
        rules: ShareRules | None = None,
    ):
        self.groups, self.session_class = groups, session_class
        self.rules = rules or ShareRules()
        self.mps = None  # a cadence.serve.mps.MpsDaemon while one runs for the workers
        self.shares: list[SharedDevice] = []
        for placement, ix in (sharing.shared if sharing is not None else {}).items():
            share = SharedDevice(placement, [groups[i] for i in ix])
            for g in share.groups:
                g.share = share
            self.shares.append(share)

    @property
    def recipe(self):
        """What the groups build (each group's own resolution; one model, so one geometry): the first's."""
        return self.groups[0].spec.recipe

    async def start(self, route: Callable, metrics, timeout_s: float) -> None:
        """Start every group; return when all are ready (RuntimeError: one failed, did not fit its GPU's
        memory, or the timeout). The first group of each shared GPU starts alone: its memory figures say how
        many more fit (``ShareRules.memory_fit``), then the others start (one that runs out of memory is left
        out: ``_start_further``); then each shared device's capacity
        is measured (``ShareRules.measures``). Each of the two starts has ``timeout_s``. (The manager exports
        this machine's groups to ``metrics``.)"""
        if self.rules.mps and any(g.device.startswith("cuda") for g in self.groups):
            from cadence.serve.mps import MpsDaemon

            self.mps = await asyncio.to_thread(MpsDaemon.start)
        for g in self.groups:
            g.on_message = lambda msg, g=g: route(g, msg)
            g.env = dict(self.mps.env) if self.mps is not None else {}
        later = {id(g) for s in self.shares if s.placement.kind == "cuda" for g in s.groups[1:]}
        first = [g for g in self.groups if id(g) not in later]
        try:
            await self._start(first, timeout_s)
        except RuntimeError as e:
            if self.mps is None:
                raise
            await self._without_mps(first, e)  # (a daemon that started but serves no client)
            await self._start(first, timeout_s)
        self._fit_memory()
        await self._start_further([g for g in self.groups if id(g) in later], timeout_s)
        if self.mps is not None:
            log.info("MPS: servers %s", await asyncio.to_thread(self.mps.servers))
        await self._measure_capacity()

    async def _without_mps(self, started: list[WorkerGroup], why: Exception) -> None:
        """The workers could not start under MPS: one log line, the daemon stopped, the groups stopped and their
        environment cleared (the caller starts them again, time-sharing the GPU)."""
        log.warning("--mps: the workers did not start under MPS (%s): starting them without it", why)
        await asyncio.gather(*(g.stop(timeout=2.0) for g in started), return_exceptions=True)
        await asyncio.to_thread(self.mps.stop)
        self.mps = None
        for g in self.groups:
            g.env, g._stopping = {}, False

    async def _start(self, groups: list[WorkerGroup], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for g in groups:
            g.start()
        while not all(g.ready.is_set() for g in groups):
            failed = [g for g in groups if g.start_error]
            if failed:
                raise RuntimeError(
                    "; ".join(f"worker {g.index} ({g.device}): {g.start_error}" for g in failed)
                )
            if loop.time() > deadline:
                raise RuntimeError(f"worker processes not ready within {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def _start_further(self, groups: list[WorkerGroup], timeout_s: float) -> None:
        """Start the further groups of the shared GPUs, all at once. One that fails because its GPU ran out of
        memory is left out (one log line; the server starts with the others: their warm-ups peak together,
        above the first group's steady footprint that :func:`memory_fit` counted); any other failure, or the
        timeout, is a RuntimeError (one line), as for the first groups."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for g in groups:
            g.start()
        pending = list(groups)
        while pending:
            failed = [g for g in pending if g.start_error]
            hard = [g for g in failed if not out_of_memory(g.start_error)]
            if hard:
                raise RuntimeError("; ".join(f"worker {g.index} ({g.device}): {g.start_error}" for g in hard))
            for g in failed:
                await self._leave_out(g)
            pending = [g for g in pending if not g.ready.is_set() and g not in failed]
            if pending and loop.time() > deadline:
                raise RuntimeError(f"worker processes not ready within {timeout_s:.0f} s")
            if pending:
                await asyncio.sleep(0.05)

    async def _leave_out(self, g: WorkerGroup) -> None:
        """A further group that ran out of memory at start: stopped, taken off its device and the server's
        groups (so the capacity measured next and admission count only those that serve); one log line."""
        why = g.start_error
        await g.stop(timeout=2.0)
        self.groups.remove(g)
        share = g.share
        if share is not None:
            share.groups.remove(g)
            share.left_out += 1
            g.share = None
        left = len(share.groups) if share is not None else 0
        log.warning(
            "worker %d (%s) left out: it ran out of GPU memory at start (%s); %d group(s) serve on %s",
            g.index,
            g.device,
            why,
            left,
            share.placement if share is not None else g.device,
        )

    def _fit_memory(self) -> None:
        """Each shared GPU, its first group up: do the others fit? RuntimeError (one line) or, with 'trim', only
        those that fit stay (the rest are never started)."""
        for share in self.shares:
            mem = share.groups[0].info.gpu_memory if share.groups[0].info is not None else None
            if not mem:
                continue
            fit = memory_fit(mem["total_mb"], mem["free_mb"])
            share.memory = {**mem, "used_mb": round(fit.used_mb, 1), "fits": fit.fits}
            if fit.fits >= len(share.groups):
                continue
            text = memory_error(str(share.placement), self.recipe.model, len(share.groups), fit)
            if self.rules.memory_fit == "error":
                raise RuntimeError(text)
            log.warning("%s: starting %d of them", text, fit.fits)
            for g in share.groups[fit.fits :]:
                self.groups.remove(g)
            del share.groups[fit.fits :]

    async def _measure_capacity(self) -> None:
        """Each shared device its rules measure: its groups stream flat out together; its capacity follows
        (one log line each). A measurement that fails leaves one session per group, said in one line."""
        chunk_s = self.recipe.config.chunk_seconds
        for share in self.shares:
            if len(share.groups) < 2 or not self.rules.measures(share.placement.kind):
                continue
            try:
                rates = await measure_throughput(share.groups, self.rules.capacity_s)
            except RuntimeError as e:
                log.warning("%s: capacity not measured (%s): one session per group", share.placement, e)
                continue
            cap = capacity_of(rates, chunk_s, len(share.groups))
            share.capacity, share.enforced = cap, self.rules.enforces
            share.measured = {
                "seconds": self.rules.capacity_s,
                "chunks_per_s": [round(r, 3) for r in rates],
                "realtime_sessions": round(sum(rates) * chunk_s, 2),
                "capacity": cap,
            }
            log.info(
                "%s: %d groups streaming together made %.2f chunks/s (a chunk is %.3f s): %.2f real-time "
                "sessions' worth; capacity %d%s",
                share.placement,
                len(share.groups),
                sum(rates),
                chunk_s,
                sum(rates) * chunk_s,
                cap,
                "" if share.enforced else " (reported, not enforced: one session per group)",
            )

    async def stop(self) -> None:
        await asyncio.gather(*(g.stop() for g in self.groups), return_exceptions=True)
        if self.mps is not None:
            await asyncio.to_thread(self.mps.stop)
            self.mps = None

    def sharing(self) -> list[dict]:
        """Each shared device: its groups, capacity, measurement, memory (``/config``, the start line)."""
        return [s.describe() for s in self.shares]

    @contextlib.asynccontextmanager
    async def admission(self):
        """Nothing to do ahead on one machine: ``acquire`` picks a free group synchronously."""
        yield

    def acquire(self) -> WorkerGroup | None:
        """A free group, on the device with the fewest sessions (a shared one at its capacity has none free)."""
        free = [g for g in self.groups if g.free]
        if not free:
            return None
        return min(free, key=lambda g: (g.share.busy() if g.share is not None else 0, g.index))

    def release(self, group: WorkerGroup, sid: str) -> None:
        if group.session_id == sid:
            group.session_id = None

    def retry_after(self) -> int | None:
        """None: the manager estimates it from its own sessions (they are all the sessions there are; on a
        device at its capacity, the soonest to end frees room there, and a group)."""
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
