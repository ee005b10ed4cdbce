"""Triton kernels of the FP8 activation quantisation (imported lazily by ``cadence.kernels.quant``;
see that module's docs). Kept to what triton 3.6 (the GPU machines) and the CPU interpreter both
accept: plain block loads, ``tl.max`` / ``tl.sum`` row reductions, ``tl.math.div_rn`` /
``sqrt_rn``, a grid-stride ``range`` loop; libdevice (``tanh``) only where compiled.

The kernels reproduce the PyTorch reference of the device they run for: compiled, CUDA tensors (torch's
CUDA kernels); under the interpreter, CPU tensors (torch's CPU kernels). Two places differ between those
(:data:`COMPILED` picks, measured on an H200 with torch 2.11, docs/perf/fp8/NOTES.md "GPU parity"):

* the row scale ``amax / 448``: torch on CUDA divides a tensor by a Python scalar as a multiply by the
  scalar's float32 reciprocal (``amax * fl(1/448)``), on the CPU it divides (``div_rn``). Off by one ulp in
  about half the rows, so ``1 / scale`` differs too and ~0.1-0.6% of the e4m3 bytes landed one step away.
* the GELU: compiled, torch's CUDA formula in its order (``0.5 x (1 + tanh(k (x + 0.044715 x^3)))`` with
  libdevice's ``tanhf``: bitwise torch's float32 on the H200); the interpreter has no libdevice, so there
  the exp form ``x / (1 + exp(-2u))`` (the same function, a few ulps from torch's CPU ``tanh``).
"""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

#: True where the kernels are compiled (CUDA tensors), False under TRITON_INTERPRET=1 (CPU tensors): which
#: device's torch arithmetic the kernels reproduce (the module docstring). Read once at import, as Triton
#: itself decides interpretation when the kernels are decorated.
COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _round_grid(y, REL: tl.constexpr, QMIN: tl.constexpr):
    """Round float32 y to the nearest value of a narrower float format, ties to even, in float32
    arithmetic: REL = 2^-mantissa bits (e4m3: 2^-3, bf16: 2^-7, fp16: 2^-10), QMIN = the format's
    subnormal step (e4m3: 2^-9, bf16: 2^-133, fp16: 2^-24). Range limits are the caller's (clamp).

    quantum q = 2^floor(log2|y|) * REL (from y's exponent bits), never below QMIN; adding and then
    subtracting c = 1.5 * 2^23 * q rounds |y| to a multiple of q in the float32 unit's own
    round-to-nearest-even (|y| < 2^22 q always holds); y's sign bit goes back on (a negative value
    that rounds to zero gives -0.0, as torch's casts do).

    Why: the casts that follow (to e4m3, or to bf16 / fp16 and back) then only meet representable
    values, so they are exact in any converter. The hardware casts (sm89+ ``cvt.rn.satfinite`` for
    e4m3, ``cvt.rn`` for bf16) and torch's already round to nearest even, but the Triton interpreter
    does not: float32 -> e4m3 rounds ties away from zero and loses the carry of a mantissa that
    rounds up into the next power of two (125.1 / scale -> 64 instead of 128 where the exponent is
    odd), and float32 -> bf16 truncates. Without this the CPU parity tests would test that
    converter, not the kernel; with it the kernel's bytes equal torch's on both. Should a compiler
    fold the add/sub away, the hardware casts still round to nearest even: the same bytes."""
    bits = y.to(tl.int32, bitcast=True)
    e = (bits & 0x7F800000).to(tl.float32, bitcast=True)
    if QMIN < 1.1754943508222875e-38:
        # below float32's normal range (bf16's 2^-133): triton 3.6 types such a float constexpr as fp64, which
        # cost an fp64 max and two f32 <-> f64 conversions per element (the FP64 units' rate); made in float32
        # at run time instead, exactly: 2^-66 * (QMIN * 2^66), both factors normal
        qmin = tl.full(e.shape, 1.3552527156068805e-20, tl.float32) * (QMIN * 7.378697629483821e19)
    else:
        qmin = QMIN
    q = tl.maximum(e * REL, qmin)
    c = q * 12582912.0
    r = (tl.abs(y) + c) - c
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_store(
    h,
    rows,
    cols,
    rmask,
    mask,
    Q,
    sqm,
    S,
    AMAX_MIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GRID_ROUND: tl.constexpr,
):
    """h [BLOCK_M, BLOCK_K] float32 (masked lanes 0) -> e4m3 rows of Q and float32 scales S[rows].

    The reference's arithmetic exactly: amax (max |h|, exact), clamp_min, scale = amax / 448 as torch
    forms it on the device (compiled / CUDA: amax * float32(1/448), one rounding; interpreter / CPU: the
    IEEE quotient, div_rn), its reciprocal IEEE-rounded (div_rn, as torch's ``reciprocal`` on both;
    Triton's plain '/' on fp32 is an approximate division on NVIDIA), h * (1/scale), clamp to +-448 before
    the cast (torch 2.11 makes NaN of overflow; the hardware cast saturates anyway), cast
    round-to-nearest-even."""
    amax = tl.maximum(tl.max(tl.abs(h), axis=1), AMAX_MIN)
    if COMPILED:  # torch's CUDA div by a Python scalar: a * (1 / b), the reciprocal rounded to float32
        scale = amax * (1.0 / FP8_MAX)
    else:
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    y = h * inv[:, None]
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if GRID_ROUND:  # off only to time the bare hardware cast (cadence bench fused --quant)
        y = _round_grid(y, 0.125, 0.001953125)  # the e4m3 grid
    tl.store(Q + rows[:, None].to(tl.int64) * sqm + cols[None, :], y.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows, scale, mask=rmask)


