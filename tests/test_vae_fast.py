"""The Wan decoder's fast paths (cadence.runtime.vae_fast) against the plain streaming decoder.

CPU, float32, small random Wan VAEs of both geometries. Tolerance: relative L2 <= 1e-5 and max abs <= 1e-4
(``cl``, ``fold`` and ``up`` change only the summation order / memory layout; well under both here).
The ``compile`` mode itself is exercised on the GPU runs (tests here check its fallback: a compiled call
that raises is re-run eagerly on the restored causal memory, and stays eager).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from cadence.errors import ConfigError
from cadence.model.vae import (
    WanVAE,
    _conv_time_folded,
    _up2_conv3x3,
    fold_time_weight,
    subpixel_weight,
    wan_vae_config,
)
from cadence.runtime import vae_fast

REL_TOL = 1e-5
ABS_TOL = 1e-4


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _vae(variant: str) -> WanVAE:
    torch.manual_seed(0)
    extra = {"decoder_base_dim": 12} if variant == "2.2" else {}
    vae = WanVAE(wan_vae_config(variant, base_dim=8, num_res_blocks=1, **extra)).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("gamma") else 0.08 * torch.randn_like(p))
    return vae


def _decode(vae: WanVAE, z: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    st = vae.stream()
    outs, i = [], 0
    for n in sizes:
        outs.append(st.decode_chunk(z[:, i : i + n]))
        i += n
    return torch.cat(outs, 1)


@pytest.mark.parametrize("kt,pad", [(3, (1, 1)), (3, (0, 0)), (1, (0, 0))])
@pytest.mark.parametrize("cl", [False, True])
def test_folded_conv_is_conv3d(kt, pad, cl):
    torch.manual_seed(1)
    ks = (kt, 3, 3) if pad == (1, 1) else (kt, 1, 1)
    x = torch.randn(2, 5, 4 + kt - 1, 6, 7)
    w = torch.randn(4, 5, *ks)
    b = torch.randn(4)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    ref = torch.nn.functional.conv3d(x, w, b, padding=(0, *pad))
    got = _conv_time_folded(x, fold_time_weight(w), b, kt, pad)
    assert got.shape == ref.shape
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    assert _rel(got, ref) <= REL_TOL and float((got - ref).abs().max()) <= ABS_TOL


@pytest.mark.parametrize("cl", [False, True])
def test_subpixel_upsample_conv_is_nearest_then_conv(cl):
    torch.manual_seed(4)
    x = torch.randn(2, 5, 6, 7)
    w, b = torch.randn(4, 5, 3, 3), torch.randn(4)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.conv2d(torch.nn.functional.interpolate(x, scale_factor=2.0), w, b, padding=1)
    got = _up2_conv3x3(x, subpixel_weight(w), b)
    assert got.shape == ref.shape and got.is_contiguous(memory_format=torch.channels_last) == cl
    assert _rel(got, ref) <= REL_TOL and float((got - ref).abs().max()) <= ABS_TOL


@pytest.mark.parametrize("variant", ["2.1", "2.2"])
@pytest.mark.parametrize("mode", ["cl", "fold", "up"])
def test_fast_decoder_matches_plain(variant, mode):
    plain = _vae(variant)
    fast = copy.deepcopy(plain)
    rep = vae_fast.accelerate_decoder(fast, mode)
    if mode in ("fold", "up"):
        fast.decoder.forward = fast.decoder.forward.eager  # the rewritten convs, without compiling on the CPU
        assert any(a.startswith("fold:" if mode == "fold" else "subpixel:") for a in rep.applied)
    assert "channels_last" in rep.applied
    z = torch.randn(plain.z_dim, 5, 4, 6, generator=torch.Generator().manual_seed(2))
    for sizes in ([1, 1, 3], [1, 2, 2]):
        ref = _decode(plain, z, sizes)
        got = _decode(fast, z, sizes)
        assert got.shape == ref.shape
        assert _rel(got, ref) <= REL_TOL and float((got - ref).abs().max()) <= ABS_TOL, (variant, mode, sizes)


def test_off_is_plain_and_modes_checked():
    vae = _vae("2.1")
    rep = vae_fast.accelerate_decoder(vae, "off")
    assert rep.applied == [] and rep.describe() == "plain"
    assert vae_fast.accelerate_decoder(vae, "off") is rep  # idempotent
    with pytest.raises(ConfigError):
        vae_fast.accelerate_decoder(vae, "cl")  # cannot switch on the same VAE
    with pytest.raises(ConfigError):
        vae_fast.accelerate_decoder(_vae("2.1"), "fast")


def test_compile_failure_falls_back_once_with_state_restored(monkeypatch, caplog):
    """A compiled call that raises (here: after touching the causal memory) is re-run eagerly from the
    memory as it was; every later call is eager; one warning line; the frames match the plain decoder."""
    calls = {"n": 0}

    def fake_compile(fn, **kw):
        def broken(x, mem):
            calls["n"] += 1
            mem.slots[0] = torch.full((1,), 7.0)  # a half-done call that dirtied the memory
            mem.first = not mem.first
            raise RuntimeError("inductor: no C++ compiler\nsecond line")

        return broken

    monkeypatch.setattr(torch, "compile", fake_compile)
    plain = _vae("2.2")
    fast = copy.deepcopy(plain)
    with caplog.at_level(logging.WARNING, logger="cadence.vae"):
        rep = vae_fast.accelerate_decoder(fast, "compile")
        assert "compile" in rep.applied
        z = torch.randn(plain.z_dim, 4, 4, 6, generator=torch.Generator().manual_seed(3))
        got = _decode(fast, z, [1, 1, 2])
    ref = _decode(plain, z, [1, 1, 2])
    assert _rel(got, ref) <= REL_TOL
    assert calls["n"] == 1  # eager for good after the first failure
    assert "compile" not in rep.applied and any("eager" in n for n in rep.notes)
    warnings = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 1 and "second line" not in warnings[0].getMessage()
