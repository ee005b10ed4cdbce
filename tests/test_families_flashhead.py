"""SoulX-FlashHead (Pro and Lite) against its own code (fixture: tests/fixtures/flashhead, made by
scripts/fixtures/make_flashhead.py from Soul-AILab/SoulX-FlashHead at the commit in fixture.json: its
``WanModelAudioProject`` at two tiny random configurations saved with ``save_pretrained`` (the released
``Model_Pro/`` / ``Model_Lite/`` format), a tiny ``Wav2Vec2ForCTC`` folder (wav2vec2-base-960h's format), one
forward pass each, ``preprocess_audio``, and two clips of ``generate_video.generate``'s stream mode per variant,
float32 on the CPU; Pro with the ``wan_vae`` fixture's tiny Wan 2.1 VAE, Lite with the stand-in codec of
tests/flashhead_standin.py at the LTX-Video VAE's geometry).

Error measure: ||cadence - reference|| / ||reference||. Tolerances: 1e-5 for one forward pass, the audio
projection and the wav2vec2 features (the same float32 operations up to SDPA's and the GEMMs' summation order,
RoPE angles in float32 where theirs are float64; measured ~1e-7 to 3e-7); 1e-4 for the stream (4 passes per
clip, the VAE's decode and encode, the CIELAB colour match, a second clip started from the first one's
re-encoded frames; measured <= 6e-6). The audio regrouping per latent frame is exact.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from family_fixtures import rel
from flashhead_standin import StandInCodec

from cadence.errors import ConfigError, WeightsError
from cadence.model.flashhead import (
    FlashHeadConfig,
    flashhead_files,
    load_flashhead,
    load_flashhead_model,
    weight_shapes,
)
from cadence.model.flashhead_stream import (
    FlashHeadAudio,
    FlashHeadClips,
    WanClipCodec,
    flashhead_timesteps,
    generate_offline,
    sample_clip,
)
from cadence.model.flashtalk import reference_image
from cadence.model.multitalk import latent_audio_windows

FIX = Path(__file__).parent / "fixtures" / "flashhead"
MODELS = FIX / "SoulX-FlashHead-tiny"
WAN_VAE = Path(__file__).parent / "fixtures" / "wan_vae" / "Wan2.1_VAE_tiny.pth"
META = json.loads((FIX / "fixture.json").read_text())
DATA = torch.load(FIX / "data.pt", weights_only=True)
FOLDER = {"pro": "Model_Pro", "lite": "Model_Lite"}
PIXELS = META["config"]["pixels"]
SEED = META["config"]["seed"]


@pytest.fixture(scope="module")
def models():
    return {v: load_flashhead_model(MODELS / f, "cpu", torch.float32) for v, f in FOLDER.items()}


@pytest.fixture(scope="module")
def features():
    from cadence.model.wav2vec2 import Wav2Vec2Features

    return Wav2Vec2Features(FIX / "wav2vec2-tiny", fps=25)


def speech() -> torch.Tensor:
    return DATA["pcm"].float() / 32768  # librosa.load's reading of the 16-bit samples


def test_config_from_the_folder_and_the_weights():
    for variant, cfg in META["config"]["variants"].items():
        c = FlashHeadConfig.from_folder(MODELS / FOLDER[variant])
        assert (c.dim, c.num_heads, c.num_layers, c.ffn_dim) == (cfg["dim"], 2, 2, cfg["ffn_dim"])
        assert (c.in_dim, c.out_dim, list(c.patch), list(c.vae_stride)) == (
            cfg["in_dim"],
            cfg["out_dim"],
            cfg["patch_size"],
            cfg["vae_stride"],
        )
        a = META["config"]["audio"]  # their AudioProjModel re-made small: read off the weights' shapes
        assert (c.audio_window, c.audio_frame_width, c.audio_hidden, c.audio_tokens, c.audio_width) == (
            a["window"],
            a["layers"] * a["channels"],
            a["hidden"],
            a["tokens"],
            cfg["dim"],
        )
        assert c.motion_frames() == DATA[f"stream_{variant}"]["motion_frames"]  # their (2 - 1) * stride + 1
    pro = FlashHeadConfig.from_folder(MODELS / "Model_Pro")
    assert pro.tokens(33, 32, 32) == 9 * 2 * 2 and pro.latent_frames(33) == 9


def test_bad_configs_are_refused(tmp_path):
    raw = json.loads((MODELS / "Model_Pro" / "config.json").read_text())
    shapes = weight_shapes(MODELS / "Model_Pro")
    with pytest.raises(ConfigError, match="lacks vae_stride"):
        FlashHeadConfig.from_config({k: v for k, v in raw.items() if k != "vae_stride"}, shapes)
    with pytest.raises(ConfigError, match="has_image_input"):
        FlashHeadConfig.from_config(dict(raw, has_image_input=True), shapes)
    with pytest.raises(WeightsError, match="patch_embedding.weight"):
        FlashHeadConfig.from_config(dict(raw, patch_size=[1, 1, 1]), shapes)
    with pytest.raises(WeightsError, match="2 blocks in the weights vs num_layers 3"):
        FlashHeadConfig.from_config(dict(raw, num_layers=3), shapes)
    with pytest.raises(
        WeightsError, match="proj1_vf"
    ):  # a vae_stride[0] the audio projection was not made for
        FlashHeadConfig.from_config(dict(raw, vae_stride=[8, 8, 8]), shapes)
    no_audio = {k: v for k, v in shapes.items() if not k.startswith("audio_proj.")}
    with pytest.raises(WeightsError, match="lack audio_proj.proj1.weight"):
        FlashHeadConfig.from_config(raw, no_audio)


@pytest.mark.parametrize("variant", ["pro", "lite"])
def test_forward_matches_flashhead(models, variant):
    model, d = models[variant], DATA[f"forward_{variant}"]
    ap = d["audio_proj"]
    first, later = latent_audio_windows(d["audio"], model.fcfg.vae_scale)
    assert torch.equal(first, ap["first"]) and torch.equal(later, ap["latter"])  # 5, then 3 + 1 x (s - 2) + 3
    assert later.shape[2] == model.fcfg.audio_window + model.fcfg.vae_scale - 1
    with torch.no_grad():
        assert rel(model.audio_proj(first, later), ap["tokens"]) <= 1e-5
        out = model(d["x"], d["t"], d["audio"], d["y"])
        err = rel(out, d["out"])
        assert err <= 1e-5, err
        ctx = model.audio_context(d["audio"])  # computed once per clip, read by every pass: the same numbers
        assert torch.equal(model(d["x"], d["t"], ctx, d["y"]), out)
        quiet = model(d["x"], d["t"], d["audio"] * 0, d["y"])
        other = model(d["x"], d["t"], ctx, d["y"].flip(2))
    assert (
        rel(quiet, d["out"]) > 1e-3 and rel(other, d["out"]) > 1e-3
    )  # the audio and the reference both matter
    with pytest.raises(ValueError, match="layers x C"):
        model.audio_context(d["audio"][..., :4])


def test_wav2vec2_features_match_preprocess_audio(features):
    w = DATA["wav2vec2"]
    got = features.encode(speech()[: w["samples"]])
    assert got.shape == w["features"].shape == (32, 2, 8)  # 32.5 frames of audio -> int() of it
    assert rel(got, w["features"]) <= 1e-5


@pytest.mark.parametrize("variant", ["pro", "lite"])
def test_audio_windows_match_their_stream(features, variant):
    """Their stream mode's audio: 28 (Pro) / 24 (Lite) frames a slice into an 8 s window, the last slice padded
    with silence (1.8 s of audio: two clips), wav2vec2 over the whole window, the last 33 frames' windows."""
    s = DATA[f"stream_{variant}"]
    audio = FlashHeadAudio(features, 16000, 33, s["motion_frames"])
    clips = audio.push(speech()) + audio.flush()
    assert len(clips) == len(s["windows"]) == 2
    for got, want in zip(clips, s["windows"]):
        assert got.shape == want.shape == (33, 5, 2, 8)
        assert rel(got, want) <= 1e-5


