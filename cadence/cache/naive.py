"""The naive K/V cache: what the production system did at launch, kept as baseline and reference.

Per layer it keeps each chunk's raw (un-rotated) K and V in the model dtype, in a list bounded by
the window. On every attention call it concatenates the window, re-applies RoPE to every cached
key at its position and, when ``fp8`` is on, re-quantises the whole window to FP8 (e4m3, one scale
per token and head) and back. All of that is "cache upkeep", timed under the ``cache`` region; the
ring cache (RoPE and FP8 once, at write time) is measured against it.

Positions are absolute latent-frame indices: the sink at 0..sink_frames-1, chunk i at
sink_frames + i * frames_per_chunk onwards; with ``sink_policy="follow"`` the sink is rotated,
at read time like every key here, ``sink_distance`` frames before the current chunk once the stream
is long enough (the ring cache's policy; see ``cadence/cache/ring.py``). Everything indexed on the device is built with
``arange`` from Python ints: no host syncs.

A frame sink (``frame_sink_chunks = k``, LongLive): the first k generated chunks are kept for the whole
stream at their own positions, beside the window of the last ``window_chunks`` chunks, so chunk c sees
the image sink, chunks 0..k-1 and chunks c-W+1..c (each once); the Self-Forcing family's rolling cache
(``local_attn_size`` = (k + W) x frames per chunk, ``sink_size`` = k x frames per chunk) gives exactly
this visible set.
"""

from __future__ import annotations

from collections import deque

import torch

from cadence.cache.base import CacheShape, SelfAttentionCache
from cadence.model.attention import attention
from cadence.model.rope import Rope3D, apply_rope
from cadence.telemetry.spans import region

FP8_MAX = 448.0


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Quantise to FP8 e4m3 with one scale per (token, head) and dequantise (clamped before the cast:
    torch 2.11 turns overflow into NaN)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


