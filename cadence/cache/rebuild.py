"""Krea Realtime's per-chunk K/V rebuild (``release_server.GenerationSession.recompute_kv_cache``).

Krea does not keep the K/V a chunk wrote while it was denoised. Before every chunk after the first it
zeroes the whole self-attention cache and refills it with one pass of the model over a short clean
context, then denoises the chunk against exactly that:

* the context (``get_clean_context_frames`` with ``keep_first_frame=True``) is the stream's first latent
  frame followed by the last ``kv_cache_num_frames - 1`` clean latent frames after it (fewer while the
  stream is short): ``n = min(frames made, kv_cache_num_frames)`` frames;
* the pass runs them at timestep 0, at RoPE positions 0..n-1 (whatever their place in the stream), under
  a block-causal mask in blocks of ``num_frame_per_block`` frames counted from the context's first frame
  (``get_block_mask``): frames of block j see blocks 0..j. Here that mask is the cache itself: the context
  is run block by block, each block committed before the next one attends, which gives the same K/V;
* the new chunk is then denoised at positions n..n+F-1, seeing the n context frames and itself.

With ``keep_first_frame=False`` (Krea's default) the first context frame is, once the stream is long
enough, not the stream's first latent but the VAE re-encoding of an older decoded pixel frame; Cadence
does not do that round trip (``StreamConfig.kv_rebuild`` documents the rule reproduced).

Parity against Krea's own server code: ``tests/test_families_krea.py``.
"""

from __future__ import annotations

import torch


def context_frames(first: torch.Tensor, recent: torch.Tensor | None, kv_frames: int) -> torch.Tensor:
    """Krea's clean context [C, n, h, w]: the stream's first latent frame `first` [C, 1, h, w] and the last
    ``kv_frames - 1`` of `recent` (the clean frames after it, oldest first; None when there are none)."""
    if kv_frames == 1 or recent is None or recent.shape[1] == 0:
        return first
    return torch.cat([first, recent[:, -(kv_frames - 1) :]], dim=1)


def rebuild(model, cache, context: torch.Tensor, text, t: torch.Tensor, frames_per_block: int) -> int:
    """Clear `cache` and refill it from `context` [C, n, h, w] (clean latents) at model timestep `t`
    (1 element), at positions 0..n-1, block-causally in blocks of `frames_per_block`; returns n, the position
    of the chunk that follows. The cache must keep ``ceil(n / frames_per_block)`` blocks beside the current
    chunk (``window_chunks``)."""
    cache.reset()
    n = context.shape[1]
    with torch.no_grad():
        for start in range(0, n, frames_per_block):
            x = context[:, start : start + frames_per_block]
            cache.begin_chunk(start, x.shape[1])
            model.forward_chunk(x, t.reshape(1), text, None, cache, commit=True)
    return n