def test_timesteps():
    torch.testing.assert_close(
        flashhead_timesteps(4, 5.0), torch.tensor([1000.0, 937.5, 2500 / 3, 625.0, 0.0])
    )
    torch.testing.assert_close(flashhead_timesteps(2, 5.0), torch.tensor([1000.0, 2500 / 3, 0.0]))
    torch.testing.assert_close(
        flashhead_timesteps(3, 1.0), torch.tensor([1000.0, 500.5, 1.0, 0.0])
    )  # linspace


def pro_codec():
    from cadence.model.vae import load_wan_vae

    return WanClipCodec(load_wan_vae(WAN_VAE))


def test_pro_clips_from_their_motion_latents(models):
    """The Pro sampler alone (no VAE): each clip from the motion latents their run started it from, the
    reference latent of their ``prepare_params`` and one generator seeded as theirs (its draws in their order:
    clip 1's initial noise follows clip 0's five draws)."""
    s = DATA["stream_pro"]
    gen = torch.Generator().manual_seed(SEED)
    ts = flashhead_timesteps(4, 5.0)
    assert torch.equal(
        torch.randn(s["draws"][0].shape, generator=torch.Generator().manual_seed(SEED)), s["draws"][0]
    )
    errs = []
    for k in range(2):
        ctx = models["pro"].audio_context(s["windows"][k][None])
        errs.append(
            rel(sample_clip(models["pro"], gen, s["motion"][k], s["ref_latent"], ctx, ts), s["latents"][k])
        )
    assert s["motion"][0].shape[1] == 1 and s["motion"][1].shape[1] == 2  # the image's latent, then 5 frames'
    assert max(errs) <= 1e-4, errs


