"""The self-attention's q/k RMS norms applied inside the ring write (``cadence.cache.qk_fold``) against the separate
norms (``CADENCE_QK_NORM_IN_WRITE=0``, the reference).

Tolerances, and why:

* float32 inputs and storage: the folded write computes ``x * rsqrt(ss / dim + eps) * w`` in float32, the
  separate norm the same product (its casts to float32 are no-ops), then the same rotation: equal to float32
  rounding (the rsqrt's last bit: rel < 1e-6 per tensor).
* bf16 inputs, bf16 storage: the separate norm rounds its output to bf16 twice (after the scale, after the
  weight; <= 2^-9 relative each) where the fold does not; after the rotation the write's own rounding to
  bf16 may then land one ulp apart (<= 2^-7 of the element): every element within 2^-6 of its (token, head)
  vector's max (2^-7 + sqrt(2) x 2^-8 = 0.0133; measured 0.008), rel < 6e-3 per tensor (measured 3.3e-3).
* FP8 storage: the same budget as ``tests/test_ring_kernels.py``'s fused write (the interpreter's e4m3 cast
  truncates): 98% of the elements within 2^-4 of the 448-scaled vector max, all within 2^-2; the scales within
  1e-2 relative (the bf16 roundings above move the row's amax by at most 3 x 2^-9).
"""

from __future__ import annotations

import math

import pytest
import torch
from streams import engine_stream

import cadence.engine.session as generate
from cadence.cache.qk_fold import FoldedSelfAttention, fold_qk_norms, unfold_qk_norms
from cadence.cache.ring import RingCache
from cadence.config import ModelConfig, get_preset
from cadence.engine.session import StreamGenerator
from cadence.kernels import ring_attention as ra
from cadence.model.dit import SelfAttention
from cadence.model.layers import rms_scale, sum_squares
from cadence.model.rope import Rope3D
from cadence.model.weights import build_model

TRITON = ra.triton_usable(torch.device("cpu"), 32, allow_interpreter=True)[0] or torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not TRITON, reason="triton cannot run here")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _inputs(g, t: int, h: int, d: int, world: int, dtype):
    """q, k, v [T, H, D] as strided views of one qkv row (the model's chunk), this rank's norm weights, and
    the sums over the full width of `world` ranks' channels: this rank's own plus the other ranks' (drawn),
    paired in one [T, 2] tensor as ``QKVNormStats`` leaves them (k's column: a misaligned strided view)."""
    qkv = (torch.randn(t, h, 3 * d, generator=g) * 2).to(DEV, dtype)
    q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
    others = torch.rand(t, 2, generator=g).to(DEV) * 4.0 * h * d * (world - 1)
    ss = torch.cat([sum_squares(q.flatten(1)), sum_squares(k.flatten(1))], -1) + others
    wq, wk = ((torch.rand(h * d, generator=g) * 1.5 + 0.25).to(DEV, dtype) for _ in range(2))
    norms = (ra.RowNorm(ss[:, 0:1], wq, world * h * d, EPS), ra.RowNorm(ss[:, 1:2], wk, world * h * d, EPS))
    return q, k, v, norms


def _buffers(t, h, d, n, dt, fp8):
    qo, qs = torch.zeros(h, t, d, dtype=dt, device=DEV), torch.zeros(h, t, device=DEV)
    ko, ks = torch.zeros(h, n, d, dtype=dt, device=DEV), torch.zeros(h, n, device=DEV)
    vo = torch.zeros((h, d, n) if fp8 else (h, n, d), dtype=dt, device=DEV)
    return qo, qs, ko, ks, vo, torch.zeros(h, n, device=DEV)


def _write(q, k, v, cos, sin, dt, fp8, norm):
    t, h, d = q.shape
    bufs = _buffers(t, h, d, 128, dt, fp8)
    zero, row0 = torch.zeros(1, dtype=torch.int32, device=DEV), torch.tensor([40], dtype=torch.int32).to(DEV)
    qo, qs, ko, ks, vo, vs = bufs
    ra.qkv_write(q, k, v, cos, sin, qo, qs, ko, ks, vo, vs, zero, row0, fp8, norm)
    got_v = vo[:, :, 40 : 40 + t].transpose(1, 2) if fp8 else vo[:, 40 : 40 + t]
    return [(qo, qs), (ko[:, 40 : 40 + t], ks[:, 40 : 40 + t]), (got_v, vs[:, 40 : 40 + t])]


