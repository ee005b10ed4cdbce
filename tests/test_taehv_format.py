"""The published TAEHV weight format (taew2_1 / taew2_2 .pth) in Cadence's tiny decoder, against the
reference taehv.py (fixture: tests/fixtures/taehv, made by scripts/fixtures/make_taehv.py).

The fixture keeps the recipe of the random weights, not the weights (~10M decoder parameters per variant):
they are regenerated here with the same seeded generator, checked against the fixture's per-tensor sums,
and written as a published-format ``.pth`` (the reference model's whole state dict, encoder included),
which Cadence then reads with ``load_published_taehv``.

Error measure: ||cadence - reference|| / ||reference|| over the decoded frames, both mapped to [0, 1];
tolerance 1e-4 (float32 convolutions through ~20 layers; the reference's own sequential and parallel
modes differ by up to 5e-6 absolute, recorded in fixture.json).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cadence.errors import WeightsError
from cadence.model.taehv import PublishedTAEHV, load_published_taehv

FIX = Path(__file__).parent / "fixtures" / "taehv"
META = json.loads((FIX / "fixture.json").read_text())
DATA = torch.load(FIX / "data.pt", weights_only=True)


def regenerate(name: str) -> dict[str, torch.Tensor]:
    v = META["variants"][name]
    shapes = [(k, tuple(s)) for k, s in v["shapes"]]
    g = torch.Generator().manual_seed(v["seed"])
    last_bias = [k for k, _ in shapes if k.startswith("decoder.") and k.endswith(".bias")][-1]
    sd = {}
    for k, shape in shapes:
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        sd[k] = (
            t * 0.02 + (0.5 if k == last_bias else 0.0)
            if k.endswith(".bias")
            else t / math.sqrt(math.prod(shape[1:]))
        )
        s, s2 = DATA[name]["checksums"][k]
        assert abs(float(sd[k].double().sum()) - s) <= 1e-6 * max(1.0, abs(s)) + 1e-9, (
            f"{k}: regenerated weights differ"
        )
        assert abs(float(sd[k].double().pow(2).sum()) - s2) <= 1e-6 * s2 + 1e-12, k
    return sd


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module", params=["taew2_1", "taew2_2"])
def variant(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("taehv") / f"{name}.pth"
    torch.save(regenerate(name), path)
    return name, path


def test_loads_published_file_with_its_geometry(variant):
    name, path = variant
    m = load_published_taehv(path)
    v = META["variants"][name]
    assert (m.latent_channels, m.patch_size) == (v["latent_channels"], v["patch_size"])
    assert m.stride == (4, 8, 8) if name == "taew2_1" else m.stride == (4, 16, 16)
    assert sum(p.numel() for p in m.parameters()) == v["decoder_params"]


def test_whole_decode_matches_reference(variant):
    name, path = variant
    m = load_published_taehv(path)
    lat = DATA[name]["latents"].transpose(0, 1)  # NTCHW frame-major -> Cadence [z, F, h, w]
    out = m.decode_video(lat)  # [3, T, H, W] in [-1, 1]
    ref = DATA[name]["frames"].transpose(0, 1)  # [T, 3, H, W] in [0, 1] -> [3, T, H, W]
    assert out.shape == ref.shape
    err = rel((out + 1) / 2, ref)
    assert err <= 1e-4, err


def test_streamed_decode_matches_reference(variant):
    """One latent frame per call through the session's stream state equals the reference's whole decode."""
    name, path = variant
    m = load_published_taehv(path)
    lat = DATA[name]["latents"].transpose(0, 1)
    st = m.stream()
    parts = [st.decode_chunk(lat[:, i : i + 1]) for i in range(lat.shape[1])]
    assert [p.shape[1] for p in parts] == [1] + [4] * (lat.shape[1] - 1)  # Wan's frame count
    out = torch.cat(parts, dim=1)
    err = rel((out + 1) / 2, DATA[name]["frames"].transpose(0, 1))
    assert err <= 1e-4, err


def test_bad_taehv_files_are_named(tmp_path):
    sd = regenerate("taew2_1")
    broken = dict(sd)
    broken["decoder.9.conv.2.weight"] = torch.zeros(128, 128, 1, 1)
    del broken["decoder.15.conv.4.bias"]
    f = tmp_path / "broken.pth"
    torch.save(broken, f)
    with pytest.raises(
        WeightsError, match=r"broken\.pth do not fit .*missing \['15\.conv\.4\.bias'\].*9\.conv\.2\.weight"
    ):
        load_published_taehv(f)
    enc_only = tmp_path / "enc.pth"
    torch.save({k: v for k, v in sd.items() if k.startswith("encoder.")}, enc_only)
    with pytest.raises(WeightsError, match=r"no decoder\.\* entries"):
        load_published_taehv(enc_only)
    with pytest.raises(WeightsError, match=r"do not exist"):
        load_published_taehv(tmp_path / "missing.pth")


def test_default_published_geometry():
    m = PublishedTAEHV()
    assert m.stride == (4, 8, 8) and m.n_slots == 9


def test_decoder_from_config(variant):
    from dataclasses import replace

    from cadence.config import get_preset
    from cadence.errors import ConfigError
    from cadence.model.taehv import tiny_decoder_from_config

    name, path = variant
    base = get_preset("tiny") if name == "taew2_1" else get_preset("w14")
    cfg = replace(base, vae=replace(base.vae, decoder="taehv", taehv_weights=str(path)))
    assert isinstance(tiny_decoder_from_config(cfg), PublishedTAEHV)
    other = get_preset("w14") if name == "taew2_1" else get_preset("tiny")
    with pytest.raises(ConfigError, match=r"the VAE is z="):
        tiny_decoder_from_config(
            replace(other, vae=replace(other.vae, decoder="taehv", taehv_weights=str(path)))
        )
    assert tiny_decoder_from_config(get_preset("tiny")) is None
