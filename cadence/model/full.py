"""A "cache" that is no cache: one forward over a whole sequence with an optional mask.

It lives in ``model/`` (not ``cache/``) because the model's own reference forward (``WanDiT.forward_full``)
uses it and the model package imports nothing above itself.

Used for the bidirectional single-chunk forward (parity with diffusers) and for the reference
forward with an explicit block-causal mask that chunked generation must reproduce.
"""

from __future__ import annotations

import torch

from cadence.model.attention import attention
from cadence.model.rope import apply_rope


class FullSequence:
    """Implements ``attend`` for a whole sequence: rotate q and k at the given angles, apply `mask`.

    ``rope``: the rotation, ``(x, cos, sin) -> x rotated`` (default :func:`cadence.model.rope.apply_rope`, the
    float32 complex reference); the model passes its ``ops.apply_rope`` (the ``ElementwiseOps`` seam: a compiled
    one-pass rotation when ``cadence.runtime.compile`` has swapped it in). cos / sin stay float32 either way."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None, rope=None):
        self.cos, self.sin, self.mask, self.rope = cos, sin, mask, rope

    def attend(self, layer: int, q, k, v, commit: bool) -> torch.Tensor:
        rot = self.rope if self.rope is not None else apply_rope  # (looked up here: a profiler may wrap it)
        return attention(rot(q, self.cos, self.sin), rot(k, self.cos, self.sin), v, self.mask)


def block_causal_mask(frame_chunk: torch.Tensor, tokens_per_frame: int, window_chunks: int) -> torch.Tensor:
    """Boolean [N, N] mask (True = may attend) for a sequence of latent frames labelled by chunk.

    `frame_chunk[f]` is the chunk index of latent frame f, with -1 for sink frames. A query in chunk
    c sees the sink and chunks c' with 0 <= c - c' < window_chunks (its own chunk whole); sink
    queries see only the sink.
    """
    c = frame_chunk.repeat_interleave(tokens_per_frame)
    q, k = c[:, None], c[None, :]
    sink_k = k < 0
    sink_q = q < 0
    within = (q - k >= 0) & (q - k < window_chunks) & ~sink_k
    return torch.where(sink_q, sink_k, sink_k | within)
