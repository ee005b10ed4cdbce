"""Wan 2.1's original VAE file layout (Wan2.1_VAE.pth) in Cadence's streaming Wan VAE, against Wan's own
VAE code (fixture: tests/fixtures/wan_vae, made by scripts/fixtures/make_wan_vae.py).

Error measure: ||cadence - reference|| / ||reference||, float32 on the CPU. Tolerances: encode 1e-5 (the
same float32 convolutions, another module layout), decode 1e-4 (the decoder's tolerance; chunked
streaming as the engine runs it, against the reference's frame-by-frame decode of the whole latent).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cadence.errors import WeightsError
from cadence.model.vae import WanVAE

FIX = Path(__file__).parent / "fixtures" / "wan_vae"
PTH = FIX / "Wan2.1_VAE_tiny.pth"
DATA = torch.load(FIX / "data.pt", weights_only=True)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_encode_matches_reference():
    vae = WanVAE.from_wan_pth(PTH)
    lat = vae.normalize_latents(vae.encode(DATA["video"]))  # [z, F, h, w]
    err = rel(lat, DATA["latent"].transpose(0, 1))
    assert err <= 1e-5, err


@pytest.mark.parametrize("split", [(3,), (1, 2), (1, 1, 1)])
def test_streamed_decode_matches_reference(split):
    vae = WanVAE.from_wan_pth(PTH)
    z = vae.denormalize_latents(DATA["z"].transpose(0, 1))  # normalised [z, F, h, w] -> raw
    st = vae.stream()
    parts, i = [], 0
    for n in split:
        parts.append(st.decode_chunk(z[:, i : i + n]))
        i += n
    out = torch.cat(parts, dim=1)  # [3, T, H, W]
    err = rel(out, DATA["frames"].transpose(0, 1))
    assert err <= 1e-4, err


def test_latent_statistics_are_wan21s():
    vae = WanVAE.from_wan_pth(PTH)
    assert abs(float(vae.latents_mean[0]) + 0.7571) < 1e-6 and abs(float(vae.latents_std[0]) - 2.8184) < 1e-6


def test_bad_wan_vae_files(tmp_path):
    sd = torch.load(PTH, weights_only=True)
    del sd["decoder.upsamples.4.shortcut.bias"]
    f = tmp_path / "broken.pth"
    torch.save(sd, f)
    with pytest.raises(
        WeightsError,
        match=r"broken\.pth: .*missing 1: decoder\.up_blocks\.1\.resnets\.0\.conv_shortcut\.bias",
    ):
        WanVAE.from_wan_pth(f)
    g = tmp_path / "other.pth"
    torch.save({"blocks.0.weight": torch.zeros(2)}, g)
    with pytest.raises(WeightsError, match=r"not Wan 2\.1's VAE layout"):
        WanVAE.from_wan_pth(g)


def test_load_wan_vae_dispatches_on_file_or_folder(tmp_path):
    from cadence.model.vae import load_wan_vae

    assert load_wan_vae(PTH).config["base_dim"] == 4
    with pytest.raises(WeightsError, match=r"no \.safetensors file"):
        (tmp_path / "vae").mkdir()
        (tmp_path / "vae" / "config.json").write_text("{}")
        load_wan_vae(tmp_path / "vae")
