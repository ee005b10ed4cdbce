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
out, fc2) plus the tiny ones of the q/k norms' sums of squares: the self-attention's q and k sums reduced
together, one [tokens, 2] (:class:`QKVNormStats`: the qkv projection computes both local sums and reduces
them once; ``CADENCE_TP_QK_PAIR=0``: one [tokens, 1] per norm, the reference), the cross-attention's q (its
k is the text's, once per session) and the audio attention's q and k (the audio K/V is computed before its
q, so they cannot share one). Small sums take the one-shot over symmetric memory on CUDA
(``cadence.parallel.fused.small_all_reduce``). The row-parallel biases ride in rank 0's GEMM epilogue. The K/V cache needs no
change: it stores whatever [B, tokens, heads, head_dim] it is handed, here H/N heads per rank.
The text and audio K/V are computed after sharding, so they are per-rank too.

Every rank must see the same inputs and draw the same noise: seed the generator identically on
every rank (``Session`` does: ``torch.Generator(device).manual_seed(seed)``). Outputs are then
identical on every rank (the all-reduce hands every rank the same sum).

Linears may be plain :class:`cadence.model.layers.Linear` or :class:`cadence.quant.fp8.FP8Linear`
(``apply_fp8`` before or after ``apply_tp``): per-output-channel FP8 scales slice with the rows.

The group: a :class:`cadence.parallel.group.TPGroup` (a real process group, ``DistGroup``, or one rank of
a group emulated in one process, ``cadence.parallel.emulate.EmulatedGroup``: the same shards, kernels and
graphs, every collective a local stand-in), or a raw ``ProcessGroup`` / None (the default group). Every
collective below goes through it, labelled with the layer that issues it (``CollectiveLog`` lists them).

``sequence_parallel=True`` (:mod:`cadence.parallel.sp`): the per-token work between the sharded linears
runs on 1/N of the tokens per rank; the column-parallel shards all-gather their input rows first (FP8:
the quantised bytes), the row-parallel ones reduce-scatter instead of all-reducing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cadence.model.layers import PLAIN_OPS, Linear, RMSNorm
from cadence.parallel.group import TPGroup, as_group
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
    are inseparable ("rs_ag", "chunked") under "linear_comm".

    Under sequence parallelism (`tokens`: the model's :class:`cadence.parallel.sp.ShardedTokens`) the
    sum is a reduce-scatter instead: the output is this rank's rows of the tokens
    (:func:`cadence.parallel.sp.row_scatter`); `comm` then does not apply. `group`: a TPGroup or a
    ProcessGroup (None: the default group). `label` names the layer in the collective records."""

    def __init__(
        self,
        linear: nn.Module,
        bias: torch.Tensor | None,
        group: TPGroup | object | None,
        comm: str = "auto",
        label: str = "",
        tokens=None,
    ):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError(
                "RowParallelLinear's inner linear must have no bias "
                "(the bias is added once, after the all-reduce)"
            )
        self.linear = linear
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.group = as_group(group)
        self.in_features = linear.in_features  # local (sharded) input width
        self.out_features = linear.out_features
        self.comm = comm
        self.label = label
        self.tokens = tokens  # sequence parallelism: reduce-scatter to these rows (None: all-reduce)

    @property
    def comm(self) -> str:
        return self._comm

    @comm.setter
    def comm(self, mode: str) -> None:
        from cadence.parallel.fused import parse_mode

        parse_mode(mode)  # raises ValueError for an unknown mode
        self._comm = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None:
            from cadence.parallel.sp import row_scatter

            return row_scatter(self.linear, x, self.bias, self.tokens, self.label)
        from cadence.parallel.fused import row_parallel

        return row_parallel(self.linear, x, self.bias, self.group, self._comm, label=self.label)

    def extra_repr(self) -> str:
        how = "reduce-scatter (sequence parallel)" if self.tokens is not None else f"comm={self._comm!r}"
        return f"in_features={self.in_features} (local), out_features={self.out_features}, {how}"


class ShardedRMSNorm(nn.Module):
    """RMS norm over a channel dimension split across the TP group (same math as
    :class:`cadence.model.layers.RMSNorm` over the full `full_dim`): the local sum of squares is
    all-reduced (SUM; :func:`cadence.parallel.fused.small_all_reduce`) and divided by the full width.
    `weight` is this rank's slice. With `pair` (a self-attention's :class:`QKStats`) the sum was already
    reduced together with the other norm's by the qkv projection (:class:`QKVNormStats`): this norm takes
    its column of it and issues no collective."""

    def __init__(
        self, weight: torch.Tensor, full_dim: int, eps: float, group, label: str = "", pair=None, which=0
    ):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().contiguous(), requires_grad=False)
        self.full_dim, self.eps, self.group, self.label = full_dim, eps, as_group(group), label
        self.ops = PLAIN_OPS  # the two local halves; apply_compile swaps in fused ones (not the all-reduce)
        self.__dict__["pair"] = pair  # shared with the qkv projection and the other norm (not a submodule)
        self.which = which

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_scale(x, self.reduced_sums(x), self.weight, self.full_dim, self.eps)

    def reduced_sums(self, x: torch.Tensor) -> torch.Tensor:
        """x's float32 sum of squares over all `full_dim` channels [.., 1]: the paired one where the qkv
        projection reduced it, else the local sum all-reduced here. The apply half is ``forward``'s, or the
        ring cache's write where it takes the norm in (``cadence.cache.qk_fold``)."""
        ss = self.pair.take(self.which, x) if self.pair is not None else None
        if ss is None:
            from cadence.parallel.fused import small_all_reduce

            ss = self.ops.sum_squares(x)
            with region("allreduce"):
                small_all_reduce(ss, self.group, self.label)
        return ss


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class QKStats:
    """The q and k sums of squares of one self-attention's pass, reduced together (one [.., 2] all-reduce
    instead of two [.., 1]): set by :class:`QKVNormStats`, taken by the two :class:`ShardedRMSNorm`. A norm
    takes its column only when its input is exactly the slice of the qkv output the sums were made from
    (same storage, shape, strides, dtype); otherwise (a model that normalises something else) it reduces
    its own sum, with one log line."""

    def __init__(self):
        self.sigs: tuple = ()
        self.ss: torch.Tensor | None = None
        self.left = 0
        self.missed = False

    def put(self, q: torch.Tensor, k: torch.Tensor, ss: torch.Tensor) -> None:
        self.sigs, self.ss, self.left = (_signature(q), _signature(k)), ss, 2

    def take(self, which: int, x: torch.Tensor) -> torch.Tensor | None:
        if self.ss is None or self.sigs[which] != _signature(x):
            if not self.missed:
                self.missed = True
                import logging

                logging.getLogger(__name__).info(
                    "q/k norm: input is not the qkv output's slice; its sum is reduced on its own"
                )
            return None
        ss = self.ss[..., which : which + 1]
        self.left -= 1
        if self.left <= 0:
            self.ss, self.sigs = None, ()
        return ss


