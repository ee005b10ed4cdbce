"""FP8 (e4m3) linear layers, applied from outside to a built model.

``apply_fp8(model)`` swaps every :class:`cadence.model.layers.Linear` inside the transformer blocks
(self-attention qkv/out, cross-attention q/kv/out, audio attention q/kv/out, FFN fc1/fc2) for an
:class:`FP8Linear`:

* weights are quantised once, to ``float8_e4m3fn`` with one scale per output channel
  (``amax / 448`` over the row of the [out, in] matrix);
* activations are quantised per token (row) at run time: ``scale = amax / 448`` over the last dim,
  ``x / scale`` clamped to [-448, 448] *before* the cast (torch 2.11 turns overflow into NaN, it
  does not saturate). :func:`quantize_activations` does it: on CUDA in ONE Triton launch
  (:mod:`cadence.kernels.quant`: the row in registers, amax + scale + clamp + cast, the same bytes
  as the reference), elsewhere or when the kernel cannot run with :func:`quantize_rows`, the
  plain-PyTorch reference (several kernels and a float32 temporary), logging the reason once.
  ``CADENCE_FP8_QUANT=torch`` (or :func:`set_quant_backend`) forces the reference; ``=triton``
  also allows the Triton interpreter on CPU (tests);
* an activation quantised beforehand (:class:`QuantizedActivation`, e.g. by the fused
  norm + modulation + quantisation kernel ``cadence.kernels.quant.quantize_rows_modulated``) is
  taken as is, skipping the quantisation (docs/perf/fp8/NOTES.md: how that is hooked in);
* the product is ``torch._scaled_mm(a_fp8, w_fp8.t(), scale_a [M, 1], scale_b [1, N], bias)``:
  fp8 x fp8 with float32 accumulation and the row/column scales applied in the epilogue; or, per shape,
  Cadence's Triton FP8 GEMM with the same contract (:meth:`FP8Linear.matmul`, the backend seam of
  :mod:`cadence.kernels.fp8_gemm`: ``gemm`` "auto" picks per shape from the measured table, "cublas" /
  "triton" force one; a backend that cannot run falls back with one log line).

Where ``_scaled_mm`` cannot run (CUDA with K or N not a multiple of 16, a GPU without FP8 tensor
cores, a torch whose op raises for this device/dtype) the layer falls back to the same quantised
numbers dequantised into a plain float32 matmul, and logs ONE warning per process (warn-once): the
numerics stay those of FP8, only the speed is lost.

Left in high precision on purpose: the patch embedding, the time / text / audio embedders and the
head. They are a negligible share of the FLOPs (they run on few tokens or narrow widths) and sit
where precision matters most: the time embedding drives every block's adaLN modulation, and the
head writes the flow prediction the sampler integrates. Reference path: the model as built by
``build_model`` is unchanged until ``apply_fp8`` is called; tests compare against it.

Order with the other fast paths: load weights, then ``apply_tp`` and ``apply_fp8`` (either order;
``apply_tp`` can shard an already-quantised layer). ``FP8Linear`` has no ``weight`` parameter, so
checkpoints must be loaded into the plain model first.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from cadence.kernels import fp8_gemm as kg
from cadence.kernels import quant as kq
from cadence.model.layers import Linear
from cadence.telemetry.logs import warn_once
from cadence.telemetry.spans import region

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn

#: x [M, K] -> (x_fp8 [M, K] e4m3, scale [M, 1] float32): the plain per-row quantisation, which lives beside
#: its Triton kernel (cadence.kernels.quant) as its reference.
quantize_rows = kq.quantize_rows_reference

# why _scaled_mm failed, decided once and not retried per call: keyed (device type, out dtype) when the op
# is missing for that device/dtype (NotImplementedError), and also by the call's (M, K, N, bias) when
# cuBLAS refuses one shape (RuntimeError, e.g. CUBLAS_STATUS_NOT_SUPPORTED): one odd shape must not
# demote every FP8 layer of the process to the slow path (seen on an H200 at TP=2, 2026-11-30).
_op_unusable: dict[tuple, str] = {}
# why the Triton GEMM could not run, keyed (device type, config text): not retried (cuBLAS instead)
_triton_refused: dict[tuple, str] = {}
_gemm_logged: set[str] = set()


QUANT_BACKENDS = ("auto", "triton", "torch")
_quant_backend = os.environ.get("CADENCE_FP8_QUANT", "auto").strip().lower() or "auto"
_quant_failed: str | None = None  # set when the Triton kernel raised once (compile error, ...): not retried
_quant_logged: set[str] = set()


def set_quant_backend(name: str) -> str:
    """Activation quantisation path for every FP8 layer of this process: "auto" (Triton on CUDA
    where usable, else the reference), "triton" (also the interpreter on CPU under
    TRITON_INTERPRET=1: tests) or "torch" (the reference). Returns the previous setting."""
    global _quant_backend, _quant_failed
    name = (name or "auto").strip().lower()
    if name not in QUANT_BACKENDS:
        raise ValueError(f"FP8 quantisation backend must be one of {QUANT_BACKENDS}, got {name!r}")
    prev, _quant_backend, _quant_failed = _quant_backend, name, None
    return prev


def quant_backend() -> str:
    return _quant_backend


def _log_quant_path(reason: str, cuda: bool) -> None:
    if reason not in _quant_logged:
        _quant_logged.add(reason)
        log.log(
            logging.WARNING if cuda else logging.INFO,
            "FP8 activation quantisation: PyTorch reference path, not the one-launch Triton kernel (%s). "
            "Logged once per process.",
            reason,
        )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]): what :class:`FP8Linear` runs per call.

    The one-launch Triton kernel (:func:`cadence.kernels.quant.quantize_rows_triton`) where it can
    run (CUDA, sm89+, triton importable, last dim contiguous, K <= 32768, bf16/fp16/fp32), else
    :func:`quantize_rows`, with one log line per reason (warning on CUDA, info elsewhere). Both give
    the same bytes (tests/test_fp8_quant.py). A kernel that raises (e.g. a compile error in this
    triton) is not retried: the reference from then on."""
    global _quant_failed
    backend = _quant_backend
    if backend == "torch":
        _log_quant_path("CADENCE_FP8_QUANT=torch / set_quant_backend('torch')", x.device.type == "cuda")
        return quantize_rows(x)
    if _quant_failed is not None:
        why = _quant_failed
    else:
        ok, why = kq.triton_usable(x, allow_interpreter=backend == "triton")
        if ok and x.dim() == 2:
            try:
                return kq.quantize_rows_triton(x)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001  (any failure of the kernel: fall back, once, loudly)
                _quant_failed = why = "Triton quantisation kernel failed: " + (
                    str(e).splitlines()[0] if str(e) else type(e).__name__
                )
        elif ok:
            why = f"wants x [M, K], got {x.dim()} dims"
    _log_quant_path(why, x.device.type == "cuda")
    return quantize_rows(x)


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation already quantised per token, handed to an :class:`FP8Linear` in place of the
    tensor it stands for (the layer then skips its own quantisation).

    q [M, K] e4m3 and scale [M, 1] float32 (``x ~= q * scale`` row-wise); `shape` is the shape of
    the activation [..., K] (the layer's output is [..., N]); `dtype` its dtype (the output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        m = 1
        for d in self.shape[:-1]:
            m *= d
        if (
            self.q.dtype != FP8_DTYPE
            or self.q.dim() != 2
            or tuple(self.q.shape) != (m, self.shape[-1])
            or tuple(self.scale.shape) != (m, 1)
            or self.scale.dtype != torch.float32
        ):
            raise ValueError(
                f"QuantizedActivation wants q [{m}, {self.shape[-1]}] e4m3 and scale [{m}, 1] float32 "
                f"for shape {list(self.shape)}, got {self.q.dtype} {list(self.q.shape)} and "
                f"{self.scale.dtype} {list(self.scale.shape)}"
            )

    @property
    def device(self) -> torch.device:
        return self.q.device


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when its data pointer is not 16-byte aligned. cuBLAS's rowwise-scaled FP8
    GEMM refuses (CUBLAS_STATUS_NOT_SUPPORTED) a scale (or operand) pointer off 16 bytes: a row slice
    of a quantised activation starting at a row that is not a multiple of 4 puts its float32 [M, 1]
    scale there (docs/benchmarks.md's trap). A host-side check; the copy is [M, 1] floats."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def note_scaled_mm_failure(key: tuple, e: BaseException) -> str:
    """Remember why ``torch._scaled_mm`` failed for the call `key` = (device type, out dtype, M, K, N,
    bias) and return the reason: NotImplementedError (the op missing for this device/dtype) for every
    call on that device/dtype; anything else (cuBLAS refusing one shape) for that shape only."""
    why = (
        f"torch._scaled_mm failed on {key[0]} with {key[1]} at M={key[2]} K={key[3]} N={key[4]}: {e}"
    ).splitlines()[0]
    _op_unusable[(key[0], key[1]) if isinstance(e, NotImplementedError) else key] = why
    return why


def fp8_report(model: nn.Module) -> dict:
    """How the FP8 linears of `model` actually ran (host counters of eager and capturing calls):
    ``fp8_linears`` (how many), ``ran_fp8`` (every call ran an FP8 GEMM: torch._scaled_mm or the Triton
    GEMM), ``fell_back`` (at
    least one call took the dequantised fallback; ``mixed``: of those, how many also ran FP8 calls),
    ``unused`` (never called), the call totals, the fallback reasons (reason -> layers) and the
    shapes / device-dtypes refused so far in this process."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    reasons: dict[str, int] = {}
    for lin in layers:
        if lin.fallback_calls and lin.fallback_reason:
            reasons[lin.fallback_reason] = reasons.get(lin.fallback_reason, 0) + 1

    def fast(m):
        return m.scaled_mm_calls + m.triton_calls

    return {
        "fp8_linears": len(layers),
        "ran_fp8": sum(1 for m in layers if fast(m) and not m.fallback_calls),
        "fell_back": sum(1 for m in layers if m.fallback_calls),
        "mixed": sum(1 for m in layers if m.fallback_calls and fast(m)),
        "unused": sum(1 for m in layers if not fast(m) and not m.fallback_calls),
        "scaled_mm_calls": sum(m.scaled_mm_calls for m in layers),
        "triton_calls": sum(m.triton_calls for m in layers),
        "fallback_calls": sum(m.fallback_calls for m in layers),
        "fallback_reasons": reasons,
        "refused": {" ".join(str(k) for k in key): why for key, why in _op_unusable.items()},
        "triton_refused": {" ".join(str(k) for k in key): why for key, why in _triton_refused.items()},
        "gemm_choices": kg.choices(),
    }


def _warn_fallback(reason: str) -> None:
    warn_once(
        log,
        "fallback",
        "FP8 fast path inactive (%s): falling back to a dequantised matmul (FP8 numerics, no FP8 speed)",
        reason,
    )


class FP8Linear(nn.Module):
    """Linear with e4m3 weights (per-output-channel scales) and per-token e4m3 activations.

    Same forward contract as :class:`cadence.model.layers.Linear`: [..., in] -> [..., out] in the
    input's dtype, timed under the "linear" region (activation quantisation included). Also takes a
    :class:`QuantizedActivation` (quantised before the call, e.g. fused into the op that made it)."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        out_f, in_f = weight_fp8.shape
        if weight_fp8.dtype != FP8_DTYPE or tuple(weight_scale.shape) != (1, out_f):
            raise ValueError(
                f"FP8Linear wants an e4m3 [out, in] weight and a [1, out] scale, got "
                f"{weight_fp8.dtype} {list(weight_fp8.shape)} and {list(weight_scale.shape)}"
            )
        self.in_features, self.out_features = in_f, out_f
        self.register_buffer("weight_fp8", weight_fp8.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())  # [1, N], scale_b's layout
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.fallback_reason: str | None = None  # set when this layer took the dequantised path
        # calls that ran torch._scaled_mm / the dequantised fallback (host counters, bumped by eager
        # and capturing calls; a CUDA graph replay runs neither): see fp8_report
        self.scaled_mm_calls = 0
        self.triton_calls = 0  # calls that ran the Triton GEMM (cadence.kernels.fp8_gemm)
        self.fallback_calls = 0
        self.gemm = "auto"  # the GEMM backend (cadence.kernels.fp8_gemm.BACKENDS; set_gemm_backend)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear) -> FP8Linear:
        """Quantise a (bf16 / fp32) linear: one scale per output channel, amax / 448."""
        w_fp8, w_scale = quantize_rows(lin.weight)
        return cls(w_fp8, w_scale.t(), lin.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight these FP8 numbers stand for, float32 [out, in] (reference / fallback)."""
        return self.weight_fp8.float() * self.weight_scale.t()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fp8=e4m3"
        )

    def _why_not_scaled_mm(self, x: torch.Tensor, out_dtype: torch.dtype) -> str | None:
        if x.device.type == "cuda" and (self.in_features % 16 or self.out_features % 16):
            return (
                f"torch._scaled_mm on CUDA needs in/out features divisible by 16, "
                f"got {self.in_features}/{self.out_features}"
            )
        return _op_unusable.get((x.device.type, out_dtype)) or _op_unusable.get(self._shape_key(x, out_dtype))

    def _shape_key(self, x, out_dtype: torch.dtype) -> tuple:
        """(device type, out dtype, M, K, N, bias) of a call; x a tensor or a QuantizedActivation."""
        m = math.prod(x.shape[:-1])
        return (x.device.type, out_dtype, m, self.in_features, self.out_features, self.bias is not None)

    def _scaled_mm(self, xq, xs, bias, out_dtype, out=None):
        kw = {} if out is None else {"out": out}
        return torch._scaled_mm(
            aligned16(xq),
            self.weight_fp8.t(),
            scale_a=aligned16(xs),
            scale_b=self.weight_scale,
            bias=bias,
            out_dtype=out_dtype,
            use_fast_accum=True,
            **kw,
        )

    def _dequant_mm(self, xq, xs, bias, out_dtype):
        y = (xq.float() * xs) @ self.dequantized_weight().t()
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)

    def _triton_mm(self, xq, xs, bias, out_dtype, cfg, out):
        """The Triton GEMM (``cadence.kernels.fp8_gemm``), or None when it cannot run here: the reason is
        remembered per (device type, config) so a config that failed once is not retried, logged once."""
        why = kg.usable(xq, self.weight_fp8, allow_interpreter=self.gemm == "triton")
        key = (xq.device.type, cfg.text() if cfg is not None else "default")
        why = why or _triton_refused.get(key)
        if why is None:
            try:
                y = kg.triton_gemm(xq, self.weight_fp8, xs, self.weight_scale, bias, out_dtype, cfg, out)
                self.triton_calls += 1
                return y
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001  (a compile error, a rejected config: cuBLAS instead)
                why = _triton_refused[key] = f"Triton FP8 GEMM ({key[1]}) failed: " + (
                    str(e).splitlines()[0] if str(e) else type(e).__name__
                )
        if why not in _gemm_logged:
            _gemm_logged.add(why)
            log.log(
                logging.WARNING if xq.device.type == "cuda" else logging.INFO,
                "FP8 GEMM: the Triton backend cannot run (%s): torch._scaled_mm (or its fallback) instead. "
                "Logged once per reason.",
                why,
            )
        return None

    def matmul(self, xq, xs, bias, out_dtype, out=None) -> torch.Tensor:
        """``(xq * xs) @ W^T + bias`` [M, N] in `out_dtype` (into `out` when given) through the backend
        seam: :func:`cadence.kernels.fp8_gemm.choose` picks cuBLAS or Triton for this shape (``self.gemm``:
        "auto" = the measured table); a Triton call that cannot run takes cuBLAS, a shape cuBLAS refuses
        takes Triton where usable, and the dequantised matmul is the last resort (warn-once)."""
        c = kg.choose(xq.shape[0], self.out_features, self.in_features, xq.device, self.gemm)
        if c.backend == "triton":
            y = self._triton_mm(xq, xs, bias, out_dtype, c.config, out)
            if y is not None:
                return y
        why = self._why_not_scaled_mm(xq, out_dtype)
        if why is None:
            try:
                y = self._scaled_mm(xq, xs, bias, out_dtype, **({} if out is None else {"out": out}))
                self.scaled_mm_calls += 1
                return y
            except torch.OutOfMemoryError:
                raise
            except (NotImplementedError, RuntimeError) as e:
                why = note_scaled_mm_failure(self._shape_key(xq, out_dtype), e)
        # cuBLAS refused the shape: the Triton GEMM (where usable) before the dequantised fallback
        if c.backend != "triton":
            y = self._triton_mm(xq, xs, bias, out_dtype, c.config, out)
            if y is not None:
                return y
        self.fallback_reason = why
        self.fallback_calls += 1
        _warn_fallback(why)
        y = self._dequant_mm(xq, xs, bias, out_dtype)
        return y if out is None else out.copy_(y)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        with region("linear"):
            if isinstance(x, QuantizedActivation):
                if x.shape[-1] != self.in_features:
                    raise ValueError(
                        f"FP8Linear({self.in_features} -> {self.out_features}) got a quantised "
                        f"activation of shape {list(x.shape)}"
                    )
                lead, xq, xs, x_dtype = x.shape[:-1], x.q, x.scale, x.dtype
            else:
                lead, x_dtype = x.shape[:-1], x.dtype
                with region("quant"):  # nested: "linear" is then the GEMM alone
                    xq, xs = quantize_activations(x.reshape(-1, x.shape[-1]))
            # Row-wise scaled FP8 GEMMs on CUDA produce bf16 only; elsewhere keep the input dtype.
            out_dtype = torch.bfloat16 if x.device.type == "cuda" else x_dtype
            bias = self.bias.to(out_dtype) if self.bias is not None else None
            y = self.matmul(xq, xs, bias, out_dtype)
            return y.to(x_dtype).reshape(*lead, self.out_features)


def _block_linears(model: nn.Module):
    """(parent module, attribute name, Linear) for every plain Linear inside the transformer blocks."""
    for _, parent in model.blocks.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, Linear):
                yield parent, name, child


def set_gemm_backend(model: nn.Module, gemm: str) -> int:
    """Set the GEMM backend ("auto" | "cublas" | "triton": ``cadence.kernels.fp8_gemm``) of every
    :class:`FP8Linear` in `model` (tensor-parallel shards included); return how many layers."""
    if gemm not in kg.BACKENDS:
        raise ValueError(f"FP8 GEMM backend must be one of {kg.BACKENDS}, got {gemm!r}")
    n = 0
    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.gemm = gemm
            n += 1
    return n


@torch.no_grad()
def apply_fp8(model: nn.Module, *, min_features: int = 0, gemm: str = "auto") -> int:
    """Swap the transformer blocks' linears for :class:`FP8Linear` in place; return how many.

    Linears with fewer than `min_features` input or output features are kept in high precision
    (at small widths FP8 saves nothing and the quantisation/launch overhead dominates). The patch
    embedding, embedders and head are never touched (see the module docstring). `gemm`: the GEMM
    backend of the new layers (:func:`set_gemm_backend`).

    All or nothing: every replacement is built first, then they are swapped in (a swap cannot fail), so
    a conversion that fails part-way raises with the model unchanged, never half-converted."""
    if gemm not in kg.BACKENDS:
        raise ValueError(f"FP8 GEMM backend must be one of {kg.BACKENDS}, got {gemm!r}")
    swaps = [
        (parent, name, FP8Linear.from_linear(lin))
        for parent, name, lin in list(_block_linears(model))
        if min(lin.in_features, lin.out_features) >= min_features
    ]
    for parent, name, fp8 in swaps:
        fp8.gemm = gemm
        setattr(parent, name, fp8)
    return len(swaps)