@pytest.mark.slow
def test_pro_stream_two_clips(models):
    """Their ``generate`` twice on the Pro model with the tiny Wan VAE: the reference latent (the image repeated
    over 33 frames, encoded), clip 0 from its first latent frame, decoded, colour-matched and its last 5 frames
    re-encoded into clip 1's motion latents; the seeded generator's draws in their order. Clip 1's own decode is
    the same step again (the next test runs the whole stream). ~5-10 s on two cores: three tiny Wan VAE
    passes."""
    import hashlib

    from PIL import Image

    assert hashlib.sha256(WAN_VAE.read_bytes()).hexdigest() == META["config"]["vae_sha256"]
    s = DATA["stream_pro"]
    ref = reference_image(Image.open(FIX / "image.png"), (PIXELS["pro"],) * 2)
    assert torch.equal(ref, s["cond_image"][0])  # resize_and_centercrop of a 45 x 37 image, exact
    clips = FlashHeadClips(models["pro"], pro_codec(), ref, SEED)
    errs = [rel(clips.ref_latent, s["ref_latent"]), rel(clips.motion, s["motion"][0])]
    frames = clips.next(s["windows"][0])
    errs += [rel(clips.last_latent, s["latents"][0]), rel(clips.motion, s["motion"][1])]
    assert frames.shape == (3, 28, 32, 32)
    pixels = ((frames + 1) / 2).permute(1, 2, 3, 0).clip(0, 1) * 255
    errs += [
        rel(pixels[:, ::4, ::4], s["frames_sub"][0]),
        rel(pixels.flatten(1).norm(dim=1), s["frame_norms"][0]),
    ]
    latent = sample_clip(
        clips.model, clips.generator, clips.motion, clips.ref_latent, s["windows"][1][None], clips.timesteps
    )
    errs.append(rel(latent, s["latents"][1]))
    assert max(errs) <= 1e-4, errs


def test_lite_stream_end_to_end(models, features):
    """Their whole stream mode on the Lite model (8 x 32 x 32, 9 motion frames, 24 new frames a clip) with the
    stand-in codec: Cadence's ``generate_offline`` from the PNG and the 16 kHz samples."""
    from PIL import Image

    s = DATA["stream_lite"]
    audio = FlashHeadAudio(features, 16000, 33, s["motion_frames"])
    out = generate_offline(
        models["lite"], StandInCodec(8), audio, Image.open(FIX / "image.png"), speech(), (64, 64), SEED
    )
    assert [tuple(f.shape) for f in out] == [(24, 64, 64, 3)] * 2
    errs = [rel(f[:, ::8, ::8], want) for f, want in zip(out, s["frames_sub"])]
    errs += [rel(f.flatten(1).norm(dim=1), want) for f, want in zip(out, s["frame_norms"])]
    assert max(errs) <= 1e-4, errs


