"""Streaming Wan VAE vs diffusers' AutoencoderKLWan (shared random weights, CPU, float32), and the
TAEHV-style tiny decoder's streaming state.

Tolerance: relative L2 <= 1e-5 and max abs <= 1e-4 on outputs of magnitude ~0.1-1 (measured: decode
<= 1.1e-6 relative / 5e-6 max abs, encode <= 9e-7 relative; only float32 summation order differs,
e.g. spatial padding done inside the conv).
"""

from __future__ import annotations

import time

import pytest
import torch

from cadence.errors import ConfigError, WeightsError
from cadence.model.taehv import TAEHV
from cadence.model.vae import WanVAE, wan_vae_config

diffusers = pytest.importorskip("diffusers")

REL_TOL = 1e-5
ABS_TOL = 1e-4
LAT_HW = (4, 6)  # latent height, width
N_LAT = 5  # latent frames decoded (1 + 4 chunks)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _tiny_cfg(variant: str) -> dict:
    # small widths, one residual block per stage; the 2.2 decoder gets its own width as released
    extra = {"decoder_base_dim": 12} if variant == "2.2" else {}
    return wan_vae_config(variant, base_dim=8, num_res_blocks=1, **extra)


@pytest.fixture(scope="module", params=["2.1", "2.2"])
def pair(request):
    """(diffusers AutoencoderKLWan, our WanVAE) sharing random weights."""
    torch.manual_seed(0)
    cfg = _tiny_cfg(request.param)
    ref = diffusers.AutoencoderKLWan(**cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    ours = WanVAE(cfg).eval()
    ours.load_diffusers_state_dict(ref.state_dict())
    return request.param, ref, ours


def _ref_decode(ref, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref.decode(z[None]).sample[0]


def _stream(ours: WanVAE, z: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    st = ours.stream()
    outs, i = [], 0
    for n in sizes:
        o = st.decode_chunk(z[:, i : i + n])
        assert o.shape[1] == ours.frames_for(n, first=i == 0)
        outs.append(o)
        i += n
    assert i == z.shape[1] and st.latent_frames == i and st.video_frames == ours.frames_for(i)
    return torch.cat(outs, 1)


def test_geometry(pair):
    variant, _, ours = pair
    assert ours.stride == ((4, 8, 8) if variant == "2.1" else (4, 16, 16))
    assert ours.z_dim == (16 if variant == "2.1" else 48)


@pytest.mark.parametrize("sizes", [[1, 1, 1, 1, 1], [1, 2, 2], [2, 2, 1], [5]])
def test_streaming_decode_matches_diffusers(pair, sizes):
    _, ref, ours = pair
    torch.manual_seed(1)
    z = torch.randn(ours.z_dim, N_LAT, *LAT_HW)
    want = _ref_decode(ref, z)
    got = _stream(ours, z, sizes)
    assert (
        got.shape
        == want.shape
        == (3, 1 + 4 * (N_LAT - 1), LAT_HW[0] * ours.stride[1], LAT_HW[1] * ours.stride[2])
    )
    assert (want.abs() < 1).float().mean() > 0.5  # mostly unclamped: the comparison means something
    assert _rel(got, want) <= REL_TOL
    assert (got - want).abs().max() <= ABS_TOL


def test_encode_matches_diffusers(pair):
    _, ref, ours = pair
    torch.manual_seed(2)
    s = ours.stride[1]
    video = torch.rand(3, 9, 4 * s, 6 * s) * 2 - 1
    with torch.no_grad():
        want_v = ref.encode(video[None]).latent_dist.mode()[0]
        want_i = ref.encode(video[None, :, :1]).latent_dist.mean[0]
    got_v = ours.encode(video)
    got_i = ours.encode_image(video[:, 0])
    assert got_v.shape == want_v.shape == (ours.z_dim, 3, 4, 6)
    assert got_i.shape == want_i.shape == (ours.z_dim, 1, 4, 6)
    assert _rel(got_v, want_v) <= REL_TOL and _rel(got_i, want_i) <= REL_TOL
    assert torch.allclose(got_i, got_v[:, :1], atol=1e-5)  # causal: the first frame's latent is the image's


def test_sessions_interleaved_and_reset(pair):
    _, ref, ours = pair
    torch.manual_seed(3)
    za, zb = torch.randn(2, ours.z_dim, 4, *LAT_HW)
    want_a, want_b = _ref_decode(ref, za), _ref_decode(ref, zb)
    sa, sb = ours.stream(), ours.stream()
    outs_a, outs_b = [], []
    for i in range(4):  # alternate the two sessions chunk by chunk
        outs_a.append(sa.decode_chunk(za[:, i : i + 1]))
        outs_b.append(sb.decode_chunk(zb[:, i : i + 1]))
    assert _rel(torch.cat(outs_a, 1), want_a) <= REL_TOL
    assert _rel(torch.cat(outs_b, 1), want_b) <= REL_TOL
    sa.reset()  # a reset session starts a new stream: b's latents now decode as b's
    assert sa.latent_frames == 0
    assert _rel(_stream(ours, zb, [4]), want_b) <= REL_TOL
    assert _rel(torch.cat([sa.decode_chunk(zb[:, :2]), sa.decode_chunk(zb[:, 2:])], 1), want_b) <= REL_TOL


def test_latent_normalisation(pair):
    _, ref, ours = pair
    z = torch.randn(ours.z_dim, 2, 3, 3)
    mean = torch.tensor(ref.config.latents_mean or [0.0] * ours.z_dim).view(-1, 1, 1, 1)
    std = torch.tensor(ref.config.latents_std or [1.0] * ours.z_dim).view(-1, 1, 1, 1)
    assert torch.allclose(ours.normalize_latents(z), (z - mean) / std)  # as diffusers' Wan pipelines do
    assert torch.allclose(ours.denormalize_latents(ours.normalize_latents(z)), z, atol=1e-5)
    assert ours.normalize_latents(z[None]).shape == (1, *z.shape)


def test_weight_errors(pair):
    _, ref, _ = pair
    cfg = dict(ref.config)
    sd = ref.state_dict()
    fresh = WanVAE(cfg)
    bad = dict(sd)
    bad.pop("decoder.conv_out.weight")
    bad["decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(WeightsError, match="missing 1: decoder.conv_out.weight.*unexpected 1: decoder.extra"):
        fresh.load_diffusers_state_dict(bad)
    bad = dict(sd)
    bad["quant_conv.weight"] = torch.zeros(1, 1, 1, 1, 1)
    with pytest.raises(WeightsError, match="shape mismatch 1: quant_conv.weight"):
        fresh.load_diffusers_state_dict(bad)
    with pytest.raises(ConfigError):
        wan_vae_config("3.0")


# ---- TAEHV ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stride,z", [((4, 8, 8), 16), ((4, 16, 16), 48)])
def test_taehv_shapes_and_streaming(stride, z):
    torch.manual_seed(4)
    chans = (32, 24, 16, 16) if stride[1] == 8 else (32, 24, 16, 16, 8)
    model = TAEHV(z, stride, channels=chans).eval()
    lat = torch.randn(z, 5, 3, 4)
    whole = model.decode_video(lat)
    assert whole.shape == (3, 17, 3 * stride[1], 4 * stride[2])
    assert whole.abs().max() <= 1.0
    for sizes in ([1, 1, 1, 1, 1], [2, 3]):
        st, outs, i = model.stream(), [], 0
        for n in sizes:
            outs.append(st.decode_chunk(lat[:, i : i + n]))
            assert outs[-1].shape[1] == (1 + 4 * (n - 1) if i == 0 else 4 * n)
            i += n
        got = torch.cat(outs, 1)
        assert _rel(got, whole) <= REL_TOL and (got - whole).abs().max() <= ABS_TOL
    # two interleaved sessions, then a reset
    a, b = model.stream(), model.stream()
    lat2 = torch.randn_like(lat)
    oa = [a.decode_chunk(lat[:, i : i + 1]) for i in range(1)]
    ob = [b.decode_chunk(lat2[:, i : i + 1]) for i in range(1)]
    for i in range(1, 5):
        oa.append(a.decode_chunk(lat[:, i : i + 1]))
        ob.append(b.decode_chunk(lat2[:, i : i + 1]))
    assert _rel(torch.cat(oa, 1), whole) <= REL_TOL
    assert _rel(torch.cat(ob, 1), model.decode_video(lat2)) <= REL_TOL
    a.reset()
    assert _rel(a.decode_chunk(lat), whole) <= REL_TOL


def test_taehv_speed_vs_wan(capsys):
    """Print the per-chunk CPU time of the tiny decoder vs the full Wan 2.1 decoder (small size)."""
    torch.manual_seed(5)
    hw = (8, 12)  # 64x96 pixels
    wan = WanVAE(wan_vae_config("2.1", base_dim=32, num_res_blocks=2)).eval()  # a third of the real width
    tae = TAEHV(16, (4, 8, 8)).eval()
    lat = torch.randn(16, 4, *hw)

    def per_chunk(dec) -> float:
        st = dec.stream()
        st.decode_chunk(lat[:, :1])
        t0 = time.perf_counter()
        for i in range(1, 4):
            st.decode_chunk(lat[:, i : i + 1])
        return (time.perf_counter() - t0) / 3 * 1e3

    t_wan, t_tae = per_chunk(wan), per_chunk(tae)
    with capsys.disabled():
        print(
            f"\n[vae speed, CPU {hw[0] * 8}x{hw[1] * 8}, per 4-frame chunk] Wan 2.1 (base_dim 32): {t_wan:.1f} ms, "
            f"TAEHV: {t_tae:.1f} ms ({t_wan / t_tae:.1f}x)"
        )
    assert t_tae < t_wan
