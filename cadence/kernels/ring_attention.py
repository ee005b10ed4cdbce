"""Triton kernels for the ring cache, each beside the plain-PyTorch reference it is tested against.

Storage (per layer, H heads of D channels, N = sink + ring tokens):

* keys   ``K  [H, N, D]``  FP8 e4m3 (or the model dtype), **already rotated** at their positions;
* values ``VT [H, D, N]``  FP8 e4m3 (or the model dtype), stored transposed so that the token axis,
  the contraction axis of P @ V, is contiguous (Hopper's FP8 MMA wants both operands K-major);
* scales ``KS, VS [H, N]`` float32, one per (token, head): value = stored * scale;
* ``n_valid`` int32 device tensor [1]: keys [0, n_valid) are attended. The ring fills its slots in
  order, and the current chunk is written into its slot before attention, so the visible keys are
  always a prefix: a length, not a mask, and only while the ring is still filling. Read on the
  device: no host syncs.

``rope_quant_write`` (one fused kernel): RoPE (optional), amax per (token, head), scale, clamp to
+-448 (torch 2.11 turns overflow into NaN), cast, store at rows ``row0 + t`` of the buffer, where
``row0`` is a device int tensor. Also used for queries (into a scratch buffer).

``ring_attention``: flash attention of FP8 (or bf16) queries over the buffer as it is (TMA tensor
descriptors, unmasked main loop, one masked tail tile), with per-token scales:
S = (Q8 K8^T) * q_scale_i * k_scale_j; P is multiplied per tile by v_scale_j * 256 / max_tile(v_scale)
before its FP8 cast (P <= 1, so the largest value is 256 < 448 and small probabilities stay out of
FP8's subnormal range) and the accumulator is kept in units of max_tile(v_scale) / 256, a change
of unit folded into the usual alpha rescale. Optional split over keys (``split``) for occupancy at
few query tiles, combined by log-sum-exp.

When Triton cannot run (no CUDA and no ``TRITON_INTERPRET=1``, a head_dim that is not a power of
two, no triton installed) the callers use the references below, logging once.
"""

from __future__ import annotations

import logging
import math
import os

import torch

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
P_SCALE = 256.0
_warned: set[str] = set()


def warn_once(key: str, msg: str, level: int = logging.WARNING) -> None:
    """Log ``msg`` once per process per ``key`` (a fallback is worth one line, not one per session)."""
    if key not in _warned:
        _warned.add(key)
        log.log(level, msg)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(device: torch.device, head_dim: int, allow_interpreter: bool = False) -> tuple[bool, str]:
    """Whether the Triton kernels can run here, and why not. On CPU only under TRITON_INTERPRET=1 and
    when asked for (the interpreter is for tests: far slower than the PyTorch reference)."""
    try:
        import triton  # noqa: F401  (availability check)
    except ImportError:
        return False, "triton is not installed"
    if device.type != "cuda" and not (allow_interpreter and interpreting()):
        return False, f"device {device} is not CUDA"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return False, f"head_dim {head_dim} is not a power of two >= 16"
    return True, ""


