"""FP8 (e4m3) 3x3(x3) convolutions for the Wan decoder, beside their plain-PyTorch reference.

    wq, sw = quantize_weight(conv.weight)              # once: [N, KT*9*C] e4m3 + one scale per output channel
    y = conv3x3_fp8(x, wq, sw, bias, kt)               # x [B, C, T + kt - 1, H, W] (causal frames in front)

Numerics: the weight gets one float32 scale per output channel (amax / 448), the activation one per tensor
(amax / 448 over the whole conv input, computed on the device each call: no host sync). Per tensor is
enough here: the decoder's big convs read ``silu(RMSNorm(x))``, and the RMS norm gives every pixel the
same RMS, so a per-pixel scale would differ from the tensor's by the pixel's peak-to-RMS ratio only.
Products accumulate in float32; the epilogue is ``acc * x_scale * w_scale[n] + bias[n]`` in float32, then
the output dtype (bf16 on GPUs).

Layout contract (:func:`quantize_input`, :func:`quantize_input_triton`): the activation is quantised, put
channels-last and zero-padded by one pixel on each spatial side in one pass after its amax: ``q [B, T + kt -
1, H + 2, W + 2, C]``. The Triton version (torch's one-pass inf-norm + one Triton pass, an op opaque to
torch.compile) is the default: letting inductor fuse the torch version into the RMSNorm + SiLU + causal cat
before it made a Wan 2.2 chunk 16 ms slower (91.2 vs 75.1 ms; it recomputes the norm in the reductions). The Triton kernel (``_conv_fp8_triton``, one autotune config under the
interpreter) then reads each tap as a contiguous shifted block of rows; see its docstring.

Backends (``backend=``): ``'triton'`` (the kernel above), ``'cudnn'`` (cuDNN's FP8 conv fprop through the
``cudnn`` Python frontend, when installed: the same quantised operands, a scale and a bias node),
``'reference'`` (:func:`conv3x3_fp8_reference`: dequantise both operands to float32, ``F.conv3d``; the
same math, for the CPU tests and the error figures). The kernel and the reference see the same quantised
bytes, so they differ only by float32 summation order (tests/test_conv_fp8.py: 1e-5 relative). Against
the unquantised conv the FP8 path is off by about 3-4% relative L2 per conv (e4m3 keeps 3 mantissa bits:
relative rounding error up to 2^-4 on each operand); the test bounds it at 6%.

``why_not(device, backend)`` says why a backend cannot run here ('' when it can); callers fall back to
the plain conv with one log line.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_MIN = 1e-12
#: delayed scaling maps HEADROOM x the previous call's amax to 448: an input up to that much larger than the
#: last is not clamped; e4m3 is a float format, so this costs one binade at the small end only
DELAYED_HEADROOM = 2.0
BACKENDS = ("triton", "cudnn", "reference")
#: channel counts the Triton kernel takes (BLOCK_K divides C; the GPU configs use BLOCK_K 64 / 128)
MIN_CHANNELS = 64


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- quantisation (plain PyTorch: what torch.compile fuses into the op before the conv) -----------------
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv weight [N, C, KT, 3, 3] (or [N, C, 3, 3]) -> (wq [N, KT * 9 * C] e4m3, K order (dt, dh, dw, c),
    contiguous; sw [N] float32), with w ~= wq * sw per output channel."""
    if w.dim() == 4:
        w = w[:, :, None]
    n = w.shape[0]
    wf = w.detach().float().permute(0, 2, 3, 4, 1).reshape(n, -1)
    sw = wf.abs().amax(1).clamp_min(AMAX_MIN) / FP8_MAX
    wq = (wf / sw[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return wq, sw


def quantize_input(
    x: torch.Tensor, amax_prev: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, C, TP, H, W] (any memory format) -> (q [B, TP, H + 2, W + 2, C] e4m3, contiguous, zero border;
    sx [1] float32; amax [1] float32, x's own max |x|), with x ~= q * sx. One scale for the tensor:
    amax / 448 (per-call scaling), or ``amax_prev * (DELAYED_HEADROOM / 448)`` (delayed scaling: the amax
    of this conv's previous input, so no pass over x comes before the quantisation; what exceeds 448 * sx
    is clamped to +-448)."""
    xf = x.float()
    amax = xf.abs().amax().reshape(1)
    if amax_prev is None:
        sx = amax.clamp_min(AMAX_MIN) / FP8_MAX
    else:
        sx = amax_prev.float().reshape(1).clamp_min(AMAX_MIN) * (DELAYED_HEADROOM / FP8_MAX)
    y = F.pad((xf / sx).permute(0, 2, 3, 4, 1), (0, 0, 1, 1, 1, 1))
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8), sx, amax


def quantize_input_triton(
    x: torch.Tensor, amax_prev: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_input` outside inductor. Per-call scaling: torch's one-pass inf-norm (amax), then one
    Triton pass (scale, clamp, cast, zero border, channels last). Delayed (``amax_prev`` given): the Triton
    pass alone, which takes its scale from ``amax_prev`` and records x's amax by an atomic max (no host
    sync). Same bytes as the torch version either way."""
    import triton

    from cadence.kernels._conv_fp8_triton import quant_pad_kernel

    if x.stride(1) != 1:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    b, c, tp, h, w = x.shape
    delayed = amax_prev is not None
    if delayed:
        amax = torch.zeros(1, device=x.device, dtype=torch.float32)
        sx = torch.empty(1, device=x.device, dtype=torch.float32)
        prev = amax_prev.float().reshape(1)
    else:
        amax = torch.linalg.vector_norm(x, float("inf")).float().reshape(1)
        sx = amax.clamp_min(AMAX_MIN) / FP8_MAX
        prev = amax
    q = torch.empty(b, tp, h + 2, w + 2, c, device=x.device, dtype=FP8)
    rows = b * tp * (h + 2) * (w + 2)
    interp = interpreting()
    br, bc = (16, 16) if interp else (32, min(256, triton.next_power_of_2(c)))
    quant_pad_kernel[(triton.cdiv(rows, br),)](
        x,
        q,
        sx,
        prev,
        amax,
        DELAYED_HEADROOM / FP8_MAX,
        rows,
        tp,
        h,
        w,
        c,
        x.stride(0),
        x.stride(2),
        x.stride(3),
        x.stride(4),
        DELAYED=delayed,
        GRID_ROUND=interp,
        BLOCK_R=br,
        BLOCK_C=bc,
        num_warps=4,
    )
    return q, sx, amax


@torch.library.custom_op("cadence::quant_pad_fp8", mutates_args=())
def _quant_op(
    x: torch.Tensor, amax_prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_input_triton(x, amax_prev)


@_quant_op.register_fake
def _(x, amax_prev):
    b, c, tp, h, w = x.shape
    one = x.new_empty((1,), dtype=torch.float32)
    return x.new_empty((b, tp, h + 2, w + 2, c), dtype=FP8), one, x.new_empty((1,), dtype=torch.float32)


# ---- the reference ---------------------------------------------------------------------------------------
def conv3x3_fp8_reference(q, sx, wq, sw, bias, kt: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The quantised conv in plain PyTorch: both operands dequantised to float32, a valid ``F.conv3d`` over
    the padded input. Returns [B, T_out, H, W, N] (channels last), as the kernel does."""
    b, tp, hp, wp, c = q.shape
    n = wq.shape[0]
    xd = (q.float() * sx).permute(0, 4, 1, 2, 3)
    wd = (wq.float() * sw[:, None]).reshape(n, kt, 3, 3, c).permute(0, 4, 1, 2, 3)
    y = F.conv3d(xd, wd, None if bias is None else bias.float())
    return y.permute(0, 2, 3, 4, 1).to(out_dtype).contiguous()


# ---- the Triton kernel's host side -----------------------------------------------------------------------
def _gpu_configs():
    import triton

    c = triton.Config
    return [
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=4),
        c({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=4),
    ]


@functools.cache
def _kernel(interp: bool):
    """The kernel, autotuned over the GPU configs (keyed by the conv's shape), or with one small config
    under the interpreter."""
    import triton

    from cadence.kernels._conv_fp8_triton import conv3x3_fp8_kernel

    if interp:
        cfg = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)
        return triton.autotune([cfg], key=[])(conv3x3_fp8_kernel)
    return triton.autotune(_gpu_configs(), key=["T_out", "H", "W", "C", "N", "KT"])(conv3x3_fp8_kernel)


def conv3x3_fp8_triton(q, sx, wq, sw, bias, kt: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton implicit GEMM on the quantised operands; [B, T_out, H, W, N] channels last."""
    import triton

    b, tp, hp, wp, c = q.shape
    n = wq.shape[0]
    t_out, h, w = tp - kt + 1, hp - 2, wp - 2
    y = torch.empty(b, t_out, h, w, n, device=q.device, dtype=out_dtype)
    rows = ((t_out - 1) * hp + h - 1) * wp + w  # the last kept output row + 1, on the padded grid
    interp = interpreting()
    kern = _kernel(interp)

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), b)

    kern[grid](
        q,
        wq,
        sx,
        sw,
        bias if bias is not None else sw,
        y,
        t_out,
        h,
        w,
        c,
        n,
        HAS_BIAS=bias is not None,
        KT=kt,
        UPCAST=interp,
        ROUND_BF16=interp and out_dtype == torch.bfloat16,
    )
    return y


# ---- cuDNN's FP8 conv fprop (optional: the ``cudnn`` frontend package) ------------------------------------
_cudnn_graphs: dict = {}


def _cudnn_handle():
    import cudnn

    h = getattr(_cudnn_handle, "h", None)
    if h is None:
        h = _cudnn_handle.h = cudnn.create_handle()
    return h


def conv3x3_fp8_cudnn(q, sx, wq, sw, bias, kt: int, out_dtype: torch.dtype) -> torch.Tensor:
    """cuDNN's conv fprop on the same e4m3 operands (valid conv over the padded input), float32 compute, then
    a per-channel scale (x_scale * w_scale) and the bias as pointwise nodes; one graph per shape, cached."""
    import cudnn

    b, tp, hp, wp, c = q.shape
    n = wq.shape[0]
    t_out, h, w = tp - kt + 1, hp - 2, wp - 2
    dt = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}.get(
        out_dtype, cudnn.data_type.FLOAT
    )
    key = (q.shape, n, kt, out_dtype, bias is not None, q.device.index)
    handle = _cudnn_handle()
    hit = _cudnn_graphs.get(key)
    if hit is None:
        g = cudnn.pygraph(
            io_data_type=dt,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        X = g.tensor(
            name="X",
            dim=[b, c, tp, hp, wp],
            stride=[tp * hp * wp * c, 1, hp * wp * c, wp * c, c],
            data_type=cudnn.data_type.FP8_E4M3,
        )
        Wt = g.tensor(
            name="W",
            dim=[n, c, kt, 3, 3],
            stride=[kt * 9 * c, 1, 9 * c, 3 * c, c],
            data_type=cudnn.data_type.FP8_E4M3,
        )
        conv = g.conv_fprop(
            image=X,
            weight=Wt,
            padding=[0, 0, 0],
            stride=[1, 1, 1],
            dilation=[1, 1, 1],
            compute_data_type=cudnn.data_type.FLOAT,
        )
        S = g.tensor(name="S", dim=[1, n, 1, 1, 1], stride=[n, 1, n, n, n], data_type=cudnn.data_type.FLOAT)
        Y = g.mul(a=conv, b=S, compute_data_type=cudnn.data_type.FLOAT)
        Bt = None
        if bias is not None:
            Bt = g.tensor(
                name="B", dim=[1, n, 1, 1, 1], stride=[n, 1, n, n, n], data_type=cudnn.data_type.FLOAT
            )
            Y = g.add(a=Y, b=Bt, compute_data_type=cudnn.data_type.FLOAT)
        Y.set_output(True).set_data_type(dt).set_dim([b, n, t_out, h, w]).set_stride(
            [t_out * h * w * n, 1, h * w * n, w * n, n]
        )
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        ws = torch.empty(max(1, g.get_workspace_size()), device=q.device, dtype=torch.uint8)
        hit = _cudnn_graphs[key] = (g, X, Wt, S, Bt, Y, ws)
    g, X, Wt, S, Bt, Y, ws = hit
    y = torch.empty(b, t_out, h, w, n, device=q.device, dtype=out_dtype)
    s = (sx * sw).contiguous()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    binds = {X: q, Wt: wq, S: s, Y: y}
    if Bt is not None:
        binds[Bt] = bias.float().contiguous()
    g.execute(binds, ws, handle=handle)
    return y


# ---- the op (opaque to torch.compile) and the entry point ---------------------------------------------
_IMPLS = {"triton": conv3x3_fp8_triton, "cudnn": conv3x3_fp8_cudnn, "reference": conv3x3_fp8_reference}


@torch.library.custom_op("cadence::conv3x3_fp8", mutates_args=())
def _conv_op(
    q: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    kt: int,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    return _IMPLS[backend](q, sx, wq, sw, bias, kt, out_dtype)


@_conv_op.register_fake
def _(q, sx, wq, sw, bias, kt, out_dtype, backend):
    b, tp, hp, wp, _c = q.shape
    return q.new_empty((b, tp - kt + 1, hp - 2, wp - 2, wq.shape[0]), dtype=out_dtype)


def conv3x3_fp8(
    x: torch.Tensor,
    wq: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    kt: int,
    backend: str = "triton",
    quant: str | None = None,
    amax: torch.Tensor | None = None,
    delayed: bool = False,
) -> torch.Tensor:
    """``conv3d(x, w, bias, padding=(0, 1, 1))`` in FP8: x [B, C, T_out + kt - 1, H, W] (temporal padding
    already in front), (wq, sw) from :func:`quantize_weight`. Returns [B, N, T_out, H, W] in x's dtype,
    channels_last_3d. ``quant``: 'triton' (:func:`quantize_input_triton`, an opaque op: measured faster) or
    'torch' (:func:`quantize_input`, which torch.compile fuses into the ops before it); None: 'torch' for
    the reference backend (the CPU tests), else 'triton'.

    ``amax`` ([1] float32 on x's device, or None): the conv's scaling state. Given, x's amax is written into
    it (``copy_``, on the device); with ``delayed`` the activation scale is taken from the amax it held
    (the previous call's) instead of a pass over x first. None: per-call scaling, nothing recorded."""
    quant = quant or ("torch" if backend == "reference" else "triton")
    prev = amax if (delayed and amax is not None) else None
    q, sx, amax_x = _quant_op(x, prev) if quant == "triton" else quantize_input(x, prev)
    if amax is not None:
        amax.copy_(amax_x)
    y = _conv_op(q, sx, wq, sw, bias, kt, x.dtype, backend)
    return y.permute(0, 4, 1, 2, 3)


# ---- can it run here? ----------------------------------------------------------------------------------
@functools.cache
def _import_reason(backend: str) -> str:
    try:
        if backend == "triton":
            import triton  # noqa: F401
        elif backend == "cudnn":
            import cudnn  # noqa: F401
    except Exception as e:  # ImportError, or a cudnn frontend that cannot find its library
        return f"{backend} is not importable ({type(e).__name__}: {str(e)[:120]})"
    return ""


def why_not(device: torch.device, backend: str) -> str:
    """'' when ``backend`` can run FP8 convs on ``device``, else why not (one line)."""
    if backend not in BACKENDS:
        return f"unknown FP8 conv backend {backend!r} (one of {', '.join(BACKENDS)})"
    if backend == "reference":
        return ""
    why = _import_reason(backend)
    if why:
        return why
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return f"FP8 tensor-core math needs compute capability >= 8.9 (got {cap[0]}.{cap[1]})"
        return ""
    if backend == "triton" and interpreting():
        return ""
    return f"needs a CUDA device (got {device.type})"
