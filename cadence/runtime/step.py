"""What one chunk step takes as input, and the key that says which steps can share a CUDA graph.

``StepInputs`` are what changes from one chunk step to the next (drawn by ``Session.prepare_step``,
outside the denoising passes), so that a captured graph of the passes is fed by copying these into its
static buffers. ``StepKey`` is the step's shape signature: equal keys can share one captured graph
(``cadence.runtime.graphs.GraphRunner``). Both are plain data the runner reads; it never sees a session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.cache.base import CacheShape
from cadence.model.dit import TextContext


@dataclass
class StepInputs:
    """The inputs of one chunk step (all device tensors)."""

    noise: torch.Tensor  # [C, F, h, w] float32
    renoise: torch.Tensor | None  # [passes - 1, C, F, h, w] for the 'renoise' rule
    audio: torch.Tensor | None  # audio feature tokens [F, A, audio_dim], None without audio layers
    text: TextContext  # the prompt's cross-attention K/V (same object until the prompt changes)


@dataclass(frozen=True)
class StepKey:
    """The shape signature of one chunk step: equal keys can share one captured graph."""

    device: str
    dtype: str
    latent_shape: tuple[int, ...]
    tokens_per_chunk: int
    text_len: int
    audio_shape: tuple[int, ...] | None
    cache: str  # "ring-bf16" | "ring-fp8" | "naive" | other class name
    window_chunks: int
    filled: bool  # ring window full (steady state)
    fill: int  # chunks visible while the ring fills (each stage has its own shapes); window when full
    commit: str
    passes: int
    sampler: str
    cache_id: int  # a graph reads this cache object's buffers

    def short(self) -> str:
        return (
            f"tokens={self.tokens_per_chunk} text_len={self.text_len} cache={self.cache} "
            f"window={self.window_chunks} filled={self.filled} fill={self.fill} commit={self.commit} "
            f"passes={self.passes}"
        )


def step_key(
    inp: StepInputs,
    shape: CacheShape,
    *,
    dtype: torch.dtype,
    tokens_per_chunk: int,
    window_chunks: int,
    commit: str,
    passes: int,
    sampler: str,
    cache_id: int,
) -> StepKey:
    """The key of a step with inputs ``inp`` on a cache whose state is ``shape`` (``cache.step_shape()``)."""
    text_len = int(inp.text.kv[0][0].shape[1]) if inp.text.kv else 0
    return StepKey(
        device=str(inp.noise.device),
        dtype=str(dtype).replace("torch.", ""),
        latent_shape=tuple(inp.noise.shape),
        tokens_per_chunk=tokens_per_chunk,
        text_len=text_len,
        audio_shape=tuple(inp.audio.shape) if inp.audio is not None else None,
        cache=shape.kind,
        window_chunks=window_chunks,
        filled=shape.filled,
        fill=shape.fill,
        commit=commit,
        passes=passes,
        sampler=sampler,
        cache_id=cache_id,
    )
