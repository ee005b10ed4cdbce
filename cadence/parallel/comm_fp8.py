"""An all-reduce whose payloads cross the links as float8 e4m3: the row-parallel sums in half the bytes.

    y = gemm(x)                       # this rank's partial [M, N] (bf16 on GPUs)
    fp8_all_reduce(y, group, label)   # y <- ~SUM over ranks of y, in place (comm mode "two_shot_fp8")

The two-shot all-reduce is a reduce-scatter then an all-gather; here both halves move e4m3 bytes plus one
float32 scale per row-block of :data:`BLOCK` columns (per row where the width is not a multiple of it):

1. each rank quantises its partial (per block: ``scale = amax / 448``, values clamped to +-448 before the
   cast: ``.to(float8_e4m3fn)`` gives NaN beyond it), packs each row as [N e4m3 bytes | its scales' bytes];
2. reduce-scatter: the packed rows are exchanged by an all-to-all (rank r receives every rank's rows
   [r P, (r+1) P), P = ceil(M / world); the tail is zero-padded), dequantised and summed in float32, in
   rank order (so every rank's shard is a deterministic function of the partials);
3. the summed shard is quantised again (same blocks) and all-gathered as bytes; every rank dequantises
   all rows into the output dtype. Every rank ends with bitwise the same tensor.

Bytes on the link per rank: (w - 1) / w of ``M (N + 4 N / BLOCK)`` per half, against ``2 M N`` for bf16
(~52% of bf16 at BLOCK = 128). Error (``docs/perf/comm/NOTES.md`` derives and measures it): e4m3 has 3
mantissa bits, so one round-to-nearest quantisation of a normal value is within 2^-4 of it relatively; a
value under 2^-6 of its block's scale falls in e4m3's subnormals, within 2^-10 x scale absolutely. Two
quantisations: ``|y~ - y| <= 2^-4 (SUM |p_i|) + 2^-4 |S| + the subnormal terms`` (S: the summed shard
before its requantisation, itself within the first term of y), plus the output dtype's rounding.
:func:`error_bound` computes it for given partials (the tests assert it elementwise).

The exchanges move bytes as ``uint8`` (gloo has no float8 collectives; NCCL moves them the same way), through
the group seam's unrecorded ``_all_to_all`` / ``_all_gather`` (:class:`cadence.parallel.group.TPGroup`):
the whole reduce is recorded as ONE ``all_reduce`` of the bf16 tensor with algo ``two_shot_fp8``, which the
comm estimate prices (``cadence.parallel.emulate``). On an emulated group the two exchanges are the group's
stand-ins, so an emulated rank runs all of the local arithmetic (quantise, sum, requantise, dequantise) on
values of the right scale.

This path is the plain-PyTorch reference of the mode (eager ops, two torch.distributed collectives). The
bf16 all-reduce (``comm="nccl"`` / ``"two_shot"``) is its reference for accuracy. Opt-in only: the chooser
(``comm="auto"``) never picks it, since it changes the numbers; a quality check of the model's output has to
accept it first.
"""

from __future__ import annotations

import os

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
#: columns per scale (CADENCE_FP8_COMM_BLOCK); a width not divisible by it gets one scale per row
BLOCK = int(os.environ.get("CADENCE_FP8_COMM_BLOCK", "128"))
ALGO = "two_shot_fp8"


def block_for(n: int, block: int | None = None) -> int:
    """Columns per scale for a row of `n`: `block` (default :data:`BLOCK`) where it divides n, else n."""
    b = BLOCK if block is None else int(block)
    return b if 0 < b <= n and n % b == 0 else n


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (e4m3 bytes as uint8 [M, N], float32 scales [M, N / block]); value ~= byte x scale."""
    m, n = x.shape
    xb = x.float().view(m, n // block, block)
    amax = xb.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (xb / scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(torch.uint8).view(m, n), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int, dtype=torch.float32) -> torch.Tensor:
    """(uint8 [M, N] e4m3 bytes, float32 [M, N / block]) -> [M, N] in `dtype`."""
    m, n = q.shape
    v = q.view(E4M3).float().view(m, n // block, block) * scale.unsqueeze(-1)
    return v.view(m, n).to(dtype)


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One uint8 row per tensor row: [N e4m3 bytes | N / block float32 scales as bytes]."""
    return torch.cat([q, scale.contiguous().view(torch.uint8)], dim=1)


def unpack(p: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack` for rows of width `n` (any leading shape)."""
    q = p[..., :n]
    s = p[..., n:].contiguous().view(torch.float32)
    return q, s


def packed_row_bytes(n: int, block: int | None = None) -> int:
    """Bytes of one packed row of width `n` (what one token costs on the link, per half)."""
    return n + 4 * (n // block_for(n, block))


def fp8_all_reduce(t: torch.Tensor, group, label: str = "", block: int | None = None) -> torch.Tensor:
    """t [M, N] (contiguous) <- the FP8-payload sum over `group` (a TPGroup), in place; returns t. Recorded as
    one all-reduce of t with algo ``two_shot_fp8``."""
    from cadence.parallel.group import as_group

    g = as_group(group)
    w = g.world
    g.note("all_reduce", t.shape, t.dtype, label, ALGO)
    if w <= 1 or t.numel() == 0:
        return t
    t2 = t.view(-1, t.shape[-1])
    m, n = t2.shape
    b = block_for(n, block)
    rows = -(-m // w)  # rows per shard
    q, s = quantize_blocks(t2, b)
    send = torch.zeros(w * rows, packed_row_bytes(n, b), dtype=torch.uint8, device=t.device)
    send[:m] = pack(q, s)
    recv = torch.empty_like(send)
    g._all_to_all(recv, send)  # recv block j: rank j's rows of this rank's shard
    rq, rs = unpack(recv.view(w, rows, -1), n)
    shard = dequantize_blocks(rq[0], rs[0], b)
    for j in range(1, w):  # float32, rank order: every rank sums its shard the same way
        shard += dequantize_blocks(rq[j], rs[j], b)
    q2, s2 = quantize_blocks(shard, b)
    full = torch.empty_like(send)
    g._all_gather(full, pack(q2, s2))
    fq, fs = unpack(full[:m], n)
    t2.copy_(dequantize_blocks(fq, fs, b, t.dtype))
    return t


def error_bound(
    partials: list[torch.Tensor], block: int | None = None, out_dtype=torch.float32
) -> torch.Tensor:
    """Elementwise bound on |fp8_all_reduce - exact sum| for the ranks' `partials` ([M, N] each): two e4m3
    roundings (2^-4 relative each: 3 mantissa bits, round to nearest), the subnormal floor of each block
    (2^-10 x its scale, absolute) and the output dtype's rounding (its eps / 2, relative)."""
    n = partials[0].shape[-1]
    b = block_for(n, block)
    u = 2.0**-4
    abs_sum = sum(p.float().abs() for p in partials)
    exact = sum(p.float() for p in partials)

    def sub(x):  # half the smallest e4m3 subnormal step (2^-9) in the block's scale
        m = x.shape[0]
        amax = x.float().abs().view(m, n // b, b).amax(-1, keepdim=True)
        return (amax / E4M3_MAX * 2.0**-10).expand(m, n // b, b).reshape(m, n)

    first = u * abs_sum + sum(sub(p) for p in partials)
    s_max = exact.abs() + first  # |S| before the second rounding is within this
    second = u * s_max + sub(s_max)
    final = torch.finfo(out_dtype).eps / 2 * (s_max + second)
    slack = 2.0**-20 * (abs_sum + s_max)  # float32 scaling, dequantising and summing (~2^-24 each)
    return first + second + final + slack
