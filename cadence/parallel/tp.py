"""Megatron-style tensor parallelism, applied from outside to a BUILT model.

``apply_tp(model, group)`` rewrites every transformer block in place for the ranks of `group`
(size N, rank r); everything outside the blocks (patch embedding, embedders, head) stays
replicated and every rank computes it identically.

Per block::

    self-attn   qkv  column-parallel: rank r keeps heads [r*H/N, (r+1)*H/N) of q, of k and of v
                norm_q / norm_k -> ShardedRMSNorm (Wan normalises across ALL heads: the sum of
                                   squares is all-reduced)
                out  -> RowParallelLinear (GEMM + all-reduce)
    cross-attn  q, kv  column-parallel by heads likewise; norms sharded; out row-parallel
    audio-attn  same as cross-attn
    FFN         fc1 column-parallel (ffn_dim / N rows); fc2 row-parallel
    heads       H -> H / N in every attention module

So one block costs four all-reduces of the [tokens, dim] activations (self out, cross out, audio
out, fc2) plus four tiny ones of a [tokens, 1] sum of squares per q/k norm. The K/V cache needs no
change: it stores whatever [B, tokens, heads, head_dim] it is handed, here H/N heads per rank.
The text and audio K/V are computed after sharding, so they are per-rank too.

Every rank must see the same inputs and draw the same noise: seed the generator identically on
every rank (``Session`` does: ``torch.Generator(device).manual_seed(seed)``). Outputs are then
identical on every rank (the all-reduce hands every rank the same sum).

Linears may be plain :class:`cadence.model.layers.Linear` or :class:`cadence.quant.fp8.FP8Linear`
(``apply_fp8`` before or after ``apply_tp``): per-output-channel FP8 scales slice with the rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from cadence.model.layers import PLAIN_OPS, Linear, RMSNorm
from cadence.quant.fp8 import FP8Linear
from cadence.telemetry.spans import region


class RowParallelLinear(nn.Module):
    """Row-parallel linear: GEMM + all-reduce over the TP group; the output is replicated on every
    rank.

    Each rank holds the input columns [r*K/N, (r+1)*K/N) of the weight and multiplies its shard of
    the activations (the heads / FFN channels it owns) into a partial [M, out] product; the partial
    products are summed over the group (one all-reduce of M x out activations), then the full bias
    is added once, after the sum, on every rank. So every call communicates one [M, out] tensor in
    the activations' dtype (bf16 on GPUs; FP8 layers produce bf16 partials).

    `comm` selects how the sum is done (see :mod:`cadence.parallel.fused`): "auto" (default: the
    per-shape chooser, which logs its pick once per shape), "nccl" (reference: GEMM then
    ``dist.all_reduce``), "two_shot" / "one_shot" (GEMM written straight into a symmetric-memory
    buffer, then the symm-mem all-reduce), "rs_ag" (fused matmul + reduce-scatter, then
    all-gather), "chunked[N]" (GEMM split along the output into N chunks, each all-reduced on a
    side stream as soon as it is done). Modes that cannot run (CPU / gloo, an op missing in this
    torch, a shape an op rejects) fall back to "nccl" with a warning logged once per reason.
    Timing regions: the GEMM under "linear", the collective under "allreduce"; modes where the two
    are inseparable ("rs_ag", "chunked") under "linear_comm"."""

    def __init__(
        self,
        linear: nn.Module,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        comm: str = "auto",
    ):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError(
                "RowParallelLinear's inner linear must have no bias "
                "(the bias is added once, after the all-reduce)"
            )
        self.linear = linear
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.group = group
        self.in_features = linear.in_features  # local (sharded) input width
        self.out_features = linear.out_features
        self.comm = comm

    @property
    def comm(self) -> str:
        return self._comm

    @comm.setter
    def comm(self, mode: str) -> None:
        from cadence.parallel.fused import parse_mode

        parse_mode(mode)  # raises ValueError for an unknown mode
        self._comm = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from cadence.parallel.fused import row_parallel

        return row_parallel(self.linear, x, self.bias, self.group, self._comm)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local), out_features={self.out_features}, comm={self._comm!r}"
        )


class ShardedRMSNorm(nn.Module):
    """RMS norm over a channel dimension split across the TP group (same math as
    :class:`cadence.model.layers.RMSNorm` over the full `full_dim`): the local sum of squares is
    all-reduced (SUM) and divided by the full width. `weight` is this rank's slice."""

    def __init__(self, weight: torch.Tensor, full_dim: int, eps: float, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().contiguous(), requires_grad=False)
        self.full_dim, self.eps, self.group = full_dim, eps, group
        self.ops = PLAIN_OPS  # the two local halves; apply_compile swaps in fused ones (not the all-reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ss = self.ops.sum_squares(x)
        with region("allreduce"):
            dist.all_reduce(ss, op=dist.ReduceOp.SUM, group=self.group)
        return self.ops.rms_scale(x, ss, self.weight, self.full_dim, self.eps)

    def extra_repr(self) -> str:
        return f"local={self.weight.numel()}, full_dim={self.full_dim}, eps={self.eps}"


# ---- slicing ---------------------------------------------------------------------------------
def _rows(parts: int, width: int, rank: int, world: int, device) -> torch.Tensor:
    """Indices of rank's share of each of `parts` consecutive blocks of `width` rows (q|k|v)."""
    per = width // world
    return torch.cat(
        [
            torch.arange(p * width + rank * per, p * width + (rank + 1) * per, device=device)
            for p in range(parts)
        ]
    )


