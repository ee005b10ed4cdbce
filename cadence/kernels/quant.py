"""One-launch FP8 (e4m3) activation quantisation for the FP8 linears, beside its PyTorch references.

``quantize_rows_triton(x)``: x [M, K] (bf16 / fp16 / fp32, last dim contiguous) -> (x_fp8 [M, K]
e4m3, scale [M, 1] float32) with x ~= x_fp8 * scale, one scale per row (token). One Triton launch:
each program holds whole rows in registers, takes max |x|, scale = max(amax, 1e-12) / 448, multiplies
by the reciprocal, clamps to +-448 (torch 2.11 turns overflow into NaN), rounds and casts. The reference is
:func:`cadence.quant.fp8.quantize_rows` (plain PyTorch: an inf-norm, a division, a reciprocal, a
float32 product, a clamp and a cast: several kernels and a float32 [M, K] temporary). Bytes moved for
a bf16 activation: 3 per element (read 2, write 1) against ~21 eager.

``quantize_rows_modulated(x, shift, scale, eps)``: the op before the FP8 linears that follow adaLN
in every block (``cadence.model.dit.Block``: ``h = (norm(x) * (1 + scale) + shift).to(dt)`` feeds the
self-attention qkv and the FFN fc1), fused with the quantisation: LayerNorm (no affine; or RMS norm)
+ modulation + rounding to the model dtype + per-row quantisation, one read of x (and of shift /
scale), one write of the FP8 rows. Its reference is :func:`quantize_rows_modulated_reference`,
exactly the model's arithmetic followed by ``quantize_rows``. How to hook it into the model from
outside, and the predicted gain: docs/perf/fp8/NOTES.md.

The same kernel family makes the other inputs of FP8 linears in one pass (``cadence.runtime.compile.
apply_fused_quant`` wires them in): ``quantize_rows_layer_norm_triton`` (the affine LayerNorm before the cross /
audio attention's q: the modulated kernel with weight / bias for 1 + scale / shift) and
``gelu_quantize_rows_triton`` (the FFN's GELU before fc2), each beside its reference
(tests/test_fused_quant.py: the same tolerance as the modulated kernel's).

Parity (tests/test_fp8_quant.py). The plain kernel gives the reference's bytes exactly: the same
IEEE operations (amax is exact; amax / 448 and 1 / scale are correctly rounded divisions,
``div_rn``, not Triton's approximate fp32 ``/``; one float32 product; the clamp), then it rounds to
the e4m3 grid itself, to nearest even, in float32 arithmetic, so the cast only meets representable
values. That step is for the Triton interpreter, whose float32 -> e4m3 conversion rounds ties away
from zero and loses the carry into the exponent (a value that should become 128 comes out as 64
when the exponent is odd), and whose float32 -> bf16 conversion truncates; the hardware casts of
sm89+ round to nearest even like torch's (``grid_round=False`` drops the step, for timing). The
modulated kernel's norm sums in another order and takes sqrt + a division where torch takes
rsqrt, so the value before rounding moves by a few float32 ulps and an element next to a rounding
boundary can land one e4m3 step the other way: its tests compare scales within 1e-6 relative and
values within one e4m3 step, with at most 0.1% of the bytes different.

When the Triton path cannot run (no triton, not CUDA and not the interpreter, an FP8 cast the GPU
lacks (sm < 8.9), a row longer than ``MAX_K``, an unsupported dtype, a non-contiguous last dim) the
callers use the references, logging once per reason.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from cadence.telemetry.logs import warn_once as warn_once_on

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_MIN = 1e-12  # an all-zero row gets a tiny scale (quantises to zeros), never a division by zero
MAX_K = 32768  # a row in one program's registers: 32768 float32 over 16 warps = 64 per thread
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NORMS = ("layer", "rms")
warn_once = functools.partial(warn_once_on, log)  # (key, msg, *args, level=...): cadence.telemetry.logs


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton_import_error() -> str:
    try:
        import triton  # noqa: F401  (availability check)
    except ImportError as e:
        return f"triton is not installed ({e})"
    return ""


@functools.lru_cache(maxsize=16)
def _capability_reason(index: int) -> str:
    cap = torch.cuda.get_device_capability(index)
    if cap < (8, 9):
        return f"the e4m3 cast needs compute capability >= 8.9 (got {cap[0]}.{cap[1]})"
    return ""


def triton_usable(x: torch.Tensor, allow_interpreter: bool = False) -> tuple[bool, str]:
    """Whether the quantisation kernels can take `x` ([..., K]) here, and why not. On CPU only under
    TRITON_INTERPRET=1 and when asked for (the interpreter is for tests: far slower than PyTorch)."""
    why = _triton_import_error()
    if why:
        return False, why
    if x.device.type == "cuda":
        why = _capability_reason(
            x.device.index if x.device.index is not None else torch.cuda.current_device()
        )
        if why:
            return False, why
    elif not (allow_interpreter and interpreting()):
        return False, f"device {x.device.type} is not CUDA"
    if x.dtype not in DTYPES:
        return False, f"dtype {x.dtype} is not one of bf16 / fp16 / fp32"
    if x.dim() < 1 or x.shape[-1] > MAX_K:
        return False, f"row length {x.shape[-1] if x.dim() else 0} > {MAX_K} (the row is held in registers)"
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return False, "last dim not contiguous"
    return True, ""


# ---- references -------------------------------------------------------------------------------
def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] e4m3, scale [M, 1] float32) with x ~= x_fp8 * scale: the plain-PyTorch
    per-row quantisation (``cadence.quant.fp8.quantize_rows`` is this function).

    One scale per row (amax / 448); values are clamped to the e4m3 range before the cast."""
    # inf-norm = max |x| in one read, no |x| temporary; multiplying by the float32 reciprocal writes
    # the float32 quotient in one pass (x is promoted), then clamp in place and cast.
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True).float().clamp_min(AMAX_MIN)
    scale = amax / FP8_MAX
    q = (x * scale.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def modulate_reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    norm: str = "layer",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(norm(x) * (1 + scale) + shift).to(out_dtype)`` in float32, as ``Block.forward`` computes the
    input of qkv and fc1 (norm: ``LayerNorm32`` without affine, or an RMS norm without weight)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    xf = x.float()
    if norm == "layer":
        n = F.layer_norm(xf, (x.shape[-1],), None, None, eps)
    else:
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (n * (1 + scale) + shift).to(out_dtype or x.dtype)


def quantize_rows_modulated_reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    norm: str = "layer",
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`modulate_reference` then :func:`quantize_rows_reference` over the rows
    ([..., K] -> [prod(...), K] e4m3 and [prod(...), 1] float32): the eager path it replaces."""
    h = modulate_reference(x, shift, scale, eps, norm, out_dtype)
    return quantize_rows_reference(h.reshape(-1, h.shape[-1]))


# ---- Triton -----------------------------------------------------------------------------------
def _kernels():
    from cadence.kernels import quant_triton as k

    return k.quant_rows_kernel, k.quant_rows_modulated_kernel, k.gelu_quant_rows_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=256)
def launch_config(
    k: int, interp: bool, block_m: int | None = None, num_warps: int | None = None, modulated: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) for rows of length k. Whole rows per program (BLOCK_K = next
    power of two >= k); small rows are packed several per program (~4096 elements a program), and
    the warps grow with the tile so each thread holds ~32 float32 values (64 at the largest rows;
    the modulated kernel holds x, shift and scale, so one step more warps)."""
    bk = max(16, _next_pow2(k))
    if interp:
        return block_m or max(1, min(16, 1024 // bk)), bk, 1
    bm = block_m or max(1, min(16, 4096 // bk))
    per = bm * bk
    nw = num_warps or min(16, max(4, per // (512 if modulated else 1024)))
    return bm, bk, nw


def quantize_rows_triton(
    x: torch.Tensor, *, block_m: int | None = None, num_warps: int | None = None, grid_round: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) in one launch (see the module docstring).
    Caller checks :func:`triton_usable` first. `block_m` / `num_warps` override the defaults
    (tuning, the benchmark's sweep); ``grid_round=False`` leaves the rounding to the cast alone
    (the same bytes on sm89+ hardware, NOT in the interpreter: for timing the step's cost only)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_triton wants x [M, K], got {list(x.shape)}")
    m, k = x.shape
    q, s = _outputs(m, k, x.device)
    if m == 0 or k == 0:
        return q, s
    interp = x.device.type != "cuda"
    bm, bk, nw = launch_config(k, interp, block_m, num_warps)
    extra = {} if interp else {"num_warps": nw}
    _kernels()[0][(triton_cdiv(m, bm),)](
        x,
        x.stride(0),
        q,
        q.stride(0),
        s,
        m,
        k,
        BLOCK_M=bm,
        BLOCK_K=bk,
        AMAX_MIN=AMAX_MIN,
        FP8_MAX=FP8_MAX,
        GRID_ROUND=bool(grid_round),
        **extra,
    )
    return q, s


def _outputs(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' outputs: e4m3 [M, K] and float32 scales [M, 1] (the floor scale when empty)."""
    q = torch.empty((m, k), dtype=FP8, device=device)
    s = torch.empty((m, 1), dtype=torch.float32, device=device)
    if m == 0 or k == 0:
        s.fill_(AMAX_MIN / FP8_MAX)
    return q, s


def _as_bnk(t: torch.Tensor, shape3: tuple[int, int, int], what: str) -> torch.Tensor:
    """Broadcast `t` to [B, N, K] without copying (stride 0 where broadcast); last dim contiguous."""
    try:
        if t.dim() > 3:
            raise RuntimeError("more than 3 dims")
        e = t.reshape((1,) * (3 - t.dim()) + tuple(t.shape)).expand(shape3)
    except RuntimeError as err:
        raise ValueError(
            f"{what} of shape {list(t.shape)} does not broadcast to {list(shape3)} ({err})"
        ) from None
    if e.shape[-1] > 1 and e.stride(-1) != 1:
        e = e.contiguous()
    return e


def _round_code(dt: torch.dtype) -> int:
    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dt]


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


PROGRAMS_PER_SM = 2  # shared-modulation grid: programs per SM walking the rows (tuned by the bench sweep)


def quantize_rows_modulated_triton(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    *,
    norm: str = "layer",
    out_dtype: torch.dtype | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int | None = None,
    plus_one: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, N, K] or [M, K]; shift / scale broadcastable to x (float32 [B, 1, K] per sample or
    [B, N, K] per token, as ``Block`` has them) -> (e4m3 [B*N, K], float32 [B*N, 1]) in one launch.
    Caller checks :func:`triton_usable` first. When every row shares one modulation row (per
    sample, B == 1: the stream), a grid of ``programs_per_sm`` x SMs programs walks the rows with
    shift / scale loaded once per program; else one block of rows per program. ``plus_one=False``:
    ``norm(x) * scale + shift`` (an affine LayerNorm, scale = weight, shift = bias:
    :func:`quantize_rows_layer_norm`)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not one of bf16 / fp16 / fp32")
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if x.dim() != 3:
        raise ValueError(f"quantize_rows_modulated wants x [B, N, K] or [M, K], got {list(x.shape)}")
    b, n, k = x.shape
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    sh = _as_bnk(shift, (b, n, k), "shift")
    sc = _as_bnk(scale, (b, n, k), "scale")
    m = b * n
    q, s = _outputs(m, k, x.device)
    if m == 0 or k == 0:
        return q, s
    interp = x.device.type != "cuda"
    bm, bk, nw = launch_config(k, interp, block_m, num_warps, modulated=True)
    extra = {} if interp else {"num_warps": nw}
    shared = all((t.stride(0) == 0 or b == 1) and (t.stride(1) == 0 or n == 1) for t in (sh, sc))
    grid = _modulated_grid(x.device, triton_cdiv(m, bm), shared, interp, programs_per_sm)
    _kernels()[1][grid](
        x,
        x.stride(0),
        x.stride(1),
        sh,
        sh.stride(0),
        sh.stride(1),
        sc,
        sc.stride(0),
        sc.stride(1),
        q,
        q.stride(0),
        s,
        m,
        n,
        k,
        float(eps),
        BLOCK_M=bm,
        BLOCK_K=bk,
        RMS=norm == "rms",
        ROUND=_round_code(out_dtype),
        SHARED=shared,
        AMAX_MIN=AMAX_MIN,
        FP8_MAX=FP8_MAX,
        PLUS_ONE=bool(plus_one),
        **extra,
    )
    return q, s


def _modulated_grid(device: torch.device, blocks: int, shared: bool, interp: bool, programs_per_sm) -> tuple:
    """One program per block of rows; with one modulation row for all (``shared``), ``programs_per_sm`` x SMs
    programs walking the rows (2 "SMs" under the interpreter)."""
    if not shared:
        return (blocks,)
    per_sm = programs_per_sm or PROGRAMS_PER_SM
    sms = (
        2 if interp else _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    )
    return (max(1, min(blocks, sms * per_sm)),)


def quantize_rows_modulated(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    *,
    norm: str = "layer",
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm (or RMS norm) + adaLN modulation + rounding to `out_dtype` (default x's) + per-row
    FP8 quantisation: ``quantize_rows((norm(x) * (1 + scale) + shift).to(out_dtype))`` over the rows.

    backend: "auto" (the Triton kernel where :func:`triton_usable`, else the reference, logged once
    per reason), "triton" (the kernel, the interpreter allowed; raises if unusable) or "torch"."""
    if backend == "torch":
        return quantize_rows_modulated_reference(x, shift, scale, eps, norm, out_dtype)
    ok, why = triton_usable(x, allow_interpreter=backend == "triton")
    if not ok:
        if backend == "triton":
            raise RuntimeError(f"quantize_rows_modulated: Triton path unusable: {why}")
        warn_once(
            f"mod:{why}",
            "fused norm+modulation+FP8 quantisation: PyTorch reference path (%s)",
            why,
            level=logging.INFO if x.device.type != "cuda" else logging.WARNING,
        )
        return quantize_rows_modulated_reference(x, shift, scale, eps, norm, out_dtype)
    return quantize_rows_modulated_triton(x, shift, scale, eps, norm=norm, out_dtype=out_dtype)


def layer_norm_reference(x, weight, bias, eps: float) -> torch.Tensor:
    """``F.layer_norm(x.float(), weight, bias).to(x.dtype)``: the model's ``layer_norm_cast`` (the affine
    LayerNorm before the cross / audio attention's q)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps).to(x.dtype)


def quantize_rows_layer_norm_reference(x, weight, bias, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`layer_norm_reference` then :func:`quantize_rows_reference` over the rows."""
    h = layer_norm_reference(x, weight, bias, eps)
    return quantize_rows_reference(h.reshape(-1, h.shape[-1]))


def quantize_rows_layer_norm_triton(x, weight, bias, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine LayerNorm + rounding to x's dtype + per-row quantisation in one launch: the modulated
    kernel with the weight as its scale (not 1 + scale) and the bias as its shift. Same tolerance as
    :func:`quantize_rows_modulated_triton` against :func:`quantize_rows_layer_norm_reference`."""
    return quantize_rows_modulated_triton(x, bias.float(), weight.float(), eps, plus_one=False)


def gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """The FFN's activation, as ``MLP2`` runs it: ``F.gelu(x, approximate="tanh")`` in x's dtype."""
    return F.gelu(x, approximate="tanh")


def gelu_quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gelu_reference` then :func:`quantize_rows_reference` ([..., K] -> [prod(...), K])."""
    g = gelu_reference(x)
    return quantize_rows_reference(g.reshape(-1, g.shape[-1]))


def gelu_quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU (tanh) + rounding to x's dtype + per-row quantisation in one launch (``gelu_quant_rows_kernel``):
    x [..., K] (last dim contiguous) -> (e4m3 [M, K], float32 [M, 1]). Caller checks :func:`triton_usable`.

    Against :func:`gelu_quantize_rows_reference`: the kernel's tanh is exp-based (torch's is its own
    tanhf), so the float32 value before the bf16 rounding differs by a few ulps and an element next to a
    rounding boundary can land one step the other way: asserted as for the modulated kernel (scales within
    one bf16 rounding of the row's amax, values within one e4m3 step, <= 0.1% of the bytes different:
    tests/test_fused_quant.py)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"gelu_quantize_rows wants bf16 / fp16 / fp32, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    q, s = _outputs(m, k, x.device)
    if m == 0 or k == 0:
        return q, s
    interp = x.device.type != "cuda"
    bm, bk, nw = launch_config(k, interp, modulated=True)
    extra = {} if interp else {"num_warps": nw}
    _kernels()[2][(triton_cdiv(m, bm),)](
        x2,
        x2.stride(0),
        q,
        q.stride(0),
        s,
        m,
        k,
        BLOCK_M=bm,
        BLOCK_K=bk,
        ROUND=_round_code(x.dtype),
        AMAX_MIN=AMAX_MIN,
        FP8_MAX=FP8_MAX,
        **extra,
    )
    return q, s


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
