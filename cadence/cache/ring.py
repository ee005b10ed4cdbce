"""The ring K/V cache: RoPE and FP8 applied once, at write time, into preallocated slots.

Storage, per layer (one allocation per tensor for all layers, made once)::

    K       [L, H, N, D]     keys, already rotated at their positions
    V       [L, H, N, D]     values (bf16 storage; FP8 read by FlashAttention-3, which has no V^T)
    VT      [L, H, D, N]     values transposed (FP8 read by the Triton kernel: the token axis is the
                             contraction axis of P @ V, and Hopper's FP8 MMA wants it contiguous)
    scales  [L, H, N]        float32, FP8 storage: one per (token, head), value = stored * scale
            [L, H]           or one per (layer, head) for the backends that take no per-token scale
                             (FA3's descales; 'triton_head'), set from the stream's first write
    rows    [0, S)           the sink (reference image); then k frame-sink slots (LongLive's frame
                             sink: the stream's first k chunks, written once, kept); then ring slot s
                             at S + (k+s)*T ... S + (k+s+1)*T; N = S + (k+W)*T rounded up to 128
                             (16-byte aligned TMA rows); pad never read

* ``dtype="bf16"`` stores in the model dtype and attends with torch SDPA (cuDNN on the GPU) over a
  prefix *view* of the buffer; ``dtype="fp8"`` stores e4m3 with per-(token, head) scales (amax/448,
  clamped to +-448 before the cast: torch 2.11 turns overflow into NaN) and attends with the Triton
  FP8 flash-attention kernel (`cadence.kernels.ring_attention`), or its PyTorch reference on CPU.
  **Which kernel reads the ring** is ``attention`` (``FastPath.attention``), resolved once at
  construction (``cadence.kernels.attention_backends.plan``: the measured per-shape table for 'auto', one
  log line for any fallback); the layout above follows it (V^T or V, per-token or per-head scales).
  Per-head scales are HEAD_HEADROOM x the amax of the stream's first write (the image sink's pass; with
  no sink, each layer's first committed chunk, decided on the device so a captured graph replays it
  right) over 448: fixed while the stream lives, so every token in the buffer shares them.
  Per-(token, head) rather than per-(chunk, head): measured in ``tests/test_ring.py`` on RMS-normed
  keys with non-uniform channel gains and values with 1% x30 outlier tokens, the attention error is
  3.9% (keys) / 4.6% (K and V) per token against 9.8% / 10.3% per chunk, for 4 bytes per 128-byte
  head vector.
* **Write before attend.** Every pass writes the current chunk's rotated (and quantised) K/V into
  its slot ``chunk_index mod W`` with one fused kernel per tensor (RoPE, amax, scale, clamp, cast,
  store; Triton on CUDA), then attends over the buffer as it lies: attention is order-free over keys
  once positions are baked in, so nothing is unrolled, copied or concatenated. The slot's previous
  content is the chunk W steps back, outside the window, so overwriting it on every pass is safe;
  the last pass of a chunk (the committing one) leaves its K/V there. Slots fill in order, so the
  visible keys are always a prefix [0, n): a length, not a mask, and only while the ring fills. On
  the FP8 Triton path that length is read on the device, so a filling step launches exactly what a
  steady step launches (``length_on_device``: one CUDA graph for both).
* **The q/k norms in the write** (``folds_qk_norm``: the Triton write, ``CADENCE_QK_NORM_IN_WRITE`` not 0):
  the self-attention hands over q and k before their RMS norms, with the norms' sums of squares and weights
  (``cadence.cache.qk_fold``, installed on the model by :meth:`RingCache.from_config`), and the write applies
  them on its way in: no separate apply kernels, no normed copy of q and k in memory.
* **No host syncs.** The write slot, its first row and the valid length are device tensors advanced
  on the device in ``begin_chunk``; RoPE tables of the current chunk live in static buffers updated
  in place. Python ints are host bookkeeping only (the bf16 path slices its prefix view with one).

Frame sink (``frame_sink_chunks`` = k, 0 by default): chunks 0..k-1 of a stream write their own slots
after the image sink instead of the ring, and chunk c >= k writes ring slot (c - k) mod W. Slots still
fill in order, so what a chunk sees (the image sink, the frame sink, the last W chunks) is still a
prefix of the buffer: the same single softmax, the same device-side length.

Long streams: the sink policy. Absolute frame positions grow without bound (6 latent frames per
second), while the sink was written at frames 0..sink_frames-1, so with absolute positions the sink
drifts ever further from the newest chunk, a geometry the model never saw in training.

* ``"absolute"``: the sink stays at its written frames (what :class:`NaiveCache` does; the parity
  reference).
* ``"follow"`` (default): once the stream is long enough the sink sits ``sink_distance`` frames
  before the current chunk (default ``sink_frames + (W-1) * frames_per_chunk``: right before the
  oldest chunk of the window, exactly the naive geometry at chunk W-1, so the first W chunks are
  identical to naive). At each new chunk the sink's keys are rotated afresh from their raw
  (un-rotated) copy, kept in the model dtype, at the new positions: one small write per layer per
  chunk (the sink is 1/(W+1) of the cache), never a rotation of an already rotated key, so no
  rounding accumulates over hours, and attention stays one softmax over one buffer. Ring keys keep
  absolute positions; float32 angles from integer positions resolve ulp(position): 6e-5 rad at
  frame 1,000, below bf16 rounding.
"""

