"""Where one worker group runs, typed: :class:`Placement` (its devices, one per tensor-parallel rank).

A group is one device ('cpu', 'cuda:0') or a tensor-parallel group of several: 'cpu' ranks (gloo, on the CPU)
or distinct GPUs. Its text is the devices joined by '+' ('cuda:0+cuda:1'), the form the recipe prints and
records and the command line takes; everything that places groups (``cadence serve``'s groups,
``cadence.serve.config.serve_groups``, a fleet's group, ``cadence.engine.recipe.resolve``) holds a Placement
and checks it once, here.

Several groups may be placed on the same devices (``cadence serve --sessions-per-gpu N``: N worker processes,
each its own engine and its own session, time-sharing one GPU; on the CPU ``--max-sessions N`` has always made
N groups on 'cpu'). What the groups share is :class:`Sharing`: for each placement, the groups placed on it, so
that the server can check that k engines fit in the device's memory and admit only as many sessions as the
device holds in real time (``cadence.serve.workers``). Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from cadence.errors import ConfigError

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Placement:
    """The devices of one worker group, rank 0 first."""

    devices: tuple[str, ...]

    def __post_init__(self) -> None:
        d = self.devices
        valid = bool(d) and all(isinstance(x, str) and _DEVICE.fullmatch(x) for x in d)
        if len(d) <= 1 and not valid:
            raise ConfigError(
                f"a worker group is 'cpu', 'cuda:N' or several joined by '+', got {str(self)!r}"
            )
        if len(d) > 1 and not (valid and (d == ("cpu",) * len(d) or all(x.startswith("cuda:") for x in d))):
            raise ConfigError(f"a tensor-parallel group is 'cpu+cpu+...' or 'cuda:I+cuda:J+...', got {self}")
        if len(d) > 1 and d[0] != "cpu" and len(set(d)) != len(d):
            raise ConfigError(f"a tensor-parallel group needs distinct GPUs, got {self}")

    @classmethod
    def of(cls, where: Placement | str | Sequence[str]) -> Placement:
        """A placement from its text ('cuda:0+cuda:1'), its devices, or itself."""
        if isinstance(where, Placement):
            return where
        return cls(tuple(str(where).split("+")) if isinstance(where, str) else tuple(where))

    def __str__(self) -> str:
        return "+".join(self.devices)

    @property
    def kind(self) -> str:
        """'cpu' or 'cuda'."""
        return "cpu" if self.devices[0] == "cpu" else "cuda"

    @property
    def ranks(self) -> int:
        """Tensor-parallel ranks (processes) of the group."""
        return len(self.devices)

    @property
    def gpus(self) -> int:
        """GPUs the group holds (0 on the CPU)."""
        return 0 if self.kind == "cpu" else len(self.devices)

    def holds_gpu(self, index: int) -> bool:
        return f"cuda:{index}" in self.devices


def gpu_groups(tp: int, count: int, ids: Sequence[int], per_gpu: int = 1) -> tuple[Placement, ...]:
    """``count`` groups of ``tp`` consecutive GPUs of ``ids``, up to ``per_gpu`` groups on each set of ``tp``
    GPUs, interleaved (group g on set g mod sets): the first groups land on distinct GPUs, so that the first
    sessions do too. Raises ConfigError when ``count`` groups do not fit."""
    sets = len(ids) // tp
    if per_gpu < 1 or count > sets * per_gpu:
        raise ConfigError(
            f"{count} group(s) of {tp} GPU(s) do not fit {len(ids)} GPU(s) at {per_gpu} per GPU"
        )
    return tuple(
        Placement(tuple(f"cuda:{ids[(g % sets) * tp + r]}" for r in range(tp))) for g in range(count)
    )


def cpu_groups(tp: int, count: int) -> tuple[Placement, ...]:
    """``count`` groups of ``tp`` CPU ranks (gloo)."""
    return (Placement(("cpu",) * tp),) * count


@dataclass(frozen=True)
class Sharing:
    """How worker groups share their devices: the groups (by index) placed on each distinct placement, in
    order of first appearance. A placement held by one group is that group's own; one held by k > 1 groups is
    time-shared by k processes (their memory k times, their GPU time divided). Placements that overlap
    without being equal ('cuda:0+cuda:1' and 'cuda:1+cuda:2': nothing here makes them) count apart."""

    groups: tuple[Placement, ...]
    by_placement: dict[Placement, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by: dict[Placement, list[int]] = {}
        for i, g in enumerate(self.groups):
            by.setdefault(Placement.of(g), []).append(i)
        object.__setattr__(self, "by_placement", {p: tuple(ix) for p, ix in by.items()})

    def peers(self, index: int) -> tuple[int, ...]:
        """The groups on group ``index``'s placement (itself included)."""
        return self.by_placement[Placement.of(self.groups[index])]

    def share(self, index: int) -> int:
        """How many groups time-share group ``index``'s devices (1: it owns them)."""
        return len(self.peers(index))

    @property
    def shared(self) -> dict[Placement, tuple[int, ...]]:
        """The placements held by more than one group."""
        return {p: ix for p, ix in self.by_placement.items() if len(ix) > 1}

    def describe(self) -> str:
        """One line: 'cuda:0 x4, cuda:1 x4' (a placement and its groups)."""
        return ", ".join(f"{p} x{len(ix)}" for p, ix in self.by_placement.items())


def gpu_worker_threads(default: int, cores: int, processes: int) -> int:
    """torch intra-op threads for a CUDA worker among ``processes`` worker processes on a machine of ``cores``
    cores: torch's ``default`` (its count of the cores, per process), at most the fair share ``cores //
    processes``, at least 1. A GPU worker's own CPU work is small (its kernels run on the GPU; two Python
    threads drive them), but each of its intra-op threads can spin on a core after a CPU op: 16 groups sharing
    one GPU at torch's 4 each were 64 threads on 16 cores, beside the web process that paces and encodes every
    session's video."""
    return max(1, min(default, cores // max(1, processes)))
