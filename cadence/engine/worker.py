"""The GPU side of ``cadence serve``: one worker process per device of a worker group, each driving one
:class:`~cadence.engine.engine.Engine`.

The web process never runs the model: each group (a GPU, a tensor-parallel set of GPUs, or a CPU slot)
owns long-lived processes started with ``spawn`` (``cadence.serve.workers.WorkerGroup``) that build the
engine once (so a new session's first frame costs a chunk, not a model build) and serve one session at
a time. Requests and replies are the dataclasses of :mod:`cadence.engine.messages`.

Rank 0 talks to the web process over a pipe; in a tensor-parallel group ('cuda:0+cuda:1') it forwards
every command to the follower ranks over a gloo group (``_Peers``), so the collectives inside the steps
meet, and only rank 0 decodes and answers. Both run the same command loop (:func:`run_commands`): rank 0's
commands come from the pipe, the followers' from rank 0. A collective that waits longer than
``TP_TIMEOUT_S`` fails, so a dead rank takes its group down (the web side restarts it) instead of hanging it.

Chunks: the main thread runs each request's diffusion (``Engine.submit``) and goes back to the pipe; the
engine's decode thread finishes the chunk and the reply (``ChunkDone``) is sent from there, frames written
straight into the request's shared-memory slot when one was lent (``cadence.engine.shm``). So while chunk
k decodes, chunk k+1 diffuses: the worker's busy time per chunk falls from step + decode toward
max(step, decode).

Before "ready": the engine's warm-up (every step shape, graph captures, the decoder; on the CPU the thread
count that sustains the faster rate), whose report sizes the web side's planning lead; then the next
session is opened ahead (default face and prompt), and again whenever the worker goes idle after a close:
a session that brings no image and the default prompt then only re-seeds it (the stream is exactly a fresh
open's), so its time to first frame is the first chunk's.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from cadence.engine.messages import (
    ChunkDone,
    ChunkRequest,
    Closed,
    CloseSession,
    Dropped,
    Error,
    Opened,
    OpenSession,
    Preopen,
    Ready,
    Stop,
    SwitchPrompt,
    WorkerInfo,
)
from cadence.engine.placement import gpu_worker_threads
from cadence.engine.recipe import WorkerSpec
from cadence.engine.spec import DEFAULT_PROMPT
from cadence.errors import one_line

log = logging.getLogger("cadence.serve")

#: How long a collective of a tensor-parallel worker group waits for a peer rank before failing: a rank
#: that died is noticed (the group then fails and is restarted) instead of hanging for torch's default.
TP_TIMEOUT_S = 300.0


class _Peers:
    """The control plane of a tensor-parallel worker group: rank 0 broadcasts every command it runs; each
    follower receives them in the same order."""

    def __init__(self, info):
        import torch.distributed as dist

        self.info = info
        self.control = info.group if info.backend == "gloo" else dist.new_group(backend="gloo")

    def bcast(self, msg=None):
        import torch.distributed as dist

        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def _tp_join(rank: int, devices: list[str], port: int):  # pragma: no cover - other process
    """Join the group's process group (rank ``rank`` of ``len(devices)``, on ``devices[rank]``)."""
    from cadence.parallel import init_tp

    dev = devices[rank]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(len(devices)),
        LOCAL_RANK=str(int(dev.split(":")[1]) if dev.startswith("cuda:") else rank),
    )
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback
    return init_tp(backend="gloo" if dev == "cpu" else None, timeout_s=TP_TIMEOUT_S)


def _build(spec: WorkerSpec, rank: int, tp, on_chunk=None):
    """This rank's engine: the group's recipe on the rank's device (a tensor-parallel group decodes on its own
    GPUs: the recipe says 'same')."""
    from cadence.engine.build import build_engine

    return build_engine(spec.recipe, spec.recipe.devices[rank], tp=tp, on_chunk=on_chunk)


def run_commands(
    eng, next_msg: Callable[[], object], reply: Callable[[object], None] | None, default_image, ring=None
) -> None:
    """The one command loop of a worker group, shared by rank 0 (``reply`` answers the web side; chunks
    decode) and the follower ranks (``reply`` None: they only step). Runs until ``Stop`` (or ``next_msg``
    raises EOFError / OSError: the other side is gone)."""
    rank0 = reply is not None
    cmds = _Commands(eng, reply or (lambda msg: None), rank0, default_image, ring)
    while True:
        try:
            msg = next_msg()
        except (EOFError, OSError):
            break
        try:
            if not cmds.handle(msg):
                break
        except (EOFError, OSError, BrokenPipeError):
            break
        except Exception as e:
            sid = getattr(msg, "sid", None)
            if isinstance(msg, OpenSession):
                cmds.sid_open = None
            if not rank0:  # rank 0 meets the same error on the same input and reports it
                log.warning("follower: %s failed (%s: %s)", type(msg).__name__, type(e).__name__, e)
            try:
                cmds.say(Error(sid, f"{type(e).__name__}: {e}", getattr(msg, "slot", None)))
            except (EOFError, OSError):
                break