@needs_triton
@pytest.mark.parametrize(
    "world,in_dtype,store",
    [
        (1, torch.float32, "float"),
        (2, torch.float32, "float"),
        (2, torch.bfloat16, "float"),
        (2, None, "fp8"),
    ],
)
def test_qkv_write_with_the_norm_folded_matches_the_separate_norm(world, in_dtype, store):
    """The Triton write given the norms' inputs and sums equals the separate norm followed by the plain write,
    at one rank (the sum is the local one) and for a rank of a TP=2 shard (the sum covers twice the channels);
    and the folded reference (``rope_quant_reference(..., norm)``) equals the kernel."""
    g = torch.Generator().manual_seed(world)
    t, h, d = 40, 2, 32
    in_dtype = in_dtype or torch.bfloat16
    fp8 = store == "fp8"
    dt = ra.FP8 if fp8 else in_dtype
    q, k, v, (nq, nk) = _inputs(g, t, h, d, world, in_dtype)
    a = torch.rand(t, d // 2, generator=g) * 50.0
    cos, sin = torch.cos(a).to(DEV), torch.sin(a).to(DEV)
    folded = _write(q, k, v, cos, sin, dt, fp8, (nq, nk))
    normed = [nq.apply(q), nk.apply(k)]  # the separate norms' outputs, in the model dtype
    assert normed[0].dtype == in_dtype
    sep = _write(normed[0], normed[1], v, cos, sin, dt, fp8, None)
    ref_q = ra.rope_quant_reference(q, cos, sin, fp8, dt, None, nq)
    ref_k = ra.rope_quant_reference(k, cos, sin, fp8, dt, None, nk)
    if not fp8:
        tol = 1e-6 if in_dtype == torch.float32 else 6e-3
        for (a_, _), (b_, _) in zip(folded, sep):
            assert rel(a_, b_) < tol
        if in_dtype == torch.bfloat16:  # per element: within 2^-6 of its vector's max (the module's budget)
            for (a_, _), (b_, _) in zip(folded[:2], sep[:2]):
                err = (a_.float() - b_.float()).abs()
                assert (err <= 2**-6 * b_.float().abs().amax(-1, keepdim=True)).all()
        for (a_, _), (b_, _) in zip(folded[:2], (ref_q, ref_k)):  # the kernel against the folded reference
            # float32: the same arithmetic; bf16: the interpreter's cast truncates (one ulp, 2^-7, apart)
            assert rel(a_, b_) < tol
            assert (a_.float() - b_.float()).abs().max() <= 2**-6 * b_.float().abs().max()
        assert rel(folded[2][0], sep[2][0]) == 0.0  # v untouched
        return
    for (a_, sa), (b_, sb) in zip(folded, sep):
        assert torch.allclose(sa, sb, rtol=1e-2)
        diff = (a_.float() - b_.float()).abs() / 448.0
        assert (diff <= 2**-4).float().mean() > 0.98 and diff.max() <= 2**-2
    for (a_, sa), (b_, sb) in zip(folded[:2], (ref_q, ref_k)):  # kernel vs folded reference: same math
        assert torch.allclose(sa, sb, rtol=1e-6)
        diff = (a_.float() - b_.float()).abs() / 448.0
        assert (diff <= 2**-4).float().mean() > 0.98 and diff.max() <= 2**-2


def test_row_norm_apply_is_the_norms_own_math_and_bad_widths_are_one_error():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 10, 2, 8, generator=g, dtype=torch.float64).to(torch.bfloat16)
    w = torch.rand(16, generator=g).to(torch.bfloat16)
    ss = sum_squares(x.flatten(-2))
    n = ra.RowNorm(ss, w, 16, EPS)
    assert torch.equal(n.apply(x), rms_scale(x.flatten(-2), ss, w, 16, EPS).unflatten(-1, (2, 8)))
    q = torch.randn(10, 2, 8, generator=g)
    bufs = _buffers(10, 2, 8, 32, torch.float32, False)
    z = torch.zeros(1, dtype=torch.int32)
    c = torch.ones(10, 4)
    bad = ra.RowNorm(ss.float(), torch.ones(12), 16, EPS)  # a weight of another width
    with pytest.raises(ValueError, match="weight of 12 for 16 channels"):
        ra.qkv_write(q, q, q, c, c * 0, *bufs[:4], bufs[4], bufs[5], z, z, False, (bad, bad))


