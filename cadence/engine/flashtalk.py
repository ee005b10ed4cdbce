"""The engine's session for SoulX-FlashTalk's clip stream (the family's ``ClipStream`` rule): a stream of
bidirectional clips, each one decoded and re-encoded before the next can start.

A block-causal family (:class:`cadence.engine.session.Session`) steps a K/V cache and hands latents to the
engine's decode stage. A clip-based family has no K/V stream: every clip is generated whole (all its tokens
attend to each other) from *motion latents* that are the VAE encoding of the previous clip's last decoded
frames, so the next step needs this step's decode. :class:`ClipSession` therefore does the whole chunk in its
step and says so (``yields_pixels``): the engine's decode stage only copies its frames to the host. It
implements the K/V session's interface (``cadence.engine.session.StreamSession``), so the engine drives both
the same way; ``cadence.engine.session.session_type`` picks it for a ``ClipStream``.

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

Encoders: with ``--weights DIR`` the family's own files (:func:`flashtalk_encoder_files`: Wan's CLIP ``.pth``
in DIR as FlashTalk ships it, the ``chinese-wav2vec2-base`` folder in or beside DIR); without weights both are
random at the sizes the model config implies (benchmarks, tests). Nothing here applies CUDA graphs or the ring
cache (no cache): the recipe (``cadence.engine.recipe``) turns them off with one note.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from pathlib import Path

import torch

from cadence.config import AUDIO_SAMPLE_RATE, CadenceConfig
from cadence.errors import ConfigError, InputError

log = logging.getLogger("cadence.engine")

#: 48 kHz samples of silence the clip session's audio starts with (one video frame at 25 fps, see the module).
AUDIO_LAG = AUDIO_SAMPLE_RATE // 25
#: The colour match strength FlashTalk ships (``color_correction_strength``).
COLOR_STRENGTH = 1.0


# ---- encoders ------------------------------------------------------------------------------------------


def flashtalk_encoder_files(weights: str | Path) -> tuple[Path, Path]:
    """The CLIP ``.pth`` and the wav2vec2 folder that go with a FlashTalk checkpoint ``weights`` (its folder,
    or a file in it): ``models_clip_*.pth`` in the folder or its parent (FlashTalk ships it inside
    ``SoulX-FlashTalk-14B/``), a folder named ``*wav2vec2*`` holding a config.json in the folder or its
    parent (``chinese-wav2vec2-base``, FlashTalk's ``--wav2vec_dir``). One clear error for what is missing."""
    p = Path(weights)
    folder = p if p.is_dir() else p.parent
    places = [folder, folder.parent]
    clip = next((f for d in places for f in sorted(d.glob("models_clip_*.pth")) if f.is_file()), None)
    w2v = next(
        (
            d
            for base in places
            for d in sorted(base.iterdir())
            if d.is_dir() and "wav2vec2" in d.name.lower() and (d / "config.json").is_file()
        ),
        None,
    )
    missing = []
    if clip is None:
        missing.append("the CLIP vision encoder (models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth)")
    if w2v is None:
        missing.append("the wav2vec2 folder (chinese-wav2vec2-base/, with config.json)")
    if missing:
        raise ConfigError(
            f"flashtalk weights {weights}: {' and '.join(missing)} not found in {folder} or {folder.parent}"
        )
    return clip, w2v


def _heads(width: int) -> int:
    return width // 80 if width % 80 == 0 else next(h for h in (8, 4, 2, 1) if width % h == 0)


def random_clip_vision(cfg: CadenceConfig, device, dtype, seed: int = 1):
    """A random CLIP vision tower of the width and token count the model takes (``image_dim``,
    ``image_tokens`` = 1 + (224 / 14)^2): ViT-H/14's depth (31 of 32 blocks run) at 1280 wide, 2 blocks
    otherwise."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from cadence.model.clip_vision import ClipVision

    m = cfg.model
    grid = round((m.image_tokens - 1) ** 0.5)
    if grid * grid + 1 != m.image_tokens:
        raise ConfigError(f"image_tokens {m.image_tokens} is not 1 + a square grid of patches")
    c = CLIPVisionConfig(
        hidden_size=m.image_dim,
        intermediate_size=4 * m.image_dim,
        num_hidden_layers=31 if m.image_dim == 1280 else 2,
        num_attention_heads=_heads(m.image_dim),
        image_size=grid * 14,
        patch_size=14,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )
    c._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPVisionModel(c)
    return ClipVision(model, device=device, dtype=dtype)


def random_wav2vec2(cfg: CadenceConfig, device, seed: int = 2):
    """A random wav2vec2 of the width and depth the model's audio projection reads (``audio_dim``,
    ``audio_layers``): wav2vec2-base's geometry at 768 wide, a small one otherwise."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    from cadence.model.wav2vec2 import Wav2Vec2Features

    m = cfg.model
    if m.audio_dim == 768:
        c = Wav2Vec2Config(num_hidden_layers=m.audio_layers)
    else:
        c = Wav2Vec2Config(
            hidden_size=m.audio_dim,
            num_hidden_layers=m.audio_layers,
            num_attention_heads=_heads(m.audio_dim),
            intermediate_size=2 * m.audio_dim,
            conv_dim=(8,) * 7,
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4 if m.audio_dim % 4 == 0 else 1,
        )
    c.update(dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0))
    c._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Wav2Vec2Model(c)
    return Wav2Vec2Features(model, fps=cfg.stream.fps, device=device)