@triton.jit
def quant_rows_kernel(
    X,
    sxm,
    Q,
    sqm,
    S,
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AMAX_MIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GRID_ROUND: tl.constexpr,
):
    """BLOCK_M whole rows of X [M, K] (last dim contiguous) per program, held in registers: one read
    of X, one write of Q [M, K] e4m3 and of S [M] float32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < K)
    x = tl.load(X + rows[:, None].to(tl.int64) * sxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    _quant_store(x, rows, cols, rmask, mask, Q, sqm, S, AMAX_MIN, FP8_MAX, GRID_ROUND)


@triton.jit
def _round_model(h, ROUND: tl.constexpr):
    """float32 h rounded to the model dtype, kept in float32. ROUND: 0 none (float32 model), 1 bf16, 2 fp16."""
    if ROUND == 1:  # the model's .to(bfloat16)
        h = _round_grid(h, 0.0078125, 9.183549615799121e-41)
    elif ROUND == 2:  # .to(float16) (|h| < 65520 assumed: beyond, torch gives inf)
        h = _round_grid(h, 0.0009765625, 5.960464477539063e-08)
    return h


@triton.jit
def _norm_modulate(x, mask, sh, sc1, kf, eps, RMS: tl.constexpr, ROUND: tl.constexpr):
    """x [R, BLOCK_K] float32 (masked lanes 0) -> (norm(x) * sc1 + sh) rounded to the model dtype,
    masked lanes 0. sc1 = 1 + scale, as torch forms ``(1 + scale)`` first (same float32 rounding); for an
    affine LayerNorm sc1 is the weight and sh the bias.
    norm: LayerNorm without affine (mean, then the variance of the centred row, both from registers)
    or, with RMS, x / sqrt(mean(x^2) + eps). ROUND: 0 none (float32 model), 1 bf16, 2 fp16."""
    one = tl.full([x.shape[0]], 1.0, tl.float32)
    if RMS:
        ms = tl.math.div_rn(tl.sum(x * x, axis=1), one * kf)
        rstd = tl.math.div_rn(one, tl.math.sqrt_rn(ms + eps))
        y = x * rstd[:, None]
    else:
        mean = tl.math.div_rn(tl.sum(x, axis=1), one * kf)
        d = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.math.div_rn(tl.sum(d * d, axis=1), one * kf)
        rstd = tl.math.div_rn(one, tl.math.sqrt_rn(var + eps))
        y = d * rstd[:, None]
    h = _round_model(y * sc1 + sh, ROUND)
    return tl.where(mask, h, 0.0)


@triton.jit
def quant_rows_modulated_kernel(
    X,
    sxb,
    sxn,
    SH,
    shb,
    shn,
    SC,
    scb,
    scn,
    Q,
    sqm,
    S,
    M,
    N,
    K,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RMS: tl.constexpr,
    ROUND: tl.constexpr,
    SHARED: tl.constexpr,
    AMAX_MIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PLUS_ONE: tl.constexpr = True,
):
    """h = norm(x) * (1 + scale) + shift, rounded to the model dtype, then quantised per row like
    quant_rows_kernel, in one pass over x. PLUS_ONE False: h = norm(x) * scale + shift (an affine
    LayerNorm: scale = its weight, shift = its bias).

    Rows are tokens of X [B, N, K] (row m = b * N + n; strides per b and n, last dim contiguous).
    SHARED (every row uses the same modulation row: per-sample modulation with B == 1, the stream's
    case): each program loads shift and 1 + scale ONCE, then walks row blocks pid, pid + programs,
    ... (grid-stride), so the modulation is read once per program, not once per row. Otherwise one
    block of rows per program, shift / scale read at (b, n) through their strides (0 where
    broadcast: [B, 1, K] per sample, [B, N, K] per token)."""
    cols = tl.arange(0, BLOCK_K)
    cmask = cols < K
    kf = K * 1.0  # float32 (K may arrive as a constexpr when 1)
    if SHARED:
        sh = tl.load(SH + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        sc1 = tl.load(SC + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if PLUS_ONE:
            sc1 = 1.0 + sc1
        for start in range(tl.program_id(0) * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            b = (rows // N).to(tl.int64)
            n = (rows % N).to(tl.int64)
            x = tl.load(X + (b * sxb + n * sxn)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = _norm_modulate(x, mask, sh, sc1, kf, eps, RMS, ROUND)
            _quant_store(h, rows, cols, rmask, mask, Q, sqm, S, AMAX_MIN, FP8_MAX, True)
    else:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        b = (rows // N).to(tl.int64)
        n = (rows % N).to(tl.int64)
        x = tl.load(X + (b * sxb + n * sxn)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(SH + (b * shb + n * shn)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sc1 = tl.load(SC + (b * scb + n * scn)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if PLUS_ONE:
            sc1 = 1.0 + sc1
        h = _norm_modulate(x, mask, sh, sc1, kf, eps, RMS, ROUND)
        _quant_store(h, rows, cols, rmask, mask, Q, sqm, S, AMAX_MIN, FP8_MAX, True)


@triton.jit
def gelu_quant_rows_kernel(
    X,
    sxm,
    Q,
    sqm,
    S,
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND: tl.constexpr,
    AMAX_MIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """GELU (tanh form) of BLOCK_M whole rows of X [M, K], rounded to the model dtype, then quantised
    per row like quant_rows_kernel: the FFN's ``F.gelu(fc1(x), approximate="tanh")`` feeding an FP8 fc2,
    one read of the fc1 output, one write of the FP8 rows.

    gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). Compiled: exactly torch's CUDA
    expression (x^3 as x * x * x, then u, then 0.5 * x * (1 + tanhf(u)), libdevice's tanhf), so its float32
    is torch's bit for bit (measured on an H200: 0 ulps over 2.2M bf16 / fp16 inputs, the tails' cancellation
    to -0.0 included). Interpreter (no libdevice): x / (1 + exp(-2u)) (1 + tanh(u) = 2 sigmoid(2u)), exact
    division; for large negative x the exponent is capped at 80 (no overflow), leaving a value below 1e-30
    in magnitude that the quantisation rounds to -0, the byte torch's -0.0 gives."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < K)
    x = tl.load(X + rows[:, None].to(tl.int64) * sxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if COMPILED:
        x3 = x * x * x
        g = 0.5 * x * (1.0 + libdevice.tanh(0.7978845608028654 * (x + 0.044715 * x3)))
    else:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(tl.minimum(-2.0 * u, 80.0))  # capped short of overflow: x / (1 + 5.5e34) rounds like -0
        g = tl.math.div_rn(x, 1.0 + e)
    g = _round_model(g, ROUND)
    _quant_store(tl.where(mask, g, 0.0), rows, cols, rmask, mask, Q, sqm, S, AMAX_MIN, FP8_MAX, True)
