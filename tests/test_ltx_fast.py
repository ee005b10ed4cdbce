"""The LTX VAE's fast paths (cadence.runtime.ltx_fast) against the plain module, CPU, float32, random weights.

Tolerances: channels-last runs the same convs on the same values in another memory layout: relative L2
<= 1e-5 and max abs <= 1e-4 (values ~0.3; only float32 summation order can differ). FP8 (the ``reference``
backend: both operands quantised to e4m3, dequantised, float32 conv): each conv is off by ~3.7% relative
(3 mantissa bits), and the decode by what the FP8 convs add up to: bounded here at 12% relative L2 for the
full-rate stage's convs (measured 4.2% here, 6.6% at the notes' size: docs/perf/vae/LTX_NOTES.md), and
required to be > 0.1% (the FP8 convs did run).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from cadence.errors import ConfigError
from cadence.model.ltx_vae import RELEASED_CONFIG, LTXVideoVAE
from cadence.runtime import ltx_fast
from cadence.runtime.ltx_fast import Fp8Conv3d, accelerate_ltx

CFG = {**RELEASED_CONFIG, "block_out_channels": [16, 32, 64, 64], "latent_channels": 8, "patch_size": 2,
       "layers_per_block": [1, 1, 1, 1, 1]}  # fmt: skip


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def plain():
    torch.manual_seed(0)
    return LTXVideoVAE.from_config(CFG)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 2, 2, generator=g), torch.rand(3, 9, 32, 32, generator=g) * 2 - 1


@pytest.fixture(scope="module")
def ref(plain, inputs):
    z, frames = inputs
    return plain.decode(z), plain.encode(frames, sample=False)


def test_channels_last_matches_plain(plain, inputs, ref):
    fast = copy.deepcopy(plain)
    rep = accelerate_ltx(fast, "cl")
    assert rep.applied == ["channels_last"]
    assert fast.decoder.conv_out.conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    z, frames = inputs
    for got, want in ((fast.decode(z), ref[0]), (fast.encode(frames, sample=False), ref[1])):
        assert got.shape == want.shape
        assert _rel(got, want) <= 1e-5 and float((got - want).abs().max()) <= 1e-4
    streamed = torch.cat(list(fast.stream_decode(z, chunk_frames=2)), 1)
    assert _rel(streamed, ref[0]) <= 1e-5


def test_fp8_reference_backend_is_close_and_applied(plain, inputs, ref, monkeypatch):
    monkeypatch.setenv("CADENCE_CONV_FP8", "reference")
    fast = copy.deepcopy(plain)
    rep = accelerate_ltx(fast, "fp8")
    assert (
        "fp8:2:reference" in rep.applied and "compile" in rep.applied
    )  # the last up block: 1 resnet, 2 convs
    assert all(
        type(m) is Fp8Conv3d for r in fast.decoder.up_blocks[-1].resnets for m in (r.conv1.conv, r.conv2.conv)
    )
    assert type(fast.decoder.up_blocks[0].resnets[0].conv1.conv) is torch.nn.Conv3d
    fast.decoder.forward = fast.decoder.forward.eager  # the FP8 convs, without compiling on the CPU
    z, _ = inputs
    err = _rel(fast.decode(z), ref[0])
    assert 1e-3 < err < 0.12
    # the stream uses the same FP8 convs; each piece gets its own activation scale, so it is not the whole
    # decode bit for bit, but as close to the plain one
    streamed = torch.cat(list(fast.stream_decode(z, chunk_frames=3)), 1)
    assert 1e-3 < _rel(streamed, ref[0]) < 0.12


def test_fp8_where_it_cannot_run_leaves_the_convs_with_one_line(plain, monkeypatch, caplog):
    monkeypatch.setenv("CADENCE_CONV_FP8", "triton")  # needs CUDA (or the interpreter the test session sets)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fast = copy.deepcopy(plain)
    with caplog.at_level(logging.WARNING, logger="cadence.ltx_vae"):
        rep = accelerate_ltx(fast, "fp8")
    assert [r.message for r in caplog.records if "FP8" in r.message] == [
        "LTX decoder FP8 convs unavailable (needs a CUDA device (got cpu)): convs unchanged"
    ]
    assert not any(type(m) is Fp8Conv3d for m in fast.modules())
    assert rep.notes and not any(a.startswith("fp8") for a in rep.applied)


def test_a_compile_that_fails_runs_eagerly_with_one_line(plain, inputs, ref, monkeypatch, caplog):
    calls = {"n": 0}

    def fake_compile(fn, **kw):
        def broken(x):
            calls["n"] += 1
            raise RuntimeError("inductor: no C++ compiler\nsecond line")

        return broken

    monkeypatch.setattr(torch, "compile", fake_compile)
    fast = copy.deepcopy(plain)
    z, frames = inputs
    with caplog.at_level(logging.WARNING, logger="cadence.ltx_vae"):
        rep = accelerate_ltx(fast, "compile")
        assert rep.applied == ["channels_last", "compile"]
        for _ in range(2):
            assert _rel(fast.decode(z), ref[0]) <= 1e-5
            assert _rel(fast.encode(frames, sample=False), ref[1]) <= 1e-5
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "LTX decoder torch.compile failed at a call (RuntimeError: inductor: no C++ compiler): running it eagerly",
        "LTX encoder torch.compile failed at a call (RuntimeError: inductor: no C++ compiler): running it eagerly",
    ]
    assert calls["n"] == 2 and len(rep.notes) == 2  # one failed call per part, eager after


def test_modes_are_checked_and_off_is_plain(plain):
    vae = copy.deepcopy(plain)
    rep = accelerate_ltx(vae, "off")
    assert rep.describe() == "plain" and accelerate_ltx(vae, "off") is rep
    with pytest.raises(ConfigError, match="already 'off'"):
        accelerate_ltx(vae, "cl")
    with pytest.raises(ConfigError, match="one of off, cl, compile, fp8"):
        accelerate_ltx(copy.deepcopy(plain), "fold")
    assert ltx_fast.MODES == ("off", "cl", "compile", "fp8")


@pytest.mark.slow
def test_real_compile_matches_plain(plain, inputs, ref):
    """torch.compile on this CPU (inductor needs a C++ compiler; without one the fallback above applies)."""
    fast = copy.deepcopy(plain)
    rep = accelerate_ltx(fast, "compile")
    z, frames = inputs
    assert _rel(fast.decode(z), ref[0]) <= 1e-5
    assert _rel(fast.encode(frames, sample=False), ref[1]) <= 1e-5
    assert "compile" in rep.applied, rep.describe()