@pytest.mark.slow
def test_pro_generate_offline(models, features):
    """Pro's whole stream mode, both clips decoded (~10 s on two cores: four tiny Wan VAE passes)."""
    from PIL import Image

    s = DATA["stream_pro"]
    audio = FlashHeadAudio(features, 16000, 33, s["motion_frames"])
    out = generate_offline(
        models["pro"], pro_codec(), audio, Image.open(FIX / "image.png"), speech(), (32, 32), SEED
    )
    errs = [rel(f[:, ::4, ::4], want) for f, want in zip(out, s["frames_sub"])]
    assert len(out) == 2 and max(errs) <= 1e-4, errs


def released_layout(tmp_path: Path, lite_vae: bool = True) -> Path:
    """The download as a user has it: SoulX-FlashHead-1_3B/{Model_Pro, Model_Lite, VAE_Wan, VAE_LTX} beside
    wav2vec2-base-960h/ (the tiny fixture's files)."""
    root = tmp_path / "SoulX-FlashHead-1_3B"
    for name in FOLDER.values():
        shutil.copytree(MODELS / name, root / name)
    (root / "VAE_Wan").mkdir()
    shutil.copy(WAN_VAE, root / "VAE_Wan" / "Wan2.1_VAE.pth")
    if lite_vae:
        shutil.copytree(MODELS / "VAE_LTX", root / "VAE_LTX")
    shutil.copytree(FIX / "wav2vec2-tiny", tmp_path / "wav2vec2-base-960h")
    return root


def test_released_folder_loads(tmp_path):
    root = released_layout(tmp_path)
    files = flashhead_files(root, "pro")
    assert (files.model.name, files.vae.name, files.wav2vec2.name) == (
        "Model_Pro",
        "Wan2.1_VAE.pth",
        "wav2vec2-base-960h",
    )
    assert (
        flashhead_files(root / "Model_Lite", "lite").vae == root / "VAE_LTX"
    )  # the model folder itself also
    parts = load_flashhead(root, "pro", dtype=torch.float32)
    assert isinstance(parts.codec, WanClipCodec) and parts.cfg.vae_stride == (4, 8, 8)
    lite = load_flashhead(
        root, "lite", dtype=torch.float32, ltx_loader=lambda folder, dev, dt: StandInCodec(8)
    )
    assert lite.cfg.patch == (1, 1, 1) and isinstance(lite.codec, StandInCodec)


def test_incomplete_folders_name_what_is_missing(tmp_path, monkeypatch):
    root = released_layout(tmp_path, lite_vae=False)
    with pytest.raises(ConfigError, match=r"missing VAE_LTX/ \(the LTX-Video VAE folder"):
        flashhead_files(root, "lite")
    (root / "VAE_Wan" / "Wan2.1_VAE.pth").unlink()
    shutil.rmtree(tmp_path / "wav2vec2-base-960h")
    with pytest.raises(ConfigError) as e:  # both, in one error
        flashhead_files(root, "pro")
    assert "VAE_Wan/Wan2.1_VAE.pth" in str(e.value) and "a wav2vec2 folder" in str(e.value)
    with pytest.raises(ConfigError, match="choose 'pro' or 'lite'"):
        flashhead_files(root, "max")
    with pytest.raises(ConfigError, match="not a folder"):
        flashhead_files(tmp_path / "nowhere", "pro")
    root = released_layout(tmp_path / "again")
    monkeypatch.setitem(sys.modules, "cadence.model.ltx_vae", None)  # a build without the LTX-Video VAE
    with pytest.raises(ConfigError, match="LTX-Video VAE"):
        load_flashhead(root, "lite", dtype=torch.float32)


