"""Prompt embeddings.

Wan conditions on umT5-XXL embeddings (512 x 4096). No text encoder can be downloaded here, so
Cadence ships a deterministic stand-in: UTF-8 bytes -> a fixed seeded embedding table plus a
sinusoidal position code, padded / truncated to ``text_len`` tokens of ``text_dim``. Real encoder
outputs can be passed to the generator as a tensor instead of a string.
"""

from __future__ import annotations

import math

import torch

from cadence.config import ModelConfig


class ByteTextEncoder:
    """Deterministic stand-in text encoder (no weights to download)."""

    def __init__(self, cfg: ModelConfig, seed: int = 1234):
        self.len, self.dim = cfg.text_len, cfg.text_dim
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(257, self.dim, generator=g)  # 256 bytes + padding
        pos = torch.arange(self.len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, self.dim, 2, dtype=torch.float32) * (-math.log(10_000.0) / self.dim))
        pe = torch.zeros(self.len, self.dim)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)[:, : self.dim // 2]
        self.pos = pe

    def __call__(self, prompt: str) -> torch.Tensor:
        """prompt -> [text_len, text_dim] float32 (CPU)."""
        ids = list(prompt.encode("utf-8"))[: self.len]
        ids = ids + [256] * (self.len - len(ids))
        return self.table[torch.tensor(ids)] + self.pos
