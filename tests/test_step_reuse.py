"""What the chunk step computes once instead of per pass (cadence.runtime.chunk) and the whole-sequence RoPE's
fast form (cadence.model.rope), each against its reference path.

Tolerances: the kept timestep embeddings and the once-per-chunk audio K/V are the reference's own values (the
same calls on the same inputs, only fewer of them): streams agree **bitwise** (torch.equal). The real-arithmetic
RoPE computes the complex product's two sums in float32; a contracted multiply-add (or a different association)
moves a float32 result by one rounding: 1e-6 relative in float32, and at most one unit of bfloat16 on a small
share of elements (rounding to bf16 after a 1-ulp float32 difference flips only at a tie boundary).
"""

from __future__ import annotations

import math

import pytest
import torch

from cadence.config import get_preset
from cadence.engine.session import StreamGenerator
from cadence.model import layers as L
from cadence.model.dit import AudioKV, PassTime
from cadence.model.rope import Rope3D, apply_rope, apply_rope_real
from cadence.model.weights import build_model
from cadence.runtime import chunk
from cadence.runtime.compile import _compiler_problem

CPU = torch.device("cpu")
HAVE_INDUCTOR = _compiler_problem(CPU) is None


def _session(cfg):
    gen = StreamGenerator(cfg, build_model(cfg, "cpu", torch.float32, seed=0))
    g = torch.Generator().manual_seed(0)
    img = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    return gen, gen.session(img, "a person talking", seed=3)


def _chunks(sess, cfg, n=3):
    t = torch.arange(n * cfg.audio_samples_per_chunk) / 48_000
    audio = (0.3 * torch.sin(2 * math.pi * 220 * t)).reshape(n, -1)
    with torch.no_grad():
        return [sess.step(a) for a in audio]


@pytest.mark.parametrize("commit", ["last_pass", "clean_pass"])
def test_reused_timesteps_and_audio_kv_are_the_reference_bitwise(monkeypatch, commit):
    cfg = get_preset("tiny").with_overrides(stream={"commit": commit})
    assert cfg.model.audio_every and cfg.stream.passes > 1
    monkeypatch.setenv("CADENCE_TIMESTEP_CACHE", "0")
    monkeypatch.setenv("CADENCE_AUDIO_KV", "pass")
    gen, sess = _session(cfg)
    ref = _chunks(sess, cfg)
    monkeypatch.setenv("CADENCE_TIMESTEP_CACHE", "1")
    monkeypatch.setenv("CADENCE_AUDIO_KV", "chunk")
    gen2, sess2 = _session(cfg)
    before = chunk.PASS_TIMES.computed
    got = _chunks(sess2, cfg)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # one embedding per distinct index over three chunks (passes, + the clean pass's), not one per pass
    assert chunk.PASS_TIMES.computed - before == cfg.stream.passes + (commit == "clean_pass")


def test_audio_kv_once_per_chunk_calls_the_projection_once(monkeypatch):
    cfg = get_preset("tiny")
    gen, sess = _session(cfg)
    calls = []
    blk = next(b for b in gen.model.blocks if b.audio_attn is not None)
    orig = blk.audio_attn.context_kv

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    blk.audio_attn.context_kv = counted
    for mode, want in (("chunk", 1), ("pass", cfg.stream.passes)):
        monkeypatch.setenv("CADENCE_AUDIO_KV", mode)
        calls.clear()
        _chunks(sess, cfg, n=1)
        assert len(calls) == want, mode
    monkeypatch.setenv("CADENCE_AUDIO_KV", "both")
    with pytest.raises(ValueError, match="chunk or pass"):
        _chunks(sess, cfg, n=1)


def test_kept_embedding_follows_weights_and_values_in_place():
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    ts = torch.tensor([1000.0, 700.0, 0.0])
    cache = chunk.PassTimes()
    a = cache.get(model, ts, 1)
    assert cache.get(model, ts, 1) is a and cache.computed == 1  # a hit computes nothing
    assert torch.equal(a.temb6, model.pass_time(ts[1:2]).temb6)
    ptr = a.temb6.data_ptr()
    with torch.no_grad():
        model.time_proj.weight.mul_(1.5)  # weights changed in place (a version bump)
    b = cache.get(model, ts, 1)
    assert b is a and b.temb6.data_ptr() == ptr  # recomputed into the kept tensors (a graph reads them)
    assert torch.equal(b.temb6, model.pass_time(ts[1:2]).temb6)
    ts[1] = 500.0  # the timesteps changed in place
    assert torch.equal(cache.get(model, ts, 1).temb6, model.pass_time(torch.tensor([500.0])).temb6)
    del ts  # the entry goes with its timesteps tensor
    assert not cache._entries
    with torch.inference_mode():  # no version counter to check against: computed on every call, never kept
        ti = torch.tensor([1000.0])
        n = cache.computed
        assert torch.equal(cache.get(model, ti, 0).temb6, cache.get(model, ti, 0).temb6)
    assert cache.computed == n + 2 and not cache._entries


def test_forward_takes_prepared_time_and_audio():
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    m = cfg.model
    audio = torch.randn(1, 2, m.audio_tokens_per_frame, m.audio_dim, generator=g)
    kv = model.prepare_audio(audio)
    assert isinstance(kv, AudioKV) and len(kv.kv) == m.num_layers
    assert [e is None for e in kv.kv] == [not m.has_audio(i) for i in range(m.num_layers)]
    assert model.prepare_audio(None) is None
    t = torch.tensor([300.0])
    pt = model.pass_time(t)
    assert isinstance(pt, PassTime) and pt.temb6.shape == (1, 6, m.dim)
    x = torch.randn(1, m.in_channels, 2, *cfg.latent_hw, generator=g)
    text = torch.randn(1, m.text_len, m.text_dim, generator=g)
    with torch.no_grad():
        ref = model.forward_full(x, t, text, audio)
        got = model.forward_full(x, t, text, kv)
    assert torch.equal(got, ref)


