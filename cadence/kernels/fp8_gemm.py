"""The FP8 GEMM backend seam of the FP8 linears: cuBLAS (``torch._scaled_mm``) or Cadence's Triton GEMM,
chosen per shape from a table measured offline.

Contract (every backend): ``a`` [M, K] e4m3 (activations, one float32 scale per row ``sa`` [M, 1]),
``b`` [N, K] e4m3 (the weight as stored, [out, in], one float32 scale per output channel ``sb`` [1, N]),
optional ``bias`` [N] -> ``C = (a @ b^T) * sa * sb + bias`` [M, N] in ``out_dtype`` (bf16 on CUDA),
float32 accumulation, one rounding; ``out`` (optional) receives it in place (a row-parallel GEMM writes
straight into a symmetric buffer). Reference: :func:`reference_gemm` (the dequantised float32 matmul that
``FP8Linear``'s fallback runs).

Backends (``FastPath.gemm``; ``BACKENDS``):

* ``"cublas"``: ``torch._scaled_mm`` rowwise, fast accumulation (cuBLASLt on CUDA; torch's own kernel on
  the CPU) - what the FP8 linears always ran before this seam.
* ``"triton"``: :func:`triton_gemm`, one persistent Triton kernel (``_fp8_gemm_triton``): tiles of
  BM x BN over a K step BK, grouped order, optional split-K over a workspace (a deterministic in-kernel
  reduction, no second launch: for the small-N shapes whose tile grid underfills the 132 SMs), TMA tensor
  descriptors or pointer loads, optional ``tl.range`` flattening / warp specialisation. Its launch
  configuration is one :class:`GemmConfig` per shape, read from the table; nothing is autotuned at run
  time (a new config means a compile: only the offline sweep, ``cadence bench linears``, tries them).
* ``"auto"``: per shape (M, N, K) from the measured table (:func:`choose`): ``docs/perf/fp8/
  gemm-<device kind>.json``, written by ``cadence bench linears`` (its ``source`` field names the bench
  JSON it came from). An entry says which backend won at that (N, K) and a measured M (the nearest within
  2x is used) and, for Triton, with which config. No table, no entry, or not CUDA: cuBLAS. Each decision
  is logged once per shape with its reason.

Fallbacks, never a crash: a Triton launch that raises (a compile error under another Triton, a config a
GPU rejects) is remembered for that config and the call runs cuBLAS, one log line per reason; a shape
cuBLAS refuses (it refuses rowwise FP8 at M = 8, W57's audio K/V) runs Triton where usable, else the
dequantised matmul (``cadence.quant.fp8``). Measured numbers: docs/perf/fp8/NOTES.md.

Scratch (split-K): one float32 workspace and one int32 counter array per device, grown to the largest
need and never freed (a CUDA graph captured with a buffer keeps its address), shared by the calls of one
stream (kernels on one stream run one after another; the counters are back at zero after every call).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cublas", "triton")
FP8 = torch.float8_e4m3fn
REPO = Path(__file__).resolve().parents[2]
TABLE_DIR = REPO / "docs" / "perf" / "fp8"


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the Triton GEMM (text form: ``128x256x128:g8:k1:w8:s4[:tma][:flat][:ws]``).

    bm / bn / bk: the tile and the K step; group_m: row tiles per column sweep; split_k: K ranges per tile
    (1: none); warps, stages: Triton's num_warps / num_stages; tma: tensor-descriptor loads; flatten /
    ws: ``tl.range(flatten=..., warp_specialize=...)`` on the persistent loop."""

    bm: int = 128
    bn: int = 128
    bk: int = 128
    group_m: int = 8
    split_k: int = 1
    warps: int = 8
    stages: int = 4
    tma: bool = True
    flatten: bool = False
    ws: bool = False

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1 or self.group_m < 1 or self.warps < 1 or self.stages < 1:
            raise ValueError(f"GemmConfig: split_k, group_m, warps and stages must be >= 1 ({self})")

    def text(self) -> str:
        flags = [f for f in ("tma", "flatten", "ws") if getattr(self, f)]
        core = f"{self.bm}x{self.bn}x{self.bk}:g{self.group_m}:k{self.split_k}:w{self.warps}:s{self.stages}"
        return ":".join([core, *("flat" if f == "flatten" else f for f in flags)])

    @classmethod
    def parse(cls, text: str) -> GemmConfig:
        tile, *rest = text.strip().split(":")
        try:
            bm, bn, bk = (int(v) for v in tile.lower().split("x"))
            kw: dict = {"bm": bm, "bn": bn, "bk": bk, "tma": False}
            keys = {"g": "group_m", "k": "split_k", "w": "warps", "s": "stages"}
            for part in rest:
                if part in ("tma", "flat", "ws"):
                    kw[{"tma": "tma", "flat": "flatten", "ws": "ws"}[part]] = True
                elif part[:1] in keys and part[1:].isdigit():
                    kw[keys[part[:1]]] = int(part[1:])
                else:
                    raise ValueError(part)
        except ValueError as e:
            raise ValueError(
                f"GEMM config {text!r}: want BMxBNxBK[:gN:kN:wN:sN][:tma][:flat][:ws] ({e})"
            ) from None
        return cls(**kw)

    def tiles(self, m: int, n: int) -> int:
        return -(-m // self.bm) * -(-n // self.bn)

    def smem_bytes(self) -> int:
        """Shared memory of the operand pipeline (FP8: one byte an element)."""
        return (self.bm + self.bn) * self.bk * self.stages


#: On GPUs without a table entry for the shape ("triton" forced): 128x128 tiles, 4 stages, TMA.
DEFAULT = GemmConfig()
#: The interpreter (CPU tests): small tiles, no pipelining.
INTERPRETER = GemmConfig(32, 32, 32, group_m=2, warps=4, stages=1, tma=False)

#: The offline sweep's candidates (``cadence bench linears``), from the wave arithmetic of the serving
#: shapes (docs/perf/fp8/NOTES.md): at M = 748, 128-row tiles give 6 row tiles (the last 108 rows), so
#: the column count decides how many waves of 132 SMs a GEMM runs; 64-row tiles double the units for the
#: small-N shapes, 256-column tiles halve them for the large-N ones; split-K fills the machine where N
#: alone cannot. Every config fits the H200's 227 KiB of shared memory.
SWEEP = (  # in the order a cut-short sweep should keep them ("--sweep short": the first four)
    GemmConfig(128, 128, 128, 8, 1, 8, 4),
    GemmConfig(128, 256, 128, 8, 1, 8, 3),
    GemmConfig(64, 128, 128, 8, 1, 4, 5),
    GemmConfig(128, 128, 128, 8, 2, 8, 4),
    GemmConfig(128, 128, 128, 8, 4, 8, 4),
    GemmConfig(64, 128, 128, 8, 2, 4, 5),
    GemmConfig(128, 256, 128, 8, 1, 8, 4),
    GemmConfig(128, 128, 128, 8, 1, 4, 4),
    GemmConfig(64, 256, 128, 8, 1, 4, 4),
    GemmConfig(128, 128, 128, 8, 1, 8, 4, tma=False),
    GemmConfig(128, 128, 128, 8, 1, 8, 4, flatten=True),
    GemmConfig(128, 256, 128, 8, 1, 8, 3, flatten=True),
    GemmConfig(128, 128, 128, 8, 1, 8, 4, flatten=True, ws=True),
)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton_missing() -> str:
    try:
        import triton  # noqa: F401  (availability check)
    except ImportError as e:
        return f"triton is not installed ({e})"
    return ""


@functools.lru_cache(maxsize=16)
def _capability_problem(index: int) -> str:
    cap = torch.cuda.get_device_capability(index)
    return "" if cap >= (8, 9) else f"FP8 MMA needs compute capability >= 8.9 (got {cap[0]}.{cap[1]})"


def usable(a: torch.Tensor, b: torch.Tensor, allow_interpreter: bool = False) -> str | None:
    """Why the Triton GEMM cannot take these operands here (None: it can). On the CPU only under
    TRITON_INTERPRET=1 and when asked for (tests: the interpreter is far slower than torch)."""
    why = _triton_missing()
    if why:
        return why
    if a.device.type == "cuda":
        why = _capability_problem(
            a.device.index if a.device.index is not None else torch.cuda.current_device()
        )
        if why:
            return why
    elif not (allow_interpreter and interpreting()):
        return f"device {a.device.type} is not CUDA"
    if a.dtype != FP8 or b.dtype != FP8:
        return f"operands must be e4m3 (got {a.dtype} and {b.dtype})"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        return f"want a [M, K] and b [N, K], got {list(a.shape)} and {list(b.shape)}"
    if a.stride(1) != 1 or b.stride(1) != 1:
        return "operands need a contiguous last dim"
    return None


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tensor descriptors can read a and b: 16-byte aligned bases and row strides (FP8: K % 16 == 0)."""
    import triton.language as tl

    return hasattr(tl, "make_tensor_descriptor") and all(
        t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (a, b)
    )


@functools.lru_cache(maxsize=16)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_scratch: dict[str, list[torch.Tensor]] = {}


def _split_scratch(device: torch.device, ws_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace (float32, >= ws_elems) and tile counters (int32 zeros, >= tiles) of `device`,
    grown to the largest need so far. The old, smaller buffers are kept alive (never freed): a graph
    captured with them may still replay."""
    key = str(device)
    cur = _scratch.get(key)
    if cur is None or cur[0].numel() < ws_elems or cur[1].numel() < tiles:
        ws = torch.empty(max(ws_elems, cur[0].numel() if cur else 0), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(tiles, cur[1].numel() if cur else 0), dtype=torch.int32, device=device)
        _scratch.setdefault(key + ":old", []).extend(cur or [])
        _scratch[key] = cur = [ws, cnt]
    return cur[0], cur[1]


def programs(device: torch.device, units: int) -> int:
    """Persistent grid: one program per SM (at most one per work unit); 4 on the interpreter."""
    if device.type == "cuda":
        return max(
            1, min(units, sm_count(device.index if device.index is not None else torch.cuda.current_device()))
        )
    return max(1, min(units, 4))


def triton_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton FP8 GEMM (module docstring's contract). Caller checks :func:`usable` first. `config`
    defaults to :data:`DEFAULT` on GPUs and :data:`INTERPRETER` on the CPU; a TMA config whose operands
    are not 16-byte aligned runs with pointer loads."""
    from cadence.kernels import _fp8_gemm_triton as kt

    m, k = a.shape
    n = b.shape[0]
    interp = a.device.type != "cuda"
    cfg = config or (INTERPRETER if interp else DEFAULT)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    elif tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with a contiguous last dim, got {list(out.shape)}")
    if m == 0 or n == 0:
        return out
    sa = sa.reshape(-1).float().contiguous()
    sb = sb.reshape(-1).float().contiguous()
    tma = cfg.tma and _tma_ok(a, b)
    if tma and not interp:
        from cadence.kernels.gemm_allreduce import _set_allocator

        _set_allocator()  # device-side descriptors take scratch from torch's allocator
    t = cfg.tiles(m, n)
    units = t * cfg.split_k
    if cfg.split_k > 1:
        ws, cnt = _split_scratch(a.device, t * cfg.split_k * cfg.bm * cfg.bn, t)
    else:
        ws = cnt = out  # never touched without split-K
    extra = {} if interp else {"num_warps": cfg.warps, "num_stages": cfg.stages}
    kt.fp8_gemm_kernel[(programs(a.device, units),)](
        a, b, sa, sb, bias if bias is not None else sa, out, ws, cnt,
        m, n, k, a.stride(0), b.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, TMA=tma, UPCAST=interp,
        ROUND=interp and out.dtype == torch.bfloat16, EVEN_K=k % cfg.bk == 0,
        FLATTEN=cfg.flatten, WS=cfg.ws,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, **extra,
    )  # fmt: skip
    return out


def reference_gemm(a, b, sa, sb, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The dequantised float32 matmul every backend is tested against (``FP8Linear``'s fallback)."""
    y = (a.float() * sa.reshape(-1, 1).float()) @ (b.float() * sb.reshape(-1, 1).float()).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# ---- the per-shape choice -----------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    backend: str  # "cublas" | "triton"
    config: GemmConfig | None
    why: str


_choices: dict[tuple, Choice] = {}
_tables: dict[str, tuple[Path | None, list[dict]]] = {}


def table_path(device: torch.device) -> Path | None:
    """This device's measured table, ``docs/perf/fp8/gemm-<kind>.json`` (None when there is none)."""
    if device.type != "cuda":
        return None
    from cadence.telemetry.devices import device_kind

    p = TABLE_DIR / f"gemm-{device_kind(device)}.json"
    return p if p.is_file() else None


def load_table(device: torch.device) -> list[dict]:
    p = table_path(device)
    key = str(p)
    if key not in _tables:
        entries: list[dict] = []
        if p is not None:
            try:
                entries = list(json.loads(p.read_text()).get("entries", []))
            except (OSError, ValueError, TypeError, AttributeError) as e:
                log.warning("FP8 GEMM table %s unreadable (%s): cuBLAS everywhere", p, e)
        _tables[key] = (p, entries)
    return _tables[key][1]


def _lookup(m: int, n: int, k: int, device: torch.device) -> Choice:
    best = None
    for e in load_table(device):
        try:
            if int(e["n"]) != n or int(e["k"]) != k:
                continue
            d = abs(math.log(max(int(e["m"]), 1) / max(m, 1)))
        except (KeyError, ValueError, TypeError):
            continue
        if d <= math.log(2) and (best is None or d < best[0]):
            best = (d, e)
    if best is None:
        return Choice("cublas", None, "no measured entry for this shape: cuBLAS")
    e = best[1]
    src = f"{table_path(device).name} at m={e['m']}: {e.get('us', {})}"
    if e.get("backend") == "triton":
        try:
            return Choice("triton", GemmConfig.parse(str(e["config"])), f"measured, {src}")
        except (KeyError, ValueError) as err:
            return Choice("cublas", None, f"table entry unusable ({err}): cuBLAS")
    return Choice("cublas", None, f"measured, {src}")


def choose(m: int, n: int, k: int, device: torch.device, backend: str = "auto") -> Choice:
    """The backend (and Triton config) for one call [m, k] x [k, n]; logged once per shape."""
    if backend not in BACKENDS:
        raise ValueError(f"FP8 GEMM backend must be one of {BACKENDS}, got {backend!r}")
    key = (m, n, k, device.type, backend)
    c = _choices.get(key)
    if c is None:
        if backend == "cublas":
            c = Choice("cublas", None, "asked for")
        elif backend == "triton":
            hit = _lookup(m, n, k, device) if device.type == "cuda" else None
            cfg = hit.config if hit is not None and hit.config is not None else None
            c = Choice("triton", cfg, "asked for" + ("" if cfg else " (default config)"))
        elif device.type != "cuda":
            c = Choice("cublas", None, f"{device.type}: no measured table")
        else:
            c = _lookup(m, n, k, device)
        _choices[key] = c
        log.info(
            "FP8 GEMM %dx%d->%d: %s%s (%s)",
            m,
            k,
            n,
            c.backend,
            f" {c.config.text()}" if c.config else "",
            c.why,
        )
    return c


def choices() -> dict[str, dict]:
    """Every shape decided so far: 'm x k -> n (backend asked)' -> {backend, config, why}."""
    return {
        f"{k[0]}x{k[2]}->{k[1]} ({k[4]})": {
            "backend": c.backend,
            "config": c.config.text() if c.config else None,
            "why": c.why,
        }
        for k, c in _choices.items()
    }


def reset() -> None:
    """Forget the decisions and tables (tests; a table written during a process)."""
    _choices.clear()
    _tables.clear()


def with_config(cfg: GemmConfig, **kw) -> GemmConfig:
    return dataclasses.replace(cfg, **kw)
