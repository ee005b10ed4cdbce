"""The engine's session for SoulX-FlashTalk's clip stream (the family's ``ClipStream`` rule): a stream of
bidirectional clips, each one decoded and re-encoded before the next can start.

A block-causal family (:class:`cadence.engine.session.Session`) steps a K/V cache and hands latents to the
engine's decode stage. A clip-based family has no K/V stream: every clip is generated whole (all its tokens
attend to each other) from *motion latents* that are the VAE encoding of the previous clip's last decoded
frames, so the next step needs this step's decode. :class:`ClipSession` therefore does the whole chunk in its
step and says so (``yields_pixels``): the engine's decode stage only copies its frames to the host. It
implements the K/V session's interface (``cadence.engine.session.StreamSession``), so the engine drives both
the same way; the family's registry entry names it (``ClipStream.session``), ``session_type`` loads it.

Per stream (``open`` / ``reset``), once: the reference image's CLIP tokens (``cadence.model.clip_vision``), the
I2V condition (the VAE latent of [image, 32 black frames] + mask) and the image's own latent (the first clip's
motion latents), kept per image by the generator; the prompt's cross-attention K/V (the embedding padded with
zeros to ``text_len``, as Wan pads it) with the image tokens; one seeded generator for every noise draw; a
fresh :class:`cadence.model.flashtalk.FlashTalkAudio` (8 s rolling window, loudness, wav2vec2).

Per chunk (one clip: ``clip_frames - motion_frames`` = 28 new frames, 53,760 samples at 48 kHz): the chunk's
samples through ``FlashTalkAudio`` (the clip's [33, 5, layers, dim] windows), ``sample_clip`` (4 passes),
``next_clip_frames`` (whole-clip Wan VAE decode, colour match to the reference, the last 5 frames encoded:
the next clip's motion latents), then uint8 frames [28, H, W, 3] on the model's device.

Audio look-ahead: ``FlashTalkAudio`` resamples 48 -> 16 kHz with soxr's streaming HQ filter, which holds up to
~26 ms of output back until more input comes. A clip can only be cut once its last 16 kHz sample is out, so
the session runs the audio ``AUDIO_LAG`` samples (one video frame, 40 ms) behind the engine's clock: the
stream it makes is exactly FlashTalk's offline stream (``generate_offline``) of the same audio delayed by
40 ms (silence first), every clip complete when its chunk's samples arrive. The mouth trails the voice by
that one frame (inside ITU-R BT.1359's +45 ms detectability bound for sound ahead of picture).

Encoders: the family's front ends (its registry entry: ``Wav2Vec2Audio``, ``ClipVisionImage``), built by the
generator from the recipe (``cadence.model.encoders``: with ``--weights DIR`` Wan's CLIP ``.pth`` in DIR as
FlashTalk ships it and the ``chinese-wav2vec2-base`` folder in or beside DIR; without weights both random at
the sizes the model config implies); this session reads them as ``gen.image_encoder`` and ``gen.audio``.
Nothing here applies CUDA graphs or the ring cache (no cache): the recipe (``cadence.engine.recipe``) turns
them off with one note.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import torch

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.engine.cut_in import AUDIO_LAG, ClipCutIn, cut_in_history
from cadence.errors import ConfigError, InputError

log = logging.getLogger("cadence.engine")

#: 48 kHz samples of silence the clip session's audio starts with (one video frame at 25 fps, see the module).
#: The colour match strength FlashTalk ships (``color_correction_strength``).
COLOR_STRENGTH = 1.0


# ---- the session ---------------------------------------------------------------------------------------


class ClipSession(ClipCutIn):
    """One stream of a clip stream (see the module docstring). The engine's session interface
    (``StreamSession``): ``reset`` / ``reseed`` / ``set_prompt`` / ``step`` (-> uint8 frames, ``yields_pixels``) /
    ``decode`` (identity: the frames are already pixels) / ``prime_decoder`` (nothing to prime)."""

    yields_pixels = True
    step_label = "clip"
    cache = None  # no K/V stream: nothing for CUDA graphs or the ring to hold on to

    @classmethod
    def prepare(cls, gen) -> None:
        """The per-image references every clip reads (from the generator's front ends: its CLIP vision tower
        and the Wan VAE); the stream's decoder must be the Wan VAE, and its audio wav2vec2's."""
        cfg, clip = gen.cfg, gen.rules.stream
        if not hasattr(gen.vae, "wan"):
            raise ConfigError(
                f"model family {cfg.model.family!r} decodes and re-encodes every clip with the Wan VAE: "
                f"vae.decoder must be '{gen.rules.decoder.pinned}', got {cfg.vae.decoder!r}"
            )
        if gen.image_encoder is None or not hasattr(gen.audio, "encode"):
            raise ConfigError(
                f"a FlashTalk clip session reads CLIP image tokens and wav2vec2 audio ({gen.rules})"
            )
        gen.clip_reference = ClipReferences(gen, clip.clip_frames)

    def __init__(self, gen, image: torch.Tensor, prompt, seed: int, decode_device=None):
        from cadence.model.flashtalk import shifted_timesteps

        cfg, model = gen.cfg, gen.model
        self.gen, self.cfg, self.model = gen, cfg, model
        clip = gen.rules.stream  # the family's ClipStream rule
        self.clip_frames, self.motion_frames = clip.clip_frames, clip.motion_frames
        self.decode_device = torch.device(decode_device) if decode_device is not None else model.device
        self.noise_gen = torch.Generator(device=model.device)
        s = cfg.stream
        self.timesteps = shifted_timesteps(s.timesteps, s.shift)
        self.last_latent: torch.Tensor | None = None
        self.streams = 0
        self._start(image, prompt, seed)

    # ---- stream lifetime -----------------------------------------------------------------------------
    def reset(self, image: torch.Tensor, prompt, seed: int = 0) -> None:
        self._check_image(image)
        self._start(image, self._embed(prompt), seed)

    def reseed(self, seed: int) -> None:
        if self.index:
            raise RuntimeError(f"reseed() before the first chunk only (this session made {self.index})")
        self.noise_gen.manual_seed(seed)

    def _embed(self, prompt) -> torch.Tensor:
        m = self.cfg.model
        emb = self.gen.text_encoder(prompt) if isinstance(prompt, str) else prompt
        if emb.ndim != 2 or emb.shape[1] != m.text_dim or not 1 <= emb.shape[0] <= m.text_len:
            raise InputError(
                f"prompt embedding must be [L, {m.text_dim}] with 1 <= L <= {m.text_len}, got {list(emb.shape)}"
            )
        if emb.shape[0] < m.text_len:  # zeros to text_len, as Wan's model pads its context
            emb = torch.cat([emb, emb.new_zeros(m.text_len - emb.shape[0], emb.shape[1])])
        return emb

    def _start(self, image: torch.Tensor, prompt, seed: int) -> None:
        emb = self._embed(prompt)
        self.tokens, self.cond, self.ref, self.motion = self.gen.clip_reference(image)
        self._set_context(emb)
        self.noise_gen.manual_seed(seed)
        self.audio = self._new_audio()
        self.audio.push(torch.zeros(AUDIO_LAG))
        self.heard = cut_in_history(self.audio)
        self.heard.push(torch.zeros(AUDIO_LAG))
        self.cut_ins = 0
        self.index = 0
        self.next_frame = 0
        self.last_latent = None
        self.streams += 1

    def _new_audio(self):
        from cadence.model.flashtalk import FlashTalkAudio

        return FlashTalkAudio(
            self.gen.audio,
            rate_in=AUDIO_SAMPLE_RATE,
            clip_frames=self.clip_frames,
            motion_frames=self.motion_frames,
        )

    def _encode_motion(self, video: torch.Tensor) -> torch.Tensor:
        """A cut-in's motion latents from its frames [3, N, H, W] in [-1, 1] (``ClipCutIn.rewind``), as
        ``next_clip_frames`` encodes a clip's last frames."""
        vae = self.gen.vae.wan
        return vae.normalize_latents(vae.encode(video.to(vae.param_dtype())).float())

    def _set_motion(self, motion: torch.Tensor) -> None:
        self.motion = motion

    def _set_context(self, emb: torch.Tensor) -> None:
        dev = self.model.device
        self.context = self.model.prepare_text(emb[None].to(dev), self.tokens.to(dev))

    def set_prompt(self, prompt) -> list[int]:
        """The new prompt's K/V (with the image tokens) from the next clip on; nothing is re-cached."""
        self._set_context(self._embed(prompt))
        return []

    switch_prompt = set_prompt

    # ---- the chunk step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, audio: torch.Tensor, runner=None) -> torch.Tensor:
        """One clip from its chunk's 48 kHz samples: uint8 frames [T, H, W, 3] on the model's device (its
        denoised latent in ``last_latent``). ``runner`` is not used (no CUDA graphs for a clip)."""
        from cadence.model import flashtalk as ft

        samples = audio.detach().to("cpu", torch.float32)
        windows = self._clip_audio(samples).to(self.cond)
        latent = ft.sample_clip(
            self.model, self.noise_gen, self.motion, self.cond, self.context, windows, self.timesteps
        )
        frames, self.motion = ft.next_clip_frames(
            self.gen.vae.wan, latent, self.ref, self.motion_frames, strength=COLOR_STRENGTH
        )
        self.last_latent = latent
        return self._clip_out(samples, frames)


