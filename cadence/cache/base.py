"""The cache seam: what self-attention asks of whatever keeps past chunks' keys and values.

A chunk's pass calls, per layer, ``cache.attend(layer, q, k, v, commit)`` with the current chunk's
queries, keys and values *before* RoPE ([1, tokens, heads, head_dim], q/k already RMS-normed).
The cache rotates them at the chunk's positions, attends over what the chunk may see (the sink,
the previous chunks inside the window, the whole current chunk) and, when ``commit`` is true,
keeps the chunk's K/V for later chunks. How it keeps them (raw or rotated, bf16 or FP8, a list or
a ring) is the cache's business; the model never looks inside.

Before the passes of a chunk the runtime calls ``begin_chunk(frame_start, num_frames, sink)``:
host-side bookkeeping only (Python ints, no device reads), so the step stays free of host syncs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    """What of a cache's state decides the shapes (and addresses) a chunk step launches with: the part
    of a step's key (``cadence.runtime.graphs.StepKey``) that the cache owns.

    ``kind`` names the storage ("ring-bf16", "ring-fp8", "naive", ...); ``filled`` is true when the
    window is full (steady state); ``fill`` is how many chunks a query sees while it fills (each stage
    has its own shapes), ``window`` once full. A cache that reads its fill level on the device reports
    every chunk step as steady (one shape for the whole stream)."""

    kind: str
    filled: bool
    fill: int


class SelfAttentionCache(ABC):
    """Interface between the model's self-attention and a K/V store."""

    @abstractmethod
    def begin_chunk(self, frame_start: int, num_frames: int, sink: bool = False) -> None:
        """Set the current chunk: its first latent frame position, its latent frames, and whether it
        is the sink (the reference image), which sees only itself and is kept for the whole stream."""

    @abstractmethod
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, commit: bool
    ) -> torch.Tensor:
        """Attention output [1, tokens, heads*head_dim] for the current chunk at `layer`; keep K/V if
        `commit`."""

    def reset(self) -> None:
        """Forget everything (new session)."""
        raise NotImplementedError

    # ---- the prompt-switch re-cache (``cadence.cache.recache``); optional ----------------------------
    def kept_kv(self, layer: int, frame_sink: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What a re-cache pass keeps seeing of the stored K/V at `layer`: the image sink and, with
        `frame_sink`, the frame-sink chunks, as stored (keys rotated at their positions), as
        ([1, n, heads, head_dim] keys, values) in the model dtype, or None when nothing is kept."""
        raise NotImplementedError(f"{type(self).__name__} has no prompt-switch re-cache")

    def rewrite(self, layer: int, sink: list[tuple], window: list[tuple]) -> None:
        """Replace stored K/V at `layer` with recomputed ones, each entry ``(chunk_index, frame_start,
        k, v)`` with raw (un-rotated) k, v [1, tokens, heads, head_dim]: `sink` (empty: kept) replaces
        the frame-sink chunks in order, `window` holds the most recent chunks in stream order, the last
        being the last chunk generated. Host bookkeeping (which chunk comes next) is unchanged."""
        raise NotImplementedError(f"{type(self).__name__} has no prompt-switch re-cache")

    def step_shape(self) -> CacheShape:
        """The shape-relevant state of the chunk ``begin_chunk`` placed (see :class:`CacheShape`). The
        default: a cache whose shapes change from step to step in ways it does not describe (never
        captured: its kind is its class name and it is never 'filled')."""
        return CacheShape(type(self).__name__, False, 0)