from __future__ import annotations

import logging

import torch

from cadence.cache.base import CacheShape, SelfAttentionCache
from cadence.kernels import attention_backends as ab
from cadence.kernels import attention_registry as registry
from cadence.kernels import ring_attention as ra
from cadence.model.rope import Rope3D
from cadence.telemetry.spans import region

log = logging.getLogger(__name__)

FP8_MAX = ra.FP8_MAX
FP8_DTYPE = ra.FP8
SINK_POLICIES = ("absolute", "follow")
STORAGE = ("bf16", "fp8")
ALIGN = 128


def qk_norm_in_write() -> bool:
    """``CADENCE_QK_NORM_IN_WRITE`` (default 1): a ring with the Triton write takes the self-attention's q/k
    norms' apply into that write (``cadence.cache.qk_fold``); 0: the separate norms (the reference)."""
    import os

    return os.environ.get("CADENCE_QK_NORM_IN_WRITE", "1") != "0"


def quantize_fp8(x: torch.Tensor, per: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H, D] -> (e4m3 values [N, H, D], float32 scales [N, H]) with x ~= values * scale.

    ``per="token"``: one scale per (token, head) vector (what the cache stores). ``per="chunk"``: one
    scale per head over all N tokens (kept for the granularity measurement). Clamped to +-448
    before the cast: torch 2.11 gives NaN on overflow.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    if per == "chunk":
        amax = amax.amax(dim=0, keepdim=True).expand_as(amax)
    elif per != "token":
        raise ValueError(f"per must be 'token' or 'chunk', got {per!r}")
    scale = amax.clamp_min(1e-12) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def _check(
    dtype: str,
    sink_policy: str,
    frame_sink_chunks: int,
    window_chunks: int,
    frames_per_chunk: int,
    sink_frames: int,
) -> None:
    """One clear error for a ring that cannot be built."""
    if dtype not in STORAGE:
        raise ValueError(f"dtype must be one of {STORAGE}, got {dtype!r}")
    if sink_policy not in SINK_POLICIES:
        raise ValueError(f"sink_policy must be one of {SINK_POLICIES}, got {sink_policy!r}")
    if frame_sink_chunks < 0:
        raise ValueError(f"frame_sink_chunks must be >= 0, got {frame_sink_chunks}")
    if window_chunks < 1 or frames_per_chunk < 1 or sink_frames < 0:
        raise ValueError(
            f"need window_chunks >= 1 ({window_chunks}), frames_per_chunk >= 1 "
            f"({frames_per_chunk}), sink_frames >= 0 ({sink_frames})"
        )


