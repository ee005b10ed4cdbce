"""Quantised fast paths applied from outside to a built model (``apply_fp8``)."""

from cadence.quant.fp8 import (
    FP8Linear,
    QuantizedActivation,
    apply_fp8,
    fp8_report,
    quantize_activations,
    quantize_rows,
    set_gemm_backend,
    set_quant_backend,
)

__all__ = [
    "FP8Linear",
    "QuantizedActivation",
    "apply_fp8",
    "fp8_report",
    "quantize_activations",
    "quantize_rows",
    "set_gemm_backend",
    "set_quant_backend",
]
