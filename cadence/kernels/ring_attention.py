"""Triton kernels for the ring cache, each beside the plain-PyTorch reference it is tested against.

Storage (per layer, H heads of D channels, N = sink + ring tokens):

* keys   ``K  [H, N, D]``  FP8 e4m3 (or the model dtype), **already rotated** at their positions;
* values ``VT [H, D, N]``  FP8 e4m3, stored transposed so that the token axis, the contraction axis of
  P @ V, is contiguous (Hopper's FP8 MMA wants both operands K-major); ``V [H, N, D]`` in the model
  dtype, or in FP8 for a library backend that reads it so (FlashAttention-3: see
  ``cadence.kernels.attention_backends``);
* scales, FP8 only: ``"token"``: ``KS, VS [H, N]`` float32, one per (token, head), value = stored * scale;
  ``"head"``: ``KS, VS [H]``, one per (layer, head), fixed for a stream (set from the first write with
  headroom, ``HEAD_HEADROOM``; values beyond it clamp);
* ``n_valid`` int32 device tensor [1]: keys [0, n_valid) are attended. The ring fills its slots in
  order, and the current chunk is written into its slot before attention, so the visible keys are
  always a prefix: a length, not a mask, and only while the ring is still filling. Read on the
  device: no host syncs.

``rope_quant_write`` (one fused kernel): RoPE (optional), then per (token, head) amax, scale, clamp to
+-448 (torch 2.11 turns overflow into NaN), cast, store at rows ``row0 + t`` of the buffer, where
``row0`` is a device int tensor; or quantise by a given per-head scale. Also used for queries (into a
scratch buffer). ``qkv_write``: the same for a pass's q, k and v in one launch, optionally applying the q/k
RMS norms first (:class:`RowNorm`: the rows' sums of squares, the weight; ``cadence.cache.qk_fold``).

``ring_attention``: flash attention of FP8 (or bf16) queries over the buffer as it is (TMA tensor
descriptors, unmasked main loop, one masked tail tile), written straight into the ``[M, H, D]`` layout
the output projection reads. Logits are kept in base 2 and in units of the row factor r_i = q_scale_i *
qk_scale (* the head's k scale), so each element costs one multiply-add before its exp2. Per-token
scales: S = (Q8 K8^T) * r_i * k_scale_j; P is multiplied per tile by v_scale_j * 256 / max_tile(v_scale)
before its FP8 cast (P <= 1, so the largest value is 256 < 448 and small probabilities stay out of
FP8's subnormal range) and the accumulator is kept in units of max_tile(v_scale) / 256, a change of
unit folded into the usual alpha rescale. Per-head scales: no per-key multiply at all; the 256 is
folded into the exponent and the head's v scale into the epilogue. Variants (all measured by
``cadence bench attention``): a split over keys (``split``) for occupancy at few query tiles, merged by
one combine kernel; two query blocks sharing each K/V tile (``dual``); P @ V in bf16 (``pv_bf16``);
Triton's loop warp specialisation (``ws``, where the compiler supports it).

When Triton cannot run (no CUDA and no ``TRITON_INTERPRET=1``, a head_dim that is not a power of
two, no triton installed) the callers use the references below, logging once.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch

from cadence.telemetry.logs import warn_once as warn_once_on

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
P_SCALE = 256.0
#: ``warn_once(key, msg, level=...)``: one line per process per reason (``cadence.telemetry.logs``)
warn_once = functools.partial(warn_once_on, log)


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


#: Per-head FP8 scales ("head") are set from the first write of a stream (the image sink, or the first
#: chunk without one) as HEAD_HEADROOM x its amax / 448: later tokens up to 16x larger stay exact to e4m3's
#: 3 mantissa bits (a float format: the headroom costs no relative precision, only 4 of its ~15 binades of
#: range, all below 1/1000 of the amax), larger ones clamp. The attention error this costs against per-token
#: scales is measured in tests/test_attention_backends.py (test_head_scale_granularity).
HEAD_HEADROOM = 16.0
SCALES = ("token", "head")


# ---- references -----------------------------------------------------------------------------
def head_amax_bound(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    """x [T, H, D] -> [H] float32: an upper bound of |x| per head after RoPE (rotate: sqrt(2) x the amax,
    which bounds every rotated channel pair's norm, so no angle can exceed it) or the plain amax. One
    reduction kernel, no float copy, no host sync (for FP8 scales the bound's looseness costs nothing: e4m3
    keeps the same relative precision over its range)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=(0, 2), dtype=torch.float32)
    return amax * math.sqrt(2.0) if rotate else amax


