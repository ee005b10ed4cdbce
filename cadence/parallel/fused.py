"""The row-parallel projection's communication: local GEMM + sum over the TP group, several ways.

``row_parallel(linear, x, bias, group, mode)`` computes ``all_reduce_sum(x @ W_local^T) + bias``
(every rank gets the full [M, N] output). The bias is in rank 0's GEMM epilogue where the mode's GEMM is the
whole layer's (nccl, two_shot, one_shot), so the sum carries it once and no separate add runs after it
(``CADENCE_TP_BIAS=after``: the add after the sum on every rank, the reference path); the other modes add it
after. Small sums (the q/k norms': :func:`small_all_reduce`) take the one-shot over symmetric memory. Modes:

``"nccl"``      reference: local GEMM, then ``dist.all_reduce`` (NCCL on CUDA, gloo on CPU).
``"two_shot"``  the GEMM writes straight into a symmetric-memory buffer (no copy), then
                ``torch.ops.symm_mem.two_shot_all_reduce_out`` (reduce-scatter + all-gather with
                peer loads over NVLink) writes the sum into a fresh tensor (``two_shot_all_reduce_``
                in place + a copy where the ``_out`` op is missing).
``"one_shot"``  same buffer, ``torch.ops.symm_mem.one_shot_all_reduce`` (every rank reads every peer).
``"rs_ag"``     ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` (``fused_scaled_matmul_reduce_scatter``
                for an FP8 layer: rowwise scales, fast accumulation) over the token dim, then an NCCL
                all-gather. Needs M divisible by the group size (else nccl for that shape).
``"tiles"``     one Triton kernel per rank does the GEMM and the all-reduce together, tile by tile:
                partials of the tiles the peer owns go into its symmetric buffer as they finish, the
                owner adds and sends the sum back, flags per tile (two ranks;
                :mod:`cadence.kernels.gemm_allreduce` has the protocol). Its own GEMM, not cuBLAS.
``"chunked"``   the GEMM split along N into c chunks (``"chunked4"``: c = 4; plain ``"chunked"``: 2) on
                the main stream; each finished chunk is two-shot all-reduced on a side stream.
                Measured in docs/benchmarks.md's spirit: assume nothing, ``cadence bench fused`` times it.
``"two_shot_fp8"`` the sum with e4m3 payloads (:mod:`cadence.parallel.comm_fp8`: quantise per 128-column
                block, all-to-all + float32 sum, requantise, all-gather; ~half the bytes of bf16, two
                e4m3 roundings). Runs on any group (gloo too); opt-in: "auto" never picks it.
``"auto"``      :func:`choose_mode` per shape (env CADENCE_TP_COMM=<mode> overrides "auto" process-wide,
                e.g. CADENCE_TP_COMM=nccl as a kill switch).

Never multicast: no ``multimem_*`` op is used anywhere, and ``init_tp`` keeps NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1. All symmetric-memory collectives are
issued from the caller's (main) stream, except in "chunked", whose side stream waits for the main
stream before its first collective and is waited on by the main stream after its last one, so two
symm-mem collectives of the group never run at the same time.

Buffers (:class:`SymmBufferCache`): one flat symmetric buffer pair per (group, device, dtype, N,
row bucket), allocated with ``torch.distributed._symmetric_memory.empty`` + ``rendezvous`` once
and reused; a token count M uses the prefix ``buf[:M*N]`` (storage offset 0) of the bucket that
holds it. Buckets are M rounded up to 4 steps per octave (748 -> 768, 4680 -> 5120), so a new M
(first chunk with the sink, another prompt length, another resolution) reuses a bucket or adds
one; the cache is an LRU of at most ``max_entries`` (default 4, env CADENCE_SYMM_CACHE) entries and
drops evicted buffers (they return to torch's symmetric-memory pool, which reuses them for the
next bucket of that size: memory is bounded by the distinct bucket sizes ever live, logarithmic in
the largest M). Each entry holds TWO buffers used alternately (ping-pong): before the GEMM of call
i+2 overwrites buffer A, every peer has entered call i+1's collective (its start barrier), so has
finished reading A in call i, whatever the end-of-kernel synchronisation of the torch version.
Nothing here is compiled per shape (eager ops only), so new shapes never trigger recompilation.

Fallbacks (warn-once per reason, then the nccl path, never a crash): no CUDA / not NCCL (CPU and
gloo: every mode is nccl, one warning line per process), symmetric memory or an op missing in this
torch, an op that raises for a shape (that (mode, shape) is then remembered as unusable).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from cadence.telemetry import logs
from cadence.telemetry.spans import region

log = logging.getLogger(__name__)

MODES = ("nccl", "two_shot", "one_shot", "rs_ag", "chunked", "tiles", "two_shot_fp8")
#: modes the chooser ("auto") never picks, whatever a table says: they change the numbers (opt-in only)
NOT_AUTO = ("two_shot_fp8",)
DEFAULT_CHUNKS = 2
AUTO_TWO_SHOT_MAX_M = 8192  # built-in default when no measured table: two-shot up to this M on CUDA
REPO = Path(__file__).resolve().parents[2]

# ---- warn-once (cadence.telemetry.logs) ---------------------------------------------------------
warn_once = functools.partial(logs.warn_once, log)  # (key, msg, *args): True if it logged


def fallback_warnings() -> dict[str, int]:
    """Reason key -> how many times the fallback was hit (the warning itself is logged once)."""
    return logs.once_counts(log)


def reset_fallback_warnings() -> None:
    logs.forget(log)


# ---- mode parsing ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def parse_mode(mode: str) -> tuple[str, int]:
    """'two_shot' -> ('two_shot', 1); 'chunked' -> ('chunked', 2); 'chunked4' -> ('chunked', 4)."""
    mode = (mode or "auto").strip().lower().replace("-", "_")
    m = re.fullmatch(r"chunked_?(\d+)?", mode)
    if m:
        c = int(m.group(1)) if m.group(1) else DEFAULT_CHUNKS
        if c < 1:
            raise ValueError(f"chunked mode needs >= 1 chunk, got {mode!r}")
        return "chunked", c
    if mode == "auto" or mode in MODES:
        return mode, 1
    raise ValueError(f"unknown row-parallel comm mode {mode!r}; one of auto, {', '.join(MODES)}, chunkedN")


def dtype_key(linear: torch.nn.Module, dtype: torch.dtype) -> str:
    """'fp8' for an FP8 layer, else the activation dtype's short name (bf16, fp16, fp32)."""
    from cadence.quant.fp8 import FP8Linear

    if isinstance(linear, FP8Linear):
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