class NaiveCache(SelfAttentionCache):
    """Raw K/V per chunk; window concatenated, re-rotated (and optionally re-quantised) every call."""

    def __init__(
        self,
        num_layers: int,
        window_chunks: int,
        grid: tuple[int, int],
        rope: Rope3D,
        device: torch.device | str,
        fp8: bool = False,
        sink_policy: str = "absolute",
        sink_distance: int = 0,
        frame_sink_chunks: int = 0,
    ):
        self.frame_sink_chunks = frame_sink_chunks
        self.sink_policy = sink_policy
        self.sink_distance = sink_distance
        self.num_layers = num_layers
        self.window_chunks = window_chunks
        self.grid = grid
        self.rope = rope
        self.device = torch.device(device)
        self.fp8 = fp8
        self.reset()

    @classmethod
    def from_config(cls, cfg, model) -> NaiveCache:
        """The naive cache of a whole configuration (window, frame sink, FP8, sink policy)."""
        s = cfg.stream
        return cls(
            cfg.model.num_layers,
            s.window_chunks,
            cfg.token_grid,
            model.rope,
            model.device,
            fp8=s.kv_fp8,
            sink_policy=s.sink_policy,
            sink_distance=cfg.sink_distance,
            frame_sink_chunks=s.frame_sink_chunks,
        )

    def reset(self) -> None:
        self.sink: list[tuple[torch.Tensor, torch.Tensor, int, int] | None] = [None] * self.num_layers
        self.frame_sink: list[list] = [[] for _ in range(self.num_layers)]
        self.past: list[deque] = [
            deque(maxlen=max(self.window_chunks - 1, 0)) for _ in range(self.num_layers)
        ]
        self.cur: tuple[int, int, bool] | None = None
        self._chunk = -1  # index of the current generated chunk (host bookkeeping)
        self._last_start: int | None = None

    def begin_chunk(self, frame_start: int, num_frames: int, sink: bool = False) -> None:
        if not sink and frame_start != self._last_start:
            self._last_start = frame_start
            self._chunk += 1
        self.cur = (frame_start, num_frames, sink)
        frames = torch.arange(frame_start, frame_start + num_frames, device=self.device)
        self.cur_cos, self.cur_sin = self.rope.cos_sin(frames, *self.grid)

    def _visible(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
        start, _, is_sink = self.cur
        if is_sink:
            return []
        out = []
        if self.sink[layer] is not None:
            k, v, s0, n = self.sink[layer]
            if self.sink_policy == "follow":  # re-rotated at read time like every other key
                s0 = s0 + max(0, start - self.sink_distance - s0)
            out.append((k, v, s0, n))
        out.extend(self.frame_sink[layer])
        if self.window_chunks > 1:
            out.extend(self.past[layer])
        return out

    def attend(self, layer: int, q, k, v, commit: bool) -> torch.Tensor:
        start, nf, is_sink = self.cur
        with region("cache"):
            qr = apply_rope(q, self.cur_cos, self.cur_sin)
            entries = self._visible(layer) + [(k, v, start, nf)]
            k_all = torch.cat([e[0] for e in entries], dim=1)
            v_all = torch.cat([e[1] for e in entries], dim=1)
            frames = torch.cat([torch.arange(s, s + n, device=self.device) for _, _, s, n in entries])
            cos, sin = self.rope.cos_sin(frames, *self.grid)
            k_all = apply_rope(k_all, cos, sin)
            if self.fp8:
                k_all, v_all = fake_fp8(k_all), fake_fp8(v_all)
        out = attention(qr, k_all, v_all)
        if commit:
            with region("cache"):
                # v is a view into the fused qkv output: keep a compact copy, not the whole buffer
                k, v = k.contiguous(), v.contiguous()
            if is_sink:
                self.sink[layer] = (k, v, start, nf)
            elif self._chunk < self.frame_sink_chunks:  # kept for the whole stream (a re-commit replaces)
                del self.frame_sink[layer][self._chunk :]
                self.frame_sink[layer].append((k, v, start, nf))
            elif self.window_chunks > 1:
                self.past[layer].append((k, v, start, nf))
        return out

    def kept_kv(self, layer: int, frame_sink: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image sink (at the position the last chunk saw it) and, with `frame_sink`, the frame-sink
        chunks, rotated (and FP8 round-tripped with ``fp8``) as ``attend`` reads them."""
        entries = []
        if self.sink[layer] is not None:
            k, v, s0, n = self.sink[layer]
            if self.sink_policy == "follow" and self.cur is not None:
                s0 = s0 + max(0, self.cur[0] - self.sink_distance - s0)
            entries.append((k, v, s0, n))
        if frame_sink:
            entries.extend(self.frame_sink[layer])
        if not entries:
            return None
        k_all = torch.cat([e[0] for e in entries], dim=1)
        v_all = torch.cat([e[1] for e in entries], dim=1)
        frames = torch.cat([torch.arange(s, s + n, device=self.device) for _, _, s, n in entries])
        k_all = apply_rope(k_all, *self.rope.cos_sin(frames, *self.grid))
        if self.fp8:
            k_all, v_all = fake_fp8(k_all), fake_fp8(v_all)
        return k_all, v_all

    def rewrite(self, layer: int, sink: list[tuple], window: list[tuple]) -> None:
        """Recomputed chunks replace the frame sink (when given) and the window (the last
        ``window_chunks - 1`` of `window` are kept, as committing them in order would)."""
        tpf = self.grid[0] * self.grid[1]

        def entry(e):
            _, start, k, v = e
            return (k.contiguous(), v.contiguous(), start, k.shape[1] // tpf)

        if sink:
            self.frame_sink[layer] = [entry(e) for e in sink]
        self.past[layer].clear()
        if self.window_chunks > 1:
            self.past[layer].extend(entry(e) for e in window)

    def step_shape(self) -> CacheShape:
        """Never steady: the visible K/V are re-concatenated every call (nothing to capture)."""
        return CacheShape("naive", False, 0)

    def memory_bytes(self) -> int:
        n = 0
        for layer in range(self.num_layers):
            for e in (
                ([self.sink[layer]] if self.sink[layer] is not None else [])
                + self.frame_sink[layer]
                + list(self.past[layer])
            ):
                n += e[0].numel() * e[0].element_size() + e[1].numel() * e[1].element_size()
        return n
