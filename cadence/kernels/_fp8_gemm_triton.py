"""Triton kernel of the FP8 (e4m3) GEMM with rowwise scales (imported lazily by
``cadence.kernels.fp8_gemm``, which documents the contract, the configs and the host side).

``C[M, N] = (A[M, K] @ B[N, K]^T) * sa[M, None] * sb[None, N] (+ bias[N])``, float32 accumulation,
one rounding to the output dtype. A persistent grid (about one program per SM) walks work units
``u = tile * SPLIT_K + split`` in grid-stride order; tiles are visited in grouped order (GROUP_M row
tiles per column sweep, so neighbouring programs share B columns in L2).

SPLIT_K > 1 (small-N shapes whose tile grid underfills the SMs): each unit multiplies one K range
of its tile and stores the float32 partial into its slot of a workspace ``ws[T, SPLIT_K, BM, BN]``;
then a per-tile counter is incremented (acq_rel, after a CTA barrier so every thread's stores come
first). The unit that sees SPLIT_K - 1 is the tile's last: it reads the SPLIT_K partials back in
split order (``.cg``: from L2, never a stale L1 line), so the sum is the same whichever program
finished last (deterministic), resets the counter to zero for the next call and runs the epilogue.
No unit ever waits for another: nothing can deadlock however the programs are scheduled.

TMA: the A / B blocks come through device-side tensor descriptors (out-of-range rows / columns are
zero-filled); otherwise masked pointer loads. FLATTEN / WS are passed to ``tl.range`` of the persistent
loop (software pipelining across tiles; warp specialisation where this Triton supports it). UPCAST
(interpreter only: no FP8 / bf16 dot there) multiplies in float32; ROUND (interpreter only, whose
float32 -> bf16 cast truncates) rounds to the bf16 grid first.
"""

import triton
import triton.language as tl

from cadence.kernels.quant_triton import _round_grid