class QKVNormStats(nn.Module):
    """A self-attention's column-parallel qkv projection followed by the q/k norms' local sums of squares and
    ONE small all-reduce of both (:class:`QKStats`): 1 collective per self-attention call instead of 2. The
    output is the projection's, unchanged."""

    def __init__(self, qkv: nn.Module, group: TPGroup, pair: QKStats, label: str):
        super().__init__()
        self.qkv = qkv
        self.group, self.label = group, label
        self.__dict__["pair"] = pair
        self.ops = PLAIN_OPS  # sum_squares_pair; apply_compile swaps in the compiled one
        self.in_features, self.out_features = qkv.in_features, qkv.out_features

    @property
    def qkv_linear(self) -> nn.Module:
        return self.qkv

    def forward(self, x) -> torch.Tensor:
        from cadence.parallel.fused import small_all_reduce

        y = self.qkv(x)
        q, k, _ = y.chunk(3, dim=-1)
        ss = self.ops.sum_squares_pair(q, k)
        with region("allreduce"):
            small_all_reduce(ss, self.group, self.label)
        self.pair.put(q, k, ss)
        return y

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


def _norm(norm: RMSNorm, group: TPGroup, label: str, pair=None, which: int = 0) -> ShardedRMSNorm:
    full = norm.weight.numel()
    per = full // group.world
    w = norm.weight[group.rank * per : (group.rank + 1) * per]
    return ShardedRMSNorm(w, full, norm.eps, group, label, pair, which)


def _column(lin: nn.Module, tokens, label: str) -> nn.Module:
    """A column-parallel shard as it runs: as is, or (sequence parallelism) behind its rows' all-gather."""
    if tokens is None:
        return lin
    from cadence.parallel.sp import ColumnParallelLinear

    return ColumnParallelLinear(lin, tokens, label)