# ---- the ring and the model --------------------------------------------------------------------------------
GRID, HEADS, HEAD_DIM = (2, 3), 2, 32
SPLIT = ModelConfig(dim=HEADS * HEAD_DIM, num_heads=HEADS, head_dim=HEAD_DIM).rope_split


def _ring(use_triton, dtype):
    return RingCache(
        1, 2, GRID, Rope3D(SPLIT, 10_000.0), "cpu", HEADS, HEAD_DIM, 1, 1,
        model_dtype=torch.float32, dtype=dtype, sink_policy="follow", use_triton=use_triton,
    )  # fmt: skip


@pytest.mark.parametrize(
    "use_triton,dtype",  # (the FP8 Triton attention under the interpreter: the write is covered above)
    [(False, "bf16"), (False, "fp8"), pytest.param(True, "bf16", marks=needs_triton)],
)
def test_ring_attend_with_the_norms_folded_matches_normed_inputs(use_triton, dtype):
    """``RingCache.attend(..., qk_norm=...)`` over a sink and 3 chunks (filling, then past the window) equals
    attending the separately normed q/k: the sink's pass takes the norms' own math (its raw keys are kept
    normed), the chunks fold them into the write (the kernel, or the reference write)."""
    outs = []
    for fold in (True, False):
        ring = _ring(use_triton, dtype)
        g = torch.Generator().manual_seed(0)
        got = []
        for i, sink in enumerate([True, False, False, False]):
            ring.begin_chunk(0 if sink else i, 1, sink=sink)
            q, k, v = (torch.randn(1, 6, HEADS * HEAD_DIM, generator=g) * 3 for _ in range(3))
            ss = torch.cat([sum_squares(q), sum_squares(k)], -1)
            wq, wk = (
                torch.rand(HEADS * HEAD_DIM, generator=g) + 0.5,
                torch.rand(HEADS * HEAD_DIM, generator=g),
            )
            norms = (ra.RowNorm(ss[..., 0], wq, 64, EPS), ra.RowNorm(ss[..., 1], wk, 64, EPS))
            q, k, v = (x.unflatten(-1, (HEADS, HEAD_DIM)) for x in (q, k, v))
            if not fold:
                q, k = norms[0].apply(q), norms[1].apply(k)
            got.append(ring.attend(0, q, k, v, commit=True, qk_norm=norms if fold else None))
        outs.append(torch.cat(got, 1))
    assert rel(outs[0], outs[1]) < (1e-5 if dtype == "bf16" else 2e-2)


W = 2
CFG = get_preset("tiny").with_overrides(stream={"window_chunks": W})


def _latents(cfg, model, monkeypatch, fold: bool, use_triton: bool, dtype: str, n: int = 3):
    """Latents of n chunks from a Session on `model` whose ring folds the norms or not."""

    def factory(c, m, fp8=False):
        ring = RingCache.from_config(c, m, dtype=dtype, sink_policy="follow", use_triton=use_triton)
        if not use_triton and fold:  # the reference ring folds only when told: its folded reference write
            ring.folds_qk_norm = True
            fold_qk_norms(m)
        return ring

    folded, write = [], RingCache._write

    def spy(self, *a, **k):  # how many passes' writes took the norms in
        folded.append(a[-1] is not None if len(a) == 7 else k.get("qk_norm") is not None)
        return write(self, *a, **k)

    monkeypatch.setenv("CADENCE_QK_NORM_IN_WRITE", "1" if fold else "0")
    monkeypatch.setattr(generate, "make_cache", factory)
    monkeypatch.setattr(RingCache, "_write", spy)
    g = torch.Generator().manual_seed(0)
    spc = cfg.audio_samples_per_chunk
    img = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    audio = 0.3 * torch.sin(2 * math.pi * 220 * torch.arange(n * spc) / 48_000)
    out = [o.latents for o in engine_stream(StreamGenerator(cfg, model), img, "a person", audio, n, seed=0)]
    monkeypatch.undo()
    # every chunk pass folds; the sink's pass does not (its raw keys are kept normed)
    layers = cfg.model.num_layers
    assert sum(folded) == (len(folded) - layers if fold else 0) and len(folded) > 2 * layers
    return out


