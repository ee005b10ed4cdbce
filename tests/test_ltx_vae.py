"""FlashHead Lite's LTX-Video VAE (cadence.model.ltx_vae) against SoulX-FlashHead's own code.

The fixture (scripts/fixtures/make_ltx_vae.py, tests/fixtures/flashhead/ltx/) is a tiny random VAE in the
released folder format (``VAE_LTX/``: diffusers' config.json + bfloat16 safetensors) and what FlashHead's
``LtxVAE`` made of it in float32 on the CPU: the reference image repeated over 33 frames -> posterior sample
(seeded), clip 1 decoded, its last 9 frames -> motion latents, clip 2 (motion latents in front) decoded.

Tolerance: 2e-4 absolute on values of magnitude ~1 (latents up to ~3). Cadence runs the same float32 ops in the
same order (pixel norm, SiLU, the replicate time padding, the same Conv3d calls), and on the machine that made
the fixture every output matched bit for bit (max difference 0.0). Another CPU's conv kernels may sum in
another order, and this tiny VAE's pixel norms over 2-8 channels amplify float32 rounding: decoding the same
clip in other time chunks (other conv shapes, the same math) moved outputs by up to 4e-5 in float32 while
float64 agreed to 1e-13. 2e-4 is 5x that; a wrong frame, channel order or padding is off by ~0.1-1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cadence.errors import ConfigError, WeightsError
from cadence.model.ltx_vae import (
    RELEASED_CONFIG,
    LTXDecodeStream,
    LTXVAEConfig,
    LTXVideoVAE,
    TimeConv,
)

FIX = Path(__file__).parent / "fixtures" / "flashhead" / "ltx"
ATOL = 2e-4


@pytest.fixture(scope="module")
def data():
    return torch.load(FIX / "data.pt")


@pytest.fixture(scope="module")
def meta():
    return json.loads((FIX / "fixture.json").read_text())


@pytest.fixture(scope="module")
def vae():
    return LTXVideoVAE.from_folder(FIX / "VAE_LTX")


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= atol, f"max |diff| {err:.3g} > {atol}"


def test_the_folder_loads_with_every_size_from_its_config(vae, meta):
    cfg = meta["config"]
    assert vae.latent_channels == cfg["latent_channels"]
    assert vae.config.block_out_channels == tuple(cfg["block_out_channels"])
    assert vae.config.decoder_layers_per_block == tuple(
        cfg["layers_per_block"]
    )  # absent: mirrors the encoder
    assert (vae.spatial_stride, vae.temporal_stride) == (16, 8)  # patch 2, three 2x stages
    assert vae.latent_shape(33, 32, 16) == (5, 5, 2, 1)
    assert (vae.latent_frames(9), vae.frames(5), vae.frames(2)) == (2, 33, 9)
    assert vae.decoder.conv_in.conv.weight.dtype == torch.float32  # bfloat16 file, float32 model
    assert not vae.latents_std.eq(1).all() and not vae.latents_mean.eq(0).all()  # the file's statistics


def test_reference_image_encode_matches_flashhead(vae, data):
    video = data["image"][:, None].repeat(1, 33, 1, 1)  # FlashHead: the reference image over 33 frames
    g = torch.Generator().manual_seed(11)
    _close(vae.encode(video, generator=g), data["ref_latent"])
    _close(vae.encode(video, sample=False), data["ref_mode"])
    torch.manual_seed(11)  # FlashHead samples from the global RNG; so does encode without a generator
    _close(vae.encode(video), data["ref_latent"])
    # the posterior noise matters at this size: a sample is not the mean
    assert (data["ref_latent"] - data["ref_mode"]).abs().max() > 0.1


def test_clip_decode_matches_flashhead(vae, data):
    v1 = vae.decode(data["z1"])
    assert v1.shape == (3, 33, 32, 16)
    _close(v1, data["video1"])
    _close(vae.decode(data["z2"]), data["video2"])
    _close(vae.decode(data["z2"][None])[0], data["video2"])  # batched


def test_two_clips_through_the_motion_frames_match_flashhead(vae, data):
    """Clip 2 depends on clip 1 only through the re-encoded last 9 frames (2 latent frames)."""
    v1 = vae.decode(data["z1"])
    motion = vae.encode(v1[:, -9:], generator=torch.Generator().manual_seed(12))
    assert motion.shape == (5, 2, 2, 1)
    _close(motion, data["motion"])
    _close(vae.encode(v1[:, -9:], sample=False), data["motion_mode"])
    z2 = torch.cat([motion, data["z2"][:, 2:]], 1)  # FlashHead: noise[:, :2] = latent_motion_frames
    _close(vae.decode(z2), data["video2"])


def test_diffusers_reads_the_same_folder_the_same_way(vae, data):
    """A third implementation: diffusers' AutoencoderKLLTXVideo loads the fixture's tensors strictly (decoder
    sizes given explicitly: diffusers >= 0.32 reads absent decoder_* keys as its own defaults) and decodes the
    same frames. Its RMSNorm orders the float32 ops differently (fixture.json: 2.4e-5 from FlashHead)."""
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import load_file

    cfg = {k: v for k, v in json.loads((FIX / "VAE_LTX/config.json").read_text()).items() if k[0] != "_"}
    sizes = ("block_out_channels", "layers_per_block", "spatio_temporal_scaling")
    ref = diffusers.AutoencoderKLLTXVideo(**cfg, **{f"decoder_{k}": cfg[k] for k in sizes}).eval()
    sd = load_file(str(FIX / "VAE_LTX/diffusion_pytorch_model.safetensors"))
    ref.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    with torch.no_grad():
        raw = vae.denormalize_latents(data["z2"][None])
        _close(ref.decode(raw).sample[0], vae.decode(data["z2"]))


def _double(vae: LTXVideoVAE) -> LTXVideoVAE:
    out = LTXVideoVAE(vae.config)
    out.load_state_dict(vae.state_dict())
    return out.double().eval()


@pytest.fixture(scope="module")
def v64(vae):
    return _double(vae)


@pytest.fixture(scope="module")
def whole64(v64, data):
    return v64.decode(data["z2"].double())


@pytest.mark.parametrize("chunk", [1, 3, 33])
def test_streamed_decode_equals_the_whole_clip(vae, v64, whole64, data, chunk):
    """Exact math: float64 agrees to 1e-10 (observed ~1e-13); float32 within the stated tolerance."""
    streamed = list(v64.stream_decode(data["z2"].double(), chunk_frames=chunk))
    assert all(c.shape[1] <= chunk for c in streamed) and len(streamed) >= 33 // chunk
    _close(torch.cat(streamed, 1), whole64, 1e-10)
    if chunk == 3:
        _close(torch.cat(list(vae.stream_decode(data["z2"], chunk)), 1), data["video2"])


def test_latents_pushed_one_frame_at_a_time(v64, whole64, data):
    """A sampler's order: one latent frame per push. The non-causal decoder holds everything back until the
    clip ends (its 16 latent-rate convs look 16 frames ahead), then emits in chunks."""
    z = data["z2"].double()[None]
    st = LTXDecodeStream(v64, chunk_frames=4)
    early = [c for f in range(z.shape[2]) for c in st.push(z[:, :, f : f + 1])]
    assert early == []
    rest = list(st.close())
    assert len(rest) > 1 and max(c.shape[2] for c in rest) <= 4 and st.emitted == 33
    _close(torch.cat(rest, 2)[0], whole64, 1e-10)
    with pytest.raises(ConfigError, match="closed"):
        list(st.push(z))


def test_the_first_chunk_leaves_before_the_output_conv_has_run_on_the_whole_clip(vae, data):
    calls = []
    hook = vae.decoder.conv_out.conv.register_forward_hook(lambda m, i, o: calls.append(o.shape[2]))
    try:
        it = vae.stream_decode(data["z2"], chunk_frames=4)
        first = next(it)
        before = sum(calls)
        n = first.shape[1] + sum(c.shape[1] for c in it)
    finally:
        hook.remove()
    assert 1 <= first.shape[1] <= 4 and n == 33
    assert before < 33 / 2  # the output conv had produced a few frames, not the clip
    assert sum(calls) == 33


def test_bfloat16_matches_flashhead_in_bfloat16(data):
    """FlashHead's dtype: bfloat16 weights, frames, latents, normalisation and posterior noise. Same ops in the
    same order: bit for bit on the machine that made the fixture. Tolerance 1% relative L2: bfloat16 rounding
    through this tiny net moves the decode 11% from float32, so a CPU whose kernels round one value the other
    way shows differences; a wrong dtype step (normalising in float32, noise drawn in float32) is ~10%."""
    b = LTXVideoVAE.from_folder(FIX / "VAE_LTX", dtype=torch.bfloat16)

    def rel(a, ref):
        assert a.dtype == torch.bfloat16 and a.shape == ref.shape
        return ((a.float() - ref.float()).norm() / ref.float().norm()).item()

    video = data["image"][:, None].repeat(1, 33, 1, 1).bfloat16()
    assert rel(b.encode(video, generator=torch.Generator().manual_seed(11)), data["bf16_ref_latent"]) < 1e-2
    v1 = b.decode(data["z1"].bfloat16())
    motion = b.encode(v1[:, -9:], generator=torch.Generator().manual_seed(12))
    assert rel(motion, data["bf16_motion"]) < 1e-2
    assert rel(b.decode(data["z2"].bfloat16()), data["bf16_video2"]) < 1e-2
    f32 = data["video2"]
    assert ((data["bf16_video2"].float() - f32).norm() / f32.norm()).item() > 0.02  # the test can tell


def test_released_geometry():
    """The released VAE_LTX config (LTX-Video 0.9.0): built on the meta device (no memory, no weights)."""
    cfg = LTXVAEConfig.from_dict(RELEASED_CONFIG)
    with torch.device("meta"):
        v = LTXVideoVAE(cfg)
    assert (cfg.spatial_stride, cfg.temporal_stride, v.latent_channels) == (32, 8, 128)
    assert v.latent_shape(33, 512, 512) == (128, 5, 16, 16) and v.latent_shape(9, 512, 512)[1] == 2
    assert v.decoder.conv_in.conv.weight.shape == (512, 128, 3, 3, 3)
    assert v.decoder.up_blocks[1].upsamplers[0].conv.conv.weight.shape == (4096, 512, 3, 3, 3)
    assert v.decoder.conv_out.conv.weight.shape == (48, 128, 3, 3, 3)
    assert v.encoder.conv_out.conv.weight.shape == (129, 512, 3, 3, 3)  # 128 means + one log-variance
    assert [len(b.resnets) for b in v.decoder.up_blocks] == [3, 3, 3, 4] and len(
        v.decoder.mid_block.resnets
    ) == 4
    assert v.decoder(torch.zeros(1, 128, 5, 16, 16, device="meta")).shape == (1, 3, 33, 512, 512)


def _folder(tmp_path: Path, cfg: dict | None = None, drop: str | None = None, weights: bool = True) -> Path:
    d = tmp_path / "VAE_LTX"
    d.mkdir()
    src = json.loads((FIX / "VAE_LTX/config.json").read_text())
    (d / "config.json").write_text(json.dumps(src if cfg is None else cfg))
    if weights:
        from safetensors.torch import load_file, save_file

        sd = load_file(str(FIX / "VAE_LTX/diffusion_pytorch_model.safetensors"))
        sd.pop(drop, None)
        save_file(sd, str(d / "diffusion_pytorch_model.safetensors"))
    return d


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"timestep_conditioning": True}, "timestep_conditioning"),
        ({"decoder_inject_noise": [True, False, False, False, False]}, "decoder_inject_noise"),
        ({"upsample_residual": [True, True, True, True]}, "upsample_residual"),
        ({"patch_size_t": 2}, "patch_size_t"),
        ({"layers_per_block": [1, 2, 1]}, "layers_per_block has 3 entries; need 5"),
        ({"block_out_channels": [2, 4, "8", 8]}, "block_out_channels"),
        ({"decoder_inject_noise": True}, "not a value"),
        ({"mystery_option": 1}, "mystery_option"),
        ({"_class_name": "AutoencoderKLWan"}, "AutoencoderKLWan"),
        ({"spatial_compression_ratio": 32}, "spatial_compression_ratio=32"),
        ({"decoder_spatio_temporal_scaling": [True, True, False, False]}, "2x stages"),
    ],
)
def test_a_config_it_cannot_build_is_one_config_error(tmp_path, change, needle):
    cfg = {**json.loads((FIX / "VAE_LTX/config.json").read_text()), **change}
    with pytest.raises(ConfigError) as e:
        LTXVideoVAE.from_folder(_folder(tmp_path, cfg))
    assert needle in _one_line(e) and "config.json" in str(e.value)


def test_missing_config_key_names_it(tmp_path):
    cfg = json.loads((FIX / "VAE_LTX/config.json").read_text())
    del cfg["latent_channels"]
    with pytest.raises(ConfigError, match="missing latent_channels"):
        LTXVideoVAE.from_folder(_folder(tmp_path, cfg))


def test_an_incomplete_folder_names_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        LTXVideoVAE.from_folder(tmp_path / "nope")
    d = _folder(tmp_path, weights=False)
    (d / "autoencoder.pth").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        LTXVideoVAE.from_folder(d)
    assert "diffusion_pytorch_model.safetensors" in _one_line(e) and "autoencoder.pth" in str(e.value)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json or diffusion_pytorch_model.safetensors"):
        LTXVideoVAE.from_folder(d)
    shutil.copy(FIX / "VAE_LTX/config.json", d / "config.json")
    (d / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        LTXVideoVAE.from_folder(d)


def test_tensors_that_do_not_fit_the_config_are_named(tmp_path):
    with pytest.raises(WeightsError) as e:
        LTXVideoVAE.from_folder(_folder(tmp_path, drop="latents_std"))
    assert "missing 1: latents_std" in _one_line(e)
    cfg = {**json.loads((FIX / "VAE_LTX/config.json").read_text()), "latent_channels": 6}
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(WeightsError, match=r"shape mismatch \d+: latents_mean \(5,\) \(config: \(6,\)\)"):
        LTXVideoVAE.from_folder(_folder(other, cfg))


def test_bad_inputs_are_one_config_error(vae):
    with pytest.raises(ConfigError, match="multiples of 16"):
        vae.encode(torch.zeros(3, 9, 30, 16))
    with pytest.raises(ConfigError, match="5-channel latents"):
        vae.decode(torch.zeros(4, 2, 2, 1))
    with pytest.raises(ConfigError, match="4D or 5D"):
        vae.decode(torch.zeros(5, 2, 2))
    with pytest.raises(ConfigError, match="chunk_frames"):
        LTXDecodeStream(vae, 0)


def test_time_padding_is_the_edge_frames():
    conv = TimeConv(1, 1, 3, causal=False)
    x = torch.arange(4.0).view(1, 1, 4, 1, 1)
    assert conv.pad_time(x).flatten().tolist() == [0, 0, 1, 2, 3, 3]
    conv.causal = True
    assert conv.pad_time(x).flatten().tolist() == [0, 0, 0, 1, 2, 3]
