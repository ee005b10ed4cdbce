"""Tensor parallelism applied from outside to a built model (``init_tp``, ``apply_tp``); the group seam
(``TPGroup``: a real ``DistGroup`` or one rank emulated in one process, ``EmulatedGroup``) and sequence
parallelism (``apply_tp(..., sequence_parallel=True)``, :mod:`cadence.parallel.sp`)."""

from cadence.parallel.emulate import EmulatedGroup
from cadence.parallel.group import CollectiveLog, DistGroup, TPGroup
from cadence.parallel.mesh import TPInfo, destroy_tp, init_tp
from cadence.parallel.tp import RowParallelLinear, ShardedRMSNorm, apply_tp, set_comm

__all__ = [
    "CollectiveLog",
    "DistGroup",
    "EmulatedGroup",
    "RowParallelLinear",
    "ShardedRMSNorm",
    "TPGroup",
    "TPInfo",
    "apply_tp",
    "destroy_tp",
    "init_tp",
    "set_comm",
]