def _model(world: int):
    model = build_model(CFG, "cpu", torch.float32, seed=0)
    if world > 1:
        from cadence.parallel.emulate import EmulatedGroup
        from cadence.parallel.tp import apply_tp

        apply_tp(model, EmulatedGroup(world))
    return model


@pytest.mark.parametrize(
    "world,use_triton,dtype",
    [
        (1, False, "fp8"),
        (2, False, "fp8"),
        pytest.param(1, True, "bf16", marks=needs_triton),
        pytest.param(2, True, "bf16", marks=needs_triton),
    ],
)
def test_tiny_model_stream_unchanged_with_the_fold(world, use_triton, dtype, monkeypatch):
    """The whole tiny model (float32), 3 chunks (sink pass, filling, past the window of 2), at one rank and as
    rank 0 of an emulated TP=2 group (the paired sums' reduction): the latents with the norms in the write
    equal those with the separate norms. bf16 storage on the Triton write (the interpreter): float32 rounding
    (1e-5, as tests/test_ring.py's Triton-vs-reference stream); FP8 storage on the reference write: the
    quantisation of the same values, so the same float32 rounding bound."""
    model = _model(world)
    got = _latents(CFG, model, monkeypatch, True, use_triton, dtype)
    assert all(isinstance(b.self_attn, FoldedSelfAttention) for b in model.blocks)
    unfold_qk_norms(model)
    assert all(type(b.self_attn) is SelfAttention for b in model.blocks)
    ref = _latents(CFG, model, monkeypatch, False, use_triton, dtype)
    assert all(type(b.self_attn) is SelfAttention for b in model.blocks)  # switch 0: nothing installed
    errs = [rel(a, b) for a, b in zip(got, ref)]
    print(f"\nfold vs separate norms (tp={world}, triton={use_triton}, {dtype}):", [f"{e:.1e}" for e in errs])
    assert all(torch.isfinite(x).all() for x in got)
    assert max(errs) < 1e-5


def test_compiled_ops_give_the_fold_its_sums(monkeypatch):
    """With ``apply_compile`` (traced with aot_eager here: the plumbing, not Inductor's code) the one-rank fold
    takes both sums from the compiled ``sum_squares_pair``, and the stream equals the separate compiled norms."""
    from cadence.runtime.compile import apply_compile, remove_compile

    model = _model(1)
    assert apply_compile(model, backend="aot_eager").enabled
    calls = []
    ops = model.blocks[0].self_attn.norm_q.ops
    real = ops.sum_squares_pair
    monkeypatch.setattr(ops, "sum_squares_pair", lambda q, k: calls.append(1) or real(q, k), raising=False)
    got = _latents(CFG, model, monkeypatch, True, False, "fp8", n=2)
    assert calls  # (the monkeypatch above was undone inside _latents; the calls were counted)
    unfold_qk_norms(model)
    ref = _latents(CFG, model, monkeypatch, False, False, "fp8", n=2)
    remove_compile(model)
    assert max(rel(a, b) for a, b in zip(got, ref)) < 1e-5


def test_unpaired_tp_sums_and_other_caches_take_the_plain_path(monkeypatch):
    """With ``CADENCE_TP_QK_PAIR=0`` each sharded norm reduces its own sum (``reduced_sums``); a cache that does
    not fold (the naive one) gets the plain forward, bitwise."""
    monkeypatch.setenv("CADENCE_TP_QK_PAIR", "0")
    model = _model(2)
    monkeypatch.undo()
    got = _latents(CFG, model, monkeypatch, True, False, "fp8", n=2)
    unfold_qk_norms(model)
    ref = _latents(CFG, model, monkeypatch, False, False, "fp8", n=2)
    assert max(rel(a, b) for a, b in zip(got, ref)) < 1e-5
    fold_qk_norms(model)
    attn = model.blocks[0].self_attn
    x = torch.randn(1, 6, CFG.model.dim)

    class Plain:
        def attend(self, layer, q, k, v, commit):
            return (q + k + v).flatten(-2)

    assert torch.equal(attn(x, Plain(), 0, True), SelfAttention.forward(attn, x, Plain(), 0, True))
