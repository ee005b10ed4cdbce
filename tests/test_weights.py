"""Building the model (meta-friendly, seeded) and loading checkpoints, with errors that name the problem."""

from __future__ import annotations

import time

import pytest
import torch

from cadence.config import get_preset
from cadence.errors import WeightsError
from cadence.model.weights import (
    build_model,
    convert_state_dict,
    load_state_dict_into,
    load_weights,
    save_weights,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel

TINY = get_preset("tiny")
NO_AUDIO = TINY.with_overrides(model={"audio_every": 0})


def diffusers_sd(cfg=NO_AUDIO, seed: int = 0) -> dict[str, torch.Tensor]:
    m = cfg.model
    torch.manual_seed(seed)
    d = WanTransformer3DModel(
        patch_size=m.patch,
        num_attention_heads=m.num_heads,
        attention_head_dim=m.head_dim,
        in_channels=m.in_channels,
        out_channels=m.out_channels,
        text_dim=m.text_dim,
        freq_dim=m.freq_dim,
        ffn_dim=m.ffn_dim,
        num_layers=m.num_layers,
    )
    with torch.no_grad():
        for p in d.parameters():  # nothing left at its trivial init (zero biases, unit norms)
            p.add_(0.05 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in d.state_dict().items()}


def inputs(cfg, frames=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    lh, lw = cfg.latent_hw
    x = torch.randn(1, cfg.model.in_channels, frames, lh, lw, generator=g)
    text = torch.randn(1, cfg.model.text_len, cfg.model.text_dim, generator=g)
    audio = torch.randn(1, frames, cfg.model.audio_tokens_per_frame, cfg.model.audio_dim, generator=g)
    return x, torch.tensor([600.0]), text, audio


def expect_error(sd, cfg=NO_AUDIO, **kw) -> str:
    model = build_model(cfg, "cpu", torch.float32, seed=None)
    with pytest.raises(WeightsError) as ei:
        load_state_dict_into(model, sd, **kw)
    return str(ei.value)


# ---- building ----------------------------------------------------------------------------------------


def test_w57_on_meta_fast_and_57b():
    t0 = time.perf_counter()
    model = build_model(get_preset("w57"), device="meta", dtype=torch.bfloat16, seed=None)
    dt = time.perf_counter() - t0
    assert dt < 5.0, f"meta construction took {dt:.1f} s"  # no memory is touched: ~0.6 s measured
    n = sum(p.numel() for p in model.parameters())
    # 56.96B transformer + 4.1B of audio cross-attention (every 4th of 60 blocks) = 61.06B
    assert 5.3e10 < n < 6.3e10, n
    assert all(p.device.type == "meta" for p in model.parameters())
    # the transformer without the audio branch is the published ~57B model (docs/workloads.md)
    bare = build_model(
        get_preset("w57").with_overrides(model={"audio_every": 0}), "meta", torch.bfloat16, seed=None
    )
    n_bare = sum(p.numel() for p in bare.parameters())
    assert 5.6e10 < n_bare < 5.8e10, n_bare
    assert len(model.blocks) == 60
    assert sum(b.audio_attn is not None for b in model.blocks) == 15


def test_dtype_policy():
    model = build_model(TINY, "cpu", torch.bfloat16, seed=0)
    dt = {n: p.dtype for n, p in model.named_parameters()}
    # modulation tables, the timestep MLP and the LayerNorms stay float32 (as Wan / diffusers keep them)
    assert dt["blocks.0.modulation"] == torch.float32 and dt["head.modulation"] == torch.float32
    assert dt["time_embed.fc1.weight"] == torch.float32 and dt["time_proj.weight"] == torch.float32
    assert dt["blocks.0.norm2.weight"] == torch.float32
    # the matmul weights are in the requested dtype
    assert dt["blocks.0.self_attn.qkv.weight"] == torch.bfloat16
    assert dt["blocks.1.ffn.fc1.weight"] == torch.bfloat16
    assert model.dtype == torch.bfloat16


def test_init_random_seeded():
    a = build_model(TINY, "cpu", torch.float32, seed=0)
    b = build_model(TINY, "cpu", torch.float32, seed=0)
    c = build_model(TINY, "cpu", torch.float32, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.self_attn.qkv.weight"], sc["blocks.0.self_attn.qkv.weight"])
    # linears N(0, 1/fan_in): 384x128 samples, std within 5% of 1/sqrt(128)
    w = sa["blocks.0.self_attn.qkv.weight"]
    assert abs(w.std().item() * 128**0.5 - 1.0) < 0.05
    assert torch.equal(sa["blocks.0.norm2.weight"], torch.ones(128))
    assert torch.equal(sa["blocks.0.self_attn.norm_q.weight"], torch.ones(128))
    assert all(torch.isfinite(v).all() for v in sa.values())


# ---- loading errors ----------------------------------------------------------------------------------


def test_missing_keys_named():
    sd = diffusers_sd()
    del sd["blocks.1.attn2.to_out.0.weight"]
    del sd["proj_out.bias"]
    msg = expect_error(sd)
    assert "2 missing" in msg
    assert "blocks.1.cross_attn.out.weight" in msg and "head.proj.bias" in msg


def test_unexpected_keys_named():
    sd = diffusers_sd()
    sd["blocks.0.attn1.lora_A.weight"] = torch.zeros(4, 128)
    sd["something_else"] = torch.zeros(1)
    msg = expect_error(sd)
    assert "unexpected" in msg
    assert "blocks.0.attn1.lora_A.weight" in msg and "something_else" in msg
    # keys that map to a Cadence name the model lacks are unexpected too (a 3rd block)
    sd = diffusers_sd()
    sd["blocks.2.norm2.weight"] = torch.ones(128)
    assert "blocks.2.norm2.weight" in expect_error(sd)


def test_shape_mismatch_named():
    sd = diffusers_sd()
    sd["proj_out.weight"] = torch.zeros(32, 128)
    msg = expect_error(sd)
    assert "shape mismatch" in msg
    assert "head.proj.weight" in msg and "(32, 128)" in msg and "(64, 128)" in msg


def test_wrong_model_size_lists_shapes():
    # a dim-128 checkpoint into a dim-64 model: every matrix mismatches, the message stays bounded
    small = TINY.with_overrides(model={"dim": 64, "num_heads": 2, "head_dim": 32, "audio_every": 0})
    msg = expect_error(diffusers_sd(), cfg=small)
    assert "shape mismatch" in msg and "more" in msg
    assert len(msg) < 2000


def test_fused_group_missing_part_named():
    sd = diffusers_sd()
    del sd["blocks.1.attn1.to_v.weight"]
    msg = expect_error(sd)
    assert "v" in msg and "blocks.1.self_attn.qkv.weight" in msg
    sd = diffusers_sd()
    del sd["blocks.0.attn2.to_k.bias"]
    msg = expect_error(sd)
    assert "k part" in msg and "blocks.0.cross_attn.kv.bias" in msg


def test_fused_part_wrong_shape_is_weights_error():
    # one part of a fused q/k/v group with the wrong width must be reported as a shape problem of the
    # checkpoint (WeightsError naming the key), not a raw torch.cat RuntimeError
    sd = diffusers_sd()
    sd["blocks.0.attn1.to_v.weight"] = sd["blocks.0.attn1.to_v.weight"][:, :64].clone()
    msg = expect_error(sd)
    assert "blocks.0" in msg and ("to_v" in msg or "self_attn.qkv" in msg)


def test_corrupt_safetensors(tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file(diffusers_sd(), str(good))
    data = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:8] + b"{not json" + data[17:])
    model = build_model(NO_AUDIO, "cpu", torch.float32, seed=None)
    with pytest.raises(WeightsError, match="bad.safetensors"):
        load_weights(model, bad)
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="trunc.safetensors"):
        load_weights(model, trunc)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01")
    with pytest.raises(WeightsError):
        load_weights(model, junk)


def test_no_checkpoint_there(tmp_path):
    model = build_model(NO_AUDIO, "cpu", torch.float32, seed=None)
    with pytest.raises(WeightsError, match="no safetensors"):
        load_weights(model, tmp_path / "nope.safetensors")
    with pytest.raises(WeightsError, match="no safetensors"):
        load_weights(model, tmp_path)  # an empty directory


def test_weights_error_message_is_plain():
    # KeyError would quote the message; WeightsError prints it as is
    assert str(WeightsError("a b")) == "a b"


# ---- missing audio branch ----------------------------------------------------------------------------


def test_missing_audio_branch_zeroed_and_inert():
    # a diffusers (no-audio) checkpoint into an audio model: allowed, audio output projection zeroed
    sd = diffusers_sd()
    model = build_model(TINY, "cpu", torch.float32, seed=5)  # audio branch randomly initialised
    rep = load_state_dict_into(model, sd)
    assert rep["audio_zeroed"] is True
    for blk in model.blocks:
        assert torch.equal(blk.audio_attn.out.weight, torch.zeros_like(blk.audio_attn.out.weight))
        assert torch.equal(blk.audio_attn.out.bias, torch.zeros_like(blk.audio_attn.out.bias))
    x, t, text, audio = inputs(TINY)
    with torch.no_grad():
        with_audio = model.forward_full(x, t, text, audio)
        without = model.forward_full(x, t, text, None)
        other = model.forward_full(x, t, text, audio * 3 + 1)
    # the branch adds exactly 0: bitwise identical outputs
    assert torch.equal(with_audio, without) and torch.equal(other, without)
    # and the loaded weights match a no-audio model loaded from the same checkpoint
    bare = build_model(NO_AUDIO, "cpu", torch.float32, seed=None)
    load_state_dict_into(bare, sd)
    with torch.no_grad():
        ref = bare.forward_full(x, t, text)
    assert torch.allclose(without, ref, rtol=0, atol=0)


def test_missing_audio_branch_ignores_uninitialised_memory():
    # build_generator(weights=...) builds with seed=None: parameters are torch.empty memory, which can
    # hold any bit pattern. The checkpoint leaves the audio branch's other weights uninitialised;
    # zeroing only the output projection is not enough when that memory holds NaN/Inf (0 * NaN = NaN).
    # Simulate the worst case deterministically by filling every parameter with NaN before loading.
    model = build_model(TINY, "cpu", torch.float32, seed=None)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_state_dict_into(model, diffusers_sd())
    x, t, text, audio = inputs(TINY)
    with torch.no_grad():
        out = model.forward_full(x, t, text, audio)
        ref = model.forward_full(x, t, text, None)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all().item(), "audio branch of a checkpoint without audio weights produced NaN"
    assert torch.equal(out, ref)


def test_missing_audio_not_allowed():
    msg = expect_error(diffusers_sd(), cfg=TINY, allow_missing_audio=False)
    assert "missing" in msg and "audio_attn" in msg


# ---- Cadence names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cadence_round_trip_exact(tmp_path, dtype):
    src = build_model(TINY, "cpu", dtype, seed=11)
    path = tmp_path / "cadence.safetensors"
    save_weights(src, path)
    dst = build_model(TINY, "cpu", dtype, seed=12)
    rep = load_weights(dst, path)
    assert rep["format"] == "cadence" and not rep["audio_zeroed"]
    s, d = src.state_dict(), dst.state_dict()
    assert set(s) == set(d)
    for k in s:
        assert s[k].dtype == d[k].dtype and torch.equal(s[k], d[k]), k
    x, t, text, audio = inputs(TINY)
    with torch.no_grad():
        assert torch.equal(src.forward_full(x, t, text, audio), dst.forward_full(x, t, text, audio))


def test_convert_fuses_in_qkv_order():
    sd = diffusers_sd()
    conv, unmatched = convert_state_dict(sd)
    assert unmatched == []
    qkv = conv["blocks.0.self_attn.qkv.weight"]
    assert torch.equal(qkv[:128], sd["blocks.0.attn1.to_q.weight"])
    assert torch.equal(qkv[128:256], sd["blocks.0.attn1.to_k.weight"])
    assert torch.equal(qkv[256:], sd["blocks.0.attn1.to_v.weight"])
    kv = conv["blocks.1.cross_attn.kv.bias"]
    assert torch.equal(kv, torch.cat([sd["blocks.1.attn2.to_k.bias"], sd["blocks.1.attn2.to_v.bias"]]))
    # the patch conv [dim, C, 1, 2, 2] is flattened to a linear [dim, C*1*2*2] in conv weight order
    assert torch.equal(conv["patch_embed.weight"], sd["patch_embedding.weight"].flatten(1))
    # diffusers' head table is the head modulation; block tables are block modulations
    assert torch.equal(conv["head.modulation"], sd["scale_shift_table"])
    assert torch.equal(conv["blocks.1.modulation"], sd["blocks.1.scale_shift_table"])