def _shard_attention(
    attn: nn.Module, group: TPGroup, dim: int, dev: torch.device, comm: str, name: str, tokens
) -> None:
    rank, world = group.rank, group.world
    pair = None
    if hasattr(attn, "qkv"):  # self-attention: fused [q; k; v]
        attn.qkv = _column(_take_rows(attn.qkv, _rows(3, dim, rank, world, dev)), tokens, f"{name}.qkv")
        if attn.norm_q is not None and pair_qk_norms():  # both norms' sums in one collective
            pair = QKStats()
            attn.qkv = QKVNormStats(attn.qkv, group, pair, f"{name}.norm_qk")
    else:  # cross / audio attention: q from the tokens, fused [k; v] from the (replicated) context
        attn.q = _column(_take_rows(attn.q, _rows(1, dim, rank, world, dev)), tokens, f"{name}.q")
        attn.kv = _take_rows(attn.kv, _rows(2, dim, rank, world, dev))
        if getattr(attn, "kv_img", None) is not None:  # an I2V model's image-token K/V: the rank's heads too
            attn.kv_img = _take_rows(attn.kv_img, _rows(2, dim, rank, world, dev))
            attn.norm_k_img = _norm(attn.norm_k_img, group, f"{name}.norm_k_img")
    if attn.norm_q is not None:  # (InfiniteTalk's audio attention has no q/k norms)
        attn.norm_q = _norm(attn.norm_q, group, f"{name}.norm_q", pair, 0)
        attn.norm_k = _norm(attn.norm_k, group, f"{name}.norm_k", pair, 1)
    attn.out = RowParallelLinear(*_take_cols(attn.out, rank, world), group, comm, f"{name}.out", tokens)
    attn.heads //= world


def pair_qk_norms() -> bool:
    """Whether ``apply_tp`` reduces a self-attention's q and k norm sums in one collective (default; the
    reference path, one each, with ``CADENCE_TP_QK_PAIR=0``)."""
    import os

    return os.environ.get("CADENCE_TP_QK_PAIR", "1") != "0"


def check_tp_size(mcfg, world: int) -> None:
    """Raise ValueError, naming the numbers, unless `world` divides the heads and the FFN width."""
    if world < 1 or mcfg.num_heads % world or mcfg.ffn_dim % world:
        raise ValueError(
            f"tensor-parallel size {world} must divide num_heads ({mcfg.num_heads}) and "
            f"ffn_dim ({mcfg.ffn_dim})"
        )


@torch.no_grad()
def apply_tp(model: nn.Module, group=None, comm: str = "auto", sequence_parallel: bool = False) -> nn.Module:
    """Shard `model`'s transformer blocks over `group` in place; return it.

    `group`: a :class:`cadence.parallel.group.TPGroup` (e.g. ``EmulatedGroup(4)``: this process is rank 0
    of an emulated group of four), a ProcessGroup, or None (the default group). Its size must divide
    num_heads and ffn_dim. With a group of one nothing changes. `comm` is the row-parallel layers'
    all-reduce mode (:class:`RowParallelLinear`; change it later with :func:`set_comm`).
    `sequence_parallel`: the per-token work between the linears on this rank's share of the tokens
    (:mod:`cadence.parallel.sp`). Works on a model built on the ``meta`` device too (slicing meta
    tensors allocates nothing): build on meta, shard, then ``to_empty`` on the device and
    initialise, so no rank ever holds the full model (see ``cadence bench step --tp``)."""
    group = as_group(group)
    world = group.world
    m = model.mcfg
    check_tp_size(m, world)
    if getattr(model, "tp_world_size", 1) != 1:
        raise RuntimeError(f"model is already tensor-parallel (size {model.tp_world_size})")
    if world == 1:
        return model
    dev = model.device
    tokens = None
    if sequence_parallel:
        from cadence.parallel.sp import ShardedTokens

        tokens = ShardedTokens(group)
    for blk in model.blocks:
        _shard_attention(blk.self_attn, group, m.dim, dev, comm, "self_attn", tokens)
        _shard_attention(blk.cross_attn, group, m.dim, dev, comm, "cross_attn", tokens)
        if blk.audio_attn is not None:
            _shard_attention(blk.audio_attn, group, m.dim, dev, comm, "audio_attn", tokens)
        fc1 = _take_rows(blk.ffn.fc1, _rows(1, m.ffn_dim, group.rank, world, dev))
        blk.ffn.fc1 = _column(fc1, tokens, "ffn.fc1")
        fc2, bias = _take_cols(blk.ffn.fc2, group.rank, world)
        blk.ffn.fc2 = RowParallelLinear(fc2, bias, group, comm, "ffn.fc2", tokens)
    if tokens is not None:
        model.token_layout = tokens
    model.tp_world_size, model.tp_rank, model.tp_group = world, group.rank, group
    model.tp_sequence_parallel = tokens is not None
    return model


def set_comm(model: nn.Module, comm: str) -> int:
    """Set every RowParallelLinear's comm mode in `model`; return how many layers."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, RowParallelLinear):
            mod.comm = comm
            n += 1
    return n
