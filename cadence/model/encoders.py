"""The front ends a family declares (``cadence.model.families``: its audio and image encoders), built.

A family's registry entry names its front ends as typed objects (``LogMelAudio``, ``Wav2Vec2Audio``,
``VaeSinkImage``, ``ClipVisionImage``: plain data, torch-free); the engine builds the ones of its recipe with
:func:`build_front_ends` (``cadence.engine.session.StreamGenerator``), whatever session class streams them. An
encoder that ships beside the transformer's weights says where (``Beside``: a glob in the weights' folder or
its parent, as FlashTalk ships Wan's CLIP ``.pth`` inside its folder and ``chinese-wav2vec2-base`` beside it):
all of them are looked up first, and what is missing is one error naming every file. Without weights each is
random at the sizes the model configuration implies (benchmarks, tests), with one log line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from cadence.config import AUDIO_SAMPLE_RATE, CadenceConfig, resolve_asset
from cadence.errors import ConfigError

log = logging.getLogger("cadence.engine")


def locate(weights: str | Path, front_ends: Sequence, family: str = "the model") -> list[Path | None]:
    """Each front end's file beside ``weights`` (its folder, or a file in it; then the folder's parent), None
    for a front end that reads nothing there; one ConfigError listing every one that is missing."""
    p = Path(weights)
    folder = p if p.is_dir() else p.parent
    places = [folder, folder.parent]
    found, missing = [], []
    for fe in front_ends:
        b = getattr(fe, "beside", None)
        if b is None:
            found.append(None)
            continue
        hit = next((f for d in places if d.is_dir() for f in sorted(d.glob(b.pattern)) if b.matches(f)), None)
        found.append(hit)
        if hit is None:
            missing.append(b.what)
    if missing:
        raise ConfigError(
            f"{family} weights {weights}: {' and '.join(missing)} not found in {folder} or {folder.parent}"
        )
    return found


def build_front_ends(cfg: CadenceConfig, front_ends: Sequence, device, dtype) -> list:
    """The built encoders of ``front_ends`` (each one's ``build(cfg, device, dtype, path)``), their files found
    beside ``cfg.model.weights`` first (random encoders without weights)."""
    m = cfg.model
    if m.weights:
        paths = locate(resolve_asset(m.weights), front_ends, m.family or cfg.name)
    else:
        paths = [None] * len(front_ends)
        wanted = [fe.about for fe in front_ends if getattr(fe, "beside", None) is not None]
        if wanted:
            log.warning("model family %r without weights: random %s", m.family, " and ".join(wanted))
    return [fe.build(cfg, device, dtype, path) for fe, path in zip(front_ends, paths)]


def _heads(width: int) -> int:
    return width // 80 if width % 80 == 0 else next(h for h in (8, 4, 2, 1) if width % h == 0)


def clip_vision(cfg: CadenceConfig, device, dtype, path: Path | None = None, seed: int = 1):
    """The CLIP vision tower the model's image tokens come from: Wan's ``.pth`` at ``path``, else random at
    ``image_dim`` wide with ``image_tokens`` = 1 + (224 / 14)^2 (ViT-H/14's depth, 31 of 32 blocks run, at
    1280 wide; 2 blocks otherwise). Its width must be the model's ``image_dim``."""
    from cadence.model.clip_vision import ClipVision, load_clip_vision

    m = cfg.model
    if path is not None:
        clip = load_clip_vision(path, device=device, dtype=dtype)
    else:
        from transformers import CLIPVisionConfig, CLIPVisionModel

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
            clip = ClipVision(CLIPVisionModel(c), device=device, dtype=dtype)
    width = clip.model.config.hidden_size
    if width != m.image_dim:
        raise ConfigError(f"the CLIP vision encoder is {width} wide; the model takes image_dim {m.image_dim}")
    return clip


def wav2vec2(cfg: CadenceConfig, device, path: Path | None = None, seed: int = 2):
    """wav2vec2 features at the stream's fps (float32: its features feed a loudness-normalised window; small
    next to the model): the folder at ``path``, else random at the width and depth the model's audio projection
    reads (``audio_dim``, ``audio_layers``: wav2vec2-base's geometry at 768 wide, a small one otherwise)."""
    from cadence.model.wav2vec2 import Resampler, Wav2Vec2Features

    Resampler(AUDIO_SAMPLE_RATE, 16000)  # needs soxr: one clear ImportError at build, not at the first open
    m = cfg.model
    if path is not None:
        feats = Wav2Vec2Features(path, fps=cfg.stream.fps, device=device)
    else:
        from transformers import Wav2Vec2Config, Wav2Vec2Model

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
        c.update(
            dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0)
        )
        c._attn_implementation = "eager"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            feats = Wav2Vec2Features(Wav2Vec2Model(c), fps=cfg.stream.fps, device=device)
    wc = feats.model.config
    if (wc.hidden_size, wc.num_hidden_layers) != (m.audio_dim, m.audio_layers):
        raise ConfigError(
            f"the wav2vec2 encoder gives {wc.num_hidden_layers} layers of {wc.hidden_size}; the model takes "
            f"{m.audio_layers} of {m.audio_dim}"
        )
    return feats
