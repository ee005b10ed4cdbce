"""Cadence: real-time, batch-size-one, chunk-causal video diffusion for live talking characters."""

__version__ = "0.1.0"
