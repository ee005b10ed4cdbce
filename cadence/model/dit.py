"""The Wan-architecture diffusion transformer, chunk-causal, batch size one.

Plain PyTorch. Block forwards are the math; modulation fields are named. Self-attention goes
through a cache object (``cadence.cache``): chunked generation uses a real K/V cache, the
reference forward over a whole sequence uses :class:`cadence.model.full.FullSequence`.

Per block (Wan 2.1, adaLN with six modulation vectors, computed in float32)::

    h = LN(x) * (1 + mod.attn.scale) + mod.attn.shift
    x = x + SelfAttn(h) * mod.attn.gate               q/k RMS-normed across heads, 3D RoPE, block-causal
    x = x + CrossAttn(LN_affine(x), text)             text K/V computed once per session
    x = x + AudioAttn(LN_affine(x), audio)            every `audio_every`-th block; per latent frame
    h = LN(x) * (1 + mod.ffn.scale) + mod.ffn.shift
    x = x + FFN(h) * mod.ffn.gate                     GELU (tanh)

What a pass reads that does not change from pass to pass may come prepared (``forward_chunk`` takes either
form): the timestep as a :class:`PassTime` (its embedding and 6-way projection: the same for a pass index in
every chunk, so a runtime computes it once, ``cadence.runtime.chunk``), the audio as an :class:`AudioKV` (every
audio block's K/V of the chunk's audio tokens: the same for all passes of a chunk), like the prompt's
:class:`TextContext` (once per session).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from cadence.config import CadenceConfig, ModelConfig
from cadence.model.attention import attention
from cadence.model.full import FullSequence
from cadence.model.layers import (
    ALL_TOKENS,
    MLP2,
    PLAIN_OPS,
    LayerNorm32,
    Linear,
    RMSNorm,
    timestep_embedding,
)
from cadence.model.multitalk import AudioProjection, ImageProjection, latent_audio_windows
from cadence.model.rope import Rope3D


@dataclass
class ModSet:
    """shift / scale / gate for one residual branch, float32, broadcastable to [B, N, dim]."""

    shift: torch.Tensor
    scale: torch.Tensor
    gate: torch.Tensor


@dataclass
class BlockMod:
    attn: ModSet
    ffn: ModSet


def _split_mod(table: torch.Tensor, temb6: torch.Tensor) -> BlockMod:
    """table [1, 6, dim] + temb6 [B, 6, dim] or [B, N, 6, dim] -> named fields with a token axis."""
    if temb6.ndim == 3:
        m = (table + temb6.float()).unsqueeze(1)  # [B, 1, 6, dim]
    else:
        m = table.unsqueeze(0) + temb6.float()  # [B, N, 6, dim]
    f = m.unbind(2)
    return BlockMod(attn=ModSet(f[0], f[1], f[2]), ffn=ModSet(f[3], f[4], f[5]))


@dataclass
class PassTime:
    """A pass's timestep embedded: ``temb`` [B, dim] (the head's) and its 6-way projection ``temb6`` [B, 6, dim]
    (the blocks'), float32 (:meth:`WanDiT.pass_time`)."""

    temb: torch.Tensor
    temb6: torch.Tensor


@dataclass
class AudioKV:
    """A chunk's audio, ready for every pass: per block the (k, v) of its audio attention over the chunk's audio
    tokens [B * frames, tokens, heads, head_dim], None for a block without audio attention
    (:meth:`WanDiT.prepare_audio`)."""

    kv: list[tuple[torch.Tensor, torch.Tensor] | None]


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        d = cfg.dim
        self.heads = cfg.num_heads
        self.qkv = Linear(d, 3 * d, device=device, dtype=dtype)
        self.norm_q = RMSNorm(d, cfg.eps, device=device, dtype=dtype)
        self.norm_k = RMSNorm(d, cfg.eps, device=device, dtype=dtype)
        self.out = Linear(d, d, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache, layer: int, commit: bool) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = self.norm_q(q).unflatten(-1, (self.heads, -1))
        k = self.norm_k(k).unflatten(-1, (self.heads, -1))
        v = v.unflatten(-1, (self.heads, -1))
        return self.out(cache.attend(layer, q, k, v, commit))


class CrossAttention(nn.Module):
    """Attention from the chunk's tokens to a context (text tokens, or audio tokens per frame).

    ``ctx_dim``: width of the context fed to ``kv`` (default ``dim``); ``qk_norm`` False: no RMS norms on q
    and k (InfiniteTalk's audio attention); ``image``: a second context of image tokens (Wan I2V's CLIP
    tokens) with its own K/V projection (``kv_img``) and k norm, attended by the same queries and summed
    with the first before the output projection."""

    def __init__(
        self,
        cfg: ModelConfig,
        device=None,
        dtype=None,
        ctx_dim: int | None = None,
        qk_norm: bool = True,
        image: bool = False,
    ):
        super().__init__()
        d = cfg.dim
        self.heads = cfg.num_heads
        self.q = Linear(d, d, device=device, dtype=dtype)
        self.kv = Linear(ctx_dim or d, 2 * d, device=device, dtype=dtype)
        self.norm_q = RMSNorm(d, cfg.eps, device=device, dtype=dtype) if qk_norm else None
        self.norm_k = RMSNorm(d, cfg.eps, device=device, dtype=dtype) if qk_norm else None
        self.out = Linear(d, d, device=device, dtype=dtype)
        if image:
            self.kv_img = Linear(d, 2 * d, device=device, dtype=dtype)
            self.norm_k_img = RMSNorm(d, cfg.eps, device=device, dtype=dtype)
        else:
            self.kv_img = self.norm_k_img = None

    def context_kv(self, ctx: torch.Tensor, image: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """ctx [B, L, ctx_dim] -> (k, v) [B, L, heads, head_dim]; for text this runs once per session. With
        image tokens [B, M, dim] (an ``image`` attention): (k, v, k_img, v_img)."""
        k, v = self.kv(ctx).chunk(2, dim=-1)
        if self.norm_k is not None:
            k = self.norm_k(k)
        out = (k.unflatten(-1, (self.heads, -1)), v.unflatten(-1, (self.heads, -1)))
        if image is not None:
            ki, vi = self.kv_img(image).chunk(2, dim=-1)
            out += (self.norm_k_img(ki).unflatten(-1, (self.heads, -1)), vi.unflatten(-1, (self.heads, -1)))
        return out

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, ...], groups: int = 1) -> torch.Tensor:
        """x [B, N, dim]; kv [B*groups, L, heads, head_dim] (k, v, and optionally image k, v). With groups > 1
        the tokens are split into `groups` equal consecutive runs (latent frames) and run g attends only to
        context g."""
        q = self.q(x)
        b, n = q.shape[:2]  # the queries' tokens (x may hold one rank's share of them: sequence parallelism)
        if self.norm_q is not None:
            q = self.norm_q(q)
        q = q.unflatten(-1, (self.heads, -1))
        if groups > 1:
            q = q.reshape(b * groups, n // groups, self.heads, -1)
        o = attention(q, kv[0], kv[1])
        if len(kv) == 4:
            o = o + attention(q, kv[2], kv[3])
        return self.out(o.reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, audio: bool, device=None, dtype=None):
        super().__init__()
        d = cfg.dim
        self.norm1 = LayerNorm32(d, cfg.eps, affine=False, device=device)
        self.self_attn = SelfAttention(cfg, device, dtype)
        self.norm2 = LayerNorm32(d, cfg.eps, affine=True, device=device) if cfg.cross_attn_norm else None
        self.cross_attn = CrossAttention(cfg, device, dtype, image=cfg.image_tokens > 0)
        if audio:
            self.norm_audio = LayerNorm32(d, cfg.eps, affine=True, device=device)
            if cfg.audio_arch == "multitalk":  # biased q / kv from the projected audio tokens, no q/k norms
                self.audio_attn = CrossAttention(
                    cfg, device, dtype, ctx_dim=cfg.audio_context_dim, qk_norm=False
                )
            else:
                self.audio_attn = CrossAttention(cfg, device, dtype)
        else:
            self.norm_audio = self.audio_attn = None
        self.norm3 = LayerNorm32(d, cfg.eps, affine=False, device=device)
        self.ffn = MLP2(d, cfg.ffn_dim, d, "gelu", device, dtype)
        self.modulation = nn.Parameter(torch.empty(1, 6, d, device=device, dtype=torch.float32))
        self.ops = PLAIN_OPS  # the elementwise math; a fused version may be swapped in from outside

    def forward(self, x, temb6, cache, layer: int, commit: bool, text_kv, audio_kv, frames: int):
        """audio_kv: this block's (k, v) of the chunk's audio tokens (``AudioKV.kv[layer]``), or None."""
        mod = _split_mod(self.modulation, temb6)
        ops, eps = self.ops, self.norm1.eps
        h = ops.norm_modulate(x, mod.attn.shift, mod.attn.scale, eps)
        y = self.self_attn(h, cache, layer, commit)
        # each residual add with the norm that reads its result: one op (ElementwiseOps), one compiled kernel
        if self.norm2 is not None:
            x, h = ops.gate_residual_layer_norm(x, y, mod.attn.gate, self.norm2.weight, self.norm2.bias, eps)
        else:
            x = h = ops.gate_residual(x, y, mod.attn.gate)
        y = self.cross_attn(h, text_kv)
        if self.audio_attn is not None and audio_kv is not None:
            na = self.norm_audio
            x, h = ops.add_layer_norm(x, y, na.weight, na.bias, eps)
            y = self.audio_attn(h, audio_kv, groups=frames)
        x, h = ops.add_norm_modulate(x, y, mod.ffn.shift, mod.ffn.scale, eps)
        return ops.gate_residual(x, self.ffn(h), mod.ffn.gate)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        d = cfg.dim
        self.norm = LayerNorm32(d, cfg.eps, affine=False, device=device)
        self.modulation = nn.Parameter(torch.empty(1, 2, d, device=device, dtype=torch.float32))
        self.proj = Linear(d, cfg.out_channels * math.prod(cfg.patch), device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        # temb [B, dim] or [B, N, dim]
        t = temb.float().unsqueeze(-2)  # [B, 1, dim] or [B, N, 1, dim]
        m = self.modulation + t if temb.ndim == 2 else self.modulation.unsqueeze(0) + t
        shift, scale = m.unbind(-2)
        if temb.ndim == 2:
            shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
        return self.proj((self.norm(x) * (1 + scale) + shift).to(x.dtype))


@dataclass
class TextContext:
    """Cross-attention K/V of the prompt for every block, computed once per session."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]


class WanDiT(nn.Module):
    """Chunk-causal Wan DiT. Construct on any device (``meta`` for instant construction)."""

    def __init__(self, cfg: CadenceConfig, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        m = cfg.model
        self.mcfg = m
        d = m.dim
        self.patch_embed = Linear(
            (m.in_channels + m.cond_channels) * math.prod(m.patch), d, device=device, dtype=dtype
        )
        self.time_embed = MLP2(m.freq_dim, d, d, "silu", device, torch.float32)
        self.time_proj = Linear(d, 6 * d, device=device, dtype=torch.float32)
        self.text_embed = MLP2(m.text_dim, d, d, "gelu", device, dtype)
        multitalk = m.audio_arch == "multitalk" and m.audio_every > 0
        self.audio_embed = (
            MLP2(m.audio_dim, d, d, "gelu", device, dtype) if m.audio_every > 0 and not multitalk else None
        )
        self.audio_proj = AudioProjection(m, device, dtype) if multitalk else None  # cadence.model.multitalk
        self.img_emb = ImageProjection(m, device, dtype) if m.image_tokens > 0 else None
        self.audio_pos = (
            nn.Parameter(torch.zeros(m.audio_tokens_per_frame, d, device=device, dtype=dtype))
            if m.audio_every > 0 and m.audio_pos and not multitalk
            else None
        )
        self.blocks = nn.ModuleList([Block(m, m.has_audio(i), device, dtype) for i in range(m.num_layers)])
        self.head = Head(m, device, dtype)
        rope_dev = "cpu" if device is None or torch.device(device).type == "meta" else device
        self.rope = Rope3D(m.rope_split, m.rope_theta, device=rope_dev)
        # which tokens the blocks' per-token work runs on (ALL_TOKENS; sequence parallelism swaps it from outside)
        self.token_layout = ALL_TOKENS
        # the whole-sequence RoPE of forward_full (ElementwiseOps.apply_rope); a fused one may be swapped in
        self.ops = PLAIN_OPS

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    # ---- pieces --------------------------------------------------------------------------
    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] latents -> [B, F'*H'*W', C*pt*ph*pw] patches, tokens ordered (f, h, w)."""
        b, c, f, h, w = x.shape
        pt, ph, pw = self.mcfg.patch
        x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
        x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # b, f', h', w', c, pt, ph, pw (conv3d weight order)
        return x.reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)

    def unpatchify(self, y: torch.Tensor, f: int, h: int, w: int) -> torch.Tensor:
        """[B, N, C*pt*ph*pw] -> [B, C, F, H, W] (grid in latent units f, h, w)."""
        b = y.shape[0]
        pt, ph, pw = self.mcfg.patch
        y = y.reshape(b, f // pt, h // ph, w // pw, pt, ph, pw, -1)
        y = y.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return y.reshape(b, -1, f, h, w)

    def time_embedding(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """t [B] or [B, N] (0..1000) -> temb [.., dim] and its 6-way projection [.., 6, dim] (float32)."""
        temb = self.time_embed(timestep_embedding(t, self.mcfg.freq_dim, fp64=self.mcfg.time_embed_fp64))
        proj = self.time_proj(torch.nn.functional.silu(temb))
        return temb, proj.unflatten(-1, (6, -1))

    def pass_time(self, t: torch.Tensor) -> PassTime:
        """A chunk pass's timestep (a 1-element tensor, 0..1000) embedded, as ``forward_chunk`` uses it."""
        temb, temb6 = self.time_embedding(t.reshape(1))
        return PassTime(temb, temb6)

    def prepare_text(self, text: torch.Tensor, image: torch.Tensor | None = None) -> TextContext:
        """Prompt embedding [B, L, text_dim] (and, for an image-conditioned model, CLIP image tokens
        [B, image_tokens, image_dim]) -> per-block cross-attention K/V (once per session)."""
        ctx = self.text_embed(text.to(self.dtype))
        img = None
        if self.img_emb is not None:
            if image is None:
                raise ValueError("this model reads CLIP image tokens (image_tokens > 0): pass image=")
            img = self.img_emb(image.to(self.dtype))
        return TextContext([blk.cross_attn.context_kv(ctx, img) for blk in self.blocks])

    def embed_audio(self, audio: torch.Tensor | None) -> torch.Tensor | None:
        """Audio features [B, F, A, audio_dim] -> [B*F, A, dim] (one context per latent frame). With the
        'multitalk' branch: per-video-frame windows [B, 1 + 4 (F-1), window, layers, audio_dim] ->
        [B*F, audio_tokens_per_frame, audio_context_dim] (``cadence.model.multitalk``)."""
        if audio is not None and self.audio_proj is not None:
            tokens = self.audio_proj(*latent_audio_windows(audio.to(self.dtype)))
            return tokens.flatten(0, 1)
        if audio is None or self.audio_embed is None:
            return None
        b, f, a, _ = audio.shape
        tokens = self.audio_embed(audio.to(self.dtype))
        if self.audio_pos is not None:  # which video frame of the latent frame each token belongs to
            tokens = tokens + self.audio_pos
        return tokens.reshape(b * f, a, -1)

    def prepare_audio(self, audio: torch.Tensor | None) -> AudioKV | None:
        """Audio features [B, F, A, audio_dim] (``embed_audio``'s input) -> every audio block's K/V of the
        embedded tokens (:class:`AudioKV`), or None without audio (or without audio layers). A chunk's passes
        all read the same audio: computed once, reused by each (``forward_chunk`` takes it)."""
        ctx = self.embed_audio(audio)
        if ctx is None:
            return None
        return AudioKV([None if b.audio_attn is None else b.audio_attn.context_kv(ctx) for b in self.blocks])

    def _blocks(self, x, temb6, cache, commit, text: TextContext, audio: AudioKV | None, frames: int):
        x, temb6 = self.token_layout.scatter(x, temb6)  # all tokens, or this rank's share of them
        akv = audio.kv if audio is not None else [None] * len(self.blocks)
        for i, blk in enumerate(self.blocks):
            x = blk(x, temb6, cache, i, commit, text.kv[i], akv[i], frames)
        return self.token_layout.gather(x)

    # ---- forwards ------------------------------------------------------------------------
    def forward_chunk(
        self,
        x: torch.Tensor,
        t: torch.Tensor | PassTime,
        text: TextContext,
        audio: torch.Tensor | AudioKV | None,
        cache,
        commit: bool,
    ) -> torch.Tensor:
        """One network pass over one chunk through the cache.

        x [C, F, h, w] latents of the chunk; t a 1-element tensor (0..1000) or its :class:`PassTime`
        (``pass_time(t)``); audio [F, A, audio_dim], its :class:`AudioKV` (``prepare_audio(audio[None])``) or
        None. The cache must have been told the chunk's position (``begin_chunk``). Returns the flow
        prediction [C, F, h, w] in x's dtype.
        """
        c, f, h, w = x.shape
        tokens = self.patch_embed(self.patchify(x[None].to(self.dtype)))
        pt = t if isinstance(t, PassTime) else self.pass_time(t)
        if audio is not None and not isinstance(audio, AudioKV):
            audio = self.prepare_audio(audio[None])
        tokens = self._blocks(tokens, pt.temb6, cache, commit, text, audio, f // self.mcfg.patch[0])
        return self.unpatchify(self.head(tokens, pt.temb), f, h, w)[0]

    def forward_full(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor,
        audio: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        frame_offset: int = 0,
        frame_positions: torch.Tensor | None = None,
        image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reference forward over a whole latent sequence (no cache).

        x [B, C, F, H, W]; t [B] or [B, F] (one timestep per latent frame); text [B, L, text_dim];
        audio [B, F, A, audio_dim], its :class:`AudioKV` (``prepare_audio``) or None; mask [N, N] bool (True = attend) or None for
        bidirectional attention. Frame positions are frame_offset + 0..F-1, or `frame_positions` [F // pt]
        (integers; repeats allowed: training lays a noisy copy of a chunk at its clean copy's position).
        ``text`` may also be a prepared :class:`TextContext` (``prepare_text``: the K/V computed once for
        many passes); ``image``: CLIP image tokens for an image-conditioned model. x carries
        ``in_channels + cond_channels`` channels (an I2V model's mask and reference latent concatenated).
        Returns [B, out_channels, F, H, W].
        """
        b, c, f, h, w = x.shape
        pt, ph, pw = self.mcfg.patch
        tokens = self.patch_embed(self.patchify(x.to(self.dtype)))
        n_f = f // pt
        if t.ndim == 2:  # per latent frame -> per token
            t = t[:, ::pt].repeat_interleave((h // ph) * (w // pw), dim=1)
        temb, temb6 = self.time_embedding(t)
        if frame_positions is None:  # consecutive frames: the tables of this geometry, kept (Rope3D)
            cos, sin = self.rope.grid_cos_sin(frame_offset, n_f, h // ph, w // pw)
        else:
            cos, sin = self.rope.cos_sin(frame_positions.to(x.device), h // ph, w // pw)
        seq = FullSequence(cos, sin, mask, rope=self.ops.apply_rope)
        audio_kv = audio if isinstance(audio, AudioKV) else self.prepare_audio(audio)
        ctx = text if isinstance(text, TextContext) else self.prepare_text(text, image)
        tokens = self._blocks(tokens, temb6, seq, False, ctx, audio_kv, n_f)
        return self.unpatchify(self.head(tokens, temb), f, h, w)