class RingCache(SelfAttentionCache):
    """[sink | ring of W chunk slots] K/V per layer; RoPE (and FP8) once at write; read in place."""

    def __init__(
        self,
        num_layers: int,
        window_chunks: int,
        grid: tuple[int, int],
        rope: Rope3D,
        device: torch.device | str,
        heads: int,
        head_dim: int,
        frames_per_chunk: int,
        sink_frames: int,
        model_dtype: torch.dtype = torch.bfloat16,
        dtype: str = "bf16",
        sink_policy: str = "follow",
        sink_distance: int | None = None,
        use_triton: bool | None = None,
        frame_sink_chunks: int = 0,
        attention: str = "auto",
    ):
        _check(dtype, sink_policy, frame_sink_chunks, window_chunks, frames_per_chunk, sink_frames)
        self.frame_sink_chunks = frame_sink_chunks
        self.num_layers, self.window_chunks, self.grid, self.rope = num_layers, window_chunks, grid, rope
        self.device = torch.device(device)
        self.heads, self.head_dim = heads, head_dim
        self.frames_per_chunk, self.sink_frames = frames_per_chunk, sink_frames
        self.model_dtype, self.storage, self.sink_policy = model_dtype, dtype, sink_policy
        self.sink_distance = (
            sink_frames + (window_chunks - 1) * frames_per_chunk if sink_distance is None else sink_distance
        )
        tpf = grid[0] * grid[1]
        self.tokens_per_chunk = T = tpf * frames_per_chunk
        self.sink_tokens = S = tpf * sink_frames
        self.rows = S + (frame_sink_chunks + window_chunks) * T
        fp8 = dtype == "fp8"
        # FP8: rows padded to 128 (the transposed V's TMA rows must be 16-byte aligned); bf16: exact,
        # so that the steady-state prefix is the whole buffer, contiguous, as cuDNN SDPA wants it
        N = (self.rows + ALIGN - 1) // ALIGN * ALIGN if fp8 else self.rows
        # Triton write kernels when they can run here (CUDA, or the interpreter when forced)
        ok, why = ra.triton_usable(self.device, head_dim, allow_interpreter=bool(use_triton))
        self.use_triton = ok if use_triton is None else (use_triton and ok)
        if not self.use_triton:  # expected on the CPU (INFO); on CUDA a missing fast path is a WARNING
            ra.warn_once(
                f"ring-{self.device.type}-{why}",
                f"ring cache: using the PyTorch reference path ({why or 'requested'})",
                level=logging.WARNING if self.device.type == "cuda" else logging.INFO,
            )
        self.plan = self._plan(attention, use_triton, model_dtype)
        #: take the self-attention's q/k norms into the write (``attend``'s `qk_norm`; ``cadence.cache.qk_fold``):
        #: on the Triton write by default, off with CADENCE_QK_NORM_IN_WRITE=0 (the separate norms, the reference)
        self.folds_qk_norm = self.use_triton and qk_norm_in_write()
        self.layout, self.kernel = self.plan.layout, self.plan.kernel  # what the write stores, what reads it
        self._allocate(N, FP8_DTYPE if fp8 else model_dtype)
        self.reset()

    def _allocate(self, N: int, store: torch.dtype) -> None:
        """The store (``N`` rows per layer and head, in ``store``'s dtype and the plan's layout), allocated once
        and zeroed (unused rows must hold finite values), and the device-side addressing and RoPE buffers."""
        dev, L, H, D = self.device, self.num_layers, self.heads, self.head_dim
        S, T, model_dtype = self.sink_tokens, self.tokens_per_chunk, self.model_dtype
        v_t, head = self.plan.v_transposed, self.plan.scales == "head"
        # ---- the store, allocated once, zeroed (unused rows must hold finite values) ----
        self.k = torch.zeros(L, H, N, D, dtype=store, device=dev)
        self.v = torch.zeros((L, H, D, N) if v_t else (L, H, N, D), dtype=store, device=dev)
        self.k_scale = torch.ones((L, H) if head else (L, H, N), dtype=torch.float32, device=dev)
        self.v_scale = torch.ones((L, H) if head else (L, H, N), dtype=torch.float32, device=dev)
        # per-head scales without an image sink: set by each layer's first committed chunk (device flag)
        self.scales_frozen = torch.zeros(L, dtype=torch.bool, device=dev)
        self.sink_raw = (
            torch.zeros(L, S, H, D, dtype=model_dtype, device=dev)
            if self.sink_policy == "follow" and S
            else None
        )
        # ---- device-side addressing (static buffers, updated in place) ----
        self.slot = torch.zeros(1, dtype=torch.int32, device=dev)
        self.row0 = torch.zeros(1, dtype=torch.int32, device=dev)
        self.zero = torch.zeros(1, dtype=torch.int32, device=dev)
        self.n_valid = torch.zeros(1, dtype=torch.int32, device=dev)
        self._arange_t = torch.arange(T, device=dev, dtype=torch.int32)
        self.write_rows = torch.zeros(T, dtype=torch.int64, device=dev)
        half = D // 2
        m = max(S, T)
        self.cos = torch.zeros(m, half, device=dev)
        self.sin = torch.zeros(m, half, device=dev)
        self.sink_cos = torch.zeros(max(S, 1), half, device=dev)
        self.sink_sin = torch.zeros(max(S, 1), half, device=dev)
        # scratch for the rotated (FP8) queries of the Triton path; FA3 takes one query scale per head
        self.q_rot = torch.zeros(H, m, D, dtype=store, device=dev)
        self.q_scale = torch.ones(H, m, dtype=torch.float32, device=dev)
        self.q_head_scale = torch.ones(H, dtype=torch.float32, device=dev)

    def _plan(self, attention: str, use_triton: bool | None, model_dtype: torch.dtype):
        """The attention backend and the layout it reads (``use_triton=False``: the reference path)."""
        fp8 = self.storage == "fp8"
        if use_triton is False:
            backend = registry.FALLBACK[self.storage][-1]  # the plain PyTorch one: 'reference' or 'sdpa'
            v_t, scales, on_device = ab.layout(backend, self.storage)
            return ab.AttentionPlan(backend, self.storage, v_t, scales, on_device, {}, "use_triton=False")
        p = ab.plan(
            attention,
            self.device,
            heads=self.heads,
            q_tokens=self.tokens_per_chunk,
            kv_tokens=self.rows,
            head_dim=self.head_dim,
            fp8=fp8,
            interpreter=bool(use_triton),
            float_dtype=model_dtype,
        )
        ra.warn_once(
            f"ring-plan-{self.device.type}-{p.backend}-{p.storage}-{self.heads}-{self.tokens_per_chunk}",
            f"ring attention: {p.backend} over {p.storage} K/V ({p.scales} scales; {self.heads} heads x "
            f"{self.tokens_per_chunk} q x {self.rows} kv; {p.why})",
            level=logging.INFO,
        )
        return p

    @classmethod
    def from_config(
        cls,
        cfg,
        model,
        dtype: str = "bf16",
        sink_policy: str = "follow",
        sink_distance: int | None = None,
        use_triton: bool | None = None,
        attention: str | None = None,
    ) -> RingCache:
        """The ring for ``cfg`` and this (rank's) model; ``attention`` defaults to ``cfg.stream.attention``.
        Where the ring takes the q/k norms into its write (``folds_qk_norm``), the model's self-attentions are
        made to hand them over (``cadence.cache.qk_fold.fold_qk_norms``; with other caches they run as before)."""
        m, s = cfg.model, cfg.stream
        heads = model.blocks[0].self_attn.heads  # heads of this rank under tensor parallelism
        ring = cls(
            m.num_layers,
            s.window_chunks,
            cfg.token_grid,
            model.rope,
            model.device,
            heads,
            m.head_dim,
            s.latent_frames_per_chunk // m.patch[0],
            s.sink_frames // m.patch[0],
            model_dtype=model.dtype,
            dtype=dtype,
            sink_policy=sink_policy,
            sink_distance=sink_distance,
            use_triton=use_triton,
            frame_sink_chunks=getattr(s, "frame_sink_chunks", 0),
            attention=attention or getattr(s, "attention", "auto"),
        )
        if ring.folds_qk_norm:
            from cadence.cache.qk_fold import fold_qk_norms

            fold_qk_norms(model)
        return ring

    # ---- bookkeeping ----------------------------------------------------------------------------
    def reset(self) -> None:
        """New session: the next chunk goes to slot 0, nothing is visible."""
        self.slot.fill_(self.window_chunks - 1)  # advanced to 0 by the first chunk
        self.n_valid.zero_()
        self.cur: tuple[int, int, bool] | None = None
        self._last_start: int | None = None
        self._chunks = 0  # chunks begun (host bookkeeping: the prefix length of the bf16 path)
        self._sink_start = 0
        self._sink_pos: int | None = None  # where the sink's stored keys are rotated now
        self._has_sink = False
        self.scales_frozen.zero_()  # per-head scales (no sink): the new stream's first chunk sets them

    @property
    def length_on_device(self) -> bool:
        """True when a chunk step's launches do not depend on how full the ring is: the Triton and FA3
        backends read the visible length from ``n_valid`` (device) inside the attention kernel, and every
        other per-chunk quantity (write rows, RoPE tables, sink rotation) is a device buffer updated in
        ``begin_chunk``, outside the step. Then one captured graph serves the ring-filling chunks as
        well as the steady ones (``cadence.runtime.graphs.step_key``). Torch SDPA (and the reference)
        slice a prefix with a host int (``_n_visible``): each fill stage is its own shape there."""
        return self.plan.length_on_device

    def step_shape(self) -> CacheShape:
        """The current chunk's shape state (after ``begin_chunk``): with the length read on the device
        every chunk step is the steady one; otherwise each fill stage is its own shape."""
        chunk = self.cur is not None and not self.cur[2]
        if chunk and self.length_on_device:  # the fill stage is not part of the step's shape
            return CacheShape(f"ring-{self.storage}", True, self.window_chunks)
        full = self.frame_sink_chunks + self.window_chunks
        return CacheShape(f"ring-{self.storage}", chunk and self._chunks >= full, min(self._chunks, full))

    def _n_visible(self) -> int:
        if self.cur[2]:
            return self.sink_tokens
        k, n = self.frame_sink_chunks, self._chunks
        return self.sink_tokens + (min(n, k) + min(max(n - k, 0), self.window_chunks)) * self.tokens_per_chunk

    def begin_chunk(self, frame_start: int, num_frames: int, sink: bool = False) -> None:
        """Host ints in, device work out (no device->host read). A new chunk advances the write slot
        on the device (calling again for the same chunk does not); the follow policy re-rotates the
        sink's keys when its position moves."""
        tpf = self.grid[0] * self.grid[1]
        want = self.sink_frames if sink else self.frames_per_chunk
        if num_frames != want:
            raise ValueError(
                f"{'sink' if sink else 'chunk'} of {num_frames} latent frames; this ring was "
                f"built for {want} ({num_frames * tpf} tokens vs "
                f"{self.sink_tokens if sink else self.tokens_per_chunk})"
            )
        self.cur = (frame_start, num_frames, sink)
        n = num_frames * tpf
        with region("cache"):
            frames = torch.arange(frame_start, frame_start + num_frames, device=self.device)
            c, s = self.rope.cos_sin(frames, *self.grid)
            self.cos[:n].copy_(c)
            self.sin[:n].copy_(s)
            if sink:
                self._sink_start = self._sink_pos = frame_start
                self.row0.zero_()
                self.n_valid.fill_(self.sink_tokens)
                return
            if frame_start != self._last_start:
                self._last_start = frame_start
                self._chunks += 1
                k = self.frame_sink_chunks
                if self._chunks <= k:  # a frame-sink chunk: its own slot, kept for the stream
                    self.row0.fill_(self.sink_tokens + (self._chunks - 1) * self.tokens_per_chunk)
                else:
                    self.slot.add_(1).remainder_(self.window_chunks)
                    torch.add(
                        self.slot * self.tokens_per_chunk,
                        self.sink_tokens + k * self.tokens_per_chunk,
                        out=self.row0,
                    )
                torch.add(self._arange_t, self.row0, out=self.write_rows)
                self.n_valid.fill_(self._n_visible())
            if self.sink_raw is not None and self._has_sink:
                pos = self._sink_start + max(0, frame_start - self.sink_distance - self._sink_start)
                if pos != self._sink_pos:
                    self._refresh_sink(pos)

    def _refresh_sink(self, pos: int) -> None:
        """Rotate the raw sink keys of every layer at frames pos.. and store them in the sink rows."""
        self._sink_pos = pos
        frames = torch.arange(pos, pos + self.sink_frames, device=self.device)
        c, s = self.rope.cos_sin(frames, *self.grid)
        self.sink_cos.copy_(c)
        self.sink_sin.copy_(s)
        for layer in range(self.num_layers):
            self._store_k(layer, self.sink_raw[layer], self.sink_cos, self.sink_sin, self.zero)

    # ---- writes ---------------------------------------------------------------------------------
    @property
    def _head_scales(self) -> bool:
        return self.plan.scales == "head"

    def _store_k(self, layer: int, k: torch.Tensor, cos, sin, row0, norm=None) -> None:
        """k [n, H, D] un-rotated -> rotated (quantised) into rows row0.. of layer's K (`norm`: k is the
        norm's input, normed first; the reference path only)."""
        if self.use_triton:
            ra.rope_quant_write(k, cos, sin, self.k[layer], self.k_scale[layer], row0)
            return
        hs = self.k_scale[layer] if self._head_scales else None
        vals, scale = ra.rope_quant_reference(k, cos, sin, self.storage == "fp8", self.k.dtype, hs, norm)
        self._index_copy(self.k[layer], 1, row0, vals, k.shape[0])
        if hs is None:
            self._index_copy(self.k_scale[layer], 1, row0, scale, k.shape[0])

    def _store_v(self, layer: int, v: torch.Tensor, row0) -> None:
        fp8, v_t = self.storage == "fp8", self.plan.v_transposed
        if self.use_triton:
            ra.rope_quant_write(v, None, None, self.v[layer], self.v_scale[layer], row0, transpose_out=v_t)
            return
        hs = self.v_scale[layer] if self._head_scales else None
        vals, scale = ra.rope_quant_reference(v, None, None, fp8, self.v.dtype, hs)
        if v_t:
            self._index_copy(self.v[layer], 2, row0, vals.transpose(1, 2), v.shape[0])
        else:
            self._index_copy(self.v[layer], 1, row0, vals, v.shape[0])
        if hs is None:
            self._index_copy(self.v_scale[layer], 1, row0, scale, v.shape[0])

    def _set_head_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor, is_sink: bool) -> None:
        """Per-head K/V scales from this write: always at the image sink; without a sink, only while the
        layer's flag says no chunk has committed yet (a device-side choice, so a graph captured at any
        chunk replays it right)."""
        f = ra.HEAD_HEADROOM / ra.FP8_MAX
        ks = ra.head_amax_bound(k, rotate=True).clamp_min_(1e-12).mul_(f)
        vs = ra.head_amax_bound(v, rotate=False).clamp_min_(1e-12).mul_(f)
        if not is_sink:
            frozen = self.scales_frozen[layer]
            ks = torch.where(frozen, self.k_scale[layer], ks)
            vs = torch.where(frozen, self.v_scale[layer], vs)
        self.k_scale[layer].copy_(ks)
        self.v_scale[layer].copy_(vs)

    def _index_copy(self, dst: torch.Tensor, dim: int, row0: torch.Tensor, src: torch.Tensor, n: int) -> None:
        rows = (
            self.write_rows
            if n == self.tokens_per_chunk and row0 is self.row0
            else (self._arange_n(n) + row0.long())
        )
        if dst.dtype == FP8_DTYPE:  # index_copy_ has no float8 kernel on CPU: move the bytes
            dst.view(torch.uint8).index_copy_(dim, rows, src.view(torch.uint8))
        else:
            dst.index_copy_(dim, rows, src.to(dst.dtype))

    def _arange_n(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    # ---- the step -------------------------------------------------------------------------------
    def attend(self, layer: int, q, k, v, commit: bool, qk_norm=None) -> torch.Tensor:
        """q, k, v [1, M, H, D] before RoPE -> [1, M, H*D]. Writes the chunk's rotated (FP8) K/V into
        its slot (the sink rows for the sink) first, then attends over the visible prefix.

        `qk_norm` (q's and k's :class:`cadence.kernels.ring_attention.RowNorm`): q and k are the q/k norms'
        inputs; the write applies the norms (folded into it where :meth:`_folds` says it can, else the
        norms' own math first)."""
        is_sink = self.cur[2]
        m = q.shape[1]
        with region("cache"):
            if qk_norm is not None and not self._folds(is_sink):
                q, k, qk_norm = qk_norm[0].apply(q), qk_norm[1].apply(k), None
            if is_sink and self.sink_raw is not None and commit:
                self.sink_raw[layer].copy_(k[0])
                self._has_sink = True
            qr, qs = self._write(layer, q[0], k[0], v[0], is_sink, commit, qk_norm)
        with region("attention"):
            return self._attention(layer, qr, qs, m, q.dtype).reshape(1, m, -1)

    def _folds(self, is_sink: bool) -> bool:
        """Whether this pass's write can take the q/k norms in: not the sink's pass (its raw keys are kept
        normed), nor a write that reads the normed q or k for its per-head scales."""
        head_q = self.storage == "fp8" and self.layout.q_scales == "head"
        return not (is_sink or head_q or (self._head_scales and not self.sink_tokens))

    def _write(self, layer: int, q, k, v, is_sink: bool, commit: bool, qk_norm=None):
        """The pass's writes: q rotated (quantised) into the scratch, k and v into the ring rows (one
        fused launch on the Triton path; `qk_norm`: q and k normed in it). Returns the attention's
        (queries, query scales)."""
        m = q.shape[0]
        cos, sin = self.cos[:m], self.sin[:m]
        row0 = self.zero if is_sink else self.row0
        fp8 = self.storage == "fp8"
        head = self._head_scales
        if head and (is_sink or not self.sink_tokens):
            self._set_head_scales(layer, k, v, is_sink)
        head_q = fp8 and self.layout.q_scales == "head"  # one query scale per head (FA3's), this pass's
        if head_q:
            bound = ra.head_amax_bound(q, rotate=True)
            torch.mul(bound.clamp_min_(1e-12), 1.0 / ra.FP8_MAX, out=self.q_head_scale)
        q_scale = self.q_head_scale if head_q else self.q_scale
        if self.use_triton:
            ra.qkv_write(
                q, k, v, cos, sin, self.q_rot, q_scale, self.k[layer], self.k_scale[layer],
                self.v[layer], self.v_scale[layer], self.zero, row0, self.plan.v_transposed, qk_norm,
            )  # fmt: skip
            qr, qs = self.q_rot[:, :m], (self.q_head_scale if head_q else self.q_scale[:, :m])
        else:
            qn, kn = qk_norm if qk_norm is not None else (None, None)
            self._store_k(layer, k, cos, sin, row0, kn)
            self._store_v(layer, v, row0)
            hq = q_scale if head_q else None
            qr, qs = ra.rope_quant_reference(q, cos, sin, fp8, self.q_rot.dtype, hq, qn)
            if head_q:
                qs = self.q_head_scale
        if head and commit and not self.sink_tokens:
            self.scales_frozen[layer].fill_(True)
        return qr, qs

    def _attention(self, layer: int, qr, qs, m: int, dtype: torch.dtype) -> torch.Tensor:
        """[M, H, D] (or [1, M, H, D]) in ``dtype`` from the plan's kernel over the visible keys (a host length
        only for the kernels that do not read it on the device)."""
        lay, k, v = self.layout, self.k[layer], self.v[layer]
        n = None if lay.length_on_device else self._n_visible()
        ks, vs = self.k_scale[layer], self.v_scale[layer]
        return self.kernel.attend(qr, qs, k, ks, v, vs, self.n_valid, n, lay, self.plan.config, dtype)

    # ---- the prompt-switch re-cache (cadence.cache.recache) ---------------------------------------
    def kept_kv(self, layer: int, frame_sink: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows [0, n) as stored: the image sink and, with `frame_sink`, the frame-sink slots written so
        far; keys rotated (FP8 storage dequantised), [1, n, H, D] in the model dtype."""
        n = self.sink_tokens + (
            min(self._chunks, self.frame_sink_chunks) * self.tokens_per_chunk if frame_sink else 0
        )
        if n == 0:
            return None
        vv = self.v[layer, :, :, :n].transpose(1, 2) if self.plan.v_transposed else self.v[layer, :, :n]
        if self.storage == "fp8":
            ks, vs = self.k_scale[layer], self.v_scale[layer]
            k = dequantize_fp8(
                self.k[layer, :, :n], ks[:, None].expand(-1, n) if ks.dim() == 1 else ks[:, :n]
            )
            v = dequantize_fp8(vv, vs[:, None].expand(-1, n) if vs.dim() == 1 else vs[:, :n])
        else:
            k, v = self.k[layer, :, :n], vv
        return (k.transpose(0, 1)[None].to(self.model_dtype), v.transpose(0, 1)[None].to(self.model_dtype))

    def rewrite(self, layer: int, sink: list[tuple], window: list[tuple]) -> None:
        """Recomputed chunks, rotated at their positions (quantised for FP8), into their rows: frame-sink
        entry i into frame-sink slot i, window chunk j into ring slot (j - k) mod W (where committing it
        would have put it); the write slot and chunk count are unchanged."""
        k_fs, T = self.frame_sink_chunks, self.tokens_per_chunk
        rows = [(self.sink_tokens + i * T, e) for i, e in enumerate(sink)]
        rows += [(self.sink_tokens + (k_fs + (e[0] - k_fs) % self.window_chunks) * T, e) for e in window]
        tpf = self.grid[0] * self.grid[1]
        for row, (_, start, k, v) in rows:
            row0 = torch.full((1,), row, dtype=torch.int32, device=self.device)
            frames = torch.arange(start, start + k.shape[1] // tpf, device=self.device)
            cos, sin = self.rope.cos_sin(frames, *self.grid)
            self._store_k(layer, k[0].contiguous(), cos, sin, row0)
            self._store_v(layer, v[0].contiguous(), row0)

    def memory_bytes(self) -> int:
        """Bytes held on the device (allocated up front; constant)."""
        ts = [self.k, self.v, self.q_rot]
        if self.storage == "fp8":
            ts += [self.k_scale, self.v_scale, self.q_scale]
            if self.layout.q_scales == "head":
                ts.append(self.q_head_scale)
        if self.sink_raw is not None:
            ts.append(self.sink_raw)
        return sum(t.numel() * t.element_size() for t in ts)