@dataclass(frozen=True)
class RowNorm:
    """The apply half of an RMS norm over a row's channels, for a write to fold in (``qkv_write``'s `norm`):
    ``x * rsqrt(ss / dim + eps) * weight``. `ss`: the rows' float32 sums of squares over the norm's full
    width `dim` ([T] or any shape of T elements; under tensor parallelism the all-reduced sum, of which
    this rank holds `weight.numel()` of the `dim` channels), `weight`: the channels this write sees, in
    [H, D] order. :meth:`apply` is the separate norm's own math (``cadence.model.layers.rms_scale``): what
    the fold replaces, for the paths that need the normed tensor itself."""

    ss: torch.Tensor
    weight: torch.Tensor
    dim: int
    eps: float

    def rows(self) -> torch.Tensor:
        """The sums as a [T] view (a copy only if no view can be made)."""
        return self.ss.reshape(-1)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H, D] -> the normed x in x's dtype (the separate norm's output), same shape."""
        from cadence.model.layers import rms_scale

        flat = x.flatten(-2)
        ss = self.rows().reshape(*flat.shape[:-1], 1)
        return rms_scale(flat, ss, self.weight, self.dim, self.eps).unflatten(-1, x.shape[-2:])


def rope_quant_reference(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    quant: bool,
    out_dtype: torch.dtype,
    head_scale: torch.Tensor | None = None,
    norm: RowNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (values [H, T, D] in out_dtype, scales [H, T] float32): with `norm`, first the RMS
    norm's apply in float32 (the folded write's math); rotate, then quantise per (token, head) when
    `quant` (by the given per-head scales [H] with `head_scale`; scales 1 when not quantising)."""
    xf = x.float()
    if norm is not None:
        inv = torch.rsqrt(norm.rows() / norm.dim + norm.eps)
        xf = xf * inv[:, None, None] * norm.weight.float().reshape(xf.shape[1:])
    if cos is not None:
        xc = torch.view_as_complex(xf.unflatten(-1, (-1, 2)).contiguous())
        xf = torch.view_as_real(xc * torch.complex(cos, sin)[:, None, :]).flatten(-2)
    xf = xf.transpose(0, 1)  # [H, T, D]
    if not quant:
        return xf.to(out_dtype), torch.ones(xf.shape[:2], device=x.device)
    if head_scale is not None:
        scale = head_scale.float().clamp_min(1e-30)[:, None].expand(xf.shape[:2])
    else:
        scale = xf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def _per_key(scale: torch.Tensor, n: int) -> torch.Tensor:
    """[H, N] per-token scales -> [H, n, 1]; [H] per-head scales -> [H, 1, 1]."""
    return scale[:, :n, None] if scale.dim() == 2 else scale[:, None, None]


def ring_attention_reference(
    q: torch.Tensor,
    qs: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    vt: torch.Tensor,
    vs: torch.Tensor,
    n: int,
    *,
    v_transposed: bool = True,
) -> torch.Tensor:
    """Plain PyTorch: dequantise and attend over the first n keys. q [H, M, D], qs [H, M] (or [H]);
    k [H, N, D]; vt [H, D, N] (v [H, N, D] when not v_transposed); ks, vs [H, N] per token or [H] per
    head -> out [M, H, D] float32."""
    qf = q.float() * (qs[..., None] if qs.dim() == 2 else qs[:, None, None])
    kf = k[:, :n].float() * _per_key(ks, n)
    vv = vt[:, :, :n].transpose(1, 2) if v_transposed else vt[:, :n]
    vf = vv.float() * _per_key(vs, n)
    s = qf @ kf.transpose(1, 2) / math.sqrt(q.shape[-1])
    return (torch.softmax(s, dim=-1) @ vf).transpose(0, 1)


# ---- Triton ---------------------------------------------------------------------------------
def _kernels():
    from cadence.kernels import _ring_triton as k

    return k


def _block_t() -> int:
    return 32 if interpreting() else 64


