"""Triton kernel of the tile-flag GEMM + all-reduce for two ranks (imported lazily by
``cadence.kernels.gemm_allreduce``, which documents the protocol and holds the host side).

One persistent program per SM grabs output tiles from a counter: first the tiles the PEER owns (their
partial sums go straight into the peer's symmetric ``part`` buffer, then a flag is raised there), then
the tiles this rank owns (wait for the peer's partial, add, write the sum into this rank's output and
into the peer's ``fin`` buffer, raise the peer's flag). Last, each program waits for the finished
tiles the peer owns (static share) and copies them from ``fin`` into the output. No program waits
before every tile it could need from itself has been grabbed by a running program, so the kernel
cannot deadlock however many programs are resident. The flags are consumed (compare-and-swap 1 -> 0)
by their reader, so the buffers are clean for the next call.

``PHASE`` (0 on GPUs) runs one part only: 1 = the peer's tiles, 2 = this rank's tiles, 3 = the copy;
4 = the same GEMM with no exchange at all (its time is the GEMM this kernel hides the all-reduce under).
The CPU tests run the two simulated ranks phase by phase under TRITON_INTERPRET=1, where programs run
one after another and a spin-wait on the other rank would never end.
"""

import triton
import triton.language as tl

from cadence.kernels.quant_triton import _round_grid


