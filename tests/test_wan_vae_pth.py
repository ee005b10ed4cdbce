"""Wan's original VAE file layouts in Cadence's streaming Wan VAE, against Wan's own VAE code: Wan 2.1
(Wan2.1_VAE.pth; fixture tests/fixtures/wan_vae, made by scripts/fixtures/make_wan_vae.py) and Wan 2.2
(Wan2.2_VAE.pth: z 48, patch 2, residual stages; fixture tests/fixtures/wan22_vae, made by
scripts/fixtures/make_wan22_vae.py from Wan-Video/Wan2.2's vae2_2.py through its own Wan2_2_VAE loader,
encode and decode, with its own 48 latent means / stds).

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
    with pytest.raises(WeightsError, match=r"not Wan 2\.1's or 2\.2's VAE layout"):
        WanVAE.from_wan_pth(g)


def test_load_wan_vae_dispatches_on_file_or_folder(tmp_path):
    from cadence.model.vae import load_wan_vae

    assert load_wan_vae(PTH).config["base_dim"] == 4
    with pytest.raises(WeightsError, match=r"no \.safetensors file"):
        (tmp_path / "vae").mkdir()
        (tmp_path / "vae" / "config.json").write_text("{}")
        load_wan_vae(tmp_path / "vae")


# ---- Wan 2.2 ----------------------------------------------------------------------------------------------

FIX22 = Path(__file__).parent / "fixtures" / "wan22_vae"
PTH22 = FIX22 / "Wan2.2_VAE_tiny.pth"
DATA22 = torch.load(FIX22 / "data.pt", weights_only=True)


def test_wan22_geometry_is_read_off_the_file():
    vae = WanVAE.from_wan_pth(PTH22)
    c = vae.config
    assert (c["base_dim"], c["decoder_base_dim"], c["z_dim"], c["num_res_blocks"]) == (3, 2, 48, 2)
    assert c["is_residual"] and c["patch_size"] == 2 and list(c["temperal_downsample"]) == [False, True, True]
    assert vae.stride == (4, 16, 16)


def test_wan22_latent_statistics_are_wan22s_own():
    """The 48 means / stds Cadence normalises with are Wan2_2_VAE's (not 0 / 1), from the file alone and in
    the released 2.2 config."""
    from cadence.model.vae import wan_vae_config

    vae = WanVAE.from_wan_pth(PTH22)
    assert rel(vae.latents_mean, DATA22["mean"]) <= 1e-6 and rel(vae.latents_std, DATA22["std"]) <= 1e-6
    cfg = wan_vae_config("2.2")
    assert torch.allclose(torch.tensor(cfg["latents_mean"]), DATA22["mean"], atol=1e-6)
    assert torch.allclose(torch.tensor(cfg["latents_std"]), DATA22["std"], atol=1e-6)


def test_wan22_encode_matches_reference():
    vae = WanVAE.from_wan_pth(PTH22)
    lat = vae.normalize_latents(vae.encode(DATA22["video"]))  # [48, F, h, w], Wan2_2_VAE.encode's scale
    err = rel(lat, DATA22["latent"])
    assert err <= 1e-5, err


@pytest.mark.parametrize("split", [(3,), (1, 2), (1, 1, 1)])
def test_wan22_streamed_decode_matches_reference(split):
    vae = WanVAE.from_wan_pth(PTH22)
    z = vae.denormalize_latents(DATA22["z"])  # normalised -> raw, as Wan2_2_VAE.decode does
    st = vae.stream()
    parts, i = [], 0
    for n in split:
        parts.append(st.decode_chunk(z[:, i : i + n]))
        i += n
    err = rel(torch.cat(parts, dim=1), DATA22["frames"])
    assert err <= 1e-4, err


def test_bad_wan22_file_names_what_is_wrong(tmp_path):
    sd = torch.load(PTH22, weights_only=True)
    del sd["decoder.upsamples.0.upsamples.3.time_conv.bias"]
    sd["decoder.middle.1.proj.weight"] = sd["decoder.middle.1.proj.weight"][:1]
    f = tmp_path / "broken22.pth"
    torch.save(sd, f)
    with pytest.raises(WeightsError) as e:
        WanVAE.from_wan_pth(f)
    msg = str(e.value)
    assert "broken22.pth" in msg and "missing 1: decoder.up_blocks.0.upsampler.time_conv.bias" in msg
    assert "shape mismatch 1: decoder.mid_block.attentions.0.proj.weight" in msg


def test_load_wan_vae_reads_a_wan22_pth():
    from cadence.model.vae import load_wan_vae

    assert load_wan_vae(PTH22).z_dim == 48
