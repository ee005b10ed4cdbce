"""GEMM + all-reduce in one kernel for a tensor-parallel pair: the tile-flag scheme (issue 4).

A row-parallel projection computes ``y = sum_r x_r @ W_r^T`` over the two ranks of the group (each rank
holds a K-shard of x and W). Unfused, the GEMM finishes and then an all-reduce moves and adds the
[M, N] partials (two-shot: reduce-scatter, then all-gather); on 2x H200 at W57's FFN-out (748 x 12288
-> 8192, FP8) that is 118 us + 45 us with nothing overlapped (docs/perf/fused/NOTES.md).

Here the exchange happens inside the GEMM, tile by tile. Output tile t belongs to rank t % 2 (ownership
alternates, so both ranks do the same work). Each rank's persistent kernel (``_gemm_ar_triton``):

1. computes the tiles the PEER owns first, and stores each partial straight into the peer's
   symmetric ``part`` buffer over NVLink, then raises the peer's flag for that tile (release, system
   scope): the reduce-scatter, under the GEMM;
2. computes its own tiles; for each, waits for the peer's flag (acquire; normally raised long before,
   since the peer did those tiles first), adds the peer's partial to its own, writes the sum into its
   output and into the peer's symmetric ``fin`` buffer, and raises a second flag there: the
   all-gather, under the second half of the GEMM;
3. copies the finished tiles the peer owns from ``fin`` into its output as their flags arrive.

A tile's flag is raised a quarter of the way into the next tile's K loop (``CADENCE_TILES_FLUSH``,
in eighths; always before the program waits for anything, so waits are never circular): the release
fence that must precede a flag waits for the program's remote stores to land, which right after the
stores would stall the SM for its tile's NVLink transfer. (Measured on 2x H200: at once, a quarter
in, or after the whole next tile made no difference beyond run-to-run noise.)

By design what is left exposed is the last wave's exchange and the copy of the peer's half. Measured
(docs/perf/fused/NOTES.md), the exchange still costs about a two-shot all-reduce over the kernel's own
GEMM at 748 tokens (1.45 waves of 128x256 tiles: the last wave is all own tiles), and that GEMM is
1.2-1.5x slower than cuBLAS: hidden fraction 0.23 at best at W57, 0.25-0.34 at W14 / W1.3 FP8. Flags are consumed by their reader (compare-and-swap 1 -> 0), so they are zero
again for the next call, and no buffer is written for call i+1 before its reader is done with call i
(each write of call i+1 follows a flag of call i+1 that the reader raises after finishing call i).
Tiles are handed out by a counter in grab order, so no program waits on a tile that a not-yet-resident
program of its own rank would have to compute: no deadlock however the SMs are shared.

Every rank ends with the same bytes (the owner rounds once and sends its result). The reference is
``x @ W^T`` per rank then an all-reduce of the bf16 partials; here the owner adds the peer's bf16
partial to its own float32 accumulator before one rounding, so the two differ by bf16 rounding
(a few ulp: tests/test_gemm_allreduce.py states the bound).

A second protocol, "both" (``CADENCE_TILES_PROTOCOL=both``, kernel ``gemm_ar_both_kernel``): no
owners; both ranks compute every tile in the same order, send each bf16 partial to the peer, keep it
in the output, and sum each tile one tile later from the two bf16 partials. The same bytes cross
NVLink (every partial once instead of half the partials plus half the sums), in one hop instead of
two, nothing is copied back at the end, and the result is exactly what an all-reduce of the two
rounded partials gives, on both ranks.

The CPU tests simulate the two ranks in one process under TRITON_INTERPRET=1 with ``phase`` 1, 2, 3
("both": 1, 2; rank 0 then rank 1 for each), since interpreted programs run one after another: the
one-launch GPU path (phase 0) is checked on GPUs, against NCCL, by ``cadence bench fused``; on ONE device
:class:`EmulatedPeer` runs it against a stood-in peer (the protocol's own cost without NVLink, timed by
``cadence bench linears``; also a CPU test of the one-launch path). Two ranks only;
:func:`usable` says why not otherwise, and ``cadence.parallel.fused`` then falls back with one line.
"""

from __future__ import annotations

import os

import torch