def _take_rows(lin: nn.Module, idx: torch.Tensor) -> nn.Module:
    """Column-parallel shard: the output rows `idx` (weight, bias and FP8 scales)."""
    bias = lin.bias[idx] if lin.bias is not None else None
    if isinstance(lin, FP8Linear):
        # float8 indexing is not implemented everywhere: move the bytes as uint8
        w = lin.weight_fp8.view(torch.uint8)[idx].view(lin.weight_fp8.dtype)
        return FP8Linear(w, lin.weight_scale[:, idx], bias)
    if not isinstance(lin, Linear):
        raise TypeError(f"cannot shard a {type(lin).__name__} column-parallel")
    return _linear_from(lin.weight[idx], bias)


def _take_cols(lin: nn.Module, rank: int, world: int) -> tuple[nn.Module, torch.Tensor | None]:
    """Row-parallel shard: input columns of `rank`, returned without bias (plus the full bias)."""
    per = lin.in_features // world
    sl = slice(rank * per, (rank + 1) * per)
    if isinstance(lin, FP8Linear):
        w = lin.weight_fp8.view(torch.uint8)[:, sl].contiguous().view(lin.weight_fp8.dtype)
        # the per-output-channel scales stay those of the full row (valid, if not the tightest fit)
        return FP8Linear(w, lin.weight_scale, None), lin.bias
    if not isinstance(lin, Linear):
        raise TypeError(f"cannot shard a {type(lin).__name__} row-parallel")
    return _linear_from(lin.weight[:, sl], None), lin.bias


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    out_f, in_f = weight.shape
    lin = Linear(in_f, out_f, bias=bias is not None, device="meta")  # no allocation, no init
    lin.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    return lin


def _norm(norm: RMSNorm, rank: int, world: int, group) -> ShardedRMSNorm:
    full = norm.weight.numel()
    per = full // world
    return ShardedRMSNorm(norm.weight[rank * per : (rank + 1) * per], full, norm.eps, group)


def _shard_attention(
    attn: nn.Module, rank: int, world: int, group, dim: int, dev: torch.device, comm: str = "auto"
) -> None:
    if hasattr(attn, "qkv"):  # self-attention: fused [q; k; v]
        attn.qkv = _take_rows(attn.qkv, _rows(3, dim, rank, world, dev))
    else:  # cross / audio attention: q from the tokens, fused [k; v] from the context
        attn.q = _take_rows(attn.q, _rows(1, dim, rank, world, dev))
        attn.kv = _take_rows(attn.kv, _rows(2, dim, rank, world, dev))
    attn.norm_q = _norm(attn.norm_q, rank, world, group)
    attn.norm_k = _norm(attn.norm_k, rank, world, group)
    attn.out = RowParallelLinear(*_take_cols(attn.out, rank, world), group, comm)
    attn.heads //= world


def check_tp_size(mcfg, world: int) -> None:
    """Raise ValueError, naming the numbers, unless `world` divides the heads and the FFN width."""
    if world < 1 or mcfg.num_heads % world or mcfg.ffn_dim % world:
        raise ValueError(
            f"tensor-parallel size {world} must divide num_heads ({mcfg.num_heads}) and "
            f"ffn_dim ({mcfg.ffn_dim})"
        )


@torch.no_grad()
def apply_tp(model: nn.Module, group: dist.ProcessGroup | None = None, comm: str = "auto") -> nn.Module:
    """Shard `model`'s transformer blocks over `group` (default: the world) in place; return it.

    The group's size must divide num_heads and ffn_dim. With a group of one nothing changes.
    `comm` is the row-parallel layers' communication mode (:class:`RowParallelLinear`; change it
    later with :func:`set_comm`). Works on a model built on the ``meta`` device too (slicing meta
    tensors allocates nothing): build on meta, shard, then ``to_empty`` on the device and
    initialise, so no rank ever holds the full model (see ``cadence bench step --tp``)."""
    if not dist.is_initialized():
        raise RuntimeError("apply_tp needs an initialised process group (cadence.parallel.mesh.init_tp)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    m = model.mcfg
    check_tp_size(m, world)
    if getattr(model, "tp_world_size", 1) != 1:
        raise RuntimeError(f"model is already tensor-parallel (size {model.tp_world_size})")
    if world == 1:
        return model
    dev = model.device
    for blk in model.blocks:
        _shard_attention(blk.self_attn, rank, world, group, m.dim, dev, comm)
        _shard_attention(blk.cross_attn, rank, world, group, m.dim, dev, comm)
        if blk.audio_attn is not None:
            _shard_attention(blk.audio_attn, rank, world, group, m.dim, dev, comm)
        blk.ffn.fc1 = _take_rows(blk.ffn.fc1, _rows(1, m.ffn_dim, rank, world, dev))
        blk.ffn.fc2 = RowParallelLinear(*_take_cols(blk.ffn.fc2, rank, world), group, comm)
    model.tp_world_size, model.tp_rank, model.tp_group = world, rank, group
    return model


def set_comm(model: nn.Module, comm: str) -> int:
    """Set every RowParallelLinear's comm mode in `model`; return how many layers."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, RowParallelLinear):
            mod.comm = comm
            n += 1
    return n
