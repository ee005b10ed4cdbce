"""Several sessions per GPU: the rules and the arithmetic (pure: no torch, no processes, no clock).

``cadence serve --sessions-per-gpu N`` places N worker groups on each GPU (``cadence.engine.placement.Sharing``):
N processes, each its own engine (the model's memory N times) and its own session, the GPU time-shared between
them (concurrently under CUDA MPS: ``cadence.serve.mps``). Two things then need measuring, because neither can
be read off one group alone:

* **Memory.** The first group on a shared GPU starts alone; once it is warmed up, the GPU's memory in use is
  its whole footprint (the model, the decoder, the caches, the warm-up's peak activations the allocator keeps,
  the CUDA context; plus anything else already on the GPU, so the figure errs high). Each further group needs
  that footprint plus ``MEMORY_MARGIN``; :func:`memory_fit` says how many fit in what is free, and a server
  asked for more stops with one line naming the number that fits (:func:`memory_error`), before it starts the
  others (``ShareRules.memory_fit`` 'trim' starts only those instead: the benchmark's sweeps). The estimate is
  of a steady footprint: further groups warming up together can peak above it, so one that runs out of memory
  at start is left out with one line and the server serves with the others (``LocalGroups._start_further``).
* **Capacity.** A group's warm-up measures its sustained chunk time alone on the GPU, which overstates its
  speed once k groups share it. So once every group is ready, the groups of each shared GPU stream flat out
  together for ``capacity_s`` (every group its own default session, ``max_in_flight`` chunks in flight, the
  first chunks left out) and the GPU's throughput under that load is measured; :func:`capacity_of` turns it
  into the sessions the GPU holds at real time with ``CAPACITY_MARGIN`` to spare (at least 1, at most its
  groups). Admission then takes at most that many sessions on that GPU at once: a free group on a full GPU is
  not free (``cadence.serve.workers.SharedDevice``), so a request gets 503 whose Retry-After is the time the
  soonest session ends (the manager's own rule: that session's GPU then has room, and a group), rather than
  every session on the GPU falling below real time. ``ShareRules.capacity``: 'measure' (every shared device),
  'auto' (shared GPUs; CPU groups keep one session per group, as ``--max-sessions`` always did), 'report'
  (measured and reported, not enforced: what N sessions really get, for the sweeps), 'groups' (never measured).

Flat-out throughput of all k groups is the GPU saturated by k streams: paced real-time sessions use it in
bursts, and with fewer sessions than groups fewer streams overlap under MPS; the capacity is an estimate that
``cadence bench serve --find-capacity`` checks at the client (docs/architecture.md, "Several sessions per GPU").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cadence.errors import ConfigError

#: A session on a shared GPU needs this much more than real time of the GPU's measured throughput: the
#: target is 24.5 fresh fps of 25 (2%), and chunks come back in bursts when several streams share a GPU.
CAPACITY_MARGIN = 0.05
#: Each further group on a GPU needs the first one's footprint plus this: allocator fragmentation, and a
#: session's tensors beside the warm-up's.
MEMORY_MARGIN = 0.10
CAPACITY_MODES = ("auto", "measure", "report", "groups")


@dataclass(frozen=True)
class ShareRules:
    """What a server does about groups that share a device (``ServeConfig.share_rules``)."""

    capacity: str = "auto"
    """'auto', 'measure', 'report' or 'groups' (see the module doc)."""
    capacity_s: float = 5.0
    """Seconds the groups of a shared device stream flat out together at start (0: not measured)."""
    memory_fit: str = "error"
    """More groups than a GPU's memory holds: 'error' (the server does not start; one line) or 'trim' (only
    those that fit start; the others are left out, logged)."""
    mps: bool = False
    """Run the workers under a private CUDA MPS control daemon, if ``nvidia-cuda-mps-control`` is there."""

    def __post_init__(self) -> None:
        if self.capacity not in CAPACITY_MODES:
            raise ConfigError(f"capacity must be one of {', '.join(CAPACITY_MODES)}, got {self.capacity!r}")
        if not 0 <= self.capacity_s <= 120:
            raise ConfigError(f"capacity_s must be within 0..120 s, got {self.capacity_s}")
        if self.memory_fit not in ("error", "trim"):
            raise ConfigError(f"memory_fit must be 'error' or 'trim', got {self.memory_fit!r}")

    def measures(self, kind: str) -> bool:
        """Whether a device of ``kind`` ('cpu' / 'cuda') shared by several groups is measured at start."""
        if self.capacity_s <= 0 or self.capacity == "groups":
            return False
        return self.capacity in ("measure", "report") or kind == "cuda"

    @property
    def enforces(self) -> bool:
        """Whether admission keeps to the measured capacity (not 'report')."""
        return self.capacity != "report"


def capacity_of(rates: Sequence[float], chunk_s: float, groups: int, margin: float = CAPACITY_MARGIN) -> int:
    """Sessions a device holds at real time: ``rates`` are the chunks per second each of its ``groups`` made
    while all streamed flat out together; a real-time session needs ``1 / chunk_s`` chunks a second, plus
    ``margin``. At least 1 (one session on a slow device gets fewer fresh frames, as ever), at most ``groups``."""
    if chunk_s <= 0 or groups < 1:
        raise ValueError(f"chunk_s must be > 0 and groups >= 1, got {chunk_s} and {groups}")
    held = sum(max(0.0, r) for r in rates) * chunk_s / (1.0 + margin)
    return max(1, min(groups, math.floor(held + 1e-9)))


@dataclass(frozen=True)
class MemoryFit:
    """What :func:`memory_fit` found for one GPU: ``fits`` groups in all (the first included)."""

    used_mb: float
    """The GPU's memory in use with the first group up: its footprint (and whatever else the GPU holds)."""
    free_mb: float
    per_group_mb: float
    """What each further group is counted for: ``used_mb`` x (1 + margin)."""
    fits: int


def memory_fit(total_mb: float, free_mb: float, margin: float = MEMORY_MARGIN) -> MemoryFit:
    """How many groups fit on a GPU whose memory, with its first group up and warmed up, is ``free_mb`` free of
    ``total_mb``: the first, plus as many more as ``free_mb`` holds at the first one's footprint + ``margin``."""
    used = max(1.0, total_mb - free_mb)
    per = used * (1.0 + margin)
    return MemoryFit(used, free_mb, per, 1 + max(0, math.floor(free_mb / per)))


def memory_error(device: str, model: str, wanted: int, fit: MemoryFit) -> str:
    """The one line a server that cannot place ``wanted`` groups on ``device`` stops with."""
    return (
        f"{device} cannot hold {wanted} worker groups of {model}: with one up the GPU uses "
        f"{fit.used_mb / 1024:.1f} GiB and {fit.free_mb / 1024:.1f} GiB are free, each further group needs "
        f"~{fit.per_group_mb / 1024:.1f} GiB (+{MEMORY_MARGIN:.0%}): {fit.fits} fit (--sessions-per-gpu {fit.fits})"
    )
