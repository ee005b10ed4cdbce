"""The prompt-switch K/V re-cache (LongLive's ``_recache_after_switch``).

When the prompt changes mid-stream, the cached K/V of the recent chunks were computed under the old prompt
(through cross-attention, every layer's keys and values depend on it). LongLive recomputes them under the
new prompt before the next block: the clean latents of the last ``local_attn_size`` frames (at most what
was generated) are run once more, all in *one* pass at the commit timestep (``context_noise``), at their own
frame positions, and their K/V replace the cached ones. In that pass every recomputed frame attends to
every other recomputed frame (the cached inference path applies no mask, so the pass is bidirectional
across the re-cached chunks) plus whatever of the old cache is kept.

What LongLive 1.0 keeps (``pipeline/interactive_causal_inference.py``, ``wan/modules/causal_model.py``),
with k frame-sink chunks and a window of W chunks (``local_attn_size`` = (k + W) chunks), c chunks made:

* c <= k + W (the window not full yet): all c chunks are recomputed, the frame sink among them;
* c > k + W, ``global_sink`` true (what LongLive's configs ship, ``keep_sink=True`` here): the frame sink's
  K/V are kept (old prompt) and seen by the pass; chunks c-W..c-1 are recomputed. LongLive's pass also
  carries chunks c-W-k..c-W-1 as queries, but their keys are never written nor read (the sink rows are
  protected), so nothing depends on them: they are not run here;
* c > k + W, ``global_sink`` false (``keep_sink=False``): nothing is kept; chunks c-W-k..c-1 are
  recomputed and the first k of them become the frame sink from then on (at their own positions).

Cadence keeps only W - 1 past chunks (the next chunk takes the W-th place), so of the recomputed window
chunks the cache keeps the last W - 1: the oldest one only serves as context inside the pass. The image sink
(Cadence's reference-image chunk; LongLive has none) is kept as stored and seen by the pass.

Parity against LongLive's own pipeline: ``tests/test_families_longlive.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.cache.naive import fake_fp8
from cadence.model.attention import attention
from cadence.model.rope import apply_rope


@dataclass(frozen=True)
class PastChunk:
    """A generated chunk as the re-cache needs it: stream index, first latent frame, clean latent [C, F, h, w]."""

    index: int
    frame_start: int
    latent: torch.Tensor


class RecachePass:
    """The cache seam for the one pass over several chunks: rotate at their positions, attend over the
    kept K/V plus all of them (no mask), and hold their raw K/V per layer for :meth:`store`."""

    def __init__(self, cache, frame_start: int, num_frames: int, keep_frame_sink: bool):
        self.cache, self.keep = cache, keep_frame_sink
        frames = torch.arange(frame_start, frame_start + num_frames, device=cache.device)
        self.cos, self.sin = cache.rope.cos_sin(frames, *cache.grid)
        self.fp8 = bool(getattr(cache, "fp8", False)) or getattr(cache, "storage", "") == "fp8"
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer: int, q, k, v, commit: bool) -> torch.Tensor:
        qr, kr, vv = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin), v
        if self.fp8:  # what the cache's own reads would see of these keys / values
            kr, vv = fake_fp8(kr), fake_fp8(vv)
        kept = self.cache.kept_kv(layer, self.keep)
        if kept is not None:
            kr, vv = torch.cat([kept[0], kr], dim=1), torch.cat([kept[1], vv], dim=1)
        if commit:
            self.kv[layer] = (k.contiguous(), v.contiguous())
        return attention(qr, kr, vv)


def recache(
    model,
    cache,
    chunks: list[PastChunk],
    text,
    t: torch.Tensor,
    frame_sink_chunks: int,
    window_chunks: int,
    keep_sink: bool,
) -> list[int]:
    """Recompute the K/V of the recent `chunks` (consecutive, oldest first, the last being the last chunk
    generated; at most ``frame_sink_chunks + window_chunks`` of them) under `text` (the new prompt's
    ``TextContext``) at model timestep `t` (1 element), and store them in `cache`, per the rules in the module
    docstring. Returns the indices of the chunks that were run."""
    if not chunks:
        return []
    k, w = frame_sink_chunks, window_chunks
    if len(chunks) > k + w:
        chunks = chunks[-(k + w) :]
    for a, b in zip(chunks, chunks[1:]):
        if b.index != a.index + 1 or b.frame_start != a.frame_start + a.latent.shape[1]:
            raise ValueError(f"re-cache chunks must be consecutive: chunk {a.index} then {b.index}")
    if chunks[0].index == 0:  # the window is not full: everything, the frame sink included, is recomputed
        n_sink, keep = min(k, len(chunks)), False
    elif keep_sink:  # LongLive's global_sink: the frame sink stays; its shadow chunks are dead
        chunks, n_sink, keep = chunks[-w:], 0, True
    else:
        n_sink, keep = k, False
    x = torch.cat([c.latent for c in chunks], dim=1)
    view = RecachePass(cache, chunks[0].frame_start, x.shape[1], keep)
    with torch.no_grad():
        model.forward_chunk(x, t.reshape(1), text, None, view, commit=True)
    tokens = [c.latent.shape[1] * cache.grid[0] * cache.grid[1] for c in chunks]
    for layer, (kk, vv) in sorted(view.kv.items()):
        parts = list(zip(kk.split(tokens, dim=1), vv.split(tokens, dim=1)))
        entries = [(c.index, c.frame_start, pk, pv) for c, (pk, pv) in zip(chunks, parts)]
        cache.rewrite(layer, entries[:n_sink], entries[n_sink:])
    return [c.index for c in chunks]
