"""SoulX-FlashTalk's encoders against its own code (fixture: tests/fixtures/flashtalk/encoders, made by
scripts/fixtures/make_flashtalk_encoders.py, which runs the reference's ``generate_video.generate`` in its
``stream`` audio mode at a tiny random configuration; reference commit and library versions in fixture.json).

Error measure: ||cadence - reference|| / ||reference||, float32 on the CPU (the loudness: LUFS, float64).

* CLIP: Wan's ``.pth`` (whole ``XLMRobertaCLIP``: vision and text tower) through ``load_clip_vision`` into a
  ``transformers`` ``CLIPVisionModel``; the reference image from the PNG (``reference_image``: PIL bilinear
  resize, centre crop) and ``CLIPModel.visual``'s preprocessing are exact (0.0); the 257 tokens measured 0.0
  (tolerance 1e-5: the same float32 operations, only SDPA's / the linears' summation order could differ).
* audio: the 48 kHz clip fed in pieces through ``Resampler`` = ``librosa.load(sr=16000)`` exactly (the same soxr
  HQ resampler, streamed); ``integrated_loudness`` = pyloudnorm's number for each clip's 8 s window (1e-9 LUFS
  bound, measured equal); ``FlashTalkAudio``'s per-clip windows = what the reference fed ``generate``
  (tolerance 1e-5, ~3e-7 measured: the float32 order of the feature extractor's normalisation and of
  transformers 5 vs 4.49 attention).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_fixtures import rel

from cadence.errors import WeightsError
from cadence.model.families import get_family

FIX = Path(__file__).parent / "fixtures" / "flashtalk" / "encoders"
META = json.loads((FIX / "fixture.json").read_text())
DATA = torch.load(FIX / "data.pt", weights_only=True)
AUDIO = torch.load(FIX / "audio.pt", weights_only=True)
PIECES = (1000, 4801, 17, 30000, 960, 10**6)  # 48 kHz pieces of any length


def test_reference_image_is_flashtalks():
    from PIL import Image

    from cadence.model.flashtalk import reference_image

    img = reference_image(Image.open(FIX / "image.png"), tuple(META["config"]["target_hw"]))
    assert img.shape == (3, 1, 32, 32) and torch.equal(img, DATA["image"][0])


def test_clip_tokens_match_flashtalk():
    pytest.importorskip("transformers")
    from cadence.model.clip_vision import load_clip_vision

    clip = load_clip_vision(FIX / "clip_tiny.pth", heads=META["config"]["clip"]["vision_heads"])
    assert clip.model.config.num_hidden_layers == META["config"]["clip"]["vision_layers"] - 1
    x = clip.preprocess(DATA["image"][0].transpose(0, 1))
    assert x.shape == (1, 3, 224, 224)
    assert torch.equal(x[..., ::8, ::8], DATA["clip_input_every8"])
    tokens = clip.encode(DATA["image"][0])
    assert tokens.shape == DATA["clip_tokens"].shape == (1, 257, META["config"]["clip"]["vision_dim"])
    err = rel(tokens, DATA["clip_tokens"])
    assert err <= 1e-5, err


def test_clip_file_errors(tmp_path):
    pytest.importorskip("transformers")
    from cadence.model.clip_vision import load_clip_vision

    sd = torch.load(FIX / "clip_tiny.pth", weights_only=True)
    bad = {k: v for k, v in sd.items() if k != "visual.pos_embedding"}
    torch.save(bad, tmp_path / "a.pth")
    with pytest.raises(WeightsError, match=r"a\.pth.*missing key.*visual\.pos_embedding"):
        load_clip_vision(tmp_path / "a.pth", heads=2)
    torch.save(dict(sd, **{"visual.transformer.0.attn.extra": torch.zeros(1)}), tmp_path / "b.pth")
    with pytest.raises(WeightsError, match=r"b\.pth.*unexpected.*attn\.extra"):
        load_clip_vision(tmp_path / "b.pth", heads=2)
    with pytest.raises(WeightsError, match="pass heads="):
        load_clip_vision(FIX / "clip_tiny.pth")  # 24 wide: not ViT-H's 80-wide heads
    sf = Path(__file__).parent / "fixtures" / "self_forcing" / "self_forcing_tiny.pt"
    with pytest.raises(WeightsError, match="not a Wan CLIP checkpoint"):
        load_clip_vision(sf, heads=2)


def test_resampler_is_librosas():
    pytest.importorskip("soxr")
    from cadence.model.wav2vec2 import Resampler

    pcm = AUDIO["pcm48"].float() / 32768  # what soundfile reads from the int16 wav
    r, parts, i = Resampler(48000, 16000), [], 0
    for n in PIECES:
        parts.append(r.push(pcm[i : i + n]))
        i += n
    parts.append(r.flush())
    assert torch.equal(torch.cat(parts), AUDIO["resampled16"])


def test_live_audio_windows_match_flashtalks_stream():
    pytest.importorskip("soxr")
    from cadence.model.flashtalk import FlashTalkAudio
    from cadence.model.wav2vec2 import Wav2Vec2Features

    audio = FlashTalkAudio(Wav2Vec2Features(FIX / "wav2vec2_tiny"))
    pcm, clips, i = AUDIO["pcm48"].float() / 32768, [], 0
    for n in PIECES:
        clips += audio.push(pcm[i : i + n])
        i += n
    clips += audio.flush()  # the 0.06 s after the last whole clip: dropped, as the reference drops it
    assert len(clips) == len(AUDIO["windows"]) == META["config"]["clips"] == 2
    assert audio.loudness == pytest.approx(AUDIO["loudness"].tolist(), abs=1e-9)
    for k, c in enumerate(clips):
        err = rel(c, AUDIO["windows"][k])
        assert c.shape == AUDIO["windows"][k].shape and err <= 1e-5, (k, err)


def test_loudness_edge_cases():
    from cadence.model.wav2vec2 import integrated_loudness, loudness_normalize

    silence = torch.zeros(16000)
    assert integrated_loudness(silence, 16000) == float("-inf")
    assert torch.equal(loudness_normalize(silence, 16000), silence.double())  # |L| > 100: unchanged
    tone = 0.1 * torch.sin(torch.arange(32000) * 2 * torch.pi * 1000 / 16000)
    assert integrated_loudness(loudness_normalize(tone, 16000), 16000) == pytest.approx(-23.0, abs=1e-9)


@pytest.mark.slow  # ~17 s on 2 cores (two whole-clip VAE decodes and the 33-frame I2V encode): the slow tier
def test_offline_clip_loop_matches_flashtalks_generate_video():
    """(reference image file, 48 kHz audio) -> frames through Cadence alone (``generate_offline``: its CLIP,
    VAE, wav2vec2, loudness, resampler, sampler) against the reference's own ``generate_video.generate``
    (stream mode) on the same files: each clip's denoised latent and its 28 frames (every 4th frame stored,
    every frame's norm). Tolerance 1e-4; measured latents 9.3e-8 / 4.2e-7, frames 1.9e-6 / 5.5e-6."""
    pytest.importorskip("soxr")
    from PIL import Image
    from test_families_flashtalk import FOLDER, HW, TINY

    import cadence.model.flashtalk as ft
    from cadence.model.clip_vision import load_clip_vision
    from cadence.model.families import family_config
    from cadence.model.vae import load_wan_vae
    from cadence.model.wav2vec2 import Wav2Vec2Features
    from cadence.model.weights import build_model, load_family_weights

    c = META["config"]
    m = build_model(
        family_config("flashtalk", weights=str(FOLDER), model=TINY, stream=HW), "cpu", torch.float32
    )
    load_family_weights(m, FOLDER, get_family("flashtalk"))
    vae = load_wan_vae(Path(__file__).parent / "fixtures" / "wan_vae" / "Wan2.1_VAE_tiny.pth")
    clip = load_clip_vision(FIX / "clip_tiny.pth", heads=c["clip"]["vision_heads"])
    audio = ft.FlashTalkAudio(Wav2Vec2Features(FIX / "wav2vec2_tiny"))
    text = torch.zeros(1, TINY["text_len"], TINY["text_dim"])
    text[0, : DATA["prompt"].shape[0]] = DATA["prompt"]
    latents, real = [], ft.sample_clip

    def sample_clip(*a, **k):
        latents.append(real(*a, **k))
        return latents[-1]

    ft.sample_clip = sample_clip
    try:
        frames = ft.generate_offline(
            m, vae, clip, audio, Image.open(FIX / "image.png"), AUDIO["pcm48"].float() / 32768, text,
            tuple(c["target_hw"]), c["seed"],
        )  # fmt: skip
    finally:
        ft.sample_clip = real
    assert len(frames) == len(DATA["latents"]) == 2
    for k, f in enumerate(frames):
        assert f.shape == (28, 32, 32, 3)
        errs = (
            rel(latents[k], DATA["latents"][k]),
            rel(f[::4], DATA["frames_every4"][k]),
            rel(f.flatten(1).norm(dim=1), DATA["frame_norms"][k]),
        )
        assert max(errs) <= 1e-4, (k, errs)