class _Commands:
    """What :func:`run_commands` does with each message: the open session (``sid_open``), a prompt switch
    waiting for its chunk (``switch``: (index, prompt)), replies through ``say``."""

    def __init__(self, eng, say: Callable[[object], None], rank0: bool, default_image, ring):
        self.eng, self.say, self.rank0, self.default_image, self.ring = eng, say, rank0, default_image, ring
        self.sid_open: str | None = None
        self.switch: tuple[int, str] | None = None

    def handle(self, msg) -> bool:
        """Act on ``msg``; False for ``Stop``."""
        match msg:
            case Stop():
                return False
            case OpenSession(sid=sid, image=image, prompt=prompt, seed=seed):
                self.open(sid, image, prompt, seed)
            case ChunkRequest():
                self.chunk(msg)
            case SwitchPrompt(sid=sid, index=index, prompt=prompt):
                if sid == self.sid_open:  # (every rank gets it: the followers switch with rank 0)
                    self.switch = (index, prompt)
            case CloseSession(sid=sid):
                if sid == self.sid_open:
                    self.drop(self.eng.end_stream())
                    self.sid_open = None
                self.say(Closed(sid))
            case Preopen():
                try:
                    self.eng.preopen(self.default_image, DEFAULT_PROMPT, "default")
                except Exception as e:  # only a head start: the next open works as without it
                    log.warning("worker: could not open the next session ahead (%s: %s)", type(e).__name__, e)
            case _:
                self.say(Error(None, f"unknown message {type(msg).__name__}"))
        return True

    def drop(self, tags) -> None:
        """Chunks accepted but not decoded: give their slots back."""
        for tag in tags:
            sid, index, slot = tag
            self.say(Dropped(sid, index, slot))

    def open(self, sid: str, image, prompt, seed) -> None:
        t = time.monotonic()
        self.drop(self.eng.end_stream())
        self.sid_open = None
        img = self.default_image if image is None else torch.from_numpy(image)
        self.eng.open(img, prompt, seed, key="default" if image is None else None, decode=self.rank0)
        self.sid_open, self.switch = sid, None
        self.say(Opened(sid, (time.monotonic() - t) * 1e3, self.eng.last_open_preopened))

    def chunk(self, msg: ChunkRequest) -> None:
        sid, index, slot = msg.sid, msg.index, msg.slot
        if sid != self.sid_open:  # a chunk for a session already closed: drop it
            self.say(Dropped(sid, index, slot))
            return
        out = self.ring.view(slot) if self.ring is not None and slot is not None else None
        if out is None and slot is not None:  # no ring here: the slot is not used
            self.say(Dropped(sid, index, slot))
            slot = None
        prompt = None
        if self.switch is not None and index >= self.switch[0]:  # the new prompt from this chunk on
            prompt, self.switch = self.switch[1], None
        self.eng.submit(
            index,
            msg.audio,
            out=out,
            tag=(sid, index, slot),
            t_plan=msg.t_plan,
            decode=self.rank0,
            prompt=prompt,
            rewind=msg.rewind,
        )
        del out


class _Pipe:
    """Rank 0's end of the pipe: the main thread and the decode thread both send (one lock)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)


def _chunk_reply(pipe: _Pipe):
    """The engine's on_chunk callback for rank 0: a finished chunk -> ChunkDone (or Error)."""

    def on_chunk(res) -> None:
        sid, index, slot = res.tag
        try:
            if res.error is not None:
                pipe.send(Error(sid, f"chunk {index}: {res.error}", slot))
            elif res.frames is None:  # written into the shared-memory slot
                pipe.send(ChunkDone(sid, index, None, res.timings, slot))
            else:
                pipe.send(ChunkDone(sid, index, res.frames.numpy(), res.timings, None))
        except (EOFError, OSError, BrokenPipeError):
            pass  # the web side is gone; the main loop notices

    return on_chunk