# ---- symmetric memory availability -----------------------------------------------------------
_symm_mod = None
_enabled_groups: set[str] = set()


def _symm():
    """torch.distributed._symmetric_memory (importing it registers the fused ops), or None."""
    global _symm_mod
    if _symm_mod is None:
        try:
            import torch.distributed._symmetric_memory as sm

            _symm_mod = sm
        except Exception as e:
            _symm_mod = False
            warn_once(
                "symm-import",
                "torch.distributed._symmetric_memory unavailable (%s): row-parallel "
                "layers use the nccl all-reduce",
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
    return _symm_mod or None


def _ops():
    """The symm_mem op namespace (one indirection, so CPU tests can substitute a gloo emulation)."""
    return torch.ops.symm_mem


def _op(name: str):
    try:
        return getattr(_ops(), name)
    except (AttributeError, RuntimeError):
        return None


def group_name(group) -> str:
    from cadence.parallel.group import process_group

    group = process_group(group)
    g = group if group is not None else dist.group.WORLD
    name = getattr(g, "group_name", None)
    if name is None:
        name = dist.distributed_c10d._get_process_group_name(g)  # older torch
    return name


_reason_cache: dict[tuple, str | None] = {}


def symm_unavailable_reason(device: torch.device, group) -> str | None:
    """Why symmetric-memory modes cannot run here (None: they can be tried). Cached per group."""
    from cadence.parallel.group import TPGroup

    if isinstance(group, TPGroup):
        if group.emulated:
            return "an emulated group has no peers (its collectives are local stand-ins)"
        group = group.process_group
    key = (device.type, id(group))
    if key not in _reason_cache:
        _reason_cache[key] = _symm_unavailable_reason(device, group)
    return _reason_cache[key]


def _symm_unavailable_reason(device: torch.device, group) -> str | None:
    if device.type != "cuda":
        return f"symmetric memory needs CUDA tensors (got {device.type})"
    try:
        backend = dist.get_backend(group)
    except Exception as e:
        return f"no process group ({e})"
    if str(backend).lower() != "nccl":
        return f"symmetric memory modes need the NCCL backend (got {backend})"
    if _symm() is None:
        return "torch.distributed._symmetric_memory unavailable"
    return None


_backend_set: list[str] = []


def _prepare(group) -> None:
    """Once per process: pick the symmetric-memory backend (CADENCE_SYMM_BACKEND, default "CUDA":
    cuMem + peer mappings, no NVSHMEM, no multicast) before the first allocation; once per group:
    enable symmetric memory for it (required by older torch, a no-op or deprecated in newer)."""
    sm = _symm()
    if not _backend_set:
        _backend_set.append("done")
        want = os.environ.get("CADENCE_SYMM_BACKEND", "CUDA")
        fn = getattr(sm, "set_backend", None)
        if fn is not None and want:
            try:
                fn(want)
            except Exception as e:
                log.debug("symm_mem.set_backend(%s): %s", want, e)
    name = group_name(group)
    if name in _enabled_groups:
        return
    fn = getattr(sm, "enable_symm_mem_for_group", None)
    if fn is not None:
        try:
            fn(name)
        except Exception as e:
            log.debug("enable_symm_mem_for_group(%s): %s", name, e)
    _enabled_groups.add(name)


# ---- symmetric buffer cache ------------------------------------------------------------------
def bucket_rows(m: int) -> int:
    """Rows a buffer for M tokens is allocated with: M rounded up to 4 steps per octave (>= 64)."""
    m = max(int(m), 1)
    if m <= 64:
        return 64
    step = 1 << max(int(math.floor(math.log2(m))) - 2, 0)
    return -(-m // step) * step


class SymmBufferCache:
    """LRU of symmetric-memory buffer pairs keyed by (group, device, dtype, N, row bucket).

    ``get(m, n, dtype, device, group)`` returns a flat buffer of at least m*n elements (one of the
    entry's two, alternating per call); callers view its prefix. `alloc(numel, dtype, device,
    group)` makes one rendezvoused buffer (injectable for tests: the LRU logic runs on CPU)."""

    def __init__(self, max_entries: int = 4, alloc=None):
        self.max_entries = max(1, int(max_entries))
        self._alloc = alloc or _symm_alloc
        self._entries: OrderedDict[tuple, list] = OrderedDict()  # key -> [buf0, buf1, next index]
        self.allocations = 0
        self.evictions = 0
        self.hits = 0

    def get(self, m: int, n: int, dtype: torch.dtype, device: torch.device, group) -> torch.Tensor:
        rows = bucket_rows(m)
        key = (
            group_name(group) if group is not None or dist.is_initialized() else "",
            str(device),
            dtype,
            n,
            rows,
        )
        ent = self._entries.get(key)
        if ent is None:
            while len(self._entries) >= self.max_entries:
                old_key, _ = self._entries.popitem(last=False)  # drop the buffers: back to the pool
                self.evictions += 1
                log.debug("symm buffer cache: evicted %s", old_key)
            ent = [
                self._alloc(rows * n, dtype, device, group),
                self._alloc(rows * n, dtype, device, group),
                0,
            ]
            self.allocations += 2
            self._entries[key] = ent
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        buf = ent[ent[2]]
        ent[2] ^= 1
        return buf

    def info(self) -> dict:
        """entries (<= max_entries), bytes held, allocations / evictions / hits so far, keys."""
        nbytes = sum(b.numel() * b.element_size() for e in self._entries.values() for b in e[:2])
        return {
            "entries": len(self._entries),
            "max_entries": self.max_entries,
            "bytes": nbytes,
            "allocations": self.allocations,
            "evictions": self.evictions,
            "hits": self.hits,
            "keys": [(k[3], k[4], str(k[2]).replace("torch.", "")) for k in self._entries],
        }

    def clear(self) -> None:
        self._entries.clear()


def _symm_alloc(numel: int, dtype: torch.dtype, device: torch.device, group) -> torch.Tensor:
    sm = _symm()
    _prepare(group)
    buf = sm.empty(numel, dtype=dtype, device=device)
    sm.rendezvous(buf, group_name(group))
    return buf


_CACHE = SymmBufferCache(int(os.environ.get("CADENCE_SYMM_CACHE", "4")))


def symm_cache() -> SymmBufferCache:
    return _CACHE


def symm_cache_info() -> dict:
    """The process-wide symmetric buffer cache's size and counters (see SymmBufferCache.info)."""
    return _CACHE.info()


def set_symm_cache_size(max_entries: int) -> None:
    _CACHE.max_entries = max(1, int(max_entries))
    while len(_CACHE._entries) > _CACHE.max_entries:
        _CACHE._entries.popitem(last=False)
        _CACHE.evictions += 1


def clear_symm_cache() -> None:
    _CACHE.clear()


# ---- the chooser -----------------------------------------------------------------------------
_decisions: dict[tuple, tuple[str, str]] = {}
_table_cache: dict[str, object] = {}


def table_path(world: int) -> Path | None:
    """The measured chooser table: $CADENCE_FUSED_TABLE, else the newest
    docs/perf/fused/chooser-*-tp<world>.json of this checkout (None if none)."""
    env = os.environ.get("CADENCE_FUSED_TABLE")
    if env:
        return Path(env) if Path(env).is_file() else None
    d = REPO / "docs" / "perf" / "fused"
    if not d.is_dir():
        return None
    try:  # this GPU's own table first (chooser-nvidia-h200-x2-tp2.json), else any for this TP size
        if torch.cuda.is_available():
            from cadence.telemetry.devices import device_kind

            own = (
                d
                / f"chooser-{device_kind(torch.device('cuda', torch.cuda.current_device()), world)}-tp{world}.json"
            )
            if own.is_file():
                return own
    except Exception:
        pass
    cands = sorted(p for p in d.glob(f"chooser-*-tp{world}.json") if not p.name.startswith("chooser-cpu-"))
    return cands[-1] if cands else None


def load_table(world: int) -> list[dict]:
    p = table_path(world)
    key = str(p)
    if key not in _table_cache:
        entries: list[dict] = []
        if p is not None:
            try:
                doc = json.loads(p.read_text())
                entries = [e for e in doc.get("entries", []) if int(e.get("world", world)) == world]
            except (OSError, ValueError, TypeError) as e:
                warn_once(f"table:{p}", "chooser table %s unreadable (%s): built-in default", p, e)
        _table_cache[key] = (p, entries)
    return _table_cache[key][1]


def _default_mode(m: int, device_type: str) -> tuple[str, str]:
    if device_type != "cuda":
        return "nccl", f"{device_type}: no symmetric memory"
    if m <= AUTO_TWO_SHOT_MAX_M:
        return "two_shot", f"built-in default (no measured entry): two_shot at M <= {AUTO_TWO_SHOT_MAX_M}"
    return "nccl", f"built-in default (no measured entry): nccl at M > {AUTO_TWO_SHOT_MAX_M}"


def choose_mode(
    m: int, n: int, k: int, dtype: str | torch.dtype, world: int, device_type: str = "cuda"
) -> str:
    """The comm mode for a row-parallel call [m, k] x [k, n] over `world` ranks (dtype: 'bf16',
    'fp8', ... or a torch dtype). From the measured table (same n, k, dtype, world; the nearest
    measured m within 2x), else the built-in default. Logs its pick and the reason once per shape."""
    if isinstance(dtype, torch.dtype):
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
    key = (m, n, k, dtype, world, device_type)
    hit = _decisions.get(key)
    if hit is not None:
        return hit[0]
    if device_type != "cuda" or world <= 1:
        mode, why = (
            "nccl",
            (f"{device_type}: no symmetric memory" if device_type != "cuda" else "world of one"),
        )
    else:
        best = None
        for e in load_table(world):
            try:
                if int(e["n"]) != n or int(e["k"]) != k or e["dtype"] != dtype:
                    continue
                d = abs(math.log(max(int(e["m"]), 1) / max(m, 1)))
            except (KeyError, ValueError, TypeError):
                continue
            if d <= math.log(2) and (best is None or d < best[0]):
                best = (d, e)
        if best is not None and best[1].get("best_mode") and best[1]["best_mode"] not in NOT_AUTO:
            e = best[1]
            mode = e["best_mode"]
            try:
                parse_mode(mode)
            except ValueError:
                mode, why = _default_mode(m, device_type)
            else:
                times = e.get("modes_us") or e.get("modes") or {}
                why = (
                    f"measured table {table_path(world)}: at m={e['m']} {mode} "
                    f"{times.get(mode, '?')} us vs nccl {times.get('nccl', e.get('unfused_us', '?'))} us"
                )
        else:
            mode, why = _default_mode(m, device_type)
    _decisions[key] = (mode, why)
    log.info("row-parallel %dx%d->%d %s TP=%d: comm mode %s (%s)", m, k, n, dtype, world, mode, why)
    return mode


def chooser_decisions() -> dict[str, dict]:
    """Every shape the chooser decided so far: 'm x k -> n dtype tpW' -> {mode, why}."""
    return {
        f"{k[0]}x{k[2]}->{k[1]} {k[3]} tp{k[4]}": {"mode": v[0], "why": v[1]} for k, v in _decisions.items()
    }


def reset_chooser() -> None:
    _decisions.clear()
    _table_cache.clear()


# ---- small all-reduces (the q/k norms' sums of squares) ----------------------------------------
# a payload at most this big takes the one-shot: by the link fits (cadence.parallel.emulate.LINKS) a one-shot
# beats NCCL's all-reduce below ~1 MB at 4 ranks (8.9 + 15.7 us/MB against 21.7 + 5.5 us/MB of tensor); kept well
# under that (the fits are extrapolated below their 7.7 MB smallest point): the q/k sums are 3-100 KB
SMALL_BYTES = 256 * 1024
_SMALL_CACHE = SymmBufferCache(int(os.environ.get("CADENCE_SYMM_SMALL_CACHE", "4")))


def small_mode(t: torch.Tensor) -> str:
    """How a small sum is reduced: 'one_shot' (symmetric memory: every rank reads every peer's copy once, one
    kernel; what the link table prices lowest below ~1 MB: fixed 8.9 us against NCCL's 21.7) for a CUDA
    payload of at most :data:`SMALL_BYTES`, else 'nccl' (the group's all-reduce). ``CADENCE_TP_SMALL_COMM``
    = one_shot | nccl forces either (nccl: the reference path)."""
    forced = os.environ.get("CADENCE_TP_SMALL_COMM", "auto")
    if forced in ("one_shot", "nccl"):
        return forced
    small = t.numel() * t.element_size() <= SMALL_BYTES
    return "one_shot" if t.device.type == "cuda" and small else "nccl"


def small_all_reduce(t: torch.Tensor, group, label: str = "") -> torch.Tensor:
    """t <- SUM over the group of t, in place (t contiguous), for small payloads (:func:`small_mode`). The
    one-shot copies t into a symmetric buffer (:data:`_SMALL_CACHE`, its own LRU: the GEMM buffers stay
    cached), reduces it and copies the sum back; where it cannot run (CPU / gloo, no symmetric memory, an
    op that raises) the group's all-reduce does, with one warning per reason. An emulated group records the
    algorithm the real rank would run and runs its stand-in."""
    from cadence.parallel.group import as_group

    tg = as_group(group)
    if tg.world <= 1:
        return t
    mode = small_mode(t)
    if mode == "nccl" or tg.emulated:
        tg.all_reduce(t, label=label, algo=mode)
        return t
    why = symm_unavailable_reason(t.device, tg.process_group)
    ukey = ("small", tuple(t.shape), t.dtype)
    why = why or _unusable.get(ukey) or (None if (t.numel() * t.element_size()) % 16 == 0 else "not 16-byte")
    if why is None:
        try:
            flat = _SMALL_CACHE.get(
                t.numel() // t.shape[-1], t.shape[-1], t.dtype, t.device, tg.process_group
            )
            buf = flat[: t.numel()]
            buf.copy_(t.reshape(-1))
            out = _ops().one_shot_all_reduce(buf, "sum", group_name(tg.process_group))
            t.copy_(out.view(t.shape))
            tg.note("all_reduce", t.shape, t.dtype, label, "one_shot")
            return t
        except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError) as e:
            why = _unusable[ukey] = "one_shot failed: " + (
                str(e).splitlines()[0] if str(e) else type(e).__name__
            )
    warn_once(f"small:{why[:60]}", "small all-reduce %s falls back to the group's all-reduce: %s", label, why)
    tg.all_reduce(t, label=label)
    return t


# ---- GEMM into a given buffer ----------------------------------------------------------------
def gemm_out_dtype(linear, x: torch.Tensor) -> torch.dtype:
    from cadence.quant.fp8 import FP8Linear

    if isinstance(linear, FP8Linear) and x.device.type == "cuda":
        return torch.bfloat16  # rowwise-scaled FP8 GEMMs produce bf16 on CUDA
    return x.dtype


def _fp8_fast(linear, x: torch.Tensor) -> bool:
    from cadence.quant.fp8 import FP8Linear

    return isinstance(linear, FP8Linear) and linear._why_not_scaled_mm(x, torch.bfloat16) is None


def gemm_into(
    linear,
    x2: torch.Tensor,
    out: torch.Tensor,
    rows: slice | None = None,
    timed: bool = True,
    bias: torch.Tensor | None = None,
) -> None:
    """out [M, n] <- x2 [M, K] @ W^T (+ `bias` in the GEMM's epilogue; whole layers only) (W: the layer's
    weight, or its output rows `rows`). Writes straight into `out` (cuBLAS epilogue); where that is not
    possible, computes and copies. Timed under the "linear" region unless `timed` is False (caller inside
    another region)."""
    from cadence.quant.fp8 import FP8Linear, aligned16, quantize_activations

    ctx = region("linear") if timed else contextlib.nullcontext()
    try:
        if isinstance(linear, FP8Linear):
            if _fp8_fast(linear, x2):
                with ctx:
                    pre = getattr(linear, "_cadence_xq", None)
                    if pre is None:
                        with region("quant"):
                            pre = quantize_activations(x2)
                    xq, xs = pre
                    if rows is None:  # the whole layer: through its GEMM backend seam (cuBLAS or Triton)
                        b = None if bias is None else bias.to(out.dtype)
                        linear.matmul(xq, xs, b, out.dtype, out=out)
                        return
                    torch._scaled_mm(
                        aligned16(xq),
                        linear.weight_fp8[rows].t(),
                        scale_a=aligned16(xs),
                        scale_b=_scale_slice(linear, rows),
                        out_dtype=out.dtype,
                        use_fast_accum=True,
                        out=out,
                    )
                    linear.scaled_mm_calls += 1
                return
        elif x2.dtype == linear.weight.dtype == out.dtype:
            with ctx:
                w = linear.weight if rows is None else linear.weight[rows]
                if bias is not None and rows is None:
                    torch.addmm(bias.to(out.dtype), x2, w.t(), out=out)
                else:
                    torch.mm(x2, w.t(), out=out)
            return
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, TypeError) as e:
        warn_once(
            "gemm-into",
            "GEMM straight into the symmetric buffer failed (%s): computing then copying",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
    y = _plain_gemm(linear, x2, rows)
    out.copy_(y if bias is None or rows is not None else y + bias.to(y.dtype))


def _plain_gemm(linear, x2: torch.Tensor, rows: slice | None) -> torch.Tensor:
    if rows is None:
        return linear(x2)
    from cadence.quant.fp8 import FP8Linear

    if isinstance(linear, FP8Linear):
        return linear(x2)[:, rows]
    return torch.nn.functional.linear(x2, linear.weight[rows])


def _scale_slice(linear, rows: slice) -> torch.Tensor:
    """[1, n] slice of an FP8 layer's weight scales, its own 16-byte aligned copy (cached)."""
    cache = linear.__dict__.setdefault("_cadence_scale_slices", {})
    key = (rows.start, rows.stop, linear.weight_scale.data_ptr())
    t = cache.get(key)
    if t is None:
        t = linear.weight_scale[:, rows].clone()
        cache[key] = t
    return t


# ---- the modes -------------------------------------------------------------------------------
_unusable: dict[tuple, str] = {}  # (mode, m, n, dtype) -> why it failed
_side_streams: dict[int, object] = {}


def _side_stream(device: torch.device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _side_streams.get(idx)
    if s is None:
        s = torch.cuda.Stream(device=device)
        _side_streams[idx] = s
    return s


def gemm_bias(linear, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 @ W^T (+ `bias`, in the GEMM's epilogue) for the inner linear of a row-parallel layer (which has
    no bias of its own): a fresh [M, N] tensor in the GEMM's output dtype (bf16 for FP8 on CUDA)."""
    from cadence.quant.fp8 import FP8Linear, quantize_activations

    if bias is None:
        return linear(x2)
    dt = gemm_out_dtype(linear, x2)
    with region("linear"):
        if isinstance(
            linear, FP8Linear
        ):  # as FP8Linear.forward runs a biased layer (the column-parallel ones)
            with region("quant"):
                xq, xs = quantize_activations(x2)
            return linear.matmul(xq, xs, bias.to(dt), dt)
        return torch.nn.functional.linear(x2, linear.weight, bias.to(linear.weight.dtype))


def bias_in_epilogue(bias: torch.Tensor | None, group) -> torch.Tensor | None:
    """The bias this rank adds in its GEMM's epilogue: rank 0's partial carries it, so the sum over the group
    holds it once (no separate add after the reduction: a bf16 [M, N] read + write per call, on a
    broadcasting path that runs at ~1/3 of HBM speed). ``CADENCE_TP_BIAS=after`` adds it after the sum on
    every rank instead (the reference path). None on the other ranks."""
    if bias is None or os.environ.get("CADENCE_TP_BIAS", "epilogue") == "after":
        return None
    return bias if group.rank == 0 else None


def bias_after(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias to add after the sum, on every rank (the reference path, ``CADENCE_TP_BIAS=after``), else None."""
    return bias if bias is not None and os.environ.get("CADENCE_TP_BIAS", "epilogue") == "after" else None


def _nccl(linear, x2, group, label: str = "", algo: str = "nccl", bias=None):
    """GEMM (+ this rank's epilogue bias), then the group's all-reduce (`group` a TPGroup; `algo`: what a real
    rank would run, recorded)."""
    y = gemm_bias(linear, x2, bias)
    with region("allreduce"):
        y = y.contiguous()
        group.all_reduce(y, label=label, algo=algo)
    return y


_no_out_op: list[str] = []  # set once two_shot_all_reduce_out proved missing / unusable


def _two_shot_reduce(buf: torch.Tensor, gname: str) -> torch.Tensor:
    """Two-shot sum of the symmetric `buf` into a fresh tensor (``_out`` op; else in place + copy)."""
    op = None if _no_out_op else _op("two_shot_all_reduce_out")
    if op is not None:
        out = torch.empty_like(buf)
        try:
            op(buf, "sum", gname, out)
            return out
        except (RuntimeError, NotImplementedError, TypeError) as e:  # argument checks: before any kernel
            _no_out_op.append(str(e))
            warn_once(
                "two-shot-out",
                "two_shot_all_reduce_out unusable (%s): in place + copy instead",
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
    _ops().two_shot_all_reduce_(buf, "sum", gname)
    return buf.clone()


def _symm_gemm_buffer(linear, x2, group, m, n):
    dt = gemm_out_dtype(linear, x2)
    flat = _CACHE.get(m, n, dt, x2.device, group)
    return flat[: m * n].view(m, n)


def _two_shot(linear, x2, group, m, n, bias=None):
    buf = _symm_gemm_buffer(linear, x2, group, m, n)
    gemm_into(linear, x2, buf, bias=bias)
    with region("allreduce"):
        return _two_shot_reduce(buf, group_name(group))


def _one_shot(linear, x2, group, m, n, bias=None):
    buf = _symm_gemm_buffer(linear, x2, group, m, n)
    gemm_into(linear, x2, buf, bias=bias)
    with region("allreduce"):
        return _ops().one_shot_all_reduce(buf, "sum", group_name(group))


def _rs_ag(linear, x2, group, m, n, world):
    from cadence.quant.fp8 import FP8Linear, quantize_activations

    gname = group_name(group)
    _prepare(group)  # the fused op allocates its own symmetric workspace
    with region("linear_comm"):
        if isinstance(linear, FP8Linear):
            if not _fp8_fast(linear, x2):
                raise RuntimeError("FP8 layer cannot use _scaled_mm here")
            with region("quant"):
                xq, xs = quantize_activations(x2)
            odt = gemm_out_dtype(linear, x2)  # bf16 on CUDA
            op = _ops().fused_scaled_matmul_reduce_scatter
            try:  # torch >= 2.7 signature (orig / reshaped scatter dims, output_shape)
                part = op(
                    xq,
                    linear.weight_fp8.t(),
                    xs,
                    linear.weight_scale,
                    "sum",
                    0,
                    0,
                    gname,
                    [m, n],
                    None,
                    None,
                    odt,
                    True,
                )
            except (TypeError, RuntimeError) as e:
                if "argument" not in str(e) and "schema" not in str(e).lower():
                    raise
                part = op(
                    xq, linear.weight_fp8.t(), xs, linear.weight_scale, "sum", 0, gname, None, None, odt, True
                )  # older signature
            linear.scaled_mm_calls += 1
        else:
            if x2.dtype != linear.weight.dtype:
                raise RuntimeError(f"dtype mismatch {x2.dtype} vs {linear.weight.dtype}")
            part = _ops().fused_matmul_reduce_scatter(x2, linear.weight.t(), "sum", 0, gname)
        part = part.reshape(m // world, n).contiguous()
        out = torch.empty(m, n, dtype=part.dtype, device=part.device)
        _all_gather_single(out, part, group=group)
    return out


def _all_gather_single(out: torch.Tensor, part: torch.Tensor, group) -> None:
    """all_gather_single where it exists (torch >= 2.13 deprecates all_gather_into_tensor with a
    FutureWarning per call), else all_gather_into_tensor (torch 2.11); same signature."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, part, group=group)


def _chunked(linear, x2, group, m, n, chunks):
    from cadence.quant.fp8 import FP8Linear, quantize_activations

    nc = n // chunks
    flat = _CACHE.get(m, n, gemm_out_dtype(linear, x2), x2.device, group)
    bufs = flat[: m * n].view(chunks, m, nc)
    gname = group_name(group)
    if x2.device.type != "cuda":  # emulation on CPU (tests): the same steps, one stream
        with region("linear_comm"):
            for j in range(chunks):
                gemm_into(linear, x2, bufs[j], rows=slice(j * nc, (j + 1) * nc), timed=False)
                _ops().two_shot_all_reduce_(bufs[j], "sum", gname)
            return bufs.permute(1, 0, 2).reshape(m, n)
    main = torch.cuda.current_stream(x2.device)
    side = _side_stream(x2.device)
    with region("linear_comm"):
        fp8 = isinstance(linear, FP8Linear) and _fp8_fast(linear, x2)
        if fp8:
            with region("quant"):
                linear._cadence_xq = quantize_activations(x2)  # quantise once for all chunks
        side.wait_stream(main)
        try:
            for j in range(chunks):
                gemm_into(linear, x2, bufs[j], rows=slice(j * nc, (j + 1) * nc), timed=False)
                ev = torch.cuda.Event()
                ev.record(main)
                with torch.cuda.stream(side):
                    side.wait_event(ev)
                    _ops().two_shot_all_reduce_(bufs[j], "sum", gname)
        finally:
            main.wait_stream(side)  # also on error: nothing of this call stays in flight on the side
            if fp8:
                linear._cadence_xq = None
        out = bufs.permute(1, 0, 2).reshape(m, n)  # a copy: columns back in order
    return out


class _TileState:
    """The tile kernel's symmetric buffers for one (group, device, N, row bucket): ``part`` and ``fin``
    ([rows * N] bf16, this rank's and the peer's mapping of each), the per-tile flags (int32,
    symmetric, zeroed before the rendezvous) and the tile counter (local). Reused by every call of
    that bucket; the kernel leaves flags and counter at zero."""

    def __init__(self, group, device: torch.device, n: int, rows: int, dtype: torch.dtype):
        from cadence.kernels import gemm_allreduce as gar

        sm = _symm()
        _prepare(group)
        gname = group_name(group)
        rank = dist.get_rank(group)
        peer = 1 - rank
        t = gar.max_tiles(rows, n)  # any tile config's flags fit
        self.rows, self.n = rows, n

        def alloc(numel, dt, zero=False):
            buf = sm.empty(numel, dtype=dt, device=device)
            if zero:
                buf.zero_()
                # once per buffer set (its first call: warm-up, never a captured step): the zeros must be
                # in memory before any peer can write a flag, and the rendezvous below is the barrier
                torch.cuda.synchronize(device)
            hdl = sm.rendezvous(buf, gname)
            return buf, hdl.get_buffer(peer, (numel,), dt, 0)

        self.part, self.part_peer = alloc(rows * n, dtype)
        self.fin, self.fin_peer = alloc(rows * n, dtype)
        self.flags, self.flags_peer = alloc(2 * t, torch.int32, zero=True)
        self.counter = torch.zeros(2, dtype=torch.int32, device=device)


class TileStateCache:
    """LRU of the tile kernel's buffer sets, keyed by (group, device, N, row bucket, dtype): at most
    ``max_entries`` (env CADENCE_TILE_CACHE, default 8) live, like :class:`SymmBufferCache`; an evicted
    set's buffers go back to torch's symmetric-memory pool. Safe to drop after a call: every write a
    peer makes into this rank's buffers during a call lands before this rank's kernel of that call
    ends (it waits for the flags that follow them), and every rank sees the same shapes in the same
    order, so the ranks evict the same set at the same call. ``make(group, device, n, rows, dtype)``
    builds a set (injectable: the LRU is tested on the CPU)."""

    def __init__(self, max_entries: int = 4, make=None):
        self.max_entries = max(1, int(max_entries))
        self._make = make or _TileState
        self._entries: OrderedDict[tuple, object] = OrderedDict()
        self.allocations = self.evictions = self.hits = 0

    def get(self, group, device: torch.device, n: int, m: int, dtype: torch.dtype):
        rows = bucket_rows(m)
        key = (
            group_name(group) if group is not None or dist.is_initialized() else "",
            str(device),
            n,
            rows,
            dtype,
        )
        st = self._entries.get(key)
        if st is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return st
        while len(self._entries) >= self.max_entries:
            self._entries.popitem(last=False)
            self.evictions += 1
        st = self._entries[key] = self._make(group, device, n, rows, dtype)
        self.allocations += 1
        return st

    def info(self) -> dict:
        nbytes = sum(
            2 * s.part.numel() * s.part.element_size() + s.flags.numel() * 4 for s in self._entries.values()
        )
        return {
            "entries": len(self._entries),
            "max_entries": self.max_entries,
            "bytes": nbytes,
            "allocations": self.allocations,
            "evictions": self.evictions,
            "hits": self.hits,
            "keys": [(k[2], k[3]) for k in self._entries],
        }


_TILE_CACHE = TileStateCache(int(os.environ.get("CADENCE_TILE_CACHE", "8")))


def _tiles(linear, x2, group, m, n, world):
    from cadence.kernels import gemm_allreduce as gar
    from cadence.quant.fp8 import FP8Linear, quantize_activations

    why = gar.usable(x2.device, world)
    if why is not None:
        raise RuntimeError(why)
    dt = gemm_out_dtype(linear, x2)
    st = _TILE_CACHE.get(group, x2.device, n, m, dt)
    with region("linear_comm"):
        if isinstance(linear, FP8Linear):
            if not _fp8_fast(linear, x2):
                raise RuntimeError("FP8 layer cannot use _scaled_mm here")
            with region("quant"):
                a, sa = quantize_activations(x2)
            b, sb = linear.weight_fp8, linear.weight_scale.reshape(-1)
            sa = sa.reshape(-1)
            linear.scaled_mm_calls += 1  # the FP8 fast path ran (the tile kernel's FP8 GEMM, not _scaled_mm)
        else:
            if x2.dtype != linear.weight.dtype:
                raise RuntimeError(f"dtype mismatch {x2.dtype} vs {linear.weight.dtype}")
            a, b, sa, sb = x2, linear.weight, None, None
        out = torch.empty(m, n, dtype=dt, device=x2.device)
        view = lambda flat: flat[: m * n].view(m, n)  # noqa: E731
        gar.launch(
            a,
            b,
            sa,
            sb,
            out,
            view(st.part),
            view(st.part_peer),
            view(st.fin),
            view(st.fin_peer),
            st.flags,
            st.flags_peer,
            st.counter,
            rank=dist.get_rank(group),
        )
    return out


def tile_states_info() -> dict:
    """The tile kernel's buffer sets (one per N and row bucket, LRU-bounded): see TileStateCache.info."""
    return _TILE_CACHE.info()


def _precheck(mode: str, chunks: int, m: int, n: int, dt: torch.dtype, world: int) -> str | None:
    el = dt.itemsize
    if mode == "rs_ag" and m % world:
        return f"rs_ag needs M divisible by the group size ({m} % {world})"
    if mode == "chunked" and (n % chunks or (n // chunks) % 8):
        return f"chunked{chunks} needs N/chunks a multiple of 8 (N={n})"
    per = n // chunks if mode == "chunked" else n
    if (m * per * el) % 16:
        return f"symmetric all-reduce needs 16-byte multiples (M={m}, N={per}, {el} B)"
    return None


def row_parallel(
    linear, x: torch.Tensor, bias: torch.Tensor | None, group, mode: str = "auto", label: str = ""
) -> torch.Tensor:
    """all_reduce_sum(x @ W_local^T) + bias over `group` in the given comm mode ([..., K] -> [..., N]).
    The output is replicated on every rank and never aliases a symmetric buffer. `group`: a
    :class:`cadence.parallel.group.TPGroup` or a ProcessGroup (None: the default group); on an emulated
    group every mode takes the group's all-reduce stand-in, recorded as the mode the real rank would run.
    The bias rides in rank 0's GEMM epilogue where the mode's GEMM is a whole-layer one (nccl, two_shot,
    one_shot: :func:`bias_in_epilogue`), else it is added after the sum."""
    from cadence.parallel.group import as_group

    tg = as_group(group)
    lead = x.shape[:-1]
    k, n = linear.in_features, linear.out_features
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    name, chunks = _mode_for(linear, x2, mode, tg.world, m, n, k)
    algo = name + (str(chunks) if name == "chunked" else "")
    bias0 = bias_in_epilogue(bias, tg)
    after = bias_after(bias)
    if name == "two_shot_fp8":  # any group (an emulated one: its exchanges are the stand-ins)
        from cadence.parallel.comm_fp8 import fp8_all_reduce

        y = gemm_bias(linear, x2, bias0)
        with region("allreduce"):
            y = fp8_all_reduce(y.contiguous(), tg, label)
        return _finish(y, after, x.dtype, lead, n)
    if name != "nccl" and tg.world > 1 and m > 0 and tg.emulated:
        return _finish(_nccl(linear, x2, tg, label, algo, bias0), after, x.dtype, lead, n)
    y = None
    if name != "nccl" and tg.world > 1 and m > 0:
        y, epilogue = _symm_mode(name, chunks, linear, x2, tg, m, n, k, bias0)
        if y is not None and not epilogue:  # the mode's GEMM took no bias: add it after the sum
            after = bias
    if y is None:
        y = _nccl(linear, x2, tg, label, bias=bias0)
    else:
        tg.note("all_reduce", (m, n), y.dtype, label, algo)  # a symmetric-memory mode ran it
    return _finish(y, after, x.dtype, lead, n)


def _mode_for(linear, x2, mode: str, world: int, m: int, n: int, k: int) -> tuple[str, int]:
    name, chunks = parse_mode(mode)
    if name == "auto" and os.environ.get("CADENCE_TP_COMM", "auto") != "auto":
        name, chunks = parse_mode(os.environ["CADENCE_TP_COMM"])  # process-wide override of "auto"
    if name == "auto":
        picked = choose_mode(m, n, k, dtype_key(linear, x2.dtype), world, x2.device.type)
        name, chunks = parse_mode(picked)
    return name, chunks


def _symm_mode(name, chunks, linear, x2, tg, m, n, k, bias0) -> tuple[torch.Tensor | None, bool]:
    """One symmetric-memory mode: (the sum, or None when it could not run: then nccl; whether its GEMM added
    `bias0`)."""
    why = symm_unavailable_reason(x2.device, tg.process_group)
    if why is not None:
        warn_once(f"unavailable:{why}", "row-parallel comm %r falls back to nccl: %s", name, why)
        return None, False
    group, world = tg.process_group, tg.world
    dt = gemm_out_dtype(linear, x2)
    ukey = (name, chunks, m, n, dt, dtype_key(linear, x2.dtype))
    why = _unusable.get(ukey) or _precheck(name, chunks, m, n, dt, world)
    y, epilogue = None, False
    if why is None:
        try:
            if name == "two_shot" or (name == "chunked" and chunks == 1):
                y, epilogue = _two_shot(linear, x2, group, m, n, bias0), True
            elif name == "one_shot":
                y, epilogue = _one_shot(linear, x2, group, m, n, bias0), True
            elif name == "rs_ag":
                y = _rs_ag(linear, x2, group, m, n, world)
            elif name == "tiles":
                y = _tiles(linear, x2, group, m, n, world)
            elif name == "chunked":
                y = _chunked(linear, x2, group, m, n, chunks)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError) as e:
            why = f"{name} failed: " + (str(e).splitlines()[0] if str(e) else type(e).__name__)
            _unusable[ukey] = why
            y = None
    if y is None:
        warn_once(
            f"mode:{name}:{why[:60]}",
            "row-parallel comm %s for %dx%d->%d falls back to nccl: %s",
            name,
            m,
            k,
            n,
            why,
        )
    return y, epilogue


def _finish(y: torch.Tensor, bias, dtype: torch.dtype, lead, n: int) -> torch.Tensor:
    if bias is not None:
        with region("bias"):  # (a profile names it; the step's split keeps it with the elementwise work)
            y = y.add_(bias.to(y.dtype))  # y is always a fresh tensor here (never a symmetric buffer)
    if y.dtype != dtype:
        y = y.to(dtype)
    return y.reshape(*lead, n)