# ---- references -----------------------------------------------------------------------------
def rope_quant_reference(
    x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, quant: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (values [H, T, D] in out_dtype, scales [H, T] float32): rotate, then quantise
    per (token, head) when `quant` (scales 1 otherwise)."""
    xf = x.float()
    if cos is not None:
        xc = torch.view_as_complex(xf.unflatten(-1, (-1, 2)).contiguous())
        xf = torch.view_as_real(xc * torch.complex(cos, sin)[:, None, :]).flatten(-2)
    xf = xf.transpose(0, 1)  # [H, T, D]
    if not quant:
        return xf.to(out_dtype), torch.ones(xf.shape[:2], device=x.device)
    scale = xf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def ring_attention_reference(
    q: torch.Tensor,
    qs: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    vt: torch.Tensor,
    vs: torch.Tensor,
    n: int,
) -> torch.Tensor:
    """Plain PyTorch: dequantise and attend over the first n keys. q [H, M, D], qs [H, M];
    k [H, N, D], ks [H, N]; vt [H, D, N], vs [H, N] -> out [M, H, D] float32."""
    qf = q.float() * qs[..., None]
    kf = k[:, :n].float() * ks[:, :n, None]
    vf = vt[:, :, :n].float().transpose(1, 2) * vs[:, :n, None]
    s = qf @ kf.transpose(1, 2) / math.sqrt(q.shape[-1])
    return (torch.softmax(s, dim=-1) @ vf).transpose(0, 1)


# ---- Triton ---------------------------------------------------------------------------------
def _kernels():
    from cadence.kernels import _ring_triton as k

    return k.rope_quant_kernel, k.attn_kernel, k.qkv_write_kernel


def _block_t() -> int:
    return 32 if interpreting() else 64


def _out_strides(out: torch.Tensor, transpose_out: bool) -> tuple[int, int, int]:
    """(head, token, channel) strides of a [H, N, D] or, transposed, [H, D, N] buffer."""
    if transpose_out:
        return out.stride(0), out.stride(2), out.stride(1)
    return out.stride(0), out.stride(1), out.stride(2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_quant_write(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    out: torch.Tensor,
    scale: torch.Tensor,
    row0: torch.Tensor,
    *,
    transpose_out: bool = False,
) -> None:
    """Fused RoPE + per-(token, head) FP8 quantisation + store (Triton).

    x [T, H, D] (channels contiguous); cos/sin [T, D/2] float32 or None (no rotation); out [H, N, D]
    (or [H, D, N] with transpose_out) of FP8 (quantise) or a float dtype (store as is); scale [H, N]
    float32; row0 int32 device tensor [1]: buffer row of token 0.
    """
    kern = _kernels()[0]
    x = _rows(x)
    t, h, d = x.shape
    rotate = cos is not None
    c = cos if rotate else x.new_empty(1, dtype=torch.float32)
    s = sin if rotate else c
    soh, son, sod = _out_strides(out, transpose_out)
    bt = _block_t()
    kern[(triton_cdiv(t, bt), h)](
        x,
        x.stride(0),
        x.stride(1),
        c,
        s,
        out,
        soh,
        son,
        sod,
        scale,
        scale.stride(0),
        scale.stride(1),
        row0,
        t,
        D=d,
        BLOCK_T=bt,
        ROTATE=rotate,
        QUANT=out.dtype == FP8,
    )


def qkv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    q_scale: torch.Tensor,
    k_out: torch.Tensor,
    k_scale: torch.Tensor,
    v_out: torch.Tensor,
    v_scale: torch.Tensor,
    zero: torch.Tensor,
    row0: torch.Tensor,
    v_transposed: bool,
) -> None:
    """One launch: q rotated (and quantised) into q_out rows 0.., k rotated and v as is into the
    cache rows row0.. (v_out [H, D, N] when v_transposed). All outputs FP8 or all float."""
    kern = _kernels()[2]
    q, k, v = _rows(q), _rows(k), _rows(v)
    t, h, d = q.shape
    bt = _block_t()
    kern[(triton_cdiv(t, bt), h, 3)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        v,
        v.stride(0),
        v.stride(1),
        cos,
        sin,
        q_out,
        *_out_strides(q_out, False),
        q_scale,
        q_scale.stride(0),
        q_scale.stride(1),
        k_out,
        *_out_strides(k_out, False),
        k_scale,
        k_scale.stride(0),
        k_scale.stride(1),
        v_out,
        *_out_strides(v_out, v_transposed),
        v_scale,
        v_scale.stride(0),
        v_scale.stride(1),
        zero,
        row0,
        t,
        D=d,
        BLOCK_T=bt,
        QUANT=k_out.dtype == FP8,
    )


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def ring_attention(
    q: torch.Tensor,
    qs: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    vt: torch.Tensor,
    vs: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    split: int = 1,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Flash attention (Triton) of q [H, M, D] over the first n_valid keys of the buffer k [H, N, D] /
    vt [H, D, N] with per-(token, head) scales; n_valid is an int32 device tensor [1] (no host sync).
    Returns [M, H, D] in out_dtype. N must be a multiple of 16 (TMA row alignment of vt)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kern = _kernels()[1]
    h, m, d = q.shape
    n = k.shape[1]
    quant = k.dtype == FP8
    interp = interpreting()
    # defaults: the fastest shapes of the sweep on an H200 at W57 (docs/perf/cache/NOTES.md)
    bm = block_m or (32 if interp else (64 if quant else 128))
    bn = block_n or (32 if interp else 128)
    split = max(1, int(split))
    per = triton_cdiv(triton_cdiv(n, split), bn) * bn
    split = triton_cdiv(n, per)
    o = torch.empty((split, h, m, d), device=q.device, dtype=torch.float32 if split > 1 else out_dtype)
    lse = torch.empty((split, h, m), device=q.device, dtype=torch.float32)
    qk_scale = (1.0 / math.sqrt(d)) * 1.4426950408889634  # softmax in base 2
    q_desc = TensorDescriptor.from_tensor(q, [1, bm, d])
    k_desc = TensorDescriptor.from_tensor(k, [1, bn, d])
    v_desc = TensorDescriptor.from_tensor(vt, [1, d, bn])
    grid = (triton_cdiv(m, bm), h, split)
    extra = {}
    if not interp:
        extra = dict(num_warps=num_warps or (4 if bm <= 64 else 8), num_stages=num_stages or 3)
    kern[grid](
        q_desc,
        qs,
        k_desc,
        ks,
        v_desc,
        vs,
        n_valid,
        o,
        lse,
        qs.stride(0),
        qs.stride(1),
        ks.stride(0),
        ks.stride(1),
        vs.stride(0),
        vs.stride(1),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        o.stride(3),
        lse.stride(0),
        lse.stride(1),
        lse.stride(2),
        m,
        per,
        qk_scale,
        HEAD_D=d,
        BLOCK_M=bm,
        BLOCK_N=bn,
        QUANT=quant,
        DOT_F32=interp,
        PREC="ieee" if k.dtype == torch.float32 else "tf32",
        **extra,
    )
    if split == 1:
        return o[0].transpose(0, 1)
    w = torch.softmax(lse * math.log(2.0), dim=0)  # [split, H, M]; empty splits have lse -inf -> weight 0
    return (o * w[..., None]).sum(0).transpose(0, 1).to(out_dtype)
