"""Training of the default character (cadence.train.character) at toy size on the CPU.

* The training sequence shows each noisy chunk exactly what the engine's cache shows it in a stream
  (sink + clean chunks committed by a clean pass), float32: relative error ~1e-7 (float32 rounding of
  two orders of the same sums); bound 1e-5.
* A toy run (seconds) writes weights that ``build_generator`` loads and streams; the VAE loss goes down.
"""

import json
import math

import pytest
import torch
from streams import engine_stream

from cadence.config import get_preset
from cadence.engine.session import build_generator, make_cache
from cadence.model.audio import AudioFeatures
from cadence.model.text import ByteTextEncoder
from cadence.model.weights import build_model
from cadence.train.character import TrainConfig, sequence_layout, toy_config, train


def _toy_cfg(**stream):
    return get_preset("character").with_overrides(
        model={"dim": 64, "num_heads": 2, "head_dim": 32, "ffn_dim": 128, "num_layers": 2, "weights": None},
        vae={"weights": None, "base_dim": 8, "taehv_channels": (16, 16)},
        stream={"height": 64, "width": 64, "cache": "naive", **stream},
    )


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("window", [2, 4])
def test_training_sequence_equals_cached_stream(window):
    cfg = _toy_cfg(window_chunks=window)
    torch.manual_seed(0)
    model = build_model(cfg, "cpu", torch.float32, seed=3)
    W = window
    z, (h, w) = cfg.vae.latent_channels, cfg.latent_hw
    tpf = (h // 2) * (w // 2)
    lat = torch.randn(1, z, 1 + W, h, w)  # sink + W chunks (clean)
    xt = torch.randn(1, z, W, h, w)  # noisy copies
    sig = torch.tensor([0.9, 0.6, 0.3, 0.8][:W])
    feats = AudioFeatures(cfg)
    audio = feats(torch.randn(W * feats.samples_per_frame) * 0.2).reshape(
        W, *feats(torch.zeros(feats.samples_per_frame)).shape[1:]
    )
    silence = feats(torch.zeros(feats.samples_per_frame))
    text = ByteTextEncoder(cfg.model)("a friendly face")

    pos, mask = sequence_layout(W, tpf)
    x = torch.cat([lat[:, :, :W], xt], 2)  # sink, c_1..c_{W-1}, n_1..n_W
    t = torch.cat([torch.zeros(W), 1000 * sig])[None]
    aud = torch.cat([silence, audio[: W - 1], audio])[None]
    with torch.no_grad():
        out = model.forward_full(x, t, text[None], aud, mask=mask, frame_positions=pos)[0, :, W:]

        # the engine: sink, then clean chunks committed one by one (what a clean-pass commit stores)
        ctx = model.prepare_text(text[None])
        for i in range(1, W + 1):
            cache = make_cache(cfg, model)
            cache.begin_chunk(0, 1, sink=True)
            model.forward_chunk(lat[0, :, :1], torch.zeros(1), ctx, silence, cache, commit=True)
            for j in range(1, i):
                cache.begin_chunk(j, 1)
                model.forward_chunk(
                    lat[0, :, j : j + 1], torch.zeros(1), ctx, audio[j - 1 : j], cache, commit=True
                )
            cache.begin_chunk(i, 1)
            ref = model.forward_chunk(
                xt[0, :, i - 1 : i], 1000 * sig[i - 1 : i], ctx, audio[i - 1 : i], cache, commit=False
            )
            assert _rel(out[:, i - 1 : i], ref) < 1e-5, (i, _rel(out[:, i - 1 : i], ref))


@pytest.mark.slow
def test_toy_training_writes_loadable_weights(tmp_path):
    tc = toy_config()
    tc.vae_steps = 12
    log = train(tc, tmp_path, "cpu")
    for f in (
        "dit.safetensors",
        "train_log.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "vae/taehv.json",
        "vae/taehv.safetensors",
    ):
        assert (tmp_path / f).is_file(), f
    saved = json.loads((tmp_path / "train_log.json").read_text())
    assert saved["dit"]["steps"] == tc.dit_steps and saved["vae"]["steps"] == tc.vae_steps
    assert all(math.isfinite(v) for v in saved["vae"]["loss_first"] + [saved["dit"]["loss_last_100"]])
    # the VAE learns: its last losses are below its first (12 steps at lr 1e-3 on 6 clips)
    assert log["vae"]["loss_last_100"] < log["vae"]["loss_first"][0]
    vcfg = json.loads((tmp_path / "vae/config.json").read_text())
    assert len(vcfg["latents_std"]) == 16 and all(s > 0 for s in vcfg["latents_std"])

    cfg = (
        get_preset("character")
        .with_overrides(**tc.overrides)
        .with_overrides(
            model={"weights": str(tmp_path / "dit.safetensors")}, vae={"weights": str(tmp_path / "vae")}
        )
    )
    gen = build_generator(cfg, "cpu")
    # loaded, not random: a parameter equals the saved (float16) one
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "dit.safetensors"))
    k = next(k for k in sd if k.endswith("audio_pos"))
    assert torch.equal(dict(gen.model.named_parameters())[k].half(), sd[k])
    image = torch.rand(3, 64, 64) * 2 - 1
    audio = torch.randn(3 * cfg.audio_samples_per_chunk) * 0.1
    outs = list(engine_stream(gen, image, "hello", audio, 3, seed=1))
    assert [tuple(o.frames.shape) for o in outs] == [(4, 64, 64, 3)] * 3


def test_train_config_checks_window():
    tc = TrainConfig(**{**toy_config().__dict__, "latents": 2, "window": 4})
    with pytest.raises(ValueError, match="window"):
        train(tc, None, "cpu")