def make_clip_encoders(cfg: CadenceConfig, device, dtype):
    """(CLIP vision, wav2vec2 features) for a clip-based family: the checkpoint's own files beside
    ``model.weights``, else random ones (logged). wav2vec2 runs in float32 (its features feed a loudness-
    normalised window; small next to the model)."""
    from cadence.config import resolve_asset
    from cadence.model.wav2vec2 import Resampler

    Resampler(AUDIO_SAMPLE_RATE, 16000)  # needs soxr: one clear ImportError at build, not at the first open
    m = cfg.model
    if m.weights:
        from cadence.model.clip_vision import load_clip_vision
        from cadence.model.wav2vec2 import Wav2Vec2Features

        clip_file, w2v_dir = flashtalk_encoder_files(resolve_asset(m.weights))
        clip = load_clip_vision(clip_file, device=device, dtype=dtype)
        feats = Wav2Vec2Features(w2v_dir, fps=cfg.stream.fps, device=device)
    else:
        log.warning("model family %r without weights: random CLIP vision and wav2vec2 encoders", m.family)
        clip = random_clip_vision(cfg, device, dtype)
        feats = random_wav2vec2(cfg, device)
    width = clip.model.config.hidden_size
    if width != m.image_dim:
        raise ConfigError(f"the CLIP vision encoder is {width} wide; the model takes image_dim {m.image_dim}")
    wc = feats.model.config
    if (wc.hidden_size, wc.num_hidden_layers) != (m.audio_dim, m.audio_layers):
        raise ConfigError(
            f"the wav2vec2 encoder gives {wc.num_hidden_layers} layers of {wc.hidden_size}; the model takes "
            f"{m.audio_layers} of {m.audio_dim}"
        )
    return clip, feats


# ---- the session ---------------------------------------------------------------------------------------


class ClipSession:
    """One stream of a clip stream (see the module docstring). The engine's session interface
    (``StreamSession``): ``reset`` / ``reseed`` / ``set_prompt`` / ``step`` (-> uint8 frames, ``yields_pixels``) /
    ``decode`` (identity: the frames are already pixels) / ``prime_decoder`` (nothing to prime)."""

    yields_pixels = True
    step_label = "clip"
    cache = None  # no K/V stream: nothing for CUDA graphs or the ring to hold on to

    @classmethod
    def prepare(cls, gen) -> None:
        """The generator's front ends a clip session reads: its own wav2vec2 and CLIP (no per-chunk audio
        encoder), and the per-image references; the stream's decoder must be the Wan VAE."""
        cfg, clip = gen.cfg, gen.rules.stream
        if not hasattr(gen.vae, "wan"):
            raise ConfigError(
                f"model family {cfg.model.family!r} decodes and re-encodes every clip with the Wan VAE: "
                f"vae.decoder must be '{clip.decoder}', got {cfg.vae.decoder!r}"
            )
        gen.clip_vision, gen.audio_features = make_clip_encoders(cfg, gen.model.device, gen.model.dtype)
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

    def _check_image(self, image: torch.Tensor) -> None:
        h, w = self.cfg.stream.height, self.cfg.stream.width
        if tuple(image.shape) != (3, h, w):
            raise InputError(
                f"reference image must be [3, {h}, {w}] for {self.cfg.name}, got {list(image.shape)}"
            )

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
        from cadence.model.flashtalk import FlashTalkAudio

        emb = self._embed(prompt)
        self.tokens, self.cond, self.ref, self.motion = self.gen.clip_reference(image)
        self._set_context(emb)
        self.noise_gen.manual_seed(seed)
        self.audio = FlashTalkAudio(
            self.gen.audio_features,
            rate_in=AUDIO_SAMPLE_RATE,
            clip_frames=self.clip_frames,
            motion_frames=self.motion_frames,
        )
        self.audio.push(torch.zeros(AUDIO_LAG))
        self.index = 0
        self.next_frame = 0
        self.last_latent = None
        self.streams += 1

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

        clips = self.audio.push(audio.detach().to("cpu", torch.float32))
        if len(clips) != 1:  # the lag covers the resampler's hold-back; anything else is a broken clock
            raise RuntimeError(
                f"chunk {self.index}: its audio completed {len(clips)} clips (expected 1): the resampler held "
                f"back more than the session's {AUDIO_LAG}-sample lag"
            )
        windows = clips[0].to(self.cond)
        latent = ft.sample_clip(
            self.model, self.noise_gen, self.motion, self.cond, self.context, windows, self.timesteps
        )
        frames, self.motion = ft.next_clip_frames(
            self.gen.vae.wan, latent, self.ref, self.motion_frames, strength=COLOR_STRENGTH
        )
        self.last_latent = latent
        self.next_frame += self.cfg.stream.latent_frames_per_chunk
        self.index += 1
        return ((frames.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()

    def prime_decoder(self) -> bool:
        return False

    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """The step's frames, already pixels: moved to the decode device."""
        return frames.to(self.decode_device)


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
        tokens = gen.clip_vision.encode(ref).to(gen.model.dtype)
        video = torch.cat([ref, ref.new_zeros(3, frames - 1, *ref.shape[2:])], dim=1)
        cond = i2v_condition(vae.normalize_latents(vae.encode(video.to(vae.param_dtype())).float()))
        motion = vae.normalize_latents(vae.encode(ref.to(vae.param_dtype())).float())
        got = (tokens, cond, ref, motion)
        self._kept[key] = got
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        return got
