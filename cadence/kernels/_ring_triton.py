"""Triton kernels of the ring cache (imported lazily by ``ring_attention``; see that module's docs).

Module-level so that Triton can resolve the helpers (``_write_one``, ``attn_tile``) from the kernels'
globals. Scale modes (``SCALE`` / ``SCALES`` constexprs): 0 = stored as is (float storage), 1 = one scale
per (token, head), computed by the write and stored beside the values, 2 = one given scale per head
(``SCALE[h]``: the ring's per-(layer, head) scales, or a query scale computed for the pass).
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
    MODE: tl.constexpr,
    SS,
    sss,
    NW,
    NORM_DIM,
    NORM_EPS,
    NORM: tl.constexpr,
):
    """Rows [pid*BLOCK_T, ...) of head h of X [T, H, D] (last dim contiguous): with NORM, first the RMS
    norm's apply (x * rsqrt(SS[t] / NORM_DIM + NORM_EPS) * NW[h*D + d], in float32: SS the row's sum of
    squares over the norm's full width, NW this rank's slice of its weight); rotate interleaved
    pairs, quantise (MODE 1: per row, amax/448, scale stored; MODE 2: by the head's given scale), clamp
    to +-448, cast and store at rows ROW0 + t of OUT (MODE 0: store as is)."""
    HALF: tl.constexpr = D // 2
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    d = tl.arange(0, D)
    x = tl.load(X + t[:, None] * sxt + h * sxh + d[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
    if NORM:
        ss = tl.load(SS + t * sss, mask=tm, other=0.0)
        w = tl.load(NW + h * D + d).to(tl.float32)
        x = x * tl.rsqrt(ss / NORM_DIM + NORM_EPS)[:, None] * w[None, :]
    if ROTATE:
        i = tl.arange(0, HALF)
        c = tl.load(COS + t[:, None] * HALF + i[None, :], mask=tm[:, None], other=1.0)
        s = tl.load(SIN + t[:, None] * HALF + i[None, :], mask=tm[:, None], other=0.0)
        x0, x1 = tl.split(tl.reshape(x, [BLOCK_T, HALF, 2]))
        y = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), [BLOCK_T, D])
    else:
        y = x
    row = tl.load(ROW0) + t
    if MODE == 1:
        sc = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-12) / 448.0
        # divide (as the reference does) rather than multiply by 1/sc: the row's max lands on 448
        y = tl.minimum(tl.maximum(y / sc[:, None], -448.0), 448.0)
        tl.store(SCALE + h * ssh + row * ssn, sc, mask=tm)
    elif MODE == 2:
        sc = tl.maximum(tl.load(SCALE + h * ssh), 1e-30)
        y = tl.minimum(tl.maximum(y / sc, -448.0), 448.0)
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
    MODE: tl.constexpr,
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
        MODE,
        X,
        0,
        X,
        1.0,
        0.0,
        False,
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
    QSS,
    sqss,
    QW,
    KSS,
    skss,
    KW,
    NORM_DIM,
    NORM_EPS,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    Q_MODE: tl.constexpr,
    KV_MODE: tl.constexpr,
    NORM: tl.constexpr,
):
    """One launch for a pass's three writes: axis 2 picks q (rotated, into the query scratch at row 0),
    k (rotated, into the cache at ROW0) or v (into the cache at ROW0, no rotation). With NORM, q and k
    are first RMS-normed (their norms' apply: sums of squares QSS / KSS, weights QW / KW; ``_write_one``)."""
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
            Q_MODE,
            QSS,
            sqss,
            QW,
            NORM_DIM,
            NORM_EPS,
            NORM,
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
            KV_MODE,
            KSS,
            skss,
            KW,
            NORM_DIM,
            NORM_EPS,
            NORM,
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
            KV_MODE,
            V,
            0,
            V,
            1.0,
            0.0,
            False,
        )


@triton.jit
def attn_tile(
    q,
    r,
    k,
    v,
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
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    SCALES: tl.constexpr,
    PV_BF16: tl.constexpr,
    DOT_F32: tl.constexpr,
    MASK: tl.constexpr,
    PREC: tl.constexpr,
    V_UNIT: tl.constexpr = False,
    L_MMA: tl.constexpr = False,
):
    """One key tile for one block of query rows. k [BLOCK_N, D]; v [BLOCK_N, D] (a transposed view of
    the V^T tile for FP8). Logits in base 2 are t = (q . k) * r_i (* k_scale_j with per-token scales);
    the running max is kept in those units, so the exponent is one multiply-add per element. V_UNIT: c_prev is
    log2 of a unit fixed for the key range, subtracted in the exponent (``_short_item``). L_MMA (FP8, per-head
    scales): l_i [BLOCK_M, 16], the row sums by the tensor cores (``_l_by_mma``), not 64 adds per thread."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    offs_n = start + tl.arange(0, BLOCK_N)
    valid = offs_n < n_hi
    if SCALES == 1:
        if MASK:
            ks = tl.load(KS + h * sksh + offs_n * sksn, mask=valid, other=0.0)
        else:
            ks = tl.load(KS + h * sksh + offs_n * sksn)
        s = s * ks[None, :]
    if MASK:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * r)  # r > 0: max(s * r) = max(s) * r
    if SCALES == 2:
        # 256 * exp2(t - m): P in FP8's normal range (<= 256 < 448), the factor folded into the exponent
        # (it cancels in acc / l: l sums the same scaled numerators)
        p = tl.math.exp2(s * r[:, None] - (m_new - 8.0)[:, None])
    elif V_UNIT:
        p = tl.math.exp2(s * r[:, None] - (m_new + c_prev)[:, None])
    else:
        p = tl.math.exp2(s * r[:, None] - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    if not L_MMA:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALES == 1:
        if MASK:
            vs = tl.load(VS + h * svsh + offs_n * svsn, mask=valid, other=0.0)
        else:
            vs = tl.load(VS + h * svsh + offs_n * svsn)
        p, alpha, c_prev = _p_times_v_scale(p, alpha, c_prev, vs, V_UNIT)
    if QUANT:
        if PV_BF16:
            pv = p.to(tl.bfloat16)
            vv = v.to(tl.bfloat16)
        else:
            pv = p.to(tl.float8e4nv)
            vv = v
    else:
        pv = p.to(v.dtype)
        vv = v
    if L_MMA:
        l_i = _l_by_mma(pv, l_i, alpha, BLOCK_N, DOT_F32, PREC)
    if DOT_F32:
        pv = pv.to(tl.float32)
        vv = vv.to(tl.float32)
    acc = tl.dot(pv, vv, acc * alpha[:, None], input_precision=PREC)
    return m_new, l_i, acc, c_prev


@triton.jit
def _l_by_mma(pv, l_i, alpha, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """l_i [BLOCK_M, 16] rescaled by alpha plus P @ [1, 0, ..., 0] (its columns summed once, after the loop): P
    as rounded to FP8 for P.V times a column of ones (a constant tile the compiler hoists out of the loop), so l
    is the sum of the very numerators P.V used."""
    w = (tl.where(tl.arange(0, 16)[None, :] == 0, 1.0, 0.0) + tl.zeros([BLOCK_N, 16], tl.float32)).to(
        pv.dtype
    )
    if DOT_F32:
        return tl.dot(pv.to(tl.float32), w.to(tl.float32), l_i * alpha[:, None], input_precision=PREC)
    return tl.dot(pv, w, l_i * alpha[:, None])


@triton.jit
def _p_times_v_scale(p, alpha, c_prev, vs, V_UNIT: tl.constexpr):
    """Per-token V scales (vs: the tile's, 0 past the valid keys): P (<= 1) times v_scale_j / max_tile(v_scale) *
    256 stays in FP8's normal range; the accumulator is kept in units of this tile's max_tile(v_scale) / 256 (c),
    so moving from the previous tile's unit to this one folds into the usual alpha rescale. V_UNIT: the unit is
    the item's, already out of P."""
    if V_UNIT:
        p = p * vs[None, :]
    else:
        c = tl.maximum(tl.max(vs, axis=0), 1e-30) / 256.0
        p = p * (vs / c)[None, :]
        alpha = alpha * (c_prev / c)
        c_prev = c
    return p, alpha, c_prev


@triton.jit
def _load_kv(
    k_desc,
    v_desc,
    h,
    start,
    HEAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_TRANS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    k = k_desc.load([h, start, 0]).reshape(BLOCK_N, HEAD_D)
    if V_TRANS:
        v = tl.trans(v_desc.load([h, 0, start]).reshape(HEAD_D, BLOCK_N))
    else:
        v = v_desc.load([h, start, 0]).reshape(BLOCK_N, HEAD_D)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _finish(
    m_i,
    l_i,
    acc,
    c_prev,
    offs_m,
    mm,
    VS,
    svsh,
    OB,
    LSE,
    sp,
    h,
    sos,
    soh,
    som,
    sod,
    sls,
    slh,
    slm,
    HEAD_D: tl.constexpr,
    SCALES: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_D)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if SCALES == 1:
        out = acc * (c_prev / l_safe)[:, None]
    elif SCALES == 2:
        out = acc * (tl.load(VS + h * svsh) / l_safe)[:, None]
    else:
        out = acc / l_safe[:, None]
    tl.store(
        OB + sp * sos + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        out.to(OB.dtype.element_ty),
        mask=mm[:, None],
    )
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + sp * sls + h * slh + offs_m * slm, lse, mask=mm)


@triton.jit
def _row_factor(
    QS,
    sqsh,
    sqsm,
    KS,
    sksh,
    h,
    offs_m,
    mm,
    qk_scale,
    QUANT: tl.constexpr,
    SCALES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per query row: qk_scale (base 2) x q_scale_i (x the head's k scale with per-head scales)."""
    if QUANT:
        r = tl.load(QS + h * sqsh + offs_m * sqsm, mask=mm, other=1.0) * qk_scale
        if SCALES == 2:
            r = r * tl.load(KS + h * sksh)
    else:
        r = tl.zeros([BLOCK], dtype=tl.float32) + qk_scale
    return r


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
    SCALES: tl.constexpr,
    V_TRANS: tl.constexpr,
    PV_BF16: tl.constexpr,
    DUAL: tl.constexpr,
    WS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (row block, head, key split). A block is BLOCK_M query rows, or with DUAL two blocks of
    BLOCK_M rows that share every K/V tile loaded (two independent softmax chains per tile: one block's
    MMA can run under the other's exponentials). The visible length is read on the device (NVALID)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n_valid = tl.load(NVALID)
    n_lo = sp * n_per_split
    n_hi = tl.minimum(n_valid, n_lo + n_per_split)
    n_full = n_lo + tl.maximum(n_hi - n_lo, 0) // BLOCK_N * BLOCK_N
    row_a = pid_m * BLOCK_M * (1 + DUAL)
    offs_a = row_a + tl.arange(0, BLOCK_M)
    ma = offs_a < M
    qa = q_desc.load([h, row_a, 0]).reshape(BLOCK_M, HEAD_D)
    if DOT_F32:
        qa = qa.to(tl.float32)
    ra = _row_factor(QS, sqsh, sqsm, KS, sksh, h, offs_a, ma, qk_scale, QUANT, SCALES, BLOCK_M)
    ma_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    la_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    ca = 1.0
    if DUAL:
        offs_b = offs_a + BLOCK_M
        mb = offs_b < M
        qb = q_desc.load([h, row_a + BLOCK_M, 0]).reshape(BLOCK_M, HEAD_D)
        if DOT_F32:
            qb = qb.to(tl.float32)
        rb = _row_factor(QS, sqsh, sqsm, KS, sksh, h, offs_b, mb, qk_scale, QUANT, SCALES, BLOCK_M)
        mb_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        lb_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
        cb = 1.0
    # the tile calls stay compact: a line of state, a line of tile arguments, a line of constexprs
    # fmt: off
    for start in tl.range(n_lo, n_full, BLOCK_N, warp_specialize=WS):
        k, v = _load_kv(k_desc, v_desc, h, start, HEAD_D, BLOCK_N, V_TRANS, DOT_F32)
        ma_i, la_i, acc_a, ca = attn_tile(
            qa, ra, k, v, KS, VS, sksh, sksn, svsh, svsn, h, start, n_hi, ma_i, la_i, acc_a, ca,
            BLOCK_N, QUANT, SCALES, PV_BF16, DOT_F32, False, PREC)
        if DUAL:
            mb_i, lb_i, acc_b, cb = attn_tile(
                qb, rb, k, v, KS, VS, sksh, sksn, svsh, svsn, h, start, n_hi, mb_i, lb_i, acc_b, cb,
                BLOCK_N, QUANT, SCALES, PV_BF16, DOT_F32, False, PREC)
    if n_full < n_hi:  # the one masked tile: the visible length ends inside it
        k, v = _load_kv(k_desc, v_desc, h, n_full, HEAD_D, BLOCK_N, V_TRANS, DOT_F32)
        ma_i, la_i, acc_a, ca = attn_tile(
            qa, ra, k, v, KS, VS, sksh, sksn, svsh, svsn, h, n_full, n_hi, ma_i, la_i, acc_a, ca,
            BLOCK_N, QUANT, SCALES, PV_BF16, DOT_F32, True, PREC)
        if DUAL:
            mb_i, lb_i, acc_b, cb = attn_tile(
                qb, rb, k, v, KS, VS, sksh, sksn, svsh, svsn, h, n_full, n_hi, mb_i, lb_i, acc_b, cb,
                BLOCK_N, QUANT, SCALES, PV_BF16, DOT_F32, True, PREC)
    _finish(ma_i, la_i, acc_a, ca, offs_a, ma, VS, svsh, O, LSE, sp, h, sos, soh, som, sod, sls, slh, slm,
            HEAD_D, SCALES)
    if DUAL:
        _finish(mb_i, lb_i, acc_b, cb, offs_b, mb, VS, svsh, O, LSE, sp, h, sos, soh, som, sod, sls, slh, slm,
                HEAD_D, SCALES)
    # fmt: on


@triton.jit
def combine_kernel(
    PART,
    LSE,
    OUT,
    sos,
    soh,
    som,
    sod,
    sls,
    slh,
    slm,
    sotm,
    soth,
    sotd,
    M,
    NSPLIT,
    HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Merge the key splits of one (row block, head): out = sum_s w_s o_s with w = softmax over the splits'
    base-2 log-sum-exps (an empty split has lse -inf, weight 0); written once, in the output layout."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < M
    offs_d = tl.arange(0, HEAD_D)
    mx = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    for s in range(NSPLIT):
        lse = tl.load(LSE + s * sls + h * slh + offs_m * slm, mask=mm, other=float("-inf"))
        mx = tl.maximum(mx, lse)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    for s in range(NSPLIT):
        lse = tl.load(LSE + s * sls + h * slh + offs_m * slm, mask=mm, other=float("-inf"))
        w = tl.math.exp2(lse - mx)
        den += w
        o = tl.load(
            PART + s * sos + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
            mask=mm[:, None],
            other=0.0,
        )
        acc += o * w[:, None]
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(
        OUT + offs_m[:, None] * sotm + h * soth + offs_d[None, :] * sotd,
        out.to(OUT.dtype.element_ty),
        mask=mm[:, None],
    )


# ---- the short-query kernel: a persistent grid over (row block, head, key split) items ----------------------
@triton.jit
def _v_unit(VS, svsh, svsn, h, n_lo, n_hi, CHUNK: tl.constexpr):
    """log2 of the accumulator's unit for one item's keys [n_lo, n_hi): log2(max v scale / 256). Each chunk is
    one load and one block-wide maximum (shared memory, barriers) in series: a larger CHUNK, fewer rounds."""
    vmax = 1e-30
    for start in range(n_lo, n_hi, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        vs = tl.load(VS + h * svsh + offs * svsn, mask=offs < n_hi, other=0.0)
        vmax = tl.maximum(vmax, tl.max(vs, axis=0))
    return tl.log2(vmax) - 8.0


@triton.jit
def _lazy_tile(q, r, k, v, KS, VS, sksh, sksn, svsh, svsn, h, start, n_hi, m_i, l_i, acc, c,
               BLOCK_N: tl.constexpr, SCALES: tl.constexpr, DOT_F32: tl.constexpr, MASK: tl.constexpr,
               PREC: tl.constexpr, L_MMA: tl.constexpr, TAU: tl.constexpr):  # fmt: skip
    """``attn_tile`` (FP8, per-head scales or V_UNIT) with a lazy rescale: the running maximum moves only when a
    row's tile maximum exceeds it by more than TAU (log2 units) anywhere in the block, so most tiles skip the
    rescale of acc and l (one block-wide maximum instead); P is then at most 2^TAU of the scale it had, so its
    FP8 factor is 2^(8 - TAU) (per-head) or the unit 2^TAU larger (c, ``_short_item``)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    offs_n = start + tl.arange(0, BLOCK_N)
    valid = offs_n < n_hi
    if SCALES == 1:
        if MASK:
            ks = tl.load(KS + h * sksh + offs_n * sksn, mask=valid, other=0.0)
            vs = tl.load(VS + h * svsh + offs_n * svsn, mask=valid, other=0.0)
        else:
            ks = tl.load(KS + h * sksh + offs_n * sksn)
            vs = tl.load(VS + h * svsh + offs_n * svsn)
        s = s * ks[None, :]
    if MASK:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_tile = tl.max(s, axis=1) * r
    if tl.max(m_tile - m_i, axis=0) > TAU:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        if L_MMA:
            l_i = l_i * alpha[:, None]
        else:
            l_i = l_i * alpha
        m_i = m_new
    if SCALES == 2:
        p = tl.math.exp2(s * r[:, None] - (m_i - (8.0 - TAU))[:, None])
    else:
        p = tl.math.exp2(s * r[:, None] - (m_i + c)[:, None])
    if not L_MMA:
        l_i = l_i + tl.sum(p, axis=1)
    if SCALES == 1:
        p = p * vs[None, :]
    pv = p.to(tl.float8e4nv)
    if L_MMA:
        l_i = _l_by_mma(pv, l_i, tl.full([pv.shape[0]], 1.0, tl.float32), BLOCK_N, DOT_F32, PREC)
    if DOT_F32:
        acc = tl.dot(pv.to(tl.float32), v.to(tl.float32), acc, input_precision=PREC)
    else:
        acc = tl.dot(pv, v, acc)
    return m_i, l_i, acc, c


@triton.jit
def _short_tile(q, r, k_desc, v_desc, KS, VS, sksh, sksn, svsh, svsn, h, start, n_hi, m_i, l_i, acc, c,
                HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, SCALES: tl.constexpr,
                V_TRANS: tl.constexpr, V_UNIT: tl.constexpr, DOT_F32: tl.constexpr, MASK: tl.constexpr,
                PREC: tl.constexpr, L_MMA: tl.constexpr, TAU: tl.constexpr):  # fmt: skip
    """One key tile of an item: K / V loaded, then ``attn_tile`` (``_lazy_tile`` with TAU > 0)."""
    k, v = _load_kv(k_desc, v_desc, h, start, HEAD_D, BLOCK_N, V_TRANS, DOT_F32)
    if TAU > 0:
        return _lazy_tile(q, r, k, v, KS, VS, sksh, sksn, svsh, svsn, h, start, n_hi, m_i, l_i, acc, c, BLOCK_N,
                          SCALES, DOT_F32, MASK, PREC, L_MMA, TAU)  # fmt: skip
    return attn_tile(q, r, k, v, KS, VS, sksh, sksn, svsh, svsn, h, start, n_hi, m_i, l_i, acc, c, BLOCK_N,
                     QUANT, SCALES, False, DOT_F32, MASK, PREC, V_UNIT, L_MMA)  # fmt: skip


@triton.jit
def _short_item(q_desc, QS, k_desc, KS, v_desc, VS, OB, LSE, sqsh, sqsm, sksh, sksn, svsh, svsn,
                sos, soh, som, sod, sls, slh, slm, M, qk_scale, h, row, sp, n_lo, n_hi,
                HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                SCALES: tl.constexpr, V_TRANS: tl.constexpr, V_UNIT: tl.constexpr, WS: tl.constexpr,
                DOT_F32: tl.constexpr, PREC: tl.constexpr, L_MMA: tl.constexpr,
                UNIT_CHUNK: tl.constexpr, TAU: tl.constexpr):  # fmt: skip
    """One item: BLOCK_M query rows from `row` of head h over the keys [n_lo, n_hi), written as split sp.
    V_UNIT (per-token scales): c = log2 of a unit fixed for the item (its max v scale / 256) is subtracted in the
    exponent, so P and l are kept divided by the unit (it cancels in acc / l; the log-sum-exp adds it back) and
    P times v_scale_j is at most 256 with no per-tile maximum, no change of unit, and the v scales used as loaded
    (no layout conversion of a computed vector); the unit read UNIT_CHUNK scales at a time."""
    offs = row + tl.arange(0, BLOCK_M)
    mm = offs < M
    q = q_desc.load([h, row, 0]).reshape(BLOCK_M, HEAD_D)
    if DOT_F32:
        q = q.to(tl.float32)
    r = _row_factor(QS, sqsh, sqsm, KS, sksh, h, offs, mm, qk_scale, QUANT, SCALES, BLOCK_M)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    if L_MMA:  # l by the tensor cores (attn_tile): its sum over the 16 columns at the end
        l_i = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    c = 1.0
    if V_UNIT:  # c: log2 of the item's unit (attn_tile)
        c = _v_unit(VS, svsh, svsn, h, n_lo, n_hi, UNIT_CHUNK) + TAU
    n_full = n_lo + tl.maximum(n_hi - n_lo, 0) // BLOCK_N * BLOCK_N
    # fmt: off
    for start in tl.range(n_lo, n_full, BLOCK_N, warp_specialize=WS):
        m_i, l_i, acc, c = _short_tile(q, r, k_desc, v_desc, KS, VS, sksh, sksn, svsh, svsn, h,
                                       start, n_hi, m_i, l_i, acc, c, HEAD_D, BLOCK_N, QUANT, SCALES, V_TRANS,
                                       V_UNIT, DOT_F32, False, PREC, L_MMA, TAU)
    if n_full < n_hi:
        m_i, l_i, acc, c = _short_tile(q, r, k_desc, v_desc, KS, VS, sksh, sksn, svsh, svsn, h,
                                       n_full, n_hi, m_i, l_i, acc, c, HEAD_D, BLOCK_N, QUANT, SCALES, V_TRANS,
                                       V_UNIT, DOT_F32, True, PREC, L_MMA, TAU)
    if L_MMA:
        l_i = tl.sum(l_i, axis=1)
    if V_UNIT:  # P and l were kept divided by the unit: acc / l as is, the log-sum-exp with log2(unit) back
        m_i = m_i + c
        c = 1.0
    _finish(m_i, l_i, acc, c, offs, mm, VS, svsh, OB, LSE, sp, h, sos, soh, som, sod, sls, slh, slm, HEAD_D, SCALES)
    # fmt: on


@triton.jit
def short_attn_kernel(q_desc, QS, k_desc, KS, v_desc, VS, NVALID, OB, LSE, sqsh, sqsm, sksh,
                      sksn, svsh, svsn, sos, soh, som, sod, sls, slh, slm, M, H, n_per_split, n_items, qk_scale,
                      HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                      SCALES: tl.constexpr, V_TRANS: tl.constexpr, V_UNIT: tl.constexpr, WS: tl.constexpr,
                      DOT_F32: tl.constexpr, PREC: tl.constexpr, L_MMA: tl.constexpr,
                      UNIT_CHUNK: tl.constexpr, TAU: tl.constexpr):  # fmt: skip
    """Persistent attention for few query rows: program p runs items p, p + P, p + 2P, ... (P programs, a few
    per SM), item = (row block, head, key split) with the row block fastest, so the programs running together
    read the same head's key range (its K/V tiles shared through L2). FP8 (QUANT) with per-token (SCALES 1) or
    per-head (2) scales, or float storage, as ``attn_kernel``; V_UNIT: one accumulator unit per item
    (``attn_tile``); WS: Triton's warp specialisation of the key loop; L_MMA: the softmax's row sums by the
    tensor cores (``attn_tile``). Each item writes its split's partial (o, base-2 log-sum-exp), merged by
    ``combine_kernel`` (one split: o straight into [M, H, D])."""
    n_valid = tl.load(NVALID)
    mblocks = tl.cdiv(M, BLOCK_M)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        rest = item // mblocks
        h = rest % H
        sp = rest // H
        n_lo = sp * n_per_split
        n_hi = tl.minimum(n_valid, n_lo + n_per_split)
        # fmt: off
        _short_item(q_desc, QS, k_desc, KS, v_desc, VS, OB, LSE, sqsh, sqsm, sksh, sksn, svsh,
                    svsn, sos, soh, som, sod, sls, slh, slm, M, qk_scale, h, (item % mblocks) * BLOCK_M, sp, n_lo,
                    n_hi, HEAD_D, BLOCK_M, BLOCK_N, QUANT, SCALES, V_TRANS, V_UNIT, WS, DOT_F32, PREC, L_MMA,
                    UNIT_CHUNK, TAU)
        # fmt: on
