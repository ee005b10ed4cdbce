"""Tensor parallelism applied from outside to a built model (``init_tp``, ``apply_tp``)."""

from cadence.parallel.mesh import TPInfo, destroy_tp, init_tp
from cadence.parallel.tp import RowParallelLinear, ShardedRMSNorm, apply_tp, set_comm

__all__ = ["RowParallelLinear", "ShardedRMSNorm", "TPInfo", "apply_tp", "destroy_tp", "init_tp", "set_comm"]
