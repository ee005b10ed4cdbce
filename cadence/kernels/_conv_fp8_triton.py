"""Triton kernel of the FP8 implicit-GEMM 3D conv (imported lazily by ``cadence.kernels.conv_fp8``, which
holds the host side, the reference and the layout contract).

The input comes quantised AND zero-padded in space, channels last, flattened to rows of C bytes:
``Q [B, TP, H + 2, W + 2, C]`` e4m3 (TP = T_out + KT - 1: the causal frames already in front). The output is
computed on the padded grid: output row ``r = (t * HP + h) * WP + w`` of batch b reads, for tap (dt, dh, dw),
the input row ``r + (dt * HP + dh) * WP + dw``. So each tap's A block is a contiguous run of BLOCK_M rows
(a shifted plain GEMM operand, no per-element index math, no spatial masks), and the conv is KT * 9 shifted
GEMMs summed into one accumulator. The grid's border rows (h >= H or w >= W) are computed and dropped at
the store: +1.1% work at 352x544, +7.5% at 44x68.

K order of the weight ``Wq [N, KT * 9 * C]``: ``((dt * 3 + dh) * 3 + dw) * C + c``, so iteration i of the
K loop (BLOCK_K divides C) is tap ``i // (C / BLOCK_K)`` and weight column ``i * BLOCK_K``.

Epilogue: ``acc * (x_scale * w_scale[n]) + bias[n]`` in float32, cast to the output dtype, stored into
``Y [B, T_out, H, W, N]`` (channels last).
"""

import triton
import triton.language as tl

from cadence.kernels.quant_triton import _round_grid


@triton.jit
def conv3x3_fp8_kernel(
    Q,
    Wq,
    SX,
    SW,
    BIAS,
    Y,
    T_out,
    H,
    W,
    C,
    N,
    HAS_BIAS: tl.constexpr,
    KT: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # program ids: the N tiles of one M tile are neighbours (they share the A rows in L2)
    pid = tl.program_id(0)
    b = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n

    HP = H + 2
    WP = W + 2
    frame = HP * WP
    rows_in = (T_out + KT - 1) * frame  # input rows of one batch
    ktot = KT * 9 * C

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N

    q_b = Q + b.to(tl.int64) * rows_in * C
    a_base = q_b + rm[:, None].to(tl.int64) * C + rk[None, :]
    w_base = Wq + rn[None, :].to(tl.int64) * ktot + rk[:, None]  # [BLOCK_K, BLOCK_N], K contiguous

    nkc = C // BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(KT * 9 * nkc):
        tap = i // nkc
        c0 = (i - tap * nkc) * BLOCK_K
        dt = tap // 9
        dh = (tap // 3) % 3
        dw = tap % 3
        off = (dt * HP + dh) * WP + dw
        amask = (rm + off) < rows_in
        a = tl.load(a_base + (off * C + c0), mask=amask[:, None], other=0.0)
        w = tl.load(w_base + i * BLOCK_K, mask=nmask[None, :], other=0.0)
        if UPCAST:  # the interpreter has no fp8 dot: e4m3 values are exact in float32
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)

    sx = tl.load(SX)
    sw = tl.load(SW + rn, mask=nmask, other=0.0)
    out = acc * (sx * sw)[None, :]
    if HAS_BIAS:
        out += tl.load(BIAS + rn, mask=nmask, other=0.0)[None, :]
    if ROUND_BF16:  # the interpreter's float32 -> bf16 cast truncates: round to nearest even first
        out = _round_grid(out, 0.0078125, 9.183549615799121e-41)

    t = rm // frame
    rem = rm - t * frame
    h = rem // WP
    w_ = rem - h * WP
    keep = (t < T_out) & (h < H) & (w_ < W)
    yrow = ((b * T_out + t).to(tl.int64) * H + h) * W + w_
    y_ptr = Y + yrow[:, None] * N + rn[None, :]
    tl.store(y_ptr, out.to(Y.dtype.element_ty), mask=keep[:, None] & nmask[None, :])


@triton.jit
def quant_pad_kernel(
    X,
    Q,
    SX,
    AMAX_PREV,
    AMAX_OUT,
    PREV_TO_SCALE,
    R,
    TP,
    H,
    W,
    C,
    sxb,
    sxt,
    sxh,
    sxw,
    DELAYED: tl.constexpr,
    GRID_ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``Q [B, TP, H + 2, W + 2, C]`` e4m3 = clamp(X / sx, +-448) with a zero border, X [B, C, TP, H, W] with
    unit channel stride (channels last); BLOCK_R padded rows per program, the channels in BLOCK_C slices.
    The division is IEEE (``div_rn``, as torch's); GRID_ROUND (the interpreter only) rounds to the e4m3 grid
    before the cast (``quant_triton._round_grid``).

    Scale: ``SX[0]`` as given, or (DELAYED) ``max(AMAX_PREV[0], 1e-12) * PREV_TO_SCALE`` (headroom / 448: one
    float32 multiply, as the torch version, whose CUDA division by a scalar is a multiply by its reciprocal), which program 0 also writes to ``SX`` for the conv's epilogue. DELAYED
    also records this input's amax: each program's max |x| into ``AMAX_OUT[0]`` (zeroed by the caller) by an
    atomic max, so the next call's scale needs no pass of its own and no host sync."""
    HP = H + 2
    WP = W + 2
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    wp = r % WP
    rest = r // WP
    hp = rest % HP
    rest = rest // HP
    t = rest % TP
    b = rest // TP
    live = r < R
    inside = live & (hp >= 1) & (hp <= H) & (wp >= 1) & (wp <= W)
    src = (
        b.to(tl.int64) * sxb
        + t.to(tl.int64) * sxt
        + (hp - 1).to(tl.int64) * sxh
        + (wp - 1).to(tl.int64) * sxw
    )
    if DELAYED:
        sx = tl.maximum(tl.load(AMAX_PREV), 1e-12) * PREV_TO_SCALE
        if tl.program_id(0) == 0:
            tl.store(SX, sx)
    else:
        sx = tl.load(SX)
    m = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cm = cols < C
        v = tl.load(X + src[:, None] + cols[None, :], mask=inside[:, None] & cm[None, :], other=0.0)
        if DELAYED:
            m = tl.maximum(m, tl.max(tl.abs(v.to(tl.float32)), 1))
        y = tl.math.div_rn(v.to(tl.float32), tl.full(v.shape, 1.0, tl.float32) * sx)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if GRID_ROUND:
            y = _round_grid(y, 0.125, 0.001953125)
        tl.store(
            Q + r[:, None].to(tl.int64) * C + cols[None, :],
            y.to(Q.dtype.element_ty),
            mask=live[:, None] & cm[None, :],
        )
    if DELAYED:
        tl.atomic_max(AMAX_OUT, tl.max(m, 0))
