"""Sequence parallelism for the replicated regions of a tensor-parallel block (Megatron-style).

Plain TP (``apply_tp``) leaves every rank computing the same per-token work between the sharded linears:
the adaLN norms and modulation, the gates, the residual adds, the affine norms before cross / audio
attention, on all N tokens of a pass ([N, dim], float32 math). ``apply_tp(..., sequence_parallel=True)``
gives each rank a share of the tokens there instead:

    x [P, dim] (rank r's rows) -> norm + modulation ---> all-gather --> qkv / q / fc1 (column-parallel)
                                                          (FP8: the bytes + scales)     |
    x + gate * ( reduce-scatter <-- out / fc2 (row-parallel GEMM, partial [N, dim]) <-- attention / GELU
                 [P, dim] )                                                             (every token)

* :class:`ShardedTokens` (the model's ``token_layout``, a seam of ``cadence.model.layers.TokenLayout``) cuts
  the pass's tokens into ``world`` runs of P rows after the patch embedding (no communication: every rank
  holds the embedded tokens) and all-gathers them back before the head. Rank r holds rows
  [r P, (r+1) P) of the tokens padded to world x P; P is ceil(N / world) rounded up to a multiple of 4
  (748 tokens: P = 188 at TP=4 and TP=2, 4 padding rows; tiny's 64: P = 16 / 32, none) so that each rank's
  block of a gathered FP8 activation, and its [rows, 1] float32 scales, start 16-byte aligned (cuBLAS's
  rowwise-scaled FP8 GEMM refuses a scale pointer that is not: docs/benchmarks.md's trap). Padding rows are
  zeros; they flow through the norms and residuals of the last rank (finite, never read) and are dropped
  before any attention (the gather returns the first N rows) and after the last block.
* :class:`ColumnParallelLinear` wraps a column-parallel shard (qkv, cross / audio q, fc1): it all-gathers
  its input's rows first. For an FP8 layer the gather moves the quantised activation (each row's e4m3
  bytes and its float32 scale packed in one row of K + 4 bytes: one collective, half the bytes of bf16):
  each rank quantises only its own P rows, which gives exactly the bytes quantising the gathered rows
  would (the scales are per row). An input already quantised (a ``QuantizedActivation`` from a fused
  norm + quantisation kernel) is gathered as it is.
* A sequence-parallel :class:`cadence.parallel.tp.RowParallelLinear` (out of every attention, fc2)
  writes its partial product into a [world x P, dim] buffer and reduce-scatters it (:func:`row_scatter`),
  with the bias in rank 0's GEMM epilogue (so every rank's rows hold it once; ``CADENCE_TP_BIAS=after``: added
  to the rank's P rows after the sum, the reference): one reduce-scatter where TP had one all-reduce.

Per block: the all-reduces of TP (one per row-parallel layer) become an all-gather + a reduce-scatter each;
a ring moves (world-1)/world of the tensor per rank in each, the all-reduce twice that, so the bytes on
the links are equal in bf16 and 3/4 with the FP8 gathers; the fixed cost per collective doubles. What it
buys: the per-token work above runs on 1/world of the tokens (docs/perf/step/NOTES.md has the prediction
and its measurement). Not changed: the q/k RMS norms across heads (their [N, 1] sums of squares are still
all-reduced), the text / audio K/V (computed from the replicated context), attention (every query, the
rank's heads), positions and RoPE (the cache's, over all tokens). The collectives run through the group's
``all_gather`` / ``reduce_scatter`` (NCCL on CUDA, gloo on the CPU, a local stand-in on an emulated rank);
the symmetric-memory comm modes of ``cadence.parallel.fused`` apply to all-reduces only.

Reference: plain TP (``sequence_parallel=False``) and TP=1; parity tests in tests/test_sp.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cadence.model.layers import TokenLayout
from cadence.parallel.group import TPGroup
from cadence.telemetry.spans import region

ROW_ALIGN = 4  # rows per rank a multiple of this: FP8 rowwise scales of a rank's block stay 16-byte aligned


def rows_per_rank(tokens: int, world: int, align: int = ROW_ALIGN) -> int:
    """P: each rank's share of `tokens` rows, ceil(tokens / world) rounded up to a multiple of `align`."""
    per = -(-tokens // world)
    return max(align, -(-per // align) * align)


class ShardedTokens(TokenLayout):
    """The token layout of sequence parallelism (see the module docstring): this rank's P rows between
    the blocks' linears. Host state: the current pass's token count (set by :meth:`scatter`, read by the
    layers' gathers and reduce-scatters of the same pass)."""

    def __init__(self, group: TPGroup):
        self.group = group
        self.tokens = 0  # N of the pass in flight
        self.rows = 0  # P

    @property
    def padded(self) -> int:
        return self.rows * self.group.world

    def scatter(self, x: torch.Tensor, temb6: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.tokens = x.shape[1]
        self.rows = rows_per_rank(self.tokens, self.group.world)
        if temb6.ndim == 4:  # per-token modulation [B, N, 6, dim]: this rank's rows of it too
            temb6 = self.local(temb6)
        return self.local(x), temb6

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """Rows [rank P, (rank+1) P) of `t` [B, N, ...] along dim 1, zero rows where they pass N."""
        lo = self.group.rank * self.rows
        real = max(0, min(lo + self.rows, self.tokens) - lo)
        part = t.narrow(1, min(lo, self.tokens), real)
        if real < self.rows:
            pad = t.new_zeros((t.shape[0], self.rows - real, *t.shape[2:]))
            part = torch.cat([part, pad], dim=1)
        return part.contiguous()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather_rows(x, "tokens.gather", per_layer=False)

    def gather_rows(self, part: torch.Tensor, label: str, per_layer: bool = True) -> torch.Tensor:
        """[B, P, K] (this rank's rows) -> [B, N, K] (every rank's, padding dropped): one all-gather."""
        b, p, k = part.shape
        if p != self.rows:
            raise ValueError(f"sequence-parallel gather: {p} rows, this pass shares {self.rows} per rank")
        full = _gather(self.group, part.reshape(b * p, k), label, per_layer)  # [world * B * P, K]
        return _rank_major_to_batch(full, self.group.world, b, p)[:, : self.tokens]

    def __repr__(self) -> str:
        return f"ShardedTokens(world={self.group.world}, rank={self.group.rank})"


def _gather(group: TPGroup, part2: torch.Tensor, label: str, per_layer: bool) -> torch.Tensor:
    part2 = part2.contiguous()
    out = part2.new_empty((group.world * part2.shape[0], *part2.shape[1:]))
    with region("allreduce"):
        group.all_gather(out, part2, label=label, per_layer=per_layer)
    return out


def _rank_major_to_batch(full: torch.Tensor, world: int, b: int, p: int) -> torch.Tensor:
    """[world * B * P, K] in rank order -> [B, world * P, K] (a view for B = 1, the stream)."""
    k = full.shape[-1]
    if b == 1:
        return full.view(1, world * p, k)
    return full.view(world, b, p, k).transpose(0, 1).reshape(b, world * p, k)


class ColumnParallelLinear(nn.Module):
    """A column-parallel shard whose input rows are spread over the group (sequence parallelism): all-gather
    the rows (an FP8 layer: its quantised rows), then the shard's GEMM over every token. Output [B, N, out]."""

    def __init__(self, linear: nn.Module, tokens: ShardedTokens, label: str = ""):
        super().__init__()
        self.linear = linear
        self.tokens = tokens
        self.label = label
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x) -> torch.Tensor:
        from cadence.quant.fp8 import FP8Linear, QuantizedActivation

        if isinstance(self.linear, FP8Linear):
            return self.linear(self._gather_fp8(x))
        if isinstance(x, QuantizedActivation):
            raise TypeError(f"{self.label}: a quantised activation for a {type(self.linear).__name__} shard")
        return self.linear(self.tokens.gather_rows(x, self.label))

    def _gather_fp8(self, x):
        """The activation quantised per token on this rank's rows, then ONE all-gather of rows packed as
        [K e4m3 bytes | the row's 4 scale bytes] (~half the bytes of the bf16 rows; one collective, not
        two: each has a fixed cost of ~10-20 us), unpacked into a contiguous QuantizedActivation of all N
        (cuBLAS wants the e4m3 rows dense and the scales 16-byte aligned)."""
        from cadence.quant.fp8 import QuantizedActivation, quantize_activations

        if isinstance(x, QuantizedActivation):
            (b, p, k), q, s, dt = x.shape, x.q, x.scale, x.dtype
        else:
            (b, p, k), dt = x.shape, x.dtype
            with region("quant"):
                q, s = quantize_activations(x.reshape(b * p, k))
        tk = self.tokens
        if p != tk.rows:
            raise ValueError(f"{self.label}: {p} rows, this pass shares {tk.rows} per rank")
        packed = torch.empty(b * p, k + 4, dtype=torch.uint8, device=q.device)
        packed[:, :k] = q.view(torch.uint8)
        packed[:, k:] = s.float().contiguous().view(torch.uint8)
        full = _gather(tk.group, packed, self.label, True)  # [world * B * P, K + 4] bytes
        n = tk.tokens
        full = _rank_major_to_batch(full, tk.group.world, b, p)[:, :n].reshape(b * n, k + 4)
        qf = full[:, :k].contiguous().view(q.dtype)
        sf = full[:, k:].contiguous().view(torch.float32)  # [B * N, 1]
        return QuantizedActivation(qf, sf, (b, n, k), dt)

    def extra_repr(self) -> str:
        return f"{self.label}: all-gather of the rows, then {self.in_features} -> {self.out_features} (local)"


def row_scatter(linear, x: torch.Tensor, bias, tokens: ShardedTokens, label: str) -> torch.Tensor:
    """Row-parallel GEMM + reduce-scatter: x [B, N, K/world] (every token) -> this rank's rows [B, P, out]
    of the sum over the group, plus the bias (added once, after the sum, to the rank's rows)."""
    from cadence.parallel.fused import bias_after, bias_in_epilogue, gemm_bias, gemm_into, gemm_out_dtype

    b, n, k = x.shape
    if n != tokens.tokens:
        raise ValueError(f"{label}: {n} tokens, this pass has {tokens.tokens}")
    group, p, out_f = tokens.group, tokens.rows, linear.out_features
    x2 = x.reshape(b * n, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    dt = gemm_out_dtype(linear, x2)
    bias0 = bias_in_epilogue(bias, group)  # rank 0's partial carries the bias: every rank's rows get it once
    if b == 1:  # the stream: the GEMM writes straight into the padded buffer's first N rows
        buf = torch.empty(tokens.padded, out_f, dtype=dt, device=x.device)
        gemm_into(linear, x2, buf[:n], bias=bias0)
        buf[n:].zero_()
    else:
        y = gemm_bias(linear, x2, bias0).to(dt).view(b, n, out_f)
        y = torch.cat([y, y.new_zeros(b, tokens.padded - n, out_f)], dim=1)
        buf = y.view(b, group.world, p, out_f).transpose(0, 1).reshape(group.world * b * p, out_f)
    out = torch.empty(b * p, out_f, dtype=dt, device=x.device)
    with region("allreduce"):
        group.reduce_scatter(out, buf, label=label)
    if bias_after(bias) is not None:  # the reference path (CADENCE_TP_BIAS=after)
        with region("bias"):
            out.add_(bias.to(out.dtype))
    return out.to(x.dtype).view(b, p, out_f)
