"""Where one worker group runs, typed: :class:`Placement` (its devices, one per tensor-parallel rank).

A group is one device ('cpu', 'cuda:0') or a tensor-parallel group of several: 'cpu' ranks (gloo, on the CPU)
or distinct GPUs. Its text is the devices joined by '+' ('cuda:0+cuda:1'), the form the recipe prints and
records and the command line takes; everything that places groups (``cadence serve``'s groups,
``cadence.serve.config.serve_groups``, a fleet's group, ``cadence.engine.recipe.resolve``) holds a Placement
and checks it once, here. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

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


def gpu_groups(tp: int, count: int, ids: Sequence[int]) -> tuple[Placement, ...]:
    """``count`` groups of ``tp`` consecutive GPUs of ``ids``."""
    return tuple(Placement(tuple(f"cuda:{ids[g * tp + r]}" for r in range(tp))) for g in range(count))


def cpu_groups(tp: int, count: int) -> tuple[Placement, ...]:
    """``count`` groups of ``tp`` CPU ranks (gloo)."""
    return (Placement(("cpu",) * tp),) * count