@triton.jit
def _cast(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    """float32 -> the output dtype (bf16), round to nearest even. ROUND (the interpreter only, whose
    float32 -> bf16 cast truncates) rounds to the bf16 grid first (``quant_triton._round_grid``); the
    GPU's cast already rounds to nearest even, to the same bytes."""
    if ROUND:
        x = _round_grid(
            x, 0.0078125, 9.183549615799121e-41
        )  # the bf16 grid: 2^-7 relative, 2^-133 subnormal step
    return x.to(dtype)


@triton.jit
def _tile_coords(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped order (GROUP_M row tiles per column sweep: neighbouring tiles share A rows and B columns
    in L2)."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    gsize = tl.minimum(tiles_m - first_m, GROUP_M)
    tm = first_m + (t % per_group) % gsize
    tn = (t % per_group) // gsize
    return tm, tn


@triton.jit
def _nth_tile(i, parity, T):
    """The i-th tile index of the given ownership parity (tile t belongs to rank t % 2)."""
    return 2 * i + parity


@triton.jit
def _mma(
    acc,
    a_ptr,
    b_ptr,
    a_desc,
    b_desc,
    tm,
    tn,
    M,
    N,
    K,
    k_lo,
    k_hi,
    sam,
    sbn,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """acc [BM, BN] += the tile's products over k in [k_lo, k_hi). TMA: blocks come through tensor
    descriptors (the Hopper tensor-memory accelerator, out-of-range rows and columns zero-filled);
    else masked pointer loads."""
    if TMA:
        for k in range(k_lo, k_hi, BK):
            a = a_desc.load([tm * BM, k])
            b = b_desc.load([tn * BN, k])  # [BN, BK]: B is [N, K], K contiguous
            if UPCAST:  # the interpreter has no fp8 / bf16 dot
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
        b_p = b_ptr + rn[None, :].to(tl.int64) * sbn + (k_lo + rk)[:, None]  # B [N, K] (K-major) as [BK, BN]
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
def _raise(flag_peer, pend):
    """Raise the peer's flag ``pend`` (if >= 0) for data this program stored earlier: the CTA barrier
    puts every thread's stores before the release (system scope) that publishes them."""
    if pend >= 0:
        tl.debug_barrier()
        tl.atomic_xchg(flag_peer + pend, 1, sem="release", scope="sys")


@triton.jit
def _tile_raising(
    a_ptr,
    b_ptr,
    a_desc,
    b_desc,
    sa_ptr,
    sb_ptr,
    tm,
    tn,
    M,
    N,
    K,
    sam,
    sbn,
    flag_peer,
    pend,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    FLUSH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Tile (tm, tn) in float32 (rowwise FP8 scales applied), raising the peer's flag ``pend`` FLUSH
    eighths into its K loop (8: after it): late enough for the previous tile's remote stores to have
    landed, early enough not to hold the peer up a whole tile. Returns acc, rows, cols and their masks."""
    k1 = ((K // BK) * FLUSH // 8) * BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _mma(
        acc, a_ptr, b_ptr, a_desc, b_desc, tm, tn, M, N, K, 0, k1, sam, sbn, UPCAST, EVEN_K, TMA, BM, BN, BK
    )
    _raise(flag_peer, pend)
    acc = _mma(
        acc, a_ptr, b_ptr, a_desc, b_desc, tm, tn, M, N, K, k1, K, sam, sbn, UPCAST, EVEN_K, TMA, BM, BN, BK
    )
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    if FP8:  # rowwise scales: activations per token, weights per output channel
        sa = tl.load(sa_ptr + rm, mask=mm, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=nm, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    return acc, rm, rn, mm, nm


@triton.jit
def _wait_and_consume(flag_ptr):
    while tl.atomic_cas(flag_ptr, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def gemm_ar_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    out_ptr,
    part_local,
    part_peer,
    fin_local,
    fin_peer,
    flag_local,
    flag_peer,
    counter_ptr,
    M,
    N,
    K,
    rank,
    sam,
    sbn,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    PHASE: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    FLUSH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    T = tiles_m * tiles_n
    peer_par = 1 - rank
    if TMA:  # descriptors made once per program (device-side: the launcher sets triton's allocator)
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[sam, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[sbn, 1], block_shape=[BN, BK])
    else:
        a_desc = a_ptr
        b_desc = b_ptr
    n_peer = (T - peer_par + 1) // 2  # tiles the peer owns
    lo = 0
    hi = T
    if PHASE == 1:
        hi = n_peer
    if PHASE == 2:
        lo = n_peer
    if PHASE != 3:
        pos = lo + tl.atomic_add(counter_ptr, 1)
        # A tile's flag is raised during the next tile's K loop (FLUSH eighths into it; 8: after it):
        # the release fence waits for this program's remote stores to land, and by then they have (a
        # fence right after the stores stalled the SM for the whole NVLink transfer of its tile).
        # Always raised before this program waits for anything, so waits are never circular.
        pend = pos * 0 - 1  # flag index (into flag_peer) still to raise, -1: none
        while pos < hi:
            if pos < n_peer:
                t = _nth_tile(pos, peer_par, T)
            else:
                t = _nth_tile(pos - n_peer, rank, T)
            tm, tn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
            acc, rm, rn, mm, nm = _tile_raising(
                a_ptr,
                b_ptr,
                a_desc,
                b_desc,
                sa_ptr,
                sb_ptr,
                tm,
                tn,
                M,
                N,
                K,
                sam,
                sbn,
                flag_peer,
                pend,
                FP8,
                UPCAST,
                EVEN_K,
                TMA,
                FLUSH,
                BM,
                BN,
                BK,
            )
            offs = rm[:, None].to(tl.int64) * N + rn[None, :]
            msk = mm[:, None] & nm[None, :]
            pend = pend * 0 - 1
            if PHASE == 4:  # the GEMM alone (timing): every tile to our output, no exchange
                tl.store(out_ptr + offs, _cast(acc, out_ptr.dtype.element_ty, UPCAST), mask=msk)
            elif pos < n_peer:  # the peer reduces this tile: hand it our partial
                tl.store(part_peer + offs, _cast(acc, part_peer.dtype.element_ty, UPCAST), mask=msk)
                pend = t
            else:  # ours: the peer's partial + ours, to our output and to the peer's copy
                _wait_and_consume(flag_local + t)
                tl.debug_barrier()
                other = tl.load(part_local + offs, mask=msk, other=0.0, cache_modifier=".cg")
                y = _cast(acc + other.to(tl.float32), out_ptr.dtype.element_ty, UPCAST)
                tl.store(out_ptr + offs, y, mask=msk)
                tl.store(fin_peer + offs, y, mask=msk)
                pend = T + t
            pos = lo + tl.atomic_add(counter_ptr, 1)
        _raise(flag_peer, pend)
        # the last program out resets the counter for the next call (all grabs of this call are done
        # once every program has seen an index past the end: each program sees exactly one)
        if tl.atomic_add(counter_ptr + 1, 1) == nprog - 1:
            tl.atomic_xchg(counter_ptr, 0)
            tl.atomic_xchg(counter_ptr + 1, 0)
    if PHASE == 0 or PHASE == 3:
        # the tiles the peer owns come back finished: program p copies the p-th, (p + nprog)-th, ...
        for i in range(pid, n_peer, nprog):
            t = _nth_tile(i, peer_par, T)
            tm, tn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
            rm = tm * BM + tl.arange(0, BM)
            rn = tn * BN + tl.arange(0, BN)
            offs = rm[:, None].to(tl.int64) * N + rn[None, :]
            msk = (rm < M)[:, None] & (rn < N)[None, :]
            _wait_and_consume(flag_local + T + t)
            tl.debug_barrier()
            y = tl.load(fin_local + offs, mask=msk, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, y, mask=msk)


@triton.jit
def _sum_tile(
    t,
    out_ptr,
    part_local,
    flag_local,
    M,
    N,
    tiles_m,
    tiles_n,
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[t] <- bf16(out[t] + part[t]): this rank's bf16 partial (stored in out) plus the peer's (in
    part, once its flag is up). Both ranks add the same two bf16 values in float32: the same bytes."""
    tm, tn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    msk = (rm < M)[:, None] & (rn < N)[None, :]
    _wait_and_consume(flag_local + t)
    tl.debug_barrier()
    mine = tl.load(out_ptr + offs, mask=msk, other=0.0)
    other = tl.load(part_local + offs, mask=msk, other=0.0, cache_modifier=".cg")
    y = _cast(mine.to(tl.float32) + other.to(tl.float32), out_ptr.dtype.element_ty, UPCAST)
    tl.store(out_ptr + offs, y, mask=msk)


@triton.jit
def gemm_ar_both_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    out_ptr,
    part_local,
    part_peer,
    flag_local,
    flag_peer,
    counter_ptr,
    M,
    N,
    K,
    sam,
    sbn,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    PHASE: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    FLUSH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The 'both' protocol: both ranks compute every tile in the same order, send each bf16 partial to
    the peer's ``part`` (flag per tile), keep it in ``out``, and sum a tile one tile later (after the
    next tile's MMA, by when the peer's partial is normally there). No owner, no second hop, no copy
    of finished tiles: the exposed tail is the last wave's partials crossing once.

    A program waits only when it holds no unraised flag (the previous tile's flag goes up during this
    tile's MMA, before the sum of the previous tile; this tile's partial is stored after it), and a
    program holding one is computing, not waiting: no cycle. PHASE 1 (CPU simulation): compute and
    send only; PHASE 2: the sums, tile t by program t % nprog."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    T = tiles_m * tiles_n
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[sam, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[sbn, 1], block_shape=[BN, BK])
    else:
        a_desc = a_ptr
        b_desc = b_ptr
    if PHASE != 2:
        t = tl.atomic_add(counter_ptr, 1)
        pend = t * 0 - 1  # flag (tile) still to raise
        prev = t * 0 - 1  # tile whose sum is still to do (PHASE 0)
        while t < T:
            tm, tn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
            acc, rm, rn, mm, nm = _tile_raising(
                a_ptr,
                b_ptr,
                a_desc,
                b_desc,
                sa_ptr,
                sb_ptr,
                tm,
                tn,
                M,
                N,
                K,
                sam,
                sbn,
                flag_peer,
                pend,
                FP8,
                UPCAST,
                EVEN_K,
                TMA,
                FLUSH,
                BM,
                BN,
                BK,
            )
            pend = pend * 0 - 1
            if prev >= 0:  # after raising: a program that waits holds no unraised flag
                _sum_tile(
                    prev, out_ptr, part_local, flag_local, M, N, tiles_m, tiles_n, UPCAST, BM, BN, GROUP_M
                )
                prev = prev * 0 - 1
            offs = rm[:, None].to(tl.int64) * N + rn[None, :]
            msk = mm[:, None] & nm[None, :]
            mine = _cast(acc, out_ptr.dtype.element_ty, UPCAST)
            tl.store(part_peer + offs, mine, mask=msk)
            tl.store(out_ptr + offs, mine, mask=msk)
            pend = t
            if PHASE == 0:
                prev = t
            t = tl.atomic_add(counter_ptr, 1)
        _raise(flag_peer, pend)
        if prev >= 0:
            _sum_tile(prev, out_ptr, part_local, flag_local, M, N, tiles_m, tiles_n, UPCAST, BM, BN, GROUP_M)
        if tl.atomic_add(counter_ptr + 1, 1) == nprog - 1:
            tl.atomic_xchg(counter_ptr, 0)
            tl.atomic_xchg(counter_ptr + 1, 0)
    else:
        for t in range(pid, T, nprog):
            _sum_tile(t, out_ptr, part_local, flag_local, M, N, tiles_m, tiles_n, UPCAST, BM, BN, GROUP_M)