# ---- the whole-sequence RoPE ----------------------------------------------------------------------------------
def _rope_inputs(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, 90, 3, 32, generator=g) * 4).to(dtype)
    a = torch.rand(90, 16, generator=g) * 60.0
    return x, torch.cos(a), torch.sin(a)


def _ulp_share(got, ref):
    """Share of elements more than one bf16 unit apart, and the largest gap in those units."""
    unit = ref.float().abs() * 2**-7 + 1e-30
    d = (got.float() - ref.float()).abs() / unit
    return float((d > 1.0).float().mean()), float(d.max())


def test_real_rope_is_the_complex_rope():
    x, c, s = _rope_inputs(torch.float32)
    ref = apply_rope(x, c, s)
    assert float((apply_rope_real(x, c, s) - ref).norm() / ref.norm()) < 1e-6
    xb = x.bfloat16()
    share, worst = _ulp_share(apply_rope_real(xb, c, s), apply_rope(xb, c, s))
    assert share == 0.0 and worst <= 1.0


@pytest.mark.skipif(not HAVE_INDUCTOR, reason="no C++ compiler for inductor")
def test_compiled_rope_and_model_seam():
    from cadence.runtime.compile import FusedOps, apply_compile, remove_compile

    ops = FusedOps("inductor")
    x, c, s = _rope_inputs(torch.float32)
    ref = apply_rope(x, c, s)
    assert float((ops.apply_rope(x, c, s) - ref).norm() / ref.norm()) < 1e-6
    share, worst = _ulp_share(ops.apply_rope(x.bfloat16(), c, s), apply_rope(x.bfloat16(), c, s))
    assert share < 0.01 and worst <= 1.0
    assert ops.status()["apply_rope"].startswith("compiled")
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    g = torch.Generator().manual_seed(4)
    xx = torch.randn(1, cfg.model.in_channels, 2, *cfg.latent_hw, generator=g)
    text = torch.randn(1, cfg.model.text_len, cfg.model.text_dim, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        want = model.forward_full(xx, t, text)
        rep = apply_compile(model, backend="inductor")
        assert isinstance(model.ops, FusedOps) and rep.blocks == cfg.model.num_layers
        got = model.forward_full(xx, t, text)
        remove_compile(model)
    assert model.ops is L.PLAIN_OPS
    assert float((got - want).norm() / want.norm()) < 1e-4  # compile tests' model tolerance


@pytest.mark.skipif(not HAVE_INDUCTOR, reason="no C++ compiler for inductor")
def test_rope_reference_switch(monkeypatch):
    """CADENCE_COMPILE_ROPE=0: the blocks compiled, the model's whole-sequence RoPE left on the reference."""
    from cadence.runtime.compile import apply_compile, remove_compile

    monkeypatch.setenv("CADENCE_COMPILE_ROPE", "0")
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    rep = apply_compile(model, backend="aot_eager")
    assert rep.blocks == cfg.model.num_layers and rep.models == 0 and model.ops is L.PLAIN_OPS
    assert "RoPE" not in rep.describe()
    remove_compile(model)


def test_grid_tables_are_kept_per_geometry():
    rope = Rope3D((12, 10, 10), 10_000.0)
    c, s = rope.grid_cos_sin(3, 2, 4, 5)
    rc, rs = rope.cos_sin(torch.arange(3, 5), 4, 5)
    assert torch.equal(c, rc) and torch.equal(s, rs)
    assert rope.grid_cos_sin(3, 2, 4, 5)[0] is c  # kept
    for i in range(Rope3D.MAX_TABLES + 2):
        rope.grid_cos_sin(10 + i, 1, 2, 2)
    assert len(rope._tables) == Rope3D.MAX_TABLES and rope.grid_cos_sin(3, 2, 4, 5)[0] is c  # never evicted
    rope.to("cpu")
    assert not rope._tables


@torch.no_grad()
def test_captured_step_reads_the_kept_embeddings():
    """The graph runner's eager warm-up fills the kept embeddings; the captured passes compute none (they read
    the kept tensors, so a CUDA graph holds no timestep GEMV) and replay to the eager step's result."""
    from cadence.bench.step import fill_cache_random
    from cadence.runtime.graphs import GraphRunner

    cfg = get_preset("tiny").with_overrides(stream={"cache": "ring"})
    gen, sess = _session(cfg)
    g = torch.Generator().manual_seed(5)
    fill_cache_random(sess.cache, cfg, gen.model, g)
    audio = torch.randn(cfg.audio_samples_per_chunk, generator=g) * 0.1
    calls, seen = [], {}
    embed = gen.model.time_embedding
    gen.model.time_embedding = lambda t: calls.append(1) or embed(t)

    class Capture:  # stands in for the CUDA capture: runs the step once at capture, again at each replay
        def __init__(self, fn):
            before = len(calls)
            self.fn, self.output = fn, fn()
            seen["in_capture"] = len(calls) - before

        def replay(self):
            self.output = self.fn()

    runner = GraphRunner(capture=Capture, warmup=1)
    sess.step(audio, runner=runner)  # the eager warm-up
    assert calls  # (the first chunk embeds its passes' timesteps)
    sess.step(audio, runner=runner)  # the capture (and its replay)
    assert runner.stats.captures == 1 and seen["in_capture"] == 0
