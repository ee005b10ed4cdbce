"""The messages between the web process and a worker group's processes, as dataclasses.

The web side (``cadence.serve.workers.WorkerGroup``) sends requests to rank 0 of a worker group over
a ``multiprocessing`` pipe; rank 0 forwards every command to the follower ranks of a tensor-parallel
group (``cadence.engine.worker``) and answers with replies. Each side dispatches in one place with
``match`` on the class. Torch-free (numpy arrays only), so the web process imports it without torch.

    web -> rank 0          OpenSession   ChunkRequest   SwitchPrompt   CloseSession   Stop
    rank 0 -> followers    the same, plus Preopen (rank 0 opens the next default session ahead when idle)
    rank 0 -> web          Ready   Opened   ChunkDone   Dropped   Closed   Error
    web side only          Died (the process or a follower rank exited)

(``Request`` and ``Reply`` below are these unions; tests/test_recipe.py checks this table against them.)

Every geometry follows the engine config: a chunk's ``audio`` is ``audio_samples_per_chunk`` float32
samples (8,000 at 4 frames / 24 fps), its frames uint8 ``[F, H, W, 3]``. Frames of 1 MiB and more travel
through a shared-memory slot (``cadence.engine.shm.FrameRing``): the request lends a ``slot``, the reply
carries ``frames=None`` and the same ``slot``, and whoever reads the frames releases it. Times are
``time.monotonic()`` (one system-wide clock, the same as asyncio's loop clock), so both processes can
compare them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

# ---- requests (web -> rank 0 -> followers) ---------------------------------------------------------


@dataclass(frozen=True)
class OpenSession:
    """Start a stream: ``image`` float32 [3, H, W] in -1..1, or None for the default face (then a session
    opened ahead with the default prompt is only re-seeded)."""

    sid: str
    image: np.ndarray | None
    prompt: str
    seed: int


@dataclass(frozen=True)
class ChunkRequest:
    """Generate chunk ``index`` of session ``sid`` from its audio window; ``t_plan`` is when the
    scheduler planned it (monotonic s); ``slot`` a shared-memory frame slot lent for the answer; ``rewind`` > 0:
    a cut-in, the chunk starts that many frames before the end of the last one made (``WorkerInfo.cut_in``)."""

    sid: str
    index: int
    audio: np.ndarray
    t_plan: float
    slot: int | None = None
    rewind: int = 0


@dataclass(frozen=True)
class SwitchPrompt:
    """Change session ``sid``'s prompt from chunk ``index`` on: for rank 0 and every follower, the engine's
    ``submit(..., prompt=prompt)`` of that chunk (``Session.set_prompt``: a model family pads it to its fixed
    text length, so the step keeps its shape, and re-caches the recent chunks' K/V where the family does,
    LongLive). The worker applies it to the first chunk request with an index >= ``index``."""

    sid: str
    index: int
    prompt: str


@dataclass(frozen=True)
class CloseSession:
    sid: str


@dataclass(frozen=True)
class Preopen:
    """Rank 0 -> followers: open the next default session ahead (the worker is idle)."""


@dataclass(frozen=True)
class Stop:
    """Leave the command loop and exit."""


# ---- replies (rank 0 -> web) -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkTimings:
    """One chunk's times. Durations in ms; instants in monotonic seconds.

    ``diffusion_ms`` / ``decode_ms`` / ``host_copy_ms`` are the stages (CUDA events on GPUs, the host
    clock on the CPU); ``work_ms`` is the worker's wall time from receiving the request to the frames
    being in host memory (the two stages and whatever waited between them); ``t_plan`` / ``t_recv`` /
    ``t_done`` are when the scheduler planned it, when the worker began it and when its frames were
    ready. ``step`` is what the graph runner did ("replay", "capture", "eager:<reason>"). ``memory``
    is the worker's memory in MB with this chunk (``rss_mb``; ``cuda_mb`` on CUDA)."""

    diffusion_ms: float = 0.0
    decode_ms: float = 0.0
    host_copy_ms: float = 0.0
    work_ms: float = 0.0
    t_plan: float = 0.0
    t_recv: float = 0.0
    t_done: float = 0.0
    step: str = ""
    memory: dict = field(default_factory=dict)

    @property
    def latency_ms(self) -> float:
        """Plan -> frames ready (what the scheduler's lead must cover)."""
        return (self.t_done - self.t_plan) * 1e3


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker group reports once it is ready (``GET /config`` -> ``workers``)."""

    preset: str
    device: str
    tp: int
    build_ms: float
    threads: int
    fast_path: dict
    notes: list[str]
    warmup: dict | None
    preopen_ms: float
    frame_transport: str
    frames_per_chunk: int
    audio_samples_per_chunk: int
    recipe: dict | None = None
    """What the group runs (``EngineRecipe.describe().as_dict()``: the model, the fast path, the rules, the
    weights and the entry served, the kernel switches in effect)."""
    gpu_memory: dict | None = None
    """Rank 0's GPU once the worker is ready (built, warmed up): ``{"total_mb", "free_mb"}`` (None on the CPU):
    how many more groups fit on it (``cadence.serve.sharing.memory_fit``)."""
    cut_in: tuple[int, int] | None = None
    """A clip stream's cut-in (``Engine.cut_in``): (the most frames a chunk may start before the end of the last
    one made, the frames before that point its motion needs); None: the chunk grid only."""

    @classmethod
    def of(cls, d: dict) -> WorkerInfo:
        """A WorkerInfo from its plain-data form (a group's ``info_dict``, e.g. over a Ray call), leaving out
        what the web side adds beside its fields (``share``, ``mps``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Ready:
    info: WorkerInfo


@dataclass(frozen=True)
class Opened:
    sid: str
    ms: float
    preopened: bool


@dataclass(frozen=True)
class ChunkDone:
    """Chunk ``index`` of ``sid`` is ready: ``frames`` uint8 [F, H, W, 3], or None when they are in
    shared-memory ``slot``."""

    sid: str
    index: int
    frames: np.ndarray | None
    timings: ChunkTimings
    slot: int | None = None


@dataclass(frozen=True)
class Dropped:
    """A chunk request that was not run (its session is closed, or it was answered another way): only
    its shared-memory slot comes back."""

    sid: str
    index: int
    slot: int | None = None


@dataclass(frozen=True)
class Closed:
    sid: str


@dataclass(frozen=True)
class Error:
    """A command failed (``sid`` None: the worker itself, e.g. at start); ``slot`` comes back if one was lent."""

    sid: str | None
    message: str
    slot: int | None = None


@dataclass(frozen=True)
class Died:
    """Web side only: the worker process (or a tensor-parallel rank) exited."""

    reason: str


Request = OpenSession | ChunkRequest | SwitchPrompt | CloseSession | Preopen | Stop
Reply = Ready | Opened | ChunkDone | Dropped | Closed | Error | Died