@triton.jit
def _tile_mn(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile index -> (row tile, column tile) in grouped order."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    gsize = tl.minimum(tiles_m - first_m, GROUP_M)
    tm = first_m + (t % per_group) % gsize
    tn = (t % per_group) // gsize
    return tm, tn


@triton.jit
def _k_range(tm, tn, a_ptr, b_ptr, a_desc, b_desc, M, N, K, sam, sbn, k_lo, k_hi,
             TMA: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """The tile's float32 products over k in [k_lo, k_hi)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        for k in range(k_lo, k_hi, BK):
            a = a_desc.load([tm * BM, k])
            b = b_desc.load([tn * BN, k])  # [BN, BK]: B is [N, K], K contiguous (the FP8 MMA's K-major B)
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32).T)
            else:
                acc = tl.dot(a, b.T, acc)
    else:
        rm = tm * BM + tl.arange(0, BM)
        rn = tn * BN + tl.arange(0, BN)
        mm = rm < M
        nm = rn < N
        rk = tl.arange(0, BK)
        a_p = a_ptr + rm[:, None].to(tl.int64) * sam + (k_lo + rk)[None, :]
        b_p = b_ptr + rn[None, :].to(tl.int64) * sbn + (k_lo + rk)[:, None]  # [BK, BN] view of B [N, K]
        for k in range(k_lo, k_hi, BK):
            if EVEN_K:
                a = tl.load(a_p, mask=mm[:, None], other=0.0)
                b = tl.load(b_p, mask=nm[None, :], other=0.0)
            else:
                km = (k + rk) < K
                a = tl.load(a_p, mask=mm[:, None] & km[None, :], other=0.0)
                b = tl.load(b_p, mask=km[:, None] & nm[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
            else:
                acc = tl.dot(a, b, acc)
            a_p += BK
            b_p += BK
    return acc


@triton.jit
def _epilogue(acc, tm, tn, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, scm,
              HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """acc * sa (per row) * sb (per column) + bias, rounded once to C's dtype, masked store."""
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    sa = tl.load(sa_ptr + rm, mask=mm, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=nm, other=0.0)
    y = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    if ROUND:
        y = _round_grid(y, 0.0078125, 9.183549615799121e-41)  # the bf16 grid (interpreter only)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :], y.to(c_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])  # fmt: skip


@triton.jit
def _unit(u, a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr,
          M, N, K, sam, sbn, scm, tiles_m, tiles_n, per_split,
          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
          ROUND: tl.constexpr, EVEN_K: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """Work unit u: tile u // SPLIT_K, K range u % SPLIT_K (the module docstring's split-K protocol)."""
    t = u // SPLIT_K
    tm, tn = _tile_mn(t, tiles_m, tiles_n, GROUP_M)
    if SPLIT_K == 1:
        acc = _k_range(tm, tn, a_ptr, b_ptr, a_desc, b_desc, M, N, K, sam, sbn, 0, K,
                       TMA, UPCAST, EVEN_K, BM, BN, BK)  # fmt: skip
        _epilogue(acc, tm, tn, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, scm, HAS_BIAS, ROUND, BM, BN)
    else:
        s = u % SPLIT_K
        k_lo = s * per_split
        k_hi = tl.minimum(K, k_lo + per_split)
        acc = _k_range(tm, tn, a_ptr, b_ptr, a_desc, b_desc, M, N, K, sam, sbn, k_lo, k_hi,
                       TMA, UPCAST, EVEN_K, BM, BN, BK)  # fmt: skip
        loc = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tile_ws = ws_ptr + t.to(tl.int64) * (SPLIT_K * BM * BN)
        tl.store(tile_ws + s * (BM * BN) + loc, acc)
        tl.debug_barrier()  # every thread's partial stored before the counter's release
        done = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the tile's last unit: sum the partials in split order
            tl.debug_barrier()
            tot = tl.load(tile_ws + loc, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT_K):
                tot += tl.load(tile_ws + j * (BM * BN) + loc, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + t, 0)  # clean for the next call
            _epilogue(tot, tm, tn, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, scm, HAS_BIAS, ROUND, BM, BN)


@triton.jit
def fp8_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr,
    M, N, K, sam, sbn, scm,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
    ROUND: tl.constexpr, EVEN_K: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The persistent grid over the work units. The plain loop unless FLATTEN / WS ask for ``tl.range``'s
    options (a branch not taken at compile time is never compiled: a Triton without those options still
    runs every other config)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    units = tiles_m * tiles_n * SPLIT_K
    per_split = tl.cdiv(tl.cdiv(K, BK), SPLIT_K) * BK
    if TMA:  # made once per program (device-side descriptors: the host sets triton's allocator)
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[sam, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[sbn, 1], block_shape=[BN, BK])
    else:
        a_desc = a_ptr
        b_desc = b_ptr
    if WS:
        for u in tl.range(pid, units, nprog, flatten=FLATTEN, warp_specialize=True):
            _unit(u, a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr,
                  M, N, K, sam, sbn, scm, tiles_m, tiles_n, per_split,
                  HAS_BIAS, SPLIT_K, TMA, UPCAST, ROUND, EVEN_K, BM, BN, BK, GROUP_M)  # fmt: skip
    elif FLATTEN:
        for u in tl.range(pid, units, nprog, flatten=True):
            _unit(u, a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr,
                  M, N, K, sam, sbn, scm, tiles_m, tiles_n, per_split,
                  HAS_BIAS, SPLIT_K, TMA, UPCAST, ROUND, EVEN_K, BM, BN, BK, GROUP_M)  # fmt: skip
    else:
        for u in range(pid, units, nprog):
            _unit(u, a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr,
                  M, N, K, sam, sbn, scm, tiles_m, tiles_n, per_split,
                  HAS_BIAS, SPLIT_K, TMA, UPCAST, ROUND, EVEN_K, BM, BN, BK, GROUP_M)  # fmt: skip