def test_wrong_wav2vec2_is_refused(tmp_path):
    root = released_layout(tmp_path)
    w2v = tmp_path / "wav2vec2-base-960h"
    cfg = json.loads((w2v / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (w2v / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="gives 1 layers of 8 per frame; Model_Pro reads 16"):
        load_flashhead(root, "pro", dtype=torch.float32)


def test_other_families_weights_are_refused():
    with pytest.raises(ConfigError, match="config.json lacks patch_size, vae_stride"):  # FlashTalk's folder
        load_flashhead_model(
            Path(__file__).parent / "fixtures" / "flashtalk" / "flashtalk_tiny", "cpu", torch.float32
        )


@pytest.mark.parametrize("variant", ["pro", "lite"])
def test_pass_flops_count_what_runs(models, variant, monkeypatch):
    """The analytic count against what the pass runs: GEMMs as torch's FLOP counter counts them, attention from
    the shapes every attention call sees (4 B H Nq Nk D: QK^T and AV)."""
    from torch.utils.flop_counter import FlopCounterMode

    import cadence.model.dit as dit
    import cadence.model.full as full
    from cadence.model.flashhead import pass_flops

    seen = []

    def counting(real):
        def attention(q, k, v, mask=None):
            seen.append(4 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * q.shape[3])
            return real(q, k, v, mask)

        return attention

    monkeypatch.setattr(dit, "attention", counting(dit.attention))
    monkeypatch.setattr(full, "attention", counting(full.attention))
    d = DATA[f"forward_{variant}"]
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        models[variant](d["x"], d["t"], d["audio"], d["y"])
    want = pass_flops(models[variant].fcfg, 33, PIXELS[variant], PIXELS[variant])
    assert want["linear"] == fc.get_total_flops() and want["attention"] == sum(seen)
    assert want["tokens"] == (36 if variant == "pro" else 20)


def test_sample_clip_rounds_timesteps_as_their_bf16_pipeline():
    """Their pipeline casts each timestep to the model's dtype before the model embeds it, and t / 1000 before
    the x0 / re-noise arithmetic: in bf16 937.5 stays, 833.3 -> 832, 625 -> 624 (and 0.8333 -> 0.832). A stub
    model (zero flow) shows both: the timesteps it is given, and the latent as the re-noising chain of the draws
    with the rounded coefficients. The motion latents are pinned."""

    class Stub:
        dtype, device, seen = torch.bfloat16, torch.device("cpu"), []

        def __call__(self, x, t, ctx, ref):
            self.seen.append(t)
            return torch.zeros_like(x)

    ts = flashhead_timesteps(4, 5.0)
    draws = [torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    motion = torch.ones(2, 1, 2, 2)
    model = Stub()
    got = sample_clip(model, draws, motion, torch.zeros(2, 3, 2, 2), object(), ts)
    assert [float(t) for t in model.seen] == [1000.0, 936.0, 832.0, 624.0]
    assert all(t.dtype == torch.bfloat16 for t in model.seen)
    c = (ts / 1000).to(torch.bfloat16).float()
    want = draws[0].clone()
    for i in range(4):
        want[:, :1] = 1.0
        want = (1 - c[i + 1]) * want + c[i + 1] * draws[i + 1]
    want[:, :1] = 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_face_crop_geometry_matches_process_image(caplog):
    """Their ``use_face_crop`` with the detector's answer given (MediaPipe is not a dependency): the crop around
    the box (2x its width, 55 % above its centre, clamped at the edges) resized, pixel for pixel."""
    from PIL import Image

    from cadence.media.face_crop import crop_around_box, face_crop

    fc = DATA["face_crop"]
    image = Image.open(FIX / "image.png").convert("RGB")
    for box, want in zip(fc["boxes"].tolist(), fc["crops"]):
        got = torch.from_numpy(np.array(crop_around_box(image, box, 2.0, (24, 20))))
        assert torch.equal(got, want)
        assert torch.equal(
            torch.from_numpy(np.array(face_crop(image, 2.0, (24, 20), lambda im, box=box: box))), want
        )
    assert face_crop(image, detector=lambda im: None) is not image  # converted copy, uncropped
    assert face_crop(image, detector=lambda im: None).size == image.size and "no face" in caplog.text

    def missing(im):
        raise ImportError("No module named 'mediapipe'")

    assert face_crop(image, detector=missing).size == image.size and "mediapipe" in caplog.text


def released_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a released folder of ``cfg`` holds (their module names; the keys the loader reads),
    with their hard-coded audio projection: 5 x 12 x 768 features -> 512 -> 32 tokens of 1536."""
    d, s = cfg["dim"], cfg["vae_stride"][0]
    shapes = {
        "patch_embedding.weight": (d, cfg["in_dim"], *cfg["patch_size"]),
        "head.head.weight": (cfg["out_dim"] * math.prod(cfg["patch_size"]), d),
        "time_embedding.0.weight": (d, cfg["freq_dim"]),
        "audio_proj.proj1.weight": (512, 5 * 12 * 768),
        "audio_proj.proj1_vf.weight": (512, (5 + s - 1) * 12 * 768),
        "audio_proj.proj3.weight": (32 * 1536, 512),
        "audio_proj.norm.weight": (1536,),
    }
    for i in range(cfg["num_layers"]):
        shapes[f"blocks.{i}.ffn.0.weight"] = (cfg["ffn_dim"], d)
        shapes[f"blocks.{i}.cross_attn.k.weight"] = (d, d)
    return shapes


def test_released_geometry():
    """Pro and Lite as released (config.json as their ``WanModelAudioProject`` takes it: Wan2.1-1.3B's sizes; Lite
    on the LTX-Video VAE's 128 channels, 8 x 32 x 32, one token per latent position), 512 x 512, 33 frames."""
    from cadence.model.flashhead import pass_flops

    wan13 = dict(dim=1536, num_heads=12, num_layers=30, ffn_dim=8960, freq_dim=256, eps=1e-6, text_dim=4096)
    pro = dict(
        wan13, in_dim=32, out_dim=16, patch_size=[1, 2, 2], vae_stride=[4, 8, 8], has_image_input=False
    )
    lite = dict(wan13, in_dim=256, out_dim=128, patch_size=[1, 1, 1], vae_stride=[8, 32, 32])
    got = {}
    for name, raw in (("pro", pro), ("lite", lite)):
        c = FlashHeadConfig.from_config(raw, released_shapes(raw))
        assert (c.audio_window, c.audio_frame_width, c.audio_hidden, c.audio_tokens, c.audio_width) == (
            5,
            12 * 768,
            512,
            32,
            1536,
        )
        got[name] = (
            c.latent_frames(33),
            c.tokens(33, 512, 512),
            c.motion_frames(),
            pass_flops(c, 33, 512, 512),
        )
    assert got["pro"][:3] == (9, 9 * 32 * 32, 5) and got["lite"][:3] == (5, 5 * 16 * 16, 9)
    assert 38e12 < got["pro"][3]["total"] < 39e12 and 3.5e12 < got["lite"][3]["total"] < 3.6e12  # per pass


def test_sessions_batch_into_one_pass(models):
    """Two clips (two sessions' latents, references, timesteps and audio) in one pass equal each alone: the
    cross-attention reads each sample's own frames' audio tokens."""
    d = DATA["forward_pro"]
    m = models["pro"]
    g = torch.Generator().manual_seed(3)
    x2, y2, a2 = (torch.randn(t.shape, generator=g) for t in (d["x"], d["y"], d["audio"]))
    t = torch.tensor([937.5, 625.0])
    with torch.no_grad():
        both = m(torch.cat([d["x"], x2]), t, torch.cat([d["audio"], a2]), torch.cat([d["y"], y2]))
        one = m(d["x"], t[:1], d["audio"], d["y"])
        two = m(x2, t[1:], a2, y2)
    assert rel(both[:1], one) <= 1e-5 and rel(both[1:], two) <= 1e-5


def test_random_build_at_the_released_size_is_cheap():
    from cadence.model.flashhead import build_flashhead, released_config

    c = released_config("lite")
    small = dict(num_layers=1, dim=64, num_heads=2, ffn_dim=128, audio_frame_width=16, audio_hidden=8)
    small = FlashHeadConfig(**{**c.__dict__, **small, "audio_tokens": 4, "audio_width": 64})
    m = build_flashhead(small, "cpu", torch.float32, seed=0)
    assert m.patch_embed.weight.shape == (64, 256) and m.head.proj.weight.shape == (128, 64)
    assert torch.isfinite(m.patch_embed.weight).all() and m.blocks[0].modulation.std() > 0
    with pytest.raises(ConfigError, match="choose 'pro' or 'lite'"):
        released_config("max")
