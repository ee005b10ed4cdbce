"""The tensor-parallel group seam: every collective of the TP layers goes through a :class:`TPGroup`.

    group.all_reduce(t, label)              t <- SUM over ranks of t, in place
    group.all_gather(out, part, label)      out [world * rows, ...] <- every rank's part [rows, ...], rank order
    group.reduce_scatter(out, inp, label)   out [rows, ...] <- SUM over ranks of inp's rank-th block of rows

Two implementations, one contract: :class:`DistGroup` (``torch.distributed`` over a real process group:
NCCL on CUDA, gloo on the CPU) and :class:`cadence.parallel.emulate.EmulatedGroup` (one process standing
in for one rank of a larger group: every collective replaced by a local stand-in with the collective's
output shape). ``apply_tp(model, group)`` takes either, or a raw ``ProcessGroup`` / ``None`` (the default
group), which :func:`as_group` wraps in a ``DistGroup``; so the code that shards, quantises, compiles and
graphs a rank's model is the same for a real rank and an emulated one, and nothing in ``cadence/model``
knows which it runs on.

The symmetric-memory modes of :mod:`cadence.parallel.fused` need a real NCCL group (``process_group``);
:meth:`TPGroup.symm_unavailable` says why they cannot run on a group (an emulated one has none: its
row-parallel sums take the plain collective, recorded with the algorithm the real rank would have used).

Recording (:class:`CollectiveLog`): while a log is active, every collective appends a :class:`Collective`
(kind, label of the layer that issued it, the full tensor's shape and dtype, its bytes, the algorithm, the
group size), on a real rank and an emulated one alike, from the host, as the call is issued (a CUDA-graph
replay records nothing: record an eager step). ``bytes`` is the size of the collective's full tensor: the
all-reduce's operand, the all-gather's output, the reduce-scatter's input; what crosses the links per rank
follows from the algorithm (``cadence.parallel.emulate.bus_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Collective:
    """One collective as issued by a rank."""

    kind: str
    """'all_reduce', 'all_gather' or 'reduce_scatter'."""
    label: str
    """The layer that issued it ('self_attn.out', 'ffn.fc1', 'self_attn.norm_q', 'tokens.gather', ...)."""
    shape: tuple[int, ...]
    """The full tensor: all-reduce operand, all-gather output, reduce-scatter input."""
    dtype: str
    nbytes: int
    algo: str
    """How the real rank runs it: 'nccl' (torch.distributed), 'two_shot', 'one_shot', 'rs_ag', ...."""
    world: int
    per_layer: bool = True
    """Issued inside a transformer block (a benchmark that runs some of the layers scales these)."""

    def key(self) -> tuple:
        """What identifies a collective in a per-chunk list (everything but the order)."""
        return (self.kind, self.label, self.shape, self.dtype, self.algo, self.world, self.per_layer)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


_logs: list[CollectiveLog] = []


class CollectiveLog:
    """Records every collective issued while active (``with CollectiveLog() as log: ...``; nests)."""

    def __init__(self) -> None:
        self.calls: list[Collective] = []

    def __enter__(self) -> CollectiveLog:
        _logs.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _logs.remove(self)

    def summary(self, layer_scale: float = 1.0) -> list[dict]:
        """The calls grouped by :meth:`Collective.key`, in first-seen order, with their count (per-layer
        counts multiplied by ``layer_scale``: a run of some of the layers scaled to all of them) and bytes."""
        groups: dict[tuple, dict] = {}
        for c in self.calls:
            g = groups.get(c.key())
            if g is None:
                g = groups[c.key()] = {**c.as_dict(), "count": 0}
            g["count"] += 1
        for g in groups.values():
            if g["per_layer"]:
                g["count"] = g["count"] * layer_scale
            g["total_bytes"] = g["count"] * g["nbytes"]
        return list(groups.values())


def record(kind: str, t_shape, dtype: torch.dtype, label: str, algo: str, world: int, per_layer=True) -> None:
    """Append one collective to every active :class:`CollectiveLog` (nothing when none is)."""
    if not _logs:
        return
    shape = tuple(int(s) for s in t_shape)
    nbytes = math.prod(shape) * dtype.itemsize
    c = Collective(kind, label, shape, str(dtype).replace("torch.", ""), nbytes, algo, world, per_layer)
    for log in _logs:
        log.calls.append(c)


class TPGroup:
    """What the TP layers need of their group: size, rank, three collectives, and whether symmetric memory
    can run on it. Subclasses implement ``_all_reduce`` / ``_all_gather`` / ``_reduce_scatter``."""

    world: int = 1
    rank: int = 0
    process_group = None  # the torch.distributed group (None: no real group behind this one)
    emulated = False

    def all_reduce(
        self, t: torch.Tensor, label: str = "", algo: str = "nccl", per_layer: bool = True
    ) -> None:
        """SUM over the group, in place (t contiguous)."""
        record("all_reduce", t.shape, t.dtype, label, algo, self.world, per_layer)
        self._all_reduce(t)

    def all_gather(
        self,
        out: torch.Tensor,
        part: torch.Tensor,
        label: str = "",
        algo: str = "nccl",
        per_layer: bool = True,
    ) -> None:
        """out [world * part.shape[0], ...] <- the ranks' parts in rank order (both contiguous)."""
        if out.shape[0] != self.world * part.shape[0] or out.shape[1:] != part.shape[1:]:
            raise ValueError(f"all_gather of {list(part.shape)} x {self.world} into {list(out.shape)}")
        record("all_gather", out.shape, out.dtype, label, algo, self.world, per_layer)
        self._all_gather(out, part)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        label: str = "",
        algo: str = "nccl",
        per_layer: bool = True,
    ) -> None:
        """out [rows, ...] <- SUM over ranks of inp [world * rows, ...]'s rows [rank*rows, (rank+1)*rows)."""
        if inp.shape[0] != self.world * out.shape[0] or inp.shape[1:] != out.shape[1:]:
            raise ValueError(f"reduce_scatter of {list(inp.shape)} over {self.world} into {list(out.shape)}")
        record("reduce_scatter", inp.shape, inp.dtype, label, algo, self.world, per_layer)
        self._reduce_scatter(out, inp)

    def note(
        self, kind: str, shape, dtype: torch.dtype, label: str, algo: str, per_layer: bool = True
    ) -> None:
        """Record a collective that ran outside this object (a symmetric-memory op of cadence.parallel.fused)."""
        record(kind, shape, dtype, label, algo, self.world, per_layer)

    def symm_unavailable(self, device: torch.device) -> str | None:
        """Why the symmetric-memory modes cannot run on this group (None: try them)."""
        return None

    def _all_reduce(self, t):
        raise NotImplementedError

    def _all_gather(self, out, part):
        raise NotImplementedError

    def _reduce_scatter(self, out, inp):
        raise NotImplementedError

    def _all_to_all(self, out, inp):
        """out's block j [rows, ...] <- rank j's block `rank` of its inp [world * rows, ...] (both contiguous,
        any dtype: FP8 payloads move as uint8). Unrecorded: the caller records what it stands for
        (cadence.parallel.comm_fp8 records one all-reduce)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world={self.world}, rank={self.rank})"


class DistGroup(TPGroup):
    """A real process group (``None``: the default one) through ``torch.distributed``."""

    def __init__(self, pg=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "tensor parallelism needs an initialised process group (cadence.parallel.mesh.init_tp) "
                "or an emulated group (cadence.parallel.emulate.EmulatedGroup)"
            )
        self.process_group = pg
        self.world, self.rank = dist.get_world_size(pg), dist.get_rank(pg)

    def _all_reduce(self, t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)

    def _all_gather(self, out, part):
        # all_gather_single where it exists (torch >= 2.13 deprecates all_gather_into_tensor), same signature
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, part, group=self.process_group)

    def _reduce_scatter(self, out, inp):
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out, inp, op=dist.ReduceOp.SUM, group=self.process_group)

    def _all_to_all(self, out, inp):
        dist.all_to_all_single(out, inp, group=self.process_group)


def as_group(group) -> TPGroup:
    """`group` itself when it is a :class:`TPGroup`, else a :class:`DistGroup` over it (a ProcessGroup, or
    None for the default group)."""
    return group if isinstance(group, TPGroup) else DistGroup(group)


def process_group(group):
    """The torch.distributed group behind `group` (a TPGroup or already a ProcessGroup / None)."""
    return group.process_group if isinstance(group, TPGroup) else group