def _setup_process(spec: WorkerSpec, label: str) -> None:
    import signal

    # Ctrl-C (SIGINT) and a service manager's SIGTERM reach the whole process group: the server stops us
    # cleanly (Stop, then terminate/kill if needed), and a parent that vanishes closes our pipe (EOF -> Stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level = logging.getLevelNamesMapping().get(
        os.environ.get("CADENCE_WORKER_LOG", "").upper(), logging.WARNING
    )
    logging.basicConfig(  # CADENCE_WORKER_LOG=INFO shows the worker's start-up and teardown steps
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s %(name)s[{label}]: %(message)s",
    )
    if spec.recipe.fast.threads > 0:
        torch.set_num_threads(spec.recipe.fast.threads)
    elif spec.cpu_share > 1 and spec.recipe.device.startswith("cuda"):  # workers sharing a GPU: a fair share
        torch.set_num_threads(
            gpu_worker_threads(torch.get_num_threads(), os.cpu_count() or 1, spec.cpu_share)
        )


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device))


def _start_line(spec: WorkerSpec) -> None:
    """The worker's start log line: what it builds, the weights and the checkpoint entry it serves (shown
    whatever ``CADENCE_WORKER_LOG`` says: it is the one line that says which model a group runs)."""
    r = spec.recipe
    c = r.config
    weights = (
        f"weights {c.model.weights}" + (f" (entry {r.weights_entry})" if r.weights_entry else "")
        if c.model.weights
        else f"random weights (seed {r.seed})"
    )
    start = logging.getLogger("cadence.serve.worker")
    start.setLevel(logging.INFO)
    logging.getLogger("cadence.startup").setLevel(logging.INFO)  # the start's estimate and its phases
    start.info(
        "worker %s: %s (%s), %s, decoder %s", spec.recipe.device, r.model, c.name, weights, c.vae.decoder
    )


def _start_up(eng, spec: WorkerSpec, default_image, decode: bool) -> tuple[dict | None, float]:
    """What every rank runs before serving, in the same order: the warm-up (when asked), then the next
    default session opened ahead. Returns (the warm-up report as a dict, for the torch-free web side, or
    None; preopen ms). Then the process's objects (~226k: torch, the model, the warm-up's state) are frozen
    out of the cyclic collector's sight: a full collection during a chunk would otherwise walk all of them, a
    stall of its own in the chunk's time."""
    import gc

    warm = (
        eng.warm_up(
            default_image, spec.recipe.warmup_chunks, decode=decode, threads=spec.recipe.fast.threads
        ).as_dict()
        if spec.recipe.warmup
        else None
    )
    preopen_ms = eng.preopen(default_image, DEFAULT_PROMPT, "default")
    gc.collect()
    gc.freeze()
    return warm, preopen_ms


def worker_main(conn, spec: WorkerSpec) -> None:  # pragma: no cover - other process
    """Rank 0 of a worker group (the process the web side talks to). For a tensor-parallel group it also
    joins the group's process group and broadcasts every command to the followers (``follower_main``)."""
    _setup_process(spec, f"worker {spec.recipe.device}")
    _start_line(spec)  # (the recipe's notes are logged by the engine as it applies them)
    pipe = _Pipe(conn)
    ring = peers = None
    try:
        eng, ring, peers, default_image, ready = _start_rank0(spec, pipe)
    except Exception as e:
        pipe.send(Error(None, one_line(f"worker start failed: {type(e).__name__}: {e}")))
        raise
    pipe.send(ready)
    try:
        with torch.no_grad():
            run_commands(eng, _rank0_messages(conn, peers), pipe.send, default_image, ring)
    finally:
        log.info("worker: stopping")
        eng.end_stream()
        if ring is not None:
            ring.close()
        if peers is not None:
            from cadence.parallel import destroy_tp

            destroy_tp(exiting=True)
    if peers is not None:  # leave as the followers do (destroy_tp(exiting=True) left the NCCL group as is)
        _exit_now()


