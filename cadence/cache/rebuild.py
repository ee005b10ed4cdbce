"""Krea Realtime's per-chunk K/V rebuild (``release_server.GenerationSession.recompute_kv_cache``).

Krea does not keep the K/V a chunk wrote while it was denoised. Before every chunk after the first it
zeroes the whole self-attention cache and refills it with one pass of the model over a short clean
context, then denoises the chunk against exactly that:

* the context (``get_clean_context_frames``) is a first frame followed by the last
  ``kv_cache_num_frames - 1`` clean latent frames after the stream's first (fewer while the stream is short):
  ``n = min(frames made, kv_cache_num_frames)`` frames;
* the pass runs them at timestep 0, at RoPE positions 0..n-1 (whatever their place in the stream), under
  a block-causal mask in blocks of ``num_frame_per_block`` frames counted from the context's first frame
  (``get_block_mask``): frames of block j see blocks 0..j. Here that mask is the cache itself: the context
  is run block by block, each block committed before the next one attends, which gives the same K/V;
* the new chunk is then denoised at positions n..n+F-1, seeing the n context frames and itself.

The first context frame (``StreamConfig.keep_first_frame``):

* ``keep_first_frame=True``: always the stream's first latent frame;
* ``keep_first_frame=False`` (Krea's default): the stream's first latent frame while
  ``frames made - F < kv_cache_num_frames`` (F = frames per block), after that the VAE re-encoding of an older
  decoded pixel frame: Krea decodes every block as it is made (``demo_utils/vae_block3.VAEDecoderWrapper``,
  one latent frame per call), keeps the last ``1 + 4 (kv - 1)`` pixel frames (``frame_context_cache``) and
  encodes the oldest of them alone (``encode_video_latent`` -> ``VAEEncoderWrapper``: the Wan encoder on one
  frame, normalised with the latent mean / std). That frame is the last pixel frame of latent frame
  ``frames made - kv``: :class:`RebuildContext` keeps the last pixel frame of each of the last ``kv`` latent
  frames, decoded by :class:`KreaFrameDecoder` (Krea's decoder, on Cadence's Wan VAE modules).

Parity against Krea's own server code (both rules): ``tests/test_families_krea.py``.
"""

from __future__ import annotations

from collections import deque

import torch

from cadence.errors import ConfigError


def context_frames(first: torch.Tensor, recent: torch.Tensor | None, kv_frames: int) -> torch.Tensor:
    """Krea's clean context [C, n, h, w]: the first frame `first` [C, 1, h, w] and the last
    ``kv_frames - 1`` of `recent` (the clean frames after the stream's first, oldest first; None when there
    are none)."""
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


class KreaFrameDecoder:
    """The pixels Krea re-encodes come from its own streaming decoder (``demo_utils/vae_block3.py``
    ``VAEDecoderWrapper``, called by ``generate_block_internal`` on every block): Wan's decoder run one latent
    frame per call from the stream's first latent frame (which decodes to one pixel frame; every later one
    to 4), clamped to [-1, 1]. It departs from Wan's own streaming decode in one place, reproduced here on a
    Cadence :class:`~cadence.model.vae.WanVAE`: its temporal upsampler (``Resample``, 'upsample3d'), given one
    input frame x after the first call, remembers ``[torch.where(previous last frame == 0, 0, x), x]`` (the
    new frame twice, where Wan remembers ``[previous frame, x]``). Only the first temporal upsampler is fed
    one frame per call (the second gets its two), so its memory is the only one that differs; the frames
    leave Wan's from the stream's fourth latent frame on (the frames Krea re-encodes in the fixture, tiny
    random VAE: 0.77 of their norm away from Wan's own decode, 1.9e-6 from this one; not measured on the
    released VAE).

    The causal state lives in a :class:`~cadence.model.vae.StreamingDecoder` of the VAE (its private
    ``_mem``, edited after each call); the VAE's modules are shared, not copied."""

    def __init__(self, vae):
        from cadence.model.vae import Resample

        ups = [m for m in vae.decoder.modules() if isinstance(m, Resample) and m.mode == "upsample3d"]
        if not ups:
            raise ConfigError(
                "Krea's re-encoded first frame needs a Wan 2.1 VAE decoder (temporal upsamplers)"
            )
        self.vae = vae
        self._slot = ups[0].time_conv.slot  # the upsampler fed one frame per call
        self._dec = vae.stream()

    def reset(self) -> None:
        self._dec.reset()

    @torch.no_grad()
    def decode_frame(self, latent: torch.Tensor) -> torch.Tensor:
        """One normalised latent frame [z, 1, h, w] (the stream's next) -> its pixel frames [3, T, H, W]
        in [-1, 1] (T = 1 for the stream's first, else 4), in the VAE's dtype."""
        mem = self._dec._mem
        old = mem.slots[self._slot]
        out = self._dec.decode_chunk(self.vae.denormalize_latents(latent.float()))
        if old is not None and old.shape[2]:  # Krea's memory rule (see the class docstring)
            new = mem.slots[self._slot][:, :, -1:]
            mem.slots[self._slot] = torch.cat([torch.where(old[:, :, -1:] == 0, 0, new), new], 2)
        return out