class ClipReferences:
    """Per reference image, what every clip of a stream reads (kept for the last ``keep`` distinct images, by a
    hash of the pixels, as ``StreamGenerator.encode_reference``): CLIP tokens [1, 257, image_dim], the I2V
    condition [20, F, h, w], the image [3, 1, H, W] and its latent [16, 1, h, w] (the first motion latents)."""

    def __init__(self, gen, clip_frames: int, keep: int = 4):
        self.gen, self.clip_frames, self.keep = gen, clip_frames, keep
        self._kept: OrderedDict[str, tuple] = OrderedDict()

    @torch.no_grad()
    def __call__(self, image: torch.Tensor) -> tuple:
        from cadence.model.flashtalk import i2v_condition

        host = image.detach().to("cpu", torch.float32).contiguous()
        key = f"{tuple(host.shape)}:{hashlib.blake2b(host.numpy().tobytes(), digest_size=16).hexdigest()}"
        got = self._kept.get(key)
        if got is not None:
            self._kept.move_to_end(key)
            return got
        gen = self.gen
        dev, vae = gen.model.device, gen.vae.wan
        frames = self.clip_frames
        ref = host[:, None].to(dev)  # [3, 1, H, W] in [-1, 1]
        tokens = gen.image_encoder.encode(ref).to(gen.model.dtype)
        video = torch.cat([ref, ref.new_zeros(3, frames - 1, *ref.shape[2:])], dim=1)
        cond = i2v_condition(vae.normalize_latents(vae.encode(video.to(vae.param_dtype())).float()))
        motion = vae.normalize_latents(vae.encode(ref.to(vae.param_dtype())).float())
        got = (tokens, cond, ref, motion)
        self._kept[key] = got
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        return got