#: (BM, BN, BK, GROUP_M, num_warps, num_stages) on GPUs, per operand type: the fastest of six configs
#: measured at the W57 / W14 / W1.3 FP8 shapes on 2x H200 (docs/perf/fused/NOTES.md, session 6); bf16
#: takes a 64-deep K step (two bytes per element: 128x256x128 with 3 stages needs 288 KiB of shared
#: memory, over the 227 KiB an H200 SM has). On the interpreter small tiles (speed).
GPU_CONFIG = (128, 256, 128, 8, 8, 4)
GPU_CONFIG_BF16 = (128, 256, 64, 8, 8, 4)
CPU_CONFIG = (32, 32, 32, 4, 4, 1)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable(device: torch.device, world: int) -> str | None:
    """Why the tile kernel cannot run here (None: it can)."""
    if world != 2:
        return f"the tile-flag kernel is written for 2 ranks (group of {world})"
    if device.type != "cuda" and not _interpreting():
        return f"needs CUDA or TRITON_INTERPRET=1 (got {device.type})"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton unavailable ({e})"
    return None


PROTOCOLS = ("owner", "both")


def protocol() -> str:
    """Which exchange (CADENCE_TILES_PROTOCOL): "owner" (tile t is summed by rank t % 2, which sends the
    sum back: two hops, half the partials each way) or "both" (every rank sends every bf16 partial and
    sums every tile itself, one tile late: one hop, the same bytes on the wire, nothing to copy back)."""
    p = os.environ.get("CADENCE_TILES_PROTOCOL", "owner")
    if p not in PROTOCOLS:
        raise ValueError(f"CADENCE_TILES_PROTOCOL={p!r}: one of {', '.join(PROTOCOLS)}")
    return p


def _kernel(proto: str = "owner"):
    from cadence.kernels import _gemm_ar_triton

    return _gemm_ar_triton.gemm_ar_both_kernel if proto == "both" else _gemm_ar_triton.gemm_ar_kernel


#: The smallest tile any config may use: flag buffers are sized for it (``max_tiles``).
MIN_TILE = 64


def max_tiles(m: int, n: int) -> int:
    return tiles(m, n, (MIN_TILE, MIN_TILE))