class RebuildContext:
    """What a session keeps for the rebuild: the stream's first clean latent frame, the last
    ``kv_frames - 1`` clean frames after it and, for Krea's default first frame (`vae` given: the session's
    autoencoder, with the Wan VAE as ``vae.wan`` and ``vae.encode(video [3, 1, H, W])`` -> normalised latent),
    the last pixel frame of each of the last ``kv_frames`` latent frames, decoded as Krea decodes.
    ``push`` after every chunk (its clean latent), ``context`` before the next (None before the first)."""

    def __init__(self, kv_frames: int, frames_per_block: int, vae=None):
        self.kv, self.frames_per_block = kv_frames, frames_per_block
        self.vae = vae
        if vae is not None and not hasattr(vae, "wan"):
            raise ConfigError(
                "kv_rebuild with keep_first_frame=False (Krea's default first context frame: a decoded "
                "pixel frame re-encoded) needs the Wan VAE: vae.decoder 'wan' or 'taehv' (give the VAE "
                "weights), or stream.keep_first_frame=True"
            )
        self.decoder = KreaFrameDecoder(vae.wan) if vae is not None else None
        self.reset()

    def reset(self) -> None:
        """Forget the stream (a session reset)."""
        self.first: torch.Tensor | None = None
        self.recent: torch.Tensor | None = None
        self.made = 0  # latent frames made so far
        self.pixels: deque[torch.Tensor] = deque(maxlen=self.kv)
        self.chunk_pixels: torch.Tensor | None = None
        if self.decoder is not None:
            self.decoder.reset()

    def push(self, x: torch.Tensor) -> None:
        """The chunk just made, clean latent [C, F, h, w] (copied: a replayed graph's output is reused)."""
        if self.decoder is not None:
            outs = [self.decoder.decode_frame(x[:, i : i + 1]) for i in range(x.shape[1])]
            self.pixels.extend(o[:, -1] for o in outs)
            # the whole chunk as Krea decodes it [3, T, H, W] (T = 1 + 4 (F - 1) for the stream's first chunk,
            # else 4F): the frames Krea shows, and the session's
            self.chunk_pixels = torch.cat(outs, dim=1)
        self.made += x.shape[1]
        if self.first is None:
            self.first, x = x[:, :1].clone(), x[:, 1:]
        keep = self.kv - 1
        recent = x if self.recent is None else torch.cat([self.recent, x], dim=1)
        self.recent = recent[:, max(0, recent.shape[1] - keep) :].clone() if keep else None

    def reencodes(self) -> bool:
        """Whether the next context starts with a re-encoded pixel frame (Krea's
        ``(block_idx - 1) * num_frame_per_block >= kv_cache_num_frames`` with keep_first_frame off)."""
        return self.decoder is not None and self.made - self.frames_per_block >= self.kv

    def first_frame(self) -> torch.Tensor:
        """The context's first frame [C, 1, h, w]: the stream's first latent frame, or the re-encoding of
        the last pixel frame of latent frame ``made - kv`` (the oldest kept)."""
        if not self.reencodes():
            return self.first
        with torch.no_grad():
            return self.vae.encode(self.pixels[0][:, None]).to(self.first)

    def context(self) -> torch.Tensor | None:
        """The next rebuild's clean context [C, n, h, w]; None before the first chunk."""
        if self.first is None:
            return None
        return context_frames(self.first_frame(), self.recent, self.kv)