def _start_rank0(spec: WorkerSpec, pipe: _Pipe):  # pragma: no cover - other process
    """Rank 0's start: the group joined (TP), the engine built, the frame ring attached, the start-up run.
    Returns (engine, ring or None, peers or None, the default reference image, the ``Ready`` message)."""
    from cadence.engine import startup
    from cadence.engine.shm import FrameRing
    from cadence.media.image import default_reference_image

    t = time.monotonic()
    devices = spec.recipe.devices
    said = _device_name(devices[0]) if devices[0].startswith("cuda") else None
    if said:  # what the start will do and how long it took here last time (a GPU's compile: minutes, once)
        startup.announce(spec.recipe, said, torch.__version__)
    info = _tp_join(0, devices, spec.tp_port) if len(devices) > 1 else None
    peers = _Peers(info) if info is not None else None
    eng = _build(spec, 0, info, on_chunk=_chunk_reply(pipe))
    ring = None
    if spec.shm:
        sh = spec.shm
        if tuple(sh["shape"]) != eng.frame_shape:
            raise ValueError(f"frame ring shape {sh['shape']} != the engine's {list(eng.frame_shape)}")
        ring = FrameRing.attach(sh["name"], sh["shape"], sh["slots"])
    cfg = eng.gen.cfg
    default_image = default_reference_image(cfg.stream.height, cfg.stream.width)
    build_ms = (time.monotonic() - t) * 1e3
    with torch.no_grad():
        warm, preopen_ms = _start_up(eng, spec, default_image, decode=True)
    if said:
        startup.remember(spec.recipe, said, torch.__version__, build_ms / 1e3, warm)
    ready = Ready(
        WorkerInfo(
            preset=cfg.name,
            device=spec.recipe.device,
            tp=len(devices),
            build_ms=round(build_ms, 1),
            threads=torch.get_num_threads(),
            fast_path=eng.describe(),
            notes=list(eng.notes),
            recipe=spec.recipe.describe().as_dict(),
            warmup=warm,
            preopen_ms=round(preopen_ms, 1),
            frame_transport="shm" if ring is not None else "pipe",
            frames_per_chunk=cfg.video_frames_per_chunk,
            audio_samples_per_chunk=cfg.audio_samples_per_chunk,
            gpu_memory=_gpu_memory(devices[0]),
            cut_in=eng.cut_in(),
        )
    )
    return eng, ring, peers, default_image, ready


def _gpu_memory(device: str) -> dict | None:
    """The device's total and free memory now (MB; None on the CPU): with the engine built and warmed up, what
    the caching allocator keeps is in use, so the free figure is what another group could have."""
    if not device.startswith("cuda"):
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return {"total_mb": round(total / 2**20, 1), "free_mb": round(free / 2**20, 1)}


def _rank0_messages(conn, peers) -> Callable[[], object]:  # pragma: no cover - other process
    """Rank 0's ``next_msg``: the web side's next command (``Stop`` once it is gone), broadcast to the
    followers; idle after a close, a ``Preopen`` (the next default session opened ahead)."""
    idle_preopen = [False]

    def next_msg():
        if idle_preopen[0] and not conn.poll():  # idle after a close: open the next default session ahead
            idle_preopen[0] = False
            msg = Preopen()
        else:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the web side is gone: stop, and tell the followers
                msg = Stop()
        if peers is not None:
            # the followers need the command, not the shared-memory slot rank 0 writes its frames to
            peers.bcast(
                ChunkRequest(msg.sid, msg.index, msg.audio, msg.t_plan, rewind=msg.rewind)
                if isinstance(msg, ChunkRequest)
                else msg
            )
        if isinstance(msg, CloseSession):
            idle_preopen[0] = True
        elif not isinstance(msg, Preopen):
            idle_preopen[0] = False
        return msg

    return next_msg


def follower_main(rank: int, spec: WorkerSpec) -> None:  # pragma: no cover - other process
    """A follower rank (1..N-1) of a tensor-parallel worker group: builds the same engine shard, runs the
    same start-up (warm-up, session opened ahead), then every command rank 0 broadcasts, without decoding;
    exits on ``Stop`` (or when a collective times out because rank 0 is gone)."""
    _setup_process(spec, f"worker {spec.recipe.device} rank {rank}")
    from cadence.media.image import default_reference_image
    from cadence.parallel import destroy_tp

    info = _tp_join(rank, spec.recipe.devices, spec.tp_port)
    try:
        peers = _Peers(info)
        eng = _build(spec, rank, info)
        cfg = eng.gen.cfg
        default_image = default_reference_image(cfg.stream.height, cfg.stream.width)
        with torch.no_grad():
            _start_up(eng, spec, default_image, decode=False)
            run_commands(eng, peers.bcast, None, default_image)
    finally:
        destroy_tp(exiting=True)
    # Leave at once: rank 0 serves the group's store and exits as soon as every follower has left its
    # group (destroy_tp); a follower's interpreter teardown (~1 s) would leave its NCCL heartbeat thread
    # polling a store that is gone (a screen of "Broken pipe" traces at every stop of a GPU group).
    _exit_now()


def _exit_now() -> None:  # pragma: no cover - other process
    """Flush the logs and leave without the interpreter's teardown (no NCCL destructors at exit)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