def _out_strides(out: torch.Tensor, transpose_out: bool) -> tuple[int, int, int]:
    """(head, token, channel) strides of a [H, N, D] or, transposed, [H, D, N] buffer."""
    if transpose_out:
        return out.stride(0), out.stride(2), out.stride(1)
    return out.stride(0), out.stride(1), out.stride(2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _mode(out: torch.Tensor, scale: torch.Tensor) -> int:
    """Write mode: 0 store as is (float storage), 1 per-(token, head) scales [H, N], 2 per-head scales [H]."""
    if out.dtype != FP8:
        return 0
    return 2 if scale.dim() == 1 else 1


def _scale_strides(scale: torch.Tensor) -> tuple[int, int]:
    return (scale.stride(0), scale.stride(1)) if scale.dim() == 2 else (scale.stride(0), 0)


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
    """Fused RoPE + FP8 quantisation + store (Triton).

    x [T, H, D] (channels contiguous); cos/sin [T, D/2] float32 or None (no rotation); out [H, N, D]
    (or [H, D, N] with transpose_out) of FP8 (quantise) or a float dtype (store as is); scale [H, N]
    float32 (per (token, head), written) or [H] (per head, read: quantise by it); row0 int32 device
    tensor [1]: buffer row of token 0.
    """
    kern = _kernels().rope_quant_kernel
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
        *_scale_strides(scale),
        row0,
        t,
        D=d,
        BLOCK_T=bt,
        ROTATE=rotate,
        MODE=_mode(out, scale),
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
    norm: tuple[RowNorm, RowNorm] | None = None,
) -> None:
    """One launch: q rotated (and quantised) into q_out rows 0.., k rotated and v as is into the
    cache rows row0.. (v_out [H, D, N] when v_transposed). All outputs FP8 or all float; each scale
    [H, N] (per token, written) or [H] (per head, read), as in ``rope_quant_write``; k and v share a mode.
    `norm` (q's, k's; one full width and eps): q and k are the norms' inputs, and each is RMS-normed
    in float32 before its rotation (the q/k norms' apply folded into this write)."""
    kern = _kernels().qkv_write_kernel
    q, k, v = _rows(q), _rows(k), _rows(v)
    t, h, d = q.shape
    bt = _block_t()
    nq, nk = norm if norm is not None else (None, None)
    if norm is not None and (nq.dim, nq.eps, nq.rows().numel(), nk.rows().numel()) != (nk.dim, nk.eps, t, t):
        raise ValueError("q/k norms folded into the write need one full width and eps, and a sum per token")
    qss, kss = (nq.rows(), nk.rows()) if norm is not None else (q, k)
    qw, kw = (_weight(nq, h * d), _weight(nk, h * d)) if norm is not None else (q, k)
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
        *_scale_strides(q_scale),
        k_out,
        *_out_strides(k_out, False),
        k_scale,
        *_scale_strides(k_scale),
        v_out,
        *_out_strides(v_out, v_transposed),
        v_scale,
        *_scale_strides(v_scale),
        zero,
        row0,
        t,
        qss,
        qss.stride(0) if norm is not None else 0,
        qw,
        kss,
        kss.stride(0) if norm is not None else 0,
        kw,
        float(nq.dim) if norm is not None else 1.0,
        float(nq.eps) if norm is not None else 0.0,
        D=d,
        BLOCK_T=bt,
        Q_MODE=_mode(q_out, q_scale),
        KV_MODE=_mode(k_out, k_scale),
        NORM=norm is not None,
    )


def _weight(n: RowNorm, width: int) -> torch.Tensor:
    """A norm's weight as the kernel reads it: [H*D] contiguous (one clear error for another width)."""
    if n.weight.numel() != width or n.dim < width or n.rows().dtype != torch.float32:
        raise ValueError(
            f"q/k norm folded into the write: weight of {n.weight.numel()} for {width} channels, full width "
            f"{n.dim}, sums {n.rows().dtype} (need the channels this write sees, float32 sums)"
        )
    return n.weight.reshape(-1).contiguous()


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def split_rows(n: int, split: int, block_n: int) -> tuple[int, int]:
    """(keys per split, splits that hold any key) for `split` requested over n buffer rows: every split
    but the last is a whole number of key tiles."""
    per = triton_cdiv(triton_cdiv(n, max(1, int(split))), block_n) * block_n
    return per, triton_cdiv(n, per)


