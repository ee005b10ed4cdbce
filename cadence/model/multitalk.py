"""The audio and image conditioning of InfiniteTalk's model (MeiGen-AI/InfiniteTalk; SoulX-FlashTalk runs it).

Wan2.1-I2V-14B with an audio branch (``ModelConfig.audio_arch = 'multitalk'``). What this module adds to
:class:`cadence.model.dit.WanDiT`:

* :func:`latent_audio_windows`: the per-video-frame wav2vec2 windows of a clip ([B, 1 + 4n, 5, layers, C]:
  frame t's features at t-2 .. t+2, ``cadence.model.wav2vec2.frame_windows``) regrouped per latent frame. The
  first latent frame (one video frame) keeps its 5-frame window; each later latent frame (4 video frames)
  takes its first frame's left half and centre (t-2 .. t), the centres of its two middle frames and its last
  frame's centre and right half (t .. t+2): 3 + 1 + 1 + 3 = 8 frames (``audio_window + vae_scale - 1``).
* :class:`AudioProjection` (the checkpoint's ``audio_proj``): the first latent frame's window flattened
  through ``proj1``, the later ones' through ``proj1_vf``, ReLU, ``proj2`` + ReLU, ``proj3`` to
  ``audio_tokens_per_frame`` tokens of ``audio_context_dim``, LayerNorm (eps 1e-5, torch's default) ->
  [B, frames, tokens, audio_context_dim]. Every block's audio cross-attention then reads its latent frame's
  tokens (``CrossAttention`` with ``ctx_dim`` = ``audio_context_dim`` and no q/k norms, after an affine
  LayerNorm of the block's input; its output added without a gate).
* :class:`ImageProjection` (``img_emb``): CLIP image tokens [B, 257, image_dim] -> LayerNorm, Linear, GELU
  (exact), Linear to ``dim``, LayerNorm (both norms eps 1e-5); the text cross-attention of every block adds
  an attention over them (``k_img`` / ``v_img``, ``norm_k_img``) before its output projection.
* :func:`reference_mask`: the 4 mask channels of the I2V input (1 on the reference frames' latent frame,
  0 after), concatenated with the reference latent to the noisy latent (``ModelConfig.cond_channels`` 20).

Only one speaker is handled (InfiniteTalk's ``human_num`` 1: its multi-speaker path places the audio tokens
with a 1-D RoPE chosen from the self-attention map, which is not reproduced).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cadence.config import ModelConfig
from cadence.model.layers import Linear

VAE_SCALE = 4  # video frames per latent frame after the first


def latent_audio_windows(
    audio: torch.Tensor, vae_scale: int = VAE_SCALE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-video-frame windows [B, 1 + vae_scale * n, W, ...] -> (first [B, 1, W, ...], later
    [B, n, W + vae_scale - 1, ...]): the regrouping of the module docstring."""
    b, frames, w = audio.shape[:3]
    if (frames - 1) % vae_scale or w % 2 == 0:
        raise ValueError(
            f"audio windows [{b}, {frames}, {w}, ...]: need 1 + {vae_scale} * n video frames and an odd window"
        )
    mid = w // 2
    later = audio[:, 1:].unflatten(1, ((frames - 1) // vae_scale, vae_scale))  # [B, n, 4, W, ...]
    parts = [later[:, :, 0, : mid + 1], later[:, :, 1:-1, mid], later[:, :, -1, mid:]]
    return audio[:, :1], torch.cat(parts, dim=2)


class AudioProjection(nn.Module):
    """``AudioProjModel``: per-latent-frame audio windows -> [B, frames, tokens, audio_context_dim]."""

    def __init__(self, m: ModelConfig, device=None, dtype=None):
        super().__init__()
        self._build(
            m.audio_window,
            m.audio_layers * m.audio_dim,
            m.audio_hidden,
            m.audio_tokens_per_frame,
            m.audio_context_dim,
            m.audio_norm_out,
            VAE_SCALE,
            device,
            dtype,
        )

    def _build(
        self,
        window: int,
        frame_width: int,
        hidden: int,
        tokens: int,
        width: int,
        norm: bool,
        vae_scale: int,
        device=None,
        dtype=None,
    ) -> None:
        """The layers at explicit sizes (``frame_width``: one video frame's features, layers x channels;
        ``vae_scale``: video frames per later latent frame; SoulX-FlashHead's Lite model has 8)."""
        self.tokens, self.width = tokens, width
        self.proj1 = Linear(window * frame_width, hidden, device=device, dtype=dtype)
        self.proj1_vf = Linear((window + vae_scale - 1) * frame_width, hidden, device=device, dtype=dtype)
        self.proj2 = Linear(hidden, hidden, device=device, dtype=dtype)
        self.proj3 = Linear(hidden, tokens * width, device=device, dtype=dtype)
        self.norm = nn.LayerNorm(width, eps=1e-5, device=device, dtype=torch.float32) if norm else None

    def forward(self, first: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
        """first [B, 1, W, layers, C], later [B, n, W + vae_scale - 1, layers, C] -> [B, 1 + n, tokens, width]."""
        h = torch.cat([F.relu(self.proj1(first.flatten(2))), F.relu(self.proj1_vf(later.flatten(2)))], dim=1)
        tokens = self.proj3(F.relu(self.proj2(h))).unflatten(-1, (self.tokens, self.width))
        if self.norm is not None:
            tokens = F.layer_norm(tokens.float(), (self.width,), self.norm.weight, self.norm.bias, 1e-5)
        return tokens.to(first.dtype)


class ImageProjection(nn.Module):
    """``img_emb`` (``MLPProj``): CLIP image tokens [B, N, image_dim] -> [B, N, dim]."""

    def __init__(self, m: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.norm_in = nn.LayerNorm(m.image_dim, eps=1e-5, device=device, dtype=torch.float32)
        self.fc1 = Linear(m.image_dim, m.image_dim, device=device, dtype=dtype)
        self.fc2 = Linear(m.image_dim, m.dim, device=device, dtype=dtype)
        self.norm_out = nn.LayerNorm(m.dim, eps=1e-5, device=device, dtype=torch.float32)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        dtype = self.fc1.weight.dtype
        n = self.norm_in
        h = F.layer_norm(image.float(), n.normalized_shape, n.weight, n.bias, n.eps).to(dtype)
        h = self.fc2(F.gelu(self.fc1(h)))
        n = self.norm_out
        return F.layer_norm(h.float(), n.normalized_shape, n.weight, n.bias, n.eps).to(dtype)


def reference_mask(
    latent_frames: int, h: int, w: int, reference_frames: int = 1, device=None, dtype=torch.float32
) -> torch.Tensor:
    """The I2V mask [4, latent_frames, h, w]: video frames 0 .. reference_frames-1 are given (the first
    video frame counts 4 times, filling latent frame 0's four channels; later video frames one channel
    each), the rest 0."""
    video = torch.zeros(1 + VAE_SCALE * (latent_frames - 1), device=device, dtype=dtype)
    video[:reference_frames] = 1
    video = torch.cat([video[:1].repeat(VAE_SCALE), video[1:]])
    return video.view(latent_frames, VAE_SCALE).T[:, :, None, None].expand(-1, -1, h, w).contiguous()