def tiles(m: int, n: int, config=None) -> int:
    bm, bn = (config or _default_config())[:2]
    return -(-m // bm) * -(-n // bn)


def parse_config(text: str) -> tuple:
    """'BMxBNxBK[:GROUP_M:warps:stages]' (e.g. '128x128x128:8:8:3') -> a config tuple."""
    tile, *rest = text.split(":")
    bm, bn, bk = (int(v) for v in tile.lower().split("x"))
    gm, warps, stages = (int(v) for v in rest) if rest else GPU_CONFIG[3:]
    return bm, bn, bk, gm, warps, stages


def _default_config(fp8: bool = True):
    """The interpreter's small tiles on CPU; on GPUs GPU_CONFIG (FP8) / GPU_CONFIG_BF16, or
    CADENCE_TILES_CONFIG (for sweeps: ``parse_config``'s format; its K step is capped at 64 for
    two-byte operands)."""
    if _interpreting():
        return CPU_CONFIG
    env = os.environ.get("CADENCE_TILES_CONFIG")
    if not env:
        return GPU_CONFIG if fp8 else GPU_CONFIG_BF16
    cfg = parse_config(env)
    return cfg if fp8 else (cfg[0], cfg[1], min(cfg[2], 64), *cfg[3:])


def num_programs(device: torch.device, t: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(t, sms))
    return max(1, min(t, 4))


def flush_eighths() -> int:
    """How far into the next tile's K loop a finished tile's flag is raised, in eighths (0-8;
    CADENCE_TILES_FLUSH, default 2: a quarter)."""
    v = int(os.environ.get("CADENCE_TILES_FLUSH", "2"))
    if not 0 <= v <= 8:
        raise ValueError(f"CADENCE_TILES_FLUSH={v}: eighths of the K loop, 0-8")
    return v


_allocator_set: list[bool] = []


def _set_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from the launcher: torch's caching allocator
    (inside a CUDA graph capture that is the graph's pool, as for any tensor)."""
    if _allocator_set:
        return
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
    _allocator_set.append(True)


def tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tensor descriptors can read a and b: 16-byte aligned bases and row strides, unit inner stride,
    and this triton has them. Off unless CADENCE_TILES_TMA=1: on 2x H200 (triton 3.6) the descriptor
    loads made this persistent GEMM no faster (docs/perf/fused/NOTES.md, session 6)."""
    if os.environ.get("CADENCE_TILES_TMA", "0") != "1":
        return False
    try:
        import triton.language as tl
    except ImportError:
        return False
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    return all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in (a, b)
    )


def launch(
    a,
    b,
    sa,
    sb,
    out,
    part_local,
    part_peer,
    fin_local,
    fin_peer,
    flag_local,
    flag_peer,
    counter,
    rank: int,
    phase: int = 0,
    config=None,
    programs: int | None = None,
    tma: bool | None = None,
    proto: str | None = None,
) -> None:
    """One rank's kernel. a [M, K] (e4m3 or bf16/fp32), b [N, K] (same), sa [M] / sb [N] float32 scales
    (FP8) or None, out [M, N] (the result); part_* / fin_* [M, N] views of the symmetric buffers (this
    rank's and the peer's mapping of the peer's), flag_* int32 [>= 2 T] symmetric (zero between
    calls), counter int32 [2] local (zero between calls)."""
    fp8 = sa is not None
    m, k = a.shape
    n = b.shape[0]
    grid, consts = _launch_setup(a, b, out, flag_local, flag_peer, fp8, phase, config, programs, tma)
    dummy = out  # never read when not FP8
    proto = proto or protocol()
    if proto == "both" and phase != 4:  # phase 4 (the GEMM alone) is the owner kernel's
        _kernel("both")[grid](
            a,
            b,
            sa if fp8 else dummy,
            sb if fp8 else dummy,
            out,
            part_local,
            part_peer,
            flag_local,
            flag_peer,
            counter,
            m,
            n,
            k,
            a.stride(0),
            b.stride(0),
            **consts,
        )
        return
    _kernel()[grid](
        a,
        b,
        sa if fp8 else dummy,
        sb if fp8 else dummy,
        out,
        part_local,
        part_peer,
        fin_local,
        fin_peer,
        flag_local,
        flag_peer,
        counter,
        m,
        n,
        k,
        rank,
        a.stride(0),
        b.stride(0),
        **consts,
    )


def _launch_setup(a, b, out, flag_local, flag_peer, fp8: bool, phase: int, config, programs, tma):
    """:func:`launch`'s grid and compile-time constants (the tile config, or the default one for the dtype;
    tensor-descriptor loads where usable unless ``tma`` says), after checking the flag buffers hold two flags
    per tile."""
    bm, bn, bk, gm, warps, stages = config or _default_config(fp8)
    m, k = a.shape
    n = b.shape[0]
    t = tiles(m, n, (bm, bn))
    if phase != 4 and min(flag_local.numel(), flag_peer.numel()) < 2 * t:
        raise ValueError(
            f"flag buffers hold {flag_local.numel()} flags, {bm}x{bn} tiles of {m}x{n} need {2 * t}"
        )
    grid = (programs or num_programs(out.device, t),)
    if tma is None:  # CADENCE_TILES_TMA=1 on GPUs where usable; the interpreter's tests ask for it explicitly
        tma = out.device.type == "cuda" and tma_ok(a, b)
    if tma and out.device.type == "cuda":
        _set_allocator()
    consts = dict(
        FP8=fp8,
        UPCAST=_interpreting(),
        PHASE=phase,
        EVEN_K=(k % bk == 0),
        TMA=bool(tma),
        FLUSH=flush_eighths(),
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=gm,
        num_warps=warps,
        num_stages=stages,
    )
    return grid, consts


def reference(a_list, b_list, sa_list=None, sb_list=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """What the unfused path computes: each rank's GEMM rounded to ``out_dtype``, then the sum of the
    rounded partials (an all-reduce of bf16 values), in float32, rounded once more."""
    parts = []
    for r, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        y = a.float() @ b.float().t()
        if sa_list is not None:
            y = y * sa_list[r].float().reshape(-1, 1) * sb_list[r].float().reshape(1, -1)
        parts.append(y.to(out_dtype).float())
    return sum(parts).to(out_dtype)


def simulate_two_ranks(
    a_list,
    b_list,
    sa_list=None,
    sb_list=None,
    out_dtype=torch.bfloat16,
    config=None,
    programs: int | None = None,
    calls: int = 1,
    tma: bool = False,
    proto: str = "owner",
) -> tuple[list[torch.Tensor], dict]:
    """Both ranks in this process (CPU, interpreter): phase 1 on each, then 2, then 3, ``calls`` times
    on the same buffers (the flags and counters must be back at zero after each call). Returns the two
    outputs of the last call and the buffers' state."""
    m, _ = a_list[0].shape
    n = b_list[0].shape[0]
    cfg = config or _default_config()
    t = tiles(m, n, cfg)
    dev = a_list[0].device
    part = [torch.zeros(m, n, dtype=out_dtype, device=dev) for _ in range(2)]
    fin = [torch.zeros(m, n, dtype=out_dtype, device=dev) for _ in range(2)]
    flags = [torch.zeros(2 * t, dtype=torch.int32, device=dev) for _ in range(2)]
    counters = [torch.zeros(2, dtype=torch.int32, device=dev) for _ in range(2)]
    outs = []
    for _ in range(calls):
        outs = [torch.empty(m, n, dtype=out_dtype, device=dev) for _ in range(2)]
        for phase in (1, 2) if proto == "both" else (1, 2, 3):
            for r in range(2):
                p = 1 - r
                launch(
                    a_list[r],
                    b_list[r],
                    None if sa_list is None else sa_list[r],
                    None if sb_list is None else sb_list[r],
                    outs[r],
                    part[r],
                    part[p],
                    fin[r],
                    fin[p],
                    flags[r],
                    flags[p],
                    counters[r],
                    rank=r,
                    phase=phase,
                    config=cfg,
                    programs=programs,
                    tma=tma,
                    proto=proto,
                )
    state = {"flags": [f.clone() for f in flags], "counters": [c.clone() for c in counters]}
    return outs, state


_scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def gemm_only(
    a, b, sa=None, sb=None, out_dtype=torch.bfloat16, config=None, tma: bool | None = None
) -> torch.Tensor:
    """The kernel's GEMM alone (phase 4: no exchange): for timing what the exchange hides under, and
    as the single-rank parity check of the GEMM part."""
    m, _ = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    cfg = config or _default_config(sa is not None)
    key = str(a.device)
    if key not in _scratch:  # phase 4 leaves the counter at zero and never touches the flag
        _scratch[key] = (
            torch.zeros(2, dtype=torch.int32, device=a.device),
            torch.zeros(1, dtype=torch.int32, device=a.device),
        )
    counter, flag = _scratch[key]
    launch(a, b, sa, sb, out, out, out, out, out, flag, flag, counter, rank=0, phase=4, config=cfg, tma=tma)
    return out


class EmulatedPeer:
    """One rank's full kernel (phase 0: the whole protocol, both exchanges) on ONE device, the peer stood in
    for by local buffers: what a single GPU can time of the fused GEMM + all-reduce (``cadence bench
    linears``), and a CPU check that the one-launch path (not only the CPU phases) computes the GEMM.

    The peer's side of every exchange is already done: this rank's flags are raised before each call
    (:meth:`arm`, one fill), the peer's partials (``part``) are zeros and its finished tiles (``fin``) are
    whatever :meth:`arm` was given (the expected output, in a check). What this rank sends goes to local
    scratch (``part_peer``, ``fin_peer``, ``flag_peer``) instead of over NVLink. So the time is the tile GEMM
    plus the protocol's own work (the atomics and system-scope fences, the partial stores, the peer-partial
    loads and adds, the copy-back of the peer's half) with HBM standing in for NVLink: no link latency or
    bandwidth, no skew between ranks. Rank 0's view (it owns the even tiles)."""

    def __init__(self, m: int, n: int, device, out_dtype=torch.bfloat16, config=None, proto: str = "owner"):
        self.m, self.n, self.proto, self.config = m, n, proto, config
        t = tiles(m, n, config)
        z = lambda *s, dt=out_dtype: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.part, self.part_peer, self.fin, self.fin_peer = (z(m, n) for _ in range(4))
        self.flags, self.flags_peer = z(2 * t, dt=torch.int32), z(2 * t, dt=torch.int32)
        self.counter = z(2, dt=torch.int32)

    def arm(self, fin: torch.Tensor | None = None) -> None:
        """Raise every flag this rank will wait for (the peer's partials and sums 'arrived')."""
        self.flags.fill_(1)
        if fin is not None:
            self.fin.copy_(fin)

    def __call__(self, a, b, sa=None, sb=None, out: torch.Tensor | None = None) -> torch.Tensor:
        out = out if out is not None else torch.empty(self.m, self.n, dtype=self.part.dtype, device=a.device)
        launch(
            a, b, sa, sb, out, self.part, self.part_peer, self.fin, self.fin_peer, self.flags,
            self.flags_peer, self.counter, rank=0, phase=0, config=self.config, proto=self.proto,
        )  # fmt: skip
        return out