def ring_attention(
    q: torch.Tensor,
    qs: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    vt: torch.Tensor,
    vs: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    v_transposed: bool = True,
    split: int = 1,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dual: bool = False,
    pv_bf16: bool = False,
    ws: bool = False,
    maxnreg: int | None = None,
    num_ctas: int | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Flash attention (Triton) of q [H, M, D] over the first n_valid keys of the buffer k [H, N, D] /
    vt [H, D, N] (v [H, N, D] with v_transposed=False: float storage only), n_valid an int32 device
    tensor [1] (no host sync). FP8 scales: ks, vs [H, N] per token or [H] per head; qs [H, M] per token.
    Returns [M, H, D] (contiguous, or `out`) in out_dtype. With V^T, N must be a multiple of 16 (TMA row
    alignment). Variants and block shapes: the module docstring; defaults: docs/perf/cache/NOTES.md.
    ``maxnreg`` caps registers per thread (more programs resident per SM); ``num_ctas`` > 1 launches
    clusters (Triton splits a block over the cluster's CTAs; K/V tiles can then be multicast)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kern = _kernels()
    h, m, d = q.shape
    n = k.shape[1]
    quant = k.dtype == FP8
    if quant and not v_transposed:
        raise ValueError("FP8 values must be stored transposed ([H, D, N]) for the Triton kernel")
    scales = 0 if not quant else (2 if ks.dim() == 1 else 1)
    interp = interpreting()
    bm = block_m or (32 if interp else (64 if quant else 128))
    bn = block_n or (32 if interp else 128)
    per, split = split_rows(n, split, bn)
    rows = bm * (2 if dual else 1)
    if out is None:
        out = torch.empty((m, h, d), device=q.device, dtype=out_dtype)
    if split == 1:  # written straight into [M, H, D]: strides of (split, head, row, channel)
        o, o_strides = out, (0, out.stride(1), out.stride(0), out.stride(2))
    else:
        o = torch.empty((split, h, m, d), device=q.device, dtype=torch.float32)
        o_strides = o.stride()
    lse = torch.empty((split, h, m), device=q.device, dtype=torch.float32)
    qk_scale = (1.0 / math.sqrt(d)) * 1.4426950408889634  # softmax in base 2
    q_desc = TensorDescriptor.from_tensor(q, [1, bm, d])
    k_desc = TensorDescriptor.from_tensor(k, [1, bn, d])
    v_desc = TensorDescriptor.from_tensor(vt, [1, d, bn] if v_transposed else [1, bn, d])
    extra = {}
    if not interp:
        extra = dict(num_warps=num_warps or (4 if bm <= 64 else 8), num_stages=num_stages or 3)
        extra.update({k: v for k, v in (("maxnreg", maxnreg), ("num_ctas", num_ctas)) if v})
    qs_s = (qs.stride(0), qs.stride(1)) if qs.dim() == 2 else (qs.stride(0), 0)
    # the launch: descriptors and scale pointers, their strides, sizes; then the constexprs
    # fmt: off
    kern.attn_kernel[(triton_cdiv(m, rows), h, split)](
        q_desc, qs, k_desc, ks, v_desc, vs, n_valid, o, lse,
        *qs_s, *_scale_strides(ks), *_scale_strides(vs), *o_strides, *lse.stride(), m, per, qk_scale,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, QUANT=quant, SCALES=scales, V_TRANS=v_transposed,
        PV_BF16=bool(pv_bf16 and quant), DUAL=bool(dual), WS=bool(ws), DOT_F32=interp,
        PREC="ieee" if k.dtype == torch.float32 else "tf32", **extra,
    )
    # fmt: on
    if split > 1:
        _combine(o, lse, out)
    return out


def _combine(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """One launch merging the key splits' partials o [S, H, M, D] / lse [S, H, M] into out [M, H, D]."""
    split, h, m, d = o.shape
    cb = 32 if interpreting() else 64
    # fmt: off
    _kernels().combine_kernel[(triton_cdiv(m, cb), h)](
        o, lse, out, *o.stride(), *lse.stride(), out.stride(0), out.stride(1), out.stride(2), m, split,
        HEAD_D=d, BLOCK_M=cb,
    )
    # fmt: on


# ---- the short-query kernel ---------------------------------------------------------------------------------
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def short_splits(units: int, tiles: int, programs: int, max_split: int = 16) -> int:
    """Key splits for ``units`` (row block, head) pairs of ``tiles`` key tiles each on ``programs`` persistent
    programs: the split whose makespan, counted in key-tile steps of the busiest program (items per program x
    (tiles per item + 2 for an item's prologue and epilogue) + 4 for the combine launch when split), is least;
    ties go to fewer splits."""
    best, best_cost = 1, None
    for s in range(1, max_split + 1):
        per = triton_cdiv(tiles, s)
        if s > 1 and (s - 1) * per >= tiles:  # the last split would be empty
            break
        cost = triton_cdiv(units * s, programs) * (per + 2) + (4 if s > 1 else 0)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def _short_options(scales: int, v_unit: bool, unit_chunk: int, l_mma: bool, lazy: float) -> dict:
    """The short kernel's scale-dependent constexprs from :func:`short_attention`'s options (checked)."""
    if unit_chunk < 16 or unit_chunk & (unit_chunk - 1):
        raise ValueError(f"unit_chunk must be a power of two >= 16, got {unit_chunk}")
    if not 0.0 <= lazy < 8.0:
        raise ValueError(f"lazy (the rescale threshold, log2 units) must be in [0, 8), got {lazy}")
    v_unit = bool(v_unit and scales == 1)
    return dict(
        V_UNIT=v_unit,
        UNIT_CHUNK=unit_chunk,
        L_MMA=bool(l_mma and scales == 2),
        TAU=float(lazy) if scales == 2 or v_unit else 0.0,
    )


def short_attention(
    q: torch.Tensor,
    qs: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    vt: torch.Tensor,
    vs: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    v_transposed: bool = True,
    split: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int = 2,
    v_unit: bool = True,
    ws: bool = False,
    unit_chunk: int = 1024,
    l_mma: bool = False,
    lazy: float = 0.0,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The short-query form of :func:`ring_attention` (same buffers, same result): for few query rows (748 at
    the W57 / W14 serving shapes) over many keys, where one program per query tile leaves the GPU underfilled
    (12 tiles of 64 rows x 16 heads = 192 programs on 132 SMs). The work is cut into items (row block, head,
    key split), ``split`` chosen by :func:`short_splits` unless given, run by a persistent grid of
    ``programs_per_sm`` programs per SM (``short_attn_kernel``: the items of one head's key range run together,
    sharing its K/V tiles through L2), the splits merged by one combine launch. ``v_unit`` (per-token scales):
    one accumulator unit per item instead of a per-tile maximum and rescale, found ``unit_chunk`` scales at a
    time (a power of two); ``ws``: Triton's warp specialisation of the key loop; ``l_mma`` (FP8 with per-head
    scales; ignored otherwise): the softmax's row sums by the tensor cores, P (FP8) times a column of ones,
    instead of a sum over P's elements; ``lazy`` (FP8, per-head scales or ``v_unit``; 0 = off): the running
    maximum moved only when some row's tile maximum passes it by more than ``lazy`` (log2 units), so most tiles
    skip rescaling the accumulator, P's FP8 factor that much lower (``_lazy_tile``). P stays FP8 for the P.V
    product. Returns [M, H, D] in out_dtype (or ``out``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kern = _kernels()
    h, m, d = q.shape
    n = k.shape[1]
    quant = k.dtype == FP8
    if quant and not v_transposed:
        raise ValueError("FP8 values must be stored transposed ([H, D, N]) for the Triton kernel")
    scales = 0 if not quant else (2 if ks.dim() == 1 else 1)
    interp = interpreting()
    bm = block_m or (32 if interp else 64)
    bn = block_n or (32 if interp else 128)
    units = triton_cdiv(m, bm) * h
    programs = 3 if interp else _sm_count(q.device) * max(1, programs_per_sm)
    split = split or short_splits(units, triton_cdiv(n, bn), programs)
    per, split = split_rows(n, split, bn)
    n_items = units * split
    if out is None:
        out = torch.empty((m, h, d), device=q.device, dtype=out_dtype)
    if split == 1:
        o, o_strides = out, (0, out.stride(1), out.stride(0), out.stride(2))
    else:
        o = torch.empty((split, h, m, d), device=q.device, dtype=torch.float32)
        o_strides = o.stride()
    lse = torch.empty((split, h, m), device=q.device, dtype=torch.float32)
    q_desc = TensorDescriptor.from_tensor(q, [1, bm, d])
    k_desc = TensorDescriptor.from_tensor(k, [1, bn, d])
    v_desc = TensorDescriptor.from_tensor(vt, [1, d, bn] if v_transposed else [1, bn, d])
    extra = {} if interp else dict(num_warps=num_warps or (4 if bm <= 64 else 8), num_stages=num_stages or 3)
    qs_s = (qs.stride(0), qs.stride(1)) if qs.dim() == 2 else (qs.stride(0), 0)
    qk_scale = (1.0 / math.sqrt(d)) * 1.4426950408889634
    # fmt: off
    kern.short_attn_kernel[(min(n_items, programs),)](
        q_desc, qs, k_desc, ks, v_desc, vs, n_valid, o, lse,
        *qs_s, *_scale_strides(ks), *_scale_strides(vs), *o_strides, *lse.stride(), m, h, per, n_items, qk_scale,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, QUANT=quant, SCALES=scales, V_TRANS=v_transposed,
        WS=bool(ws), DOT_F32=interp, PREC="ieee" if k.dtype == torch.float32 else "tf32",
        **_short_options(scales, v_unit, unit_chunk, l_mma, lazy), **extra,
    )
    # fmt: on
    if split > 1:
        _combine(o, lse, out)
    return out
