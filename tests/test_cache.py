"""The naive K/V cache (window bookkeeping, sink, fake FP8) and 3D RoPE."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cadence.cache.naive import FP8_MAX, NaiveCache, fake_fp8
from cadence.config import ModelConfig
from cadence.model.rope import Rope3D, apply_rope

GRID = (2, 3)  # tokens per frame: 6
TPF = GRID[0] * GRID[1]
HEADS, HEAD_DIM = 2, 32
SPLIT = ModelConfig(dim=HEADS * HEAD_DIM, num_heads=HEADS, head_dim=HEAD_DIM).rope_split


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rope() -> Rope3D:
    return Rope3D(SPLIT, 10_000.0)


def rand_qkv(g, frames: int, scale: float = 1.0):
    shape = (1, frames * TPF, HEADS, HEAD_DIM)
    return tuple(torch.randn(shape, generator=g, dtype=torch.float64).float() * scale for _ in range(3))


def manual_attention(r: Rope3D, q, q_start, entries):
    """Reference: rotate q at its frames and each (k, v, start, frames) entry at its own, one softmax."""
    nf = q.shape[1] // TPF
    cq, sq = r.cos_sin(torch.arange(q_start, q_start + nf), *GRID)
    qr = apply_rope(q, cq, sq)
    ks, vs = [], []
    for k, v, s, n in entries:
        c, si = r.cos_sin(torch.arange(s, s + n), *GRID)
        ks.append(apply_rope(k, c, si))
        vs.append(v)
    k_all, v_all = torch.cat(ks, 1), torch.cat(vs, 1)
    o = F.scaled_dot_product_attention(qr.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2))
    return o.transpose(1, 2).flatten(2)


# ---- NaiveCache --------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 3, 10])
def test_window_keeps_last_chunks_and_sink(window):
    layers, n, fpc = 2, 6, 1
    r = rope()
    cache = NaiveCache(layers, window, GRID, r, "cpu")
    g = torch.Generator().manual_seed(window)
    sink = rand_qkv(g, 1)
    cache.begin_chunk(0, 1, sink=True)
    for layer in range(layers):
        cache.attend(layer, *sink, commit=True)
    chunks = []
    for i in range(n):
        qkv = rand_qkv(g, fpc)
        chunks.append(qkv)
        cache.begin_chunk(1 + i * fpc, fpc)
        for layer in range(layers):
            cache.attend(layer, *qkv, commit=True)
        k = i + 1  # commits so far
        for layer in range(layers):
            assert len(cache.past[layer]) == min(k, window - 1)
            assert cache.sink[layer] is not None  # the sink is kept forever
        # memory = sink + kept chunks, K and V, float32
        per_chunk = 2 * fpc * TPF * HEADS * HEAD_DIM * 4
        assert cache.memory_bytes() == layers * per_chunk * (1 + min(k, window - 1))

    # Behaviour, not bookkeeping: the next chunk's output equals attention over exactly
    # sink + the last (window - 1) chunks + itself, each rotated at its own frame position.
    q, k_, v = rand_qkv(g, fpc)
    start = 1 + n * fpc
    cache.begin_chunk(start, fpc)
    out = cache.attend(0, q, k_, v, commit=False)
    kept = list(range(max(0, n - (window - 1)), n))
    entries = [(sink[1], sink[2], 0, 1)] + [(chunks[i][1], chunks[i][2], 1 + i * fpc, fpc) for i in kept]
    entries.append((k_, v, start, fpc))
    ref = manual_attention(r, q, start, entries)
    # same float32 math in the same order up to concatenation: agreement to rounding (1e-6)
    assert rel_err(out, ref) < 1e-6
    # ... and it differs from attending over one chunk more or less (the window is really applied)
    if 1 < window <= n:
        wider = (
            [(sink[1], sink[2], 0, 1)]
            + [(chunks[i][1], chunks[i][2], 1 + i * fpc, fpc) for i in range(n - window, n)]
            + [(k_, v, start, fpc)]
        )
        assert rel_err(out, manual_attention(r, q, start, wider)) > 1e-3
    # commit=False did not store anything
    assert len(cache.past[0]) == min(n, window - 1)


def test_sink_query_sees_only_sink():
    r = rope()
    cache = NaiveCache(1, 4, GRID, r, "cpu")
    g = torch.Generator().manual_seed(0)
    # commit a couple of ordinary chunks first: a sink query must still ignore them
    cache.begin_chunk(0, 1, sink=True)
    cache.attend(0, *rand_qkv(g, 1), commit=True)
    for i in range(2):
        cache.begin_chunk(1 + i, 1)
        cache.attend(0, *rand_qkv(g, 1), commit=True)
    q, k, v = rand_qkv(g, 1)
    cache.begin_chunk(0, 1, sink=True)
    out = cache.attend(0, q, k, v, commit=False)
    ref = manual_attention(r, q, 0, [(k, v, 0, 1)])
    assert rel_err(out, ref) < 1e-6


def test_reset_forgets():
    cache = NaiveCache(2, 3, GRID, rope(), "cpu")
    g = torch.Generator().manual_seed(0)
    cache.begin_chunk(0, 1, sink=True)
    cache.attend(0, *rand_qkv(g, 1), commit=True)
    cache.begin_chunk(1, 1)
    cache.attend(0, *rand_qkv(g, 1), commit=True)
    assert cache.memory_bytes() > 0
    cache.reset()
    assert cache.memory_bytes() == 0 and cache.sink == [None, None]


def _fp8_pair(scale_k: float = 1.0):
    r = rope()
    outs = []
    for fp8 in (False, True):
        gg = torch.Generator().manual_seed(3)
        cache = NaiveCache(1, 3, GRID, r, "cpu", fp8=fp8)
        cache.begin_chunk(0, 1, sink=True)
        s = rand_qkv(gg, 1)
        cache.attend(0, s[0], s[1] * scale_k, s[2], commit=True)
        for i in range(3):
            q, k, v = rand_qkv(gg, 2)
            cache.begin_chunk(1 + 2 * i, 2)
            out = cache.attend(0, q, k * scale_k, v, commit=True)
        outs.append(out)
    return outs


def test_fp8_close_but_active():
    ref, q8 = _fp8_pair()
    err = rel_err(q8, ref)
    # e4m3 keeps 3 mantissa bits: per-element relative error <= 2^-4 = 6.25% (round to nearest).
    # Attention averages many such errors (softmax weights and values): on random data the output's
    # relative L2 error is ~3% (3.3% measured here). Bound by the per-element worst case; > 0 proves FP8 is applied.
    assert 0.0 < err < 0.0625, err
    assert err > 1e-3


def test_fp8_huge_keys_no_nan():
    # keys 1e4 x beyond the e4m3 range (448): per-(token, head) scaling plus the clamp keep it finite
    ref, q8 = _fp8_pair(scale_k=1e4)
    assert torch.isfinite(q8).all()
    assert torch.isfinite(ref).all()


def test_fake_fp8_elementwise_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 2, 64, generator=g) * torch.logspace(-3, 3, 64)  # wide dynamic range per row
    y = fake_fp8(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    # normal e4m3 numbers: |err| <= 2^-4 |x|; below the smallest normal (2^-6) the spacing is the
    # subnormal step 2^-9, so half of it (2^-10) in scaled units bounds the absolute error there.
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale + 1e-12
    assert ((y - x).abs() <= bound).all()
    # the per-row maximum is exactly representable (it maps to 448)
    idx = x.abs().argmax(-1, keepdim=True)
    assert torch.allclose(y.gather(-1, idx), x.gather(-1, idx), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_fp8_huge_and_zero(dtype):
    x = torch.tensor(
        [[1e30, -3e30, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [3e38, -3e38, 1e-30, 5.0]], dtype=torch.float32
    ).to(dtype)
    y = fake_fp8(x)
    assert torch.isfinite(y).all()
    assert (y[1] == 0).all()  # an all-zero row stays zero (no 0/0)
    # the largest magnitudes survive to within e4m3 rounding
    assert torch.allclose(y[0, :2].float(), x[0, :2].float(), rtol=2**-4)


# ---- RoPE --------------------------------------------------------------------------------------------


def test_rope_split_like_wan():
    assert ModelConfig(dim=8192, num_heads=64, head_dim=128).rope_split == (44, 42, 42)
    assert ModelConfig(dim=128, num_heads=4, head_dim=32).rope_split == (12, 10, 10)


def test_rope_preserves_pair_norms():
    r = rope()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4 * TPF, HEADS, HEAD_DIM, generator=g)
    cos, sin = r.cos_sin(torch.arange(3, 7), *GRID)
    y = apply_rope(x, cos, sin)

    def pn(t):
        return t.unflatten(-1, (-1, 2)).norm(dim=-1)

    # a rotation of each (2i, 2i+1) pair: norms kept to float32 rounding
    assert torch.allclose(pn(y), pn(x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y, x, atol=1e-3)  # and it did rotate
    # position 0 everywhere (frame 0, row 0, column 0) is the identity
    c0, s0 = r.cos_sin(torch.tensor([0]), 1, 1)
    x0 = x[:, :1]
    assert torch.equal(apply_rope(x0, c0, s0), x0)


def test_rope_relative_positions():
    r = rope()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2 * TPF, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(1, 3 * TPF, HEADS, HEAD_DIM, generator=g)

    def scores(q_frames, k_frames):
        cq, sq = r.cos_sin(torch.tensor(q_frames), *GRID)
        ck, sk = r.cos_sin(torch.tensor(k_frames), *GRID)
        return torch.einsum("bnhd,bmhd->bhnm", apply_rope(q, cq, sq), apply_rope(k, ck, sk))

    base = scores([5, 6], [2, 3, 4])
    shifted = scores([5 + 37, 6 + 37], [2 + 37, 3 + 37, 4 + 37])
    # q.k depends only on p - p'. Angles are float32 pos * inv_freq; at positions ~40 their rounding
    # is ~40 * 6e-8 = 2.4e-6 rad, times |q||k| ~ 32 -> ~1e-4 absolute on scores of size ~6.
    assert torch.allclose(shifted, base, rtol=1e-5, atol=2e-4)
    # but not on the absolute positions of only one side
    other = scores([5 + 3, 6 + 3], [2, 3, 4])
    assert (other - base).abs().max() > 1e-2


def test_rope_large_positions_finite():
    r = rope()
    frames = torch.tensor([10**6, 10**6 + 1, 2**31 - 1])
    cos, sin = r.cos_sin(frames, *GRID)
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    assert torch.allclose(cos**2 + sin**2, torch.ones_like(cos), atol=1e-6)
    # angles are pos * inv_freq from integer positions: the frame part at frame 10^6, channel 0
    # (inv_freq 1) is exactly float32(10^6) rad
    a = r.angles(frames[:1], 1, 1)
    assert a[0, 0].item() == pytest.approx(1e6, rel=1e-7)
    x = torch.randn(1, 3 * TPF, HEADS, HEAD_DIM)
    y = apply_rope(x, cos, sin)
    assert torch.isfinite(y).all()


def test_rope_grid_order():
    # tokens are ordered (frame, row, column): token index f*TPF + h*W + w gets height angle h, width w
    r = rope()
    a = r.angles(torch.tensor([4, 9]), *GRID)
    inv = r.inv
    nf = SPLIT[0] // 2
    nh = SPLIT[1] // 2
    for f_i, f in enumerate([4, 9]):
        for h in range(GRID[0]):
            for w in range(GRID[1]):
                row = a[f_i * TPF + h * GRID[1] + w]
                assert torch.allclose(row[:nf], f * inv[0])
                assert torch.allclose(row[nf : nf + nh], h * inv[1])
                assert torch.allclose(row[nf + nh :], w * inv[2])
    assert math.isclose(inv[0][0].item(), 1.0)
