"""Quantised fast paths applied from outside to a built model (``apply_fp8``)."""

from cadence.quant.fp8 import FP8Linear, apply_fp8, quantize_rows

__all__ = ["FP8Linear", "apply_fp8", "quantize_rows"]
