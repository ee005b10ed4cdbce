"""Numerical parity of Cadence's WanDiT with diffusers' WanTransformer3DModel (code no one here wrote),
and of chunked causal generation through the naive cache with one masked full-sequence forward.

Tolerances: everything runs in float32 on the CPU. The two implementations compute the same math in a
different order (Cadence fuses q/k/v into one matmul, flattens the patch conv into a linear, computes
RoPE from angles instead of complex tables), so results differ by float32 rounding only: measured
relative L2 error ~3e-7 for a 2-3 layer model. 1e-5 leaves 30x margin for BLAS/thread differences yet
is ~4 orders of magnitude below what any real mistake (a wrong norm, a swapped shift/scale, a
mis-rotated pair, a wrong mask) produces (those give errors of order 1e-2..1).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from cadence.cache.naive import NaiveCache
from cadence.config import get_preset
from cadence.model.full import block_causal_mask
from cadence.model.weights import build_model, load_state_dict_into, load_weights

diffusers = pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel

TOL = 1e-5  # relative L2, see module docstring


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def small_cfg(stream=None, **model):
    m = dict(dim=128, num_heads=4, head_dim=32, ffn_dim=256, num_layers=2, text_dim=64, audio_every=0)
    m.update(model)
    return get_preset("tiny").with_overrides(model=m, stream=stream or {})


@torch.no_grad()
def randomise(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random and non-trivial: norm weights around 1 (not 1), biases and tables not 0."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if "scale_shift_table" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        elif p.ndim == 1 and "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        elif p.ndim == 1:  # biases (also LayerNorm biases)
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        else:
            fan_in = math.prod(p.shape[1:])
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))


def make_diffusers(cfg, seed: int = 0) -> WanTransformer3DModel:
    m = cfg.model
    d = (
        WanTransformer3DModel(
            patch_size=m.patch,
            num_attention_heads=m.num_heads,
            attention_head_dim=m.head_dim,
            in_channels=m.in_channels,
            out_channels=m.out_channels,
            text_dim=m.text_dim,
            freq_dim=m.freq_dim,
            ffn_dim=m.ffn_dim,
            num_layers=m.num_layers,
            cross_attn_norm=m.cross_attn_norm,
            eps=m.eps,
        )
        .float()
        .eval()
    )
    randomise(d, seed)
    return d


def cadence_from(cfg, sd, fmt=None):
    model = build_model(cfg, "cpu", torch.float32, seed=None)
    rep = load_state_dict_into(model, sd, fmt)
    return model, rep


def inputs(cfg, frames: int, lh: int, lw: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cfg.model.in_channels, frames, lh, lw, generator=g)
    text = torch.randn(1, cfg.model.text_len, cfg.model.text_dim, generator=g)
    return x, text


def reference(d, x, t, text, per_frame: bool = False):
    """diffusers' forward; a per-frame timestep [B, F] is expanded to diffusers' per-token [B, seq_len]."""
    if per_frame:
        pt, ph, pw = d.config.patch_size
        per_tok = (x.shape[3] // ph) * (x.shape[4] // pw)
        t = t[:, ::pt].repeat_interleave(per_tok, dim=1)
    with torch.no_grad():
        return d(x, t, text, return_dict=False)[0]


# ---- diffusers names ---------------------------------------------------------------------------------


def test_square_single_frame():
    cfg = small_cfg()
    d = make_diffusers(cfg, 0)
    model, rep = cadence_from(cfg, d.state_dict())
    assert rep["format"] == "diffusers" and not rep["audio_zeroed"]
    x, text = inputs(cfg, 1, 8, 8)
    t = torch.tensor([700.0])
    ref = reference(d, x, t, text)
    out = model.forward_full(x, t, text)
    assert out.shape == ref.shape == x.shape
    assert ref.abs().mean() > 0.1  # non-degenerate
    assert rel_err(out, ref) < TOL


def test_rectangular_odd_frames():
    # 6x10 latents -> 3x5 token grid (non-square), 5 latent frames; head_dim 64 -> RoPE split (24, 20, 20)
    cfg = small_cfg(num_heads=2, head_dim=64, num_layers=3)
    d = make_diffusers(cfg, 1)
    model, _ = cadence_from(cfg, d.state_dict())
    x, text = inputs(cfg, 5, 6, 10, seed=1)
    t = torch.tensor([432.5])
    ref = reference(d, x, t, text)
    out = model.forward_full(x, t, text)
    assert rel_err(out, ref) < TOL
    # a frame-transposed input must give a different answer (RoPE along frames / grid is active)
    out2 = model.forward_full(x.flip(2), t, text).flip(2)
    assert rel_err(out2, ref) > 1e-3


def test_per_frame_timesteps():
    cfg = small_cfg()
    d = make_diffusers(cfg, 2)
    model, _ = cadence_from(cfg, d.state_dict())
    x, text = inputs(cfg, 3, 6, 10, seed=2)
    t = torch.tensor([[0.0, 500.0, 999.0]])
    ref = reference(d, x, t, text, per_frame=True)
    out = model.forward_full(x, t, text)
    assert rel_err(out, ref) < TOL
    # and it really is per frame: a scalar timestep gives something else
    out_scalar = model.forward_full(x, torch.tensor([500.0]), text)
    assert rel_err(out_scalar, ref) > 1e-3


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import save_file

    cfg = small_cfg()
    d = make_diffusers(cfg, 4)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, str(path))
    model = build_model(cfg, "cpu", torch.float32, seed=None)
    rep = load_weights(model, path)
    assert rep["format"] == "diffusers"
    x, text = inputs(cfg, 3, 6, 10, seed=4)
    t = torch.tensor([[100.0, 600.0, 900.0]])
    assert rel_err(model.forward_full(x, t, text), reference(d, x, t, text, per_frame=True)) < TOL


def test_sharded_directory(tmp_path):
    from safetensors.torch import save_file

    cfg = small_cfg()
    d = make_diffusers(cfg, 5)
    sd = {k: v.contiguous() for k, v in d.state_dict().items()}
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[: len(keys) // 2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[len(keys) // 2 :]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    model = build_model(cfg, "cpu", torch.float32, seed=None)
    load_weights(model, tmp_path)
    x, text = inputs(cfg, 1, 8, 8, seed=5)
    t = torch.tensor([800.0])
    assert rel_err(model.forward_full(x, t, text), reference(d, x, t, text)) < TOL


# ---- original Wan names ------------------------------------------------------------------------------
# Written here independently of cadence/model/weights.py: diffusers name -> Wan-Video/Wan2.1 name.
_TO_WAN = [
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.o."),
    (r"blocks\.(\d+)\.attn1\.to_([qkv])\.", r"blocks.\1.self_attn.\2."),
    (r"blocks\.(\d+)\.attn1\.norm_([qk])\.", r"blocks.\1.self_attn.norm_\2."),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.o."),
    (r"blocks\.(\d+)\.attn2\.to_([qkv])\.", r"blocks.\1.cross_attn.\2."),
    (r"blocks\.(\d+)\.attn2\.norm_([qk])\.", r"blocks.\1.cross_attn.norm_\2."),
    (r"blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),  # Wan's name for the cross-attention norm
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.0."),
    (r"blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.2."),
    (r"blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"^patch_embedding\.", "patch_embedding."),
]


def to_wan_names(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        for pat, rep in _TO_WAN:
            new, n = re.subn(pat, rep, k)
            if n:
                out[new] = v
                break
        else:
            raise AssertionError(f"test mapping misses {k}")
    return out


def test_wan_original_names(tmp_path):
    from safetensors.torch import save_file

    cfg = small_cfg(num_layers=3)
    d = make_diffusers(cfg, 6)
    wan_sd = to_wan_names(d.state_dict())
    assert "blocks.1.norm3.weight" in wan_sd and "blocks.1.self_attn.q.weight" in wan_sd
    assert "head.head.weight" in wan_sd and "time_projection.1.weight" in wan_sd
    x, text = inputs(cfg, 3, 6, 10, seed=6)
    t = torch.tensor([[0.0, 333.0, 666.0]])
    ref = reference(d, x, t, text, per_frame=True)

    model, rep = cadence_from(cfg, wan_sd)
    assert rep["format"] == "wan"
    assert rel_err(model.forward_full(x, t, text), ref) < TOL

    path = tmp_path / "wan.safetensors"
    save_file({k: v.contiguous() for k, v in wan_sd.items()}, str(path))
    model2 = build_model(cfg, "cpu", torch.float32, seed=None)
    assert load_weights(model2, path)["format"] == "wan"
    assert rel_err(model2.forward_full(x, t, text), ref) < TOL


def test_wan_norm_names_not_swapped():
    # Loading Wan names must put Wan's norm3 (affine, before cross-attention) into the cross-attn norm:
    # if the mapping confused it with the FFN norm the output would change. Perturb it and check that
    # the Cadence cross-attention norm got exactly that tensor.
    cfg = small_cfg()
    d = make_diffusers(cfg, 7)
    wan_sd = to_wan_names(d.state_dict())
    model, _ = cadence_from(cfg, wan_sd)
    assert torch.equal(model.blocks[1].norm2.weight, wan_sd["blocks.1.norm3.weight"])
    assert torch.equal(model.blocks[0].norm2.bias, wan_sd["blocks.0.norm3.bias"])


# ---- chunked causal generation == masked full forward ------------------------------------------------


def test_block_causal_mask_small():
    # frames: sink, chunk0, chunk1, chunk2; 1 token per frame; window 2 (a chunk sees itself + 1 before)
    m = block_causal_mask(torch.tensor([-1, 0, 1, 2]), 1, 2)
    expected = torch.tensor(
        [
            # keys: sink c0  c1  c2
            [1, 0, 0, 0],  # sink query: sink only
            [1, 1, 0, 0],  # c0
            [1, 1, 1, 0],  # c1
            [1, 0, 1, 1],  # c2: chunk 0 has left the window
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)


def test_block_causal_mask_tokens_and_frames():
    # 2 tokens per frame, 2 frames per chunk: a chunk sees its own tokens bidirectionally
    fc = torch.tensor([-1, 0, 0, 1, 1])
    m = block_causal_mask(fc, 2, 1)  # window 1: sink + own chunk only
    assert m.shape == (10, 10)
    tok = fc.repeat_interleave(2)
    for i in range(10):
        for j in range(10):
            qi, kj = tok[i].item(), tok[j].item()
            want = (kj == -1) if qi == -1 else (kj == -1 or kj == qi)
            assert m[i, j].item() == want, (i, j)


def _chunked_vs_full(window: int, n: int, frames_per_chunk: int = 2):
    cfg = get_preset("tiny").with_overrides(
        stream={"window_chunks": window, "latent_frames_per_chunk": frames_per_chunk, "sink_frames": 1},
        model={"num_layers": 3},
    )
    model = build_model(cfg, "cpu", torch.float32, seed=1)
    lh, lw = cfg.latent_hw
    F = frames_per_chunk
    g = torch.Generator().manual_seed(0)
    c = cfg.model.in_channels
    sink = torch.randn(c, 1, lh, lw, generator=g)
    chunks = [torch.randn(c, F, lh, lw, generator=g) for _ in range(n)]
    text = torch.randn(1, cfg.model.text_len, cfg.model.text_dim, generator=g)
    audio = torch.randn(1 + n * F, cfg.model.audio_tokens_per_frame, cfg.model.audio_dim, generator=g)

    text_ctx = model.prepare_text(text)
    cache = NaiveCache(cfg.model.num_layers, window, cfg.token_grid, model.rope, "cpu")
    with torch.no_grad():
        cache.begin_chunk(0, 1, sink=True)
        model.forward_chunk(sink, torch.tensor([0.0]), text_ctx, audio[:1], cache, commit=True)
        outs = []
        for i in range(n):
            cache.begin_chunk(1 + i * F, F)
            outs.append(
                model.forward_chunk(
                    chunks[i],
                    torch.tensor([700.0]),
                    text_ctx,
                    audio[1 + i * F : 1 + (i + 1) * F],
                    cache,
                    commit=True,
                )
            )
        # keeps at most window - 1 past chunks per layer
        assert all(len(p) == min(n, window - 1) for p in cache.past)

        x = torch.cat([sink] + chunks, dim=1)[None]
        frame_chunk = torch.tensor([-1] + [i for i in range(n) for _ in range(F)])
        mask = block_causal_mask(frame_chunk, cfg.tokens_per_frame, window)
        t = torch.tensor([[0.0] + [700.0] * (n * F)])
        full = model.forward_full(x, t, text, audio[None], mask)[0]
    chunked = torch.cat(outs, dim=1)
    err = rel_err(chunked, full[:, 1:])
    assert err < TOL, err
    return model, cfg, x, t, text, audio, chunked


def test_chunked_equals_block_causal_sliding_window():
    # 5 chunks with a window of 2: chunks 0..2 are evicted along the way
    model, cfg, x, t, text, audio, chunked = _chunked_vs_full(window=2, n=5)
    # the mask matters: a bidirectional full forward gives a clearly different answer
    with torch.no_grad():
        bidir = model.forward_full(x, t, text, audio[None], None)[0, :, 1:]
    assert rel_err(chunked, bidir) > 1e-3


def test_chunked_equals_block_causal_window_one():
    # only sink + current chunk visible
    _chunked_vs_full(window=1, n=4)


def test_chunked_equals_block_causal_window_larger_than_stream():
    # nothing is ever evicted: plain block-causal attention
    _chunked_vs_full(window=8, n=4)


def test_chunked_one_frame_per_chunk():
    _chunked_vs_full(window=3, n=5, frames_per_chunk=1)
