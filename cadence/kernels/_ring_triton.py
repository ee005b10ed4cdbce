"""Triton kernels of the ring cache (imported lazily by ``ring_attention``; see that module's docs).

Module-level so that Triton can resolve the helper ``attn_tile`` from the kernels' globals.
"""

import triton
import triton.language as tl


@triton.jit
def _write_one(
    X,
    sxt,
    sxh,
    COS,
    SIN,
    OUT,
    soh,
    son,
    sod,
    SCALE,
    ssh,
    ssn,
    ROW0,
    T,
    pid,
    h,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROTATE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Rows [pid*BLOCK_T, ...) of head h of X [T, H, D] (last dim contiguous): rotate interleaved
    pairs, quantise per row (amax/448, clamp, cast) and store at rows ROW0 + t of OUT."""
    HALF: tl.constexpr = D // 2
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    d = tl.arange(0, D)
    x = tl.load(X + t[:, None] * sxt + h * sxh + d[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        i = tl.arange(0, HALF)
        c = tl.load(COS + t[:, None] * HALF + i[None, :], mask=tm[:, None], other=1.0)
        s = tl.load(SIN + t[:, None] * HALF + i[None, :], mask=tm[:, None], other=0.0)
        x0, x1 = tl.split(tl.reshape(x, [BLOCK_T, HALF, 2]))
        y = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), [BLOCK_T, D])
    else:
        y = x
    row = tl.load(ROW0) + t
    if QUANT:
        sc = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-12) / 448.0
        # divide (as the reference does) rather than multiply by 1/sc: the row's max lands on 448
        y = tl.minimum(tl.maximum(y / sc[:, None], -448.0), 448.0)
        tl.store(SCALE + h * ssh + row * ssn, sc, mask=tm)
    tl.store(
        OUT + h * soh + row[:, None] * son + d[None, :] * sod, y.to(OUT.dtype.element_ty), mask=tm[:, None]
    )


@triton.jit
def rope_quant_kernel(
    X,
    sxt,
    sxh,
    COS,
    SIN,
    OUT,
    soh,
    son,
    sod,
    SCALE,
    ssh,
    ssn,
    ROW0,
    T,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROTATE: tl.constexpr,
    QUANT: tl.constexpr,
):
    _write_one(
        X,
        sxt,
        sxh,
        COS,
        SIN,
        OUT,
        soh,
        son,
        sod,
        SCALE,
        ssh,
        ssn,
        ROW0,
        T,
        tl.program_id(0),
        tl.program_id(1),
        D,
        BLOCK_T,
        ROTATE,
        QUANT,
    )


@triton.jit
def qkv_write_kernel(
    Q,
    sqt,
    sqh,
    K,
    skt,
    skh,
    V,
    svt,
    svh,
    COS,
    SIN,
    QO,
    sqoh,
    sqon,
    sqod,
    QS,
    sqsh,
    sqsn,
    KO,
    skoh,
    skon,
    skod,
    KS,
    sksh,
    sksn,
    VO,
    svoh,
    svon,
    svod,
    VS,
    svsh,
    svsn,
    ZERO,
    ROW0,
    T,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One launch for a pass's three writes: axis 2 picks q (rotated, into the query scratch at row 0),
    k (rotated, into the cache at ROW0) or v (into the cache at ROW0, no rotation)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    which = tl.program_id(2)
    if which == 0:
        _write_one(
            Q,
            sqt,
            sqh,
            COS,
            SIN,
            QO,
            sqoh,
            sqon,
            sqod,
            QS,
            sqsh,
            sqsn,
            ZERO,
            T,
            pid,
            h,
            D,
            BLOCK_T,
            True,
            QUANT,
        )
    elif which == 1:
        _write_one(
            K,
            skt,
            skh,
            COS,
            SIN,
            KO,
            skoh,
            skon,
            skod,
            KS,
            sksh,
            sksn,
            ROW0,
            T,
            pid,
            h,
            D,
            BLOCK_T,
            True,
            QUANT,
        )
    else:
        _write_one(
            V,
            svt,
            svh,
            COS,
            SIN,
            VO,
            svoh,
            svon,
            svod,
            VS,
            svsh,
            svsn,
            ROW0,
            T,
            pid,
            h,
            D,
            BLOCK_T,
            False,
            QUANT,
        )


@triton.jit
def attn_tile(
    q,
    row,
    k_desc,
    v_desc,
    KS,
    VS,
    sksh,
    sksn,
    svsh,
    svsn,
    h,
    start,
    n_hi,
    m_i,
    l_i,
    acc,
    c_prev,
    HEAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_F32: tl.constexpr,
    MASK: tl.constexpr,
    PREC: tl.constexpr,
):
    k = k_desc.load([h, start, 0]).reshape(BLOCK_N, HEAD_D)
    vt = v_desc.load([h, 0, start]).reshape(HEAD_D, BLOCK_N)
    if DOT_F32:
        k = k.to(tl.float32)
        vt = vt.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    offs_n = start + tl.arange(0, BLOCK_N)
    valid = offs_n < n_hi
    if QUANT:
        if MASK:
            ks = tl.load(KS + h * sksh + offs_n * sksn, mask=valid, other=0.0)
        else:
            ks = tl.load(KS + h * sksh + offs_n * sksn)
        s = s * row[:, None] * ks[None, :]
    else:
        s = s * row[:, None]
    if MASK:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANT:
        # P (<= 1) times v_scale_j / max_tile(v_scale) * 256 stays in FP8's normal range; the
        # accumulator is kept in units of this tile's max_tile(v_scale) / 256 (c), so moving
        # from the previous tile's unit to this one folds into the usual alpha rescale.
        if MASK:
            vs = tl.load(VS + h * svsh + offs_n * svsn, mask=valid, other=0.0)
        else:
            vs = tl.load(VS + h * svsh + offs_n * svsn)
        c = tl.maximum(tl.max(vs, axis=0), 1e-30) / 256.0
        p8 = (p * (vs / c)[None, :]).to(tl.float8e4nv)
        if DOT_F32:
            p8 = p8.to(tl.float32)
        acc = tl.dot(p8, tl.trans(vt), acc * (alpha * (c_prev / c))[:, None])
        c_prev = c
    else:
        if DOT_F32:
            acc = tl.dot(p, tl.trans(vt), acc * alpha[:, None], input_precision=PREC)
        else:
            acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc * alpha[:, None], input_precision=PREC)
    return m_new, l_i, acc, c_prev


@triton.jit
def attn_kernel(
    q_desc,
    QS,
    k_desc,
    KS,
    v_desc,
    VS,
    NVALID,
    O,  # noqa: E741  (O: the output, as in the paper)
    LSE,
    sqsh,
    sqsm,
    sksh,
    sksn,
    svsh,
    svsn,
    sos,
    soh,
    som,
    sod,
    sls,
    slh,
    slm,
    M,
    n_per_split,
    qk_scale,
    HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    mm = offs_m < M
    q = q_desc.load([h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_D)
    if DOT_F32:
        q = q.to(tl.float32)
    if QUANT:
        row = tl.load(QS + h * sqsh + offs_m * sqsm, mask=mm, other=0.0) * qk_scale
    else:
        row = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    c_prev = 1.0
    n_valid = tl.load(NVALID)
    n_lo = sp * n_per_split
    n_hi = tl.minimum(n_valid, n_lo + n_per_split)
    n_full = n_lo + tl.maximum(n_hi - n_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(n_lo, n_full, BLOCK_N):
        m_i, l_i, acc, c_prev = attn_tile(
            q,
            row,
            k_desc,
            v_desc,
            KS,
            VS,
            sksh,
            sksn,
            svsh,
            svsn,
            h,
            start,
            n_hi,
            m_i,
            l_i,
            acc,
            c_prev,
            HEAD_D,
            BLOCK_N,
            QUANT,
            DOT_F32,
            False,
            PREC,
        )
    if n_full < n_hi:
        m_i, l_i, acc, c_prev = attn_tile(
            q,
            row,
            k_desc,
            v_desc,
            KS,
            VS,
            sksh,
            sksn,
            svsh,
            svsn,
            h,
            n_full,
            n_hi,
            m_i,
            l_i,
            acc,
            c_prev,
            HEAD_D,
            BLOCK_N,
            QUANT,
            DOT_F32,
            True,
            PREC,
        )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (c_prev / l_safe)[:, None]
    tl.store(
        O + sp * sos + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        out.to(O.dtype.element_ty),
        mask=mm[:, None],
    )
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + sp * sls + h * slh + offs_m * slm, lse, mask=mm)
