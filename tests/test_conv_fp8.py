"""The FP8 decoder convs (cadence.kernels.conv_fp8, the ``fp8`` mode of cadence.runtime.vae_fast) on the CPU.

Tolerances, and why:
* Triton kernel vs the plain-PyTorch reference (under TRITON_INTERPRET=1, set by conftest.py): both see the
  same e4m3 bytes and scales and accumulate in float32, so only the summation order differs: relative L2
  <= 1e-5 (bf16 output: one bf16 rounding, <= 1e-2 relative per element, 4e-3 relative L2).
* FP8 conv vs the float32 conv of the unquantised operands: e4m3 keeps 3 mantissa bits, so each operand is
  off by up to 2^-4 relative (about 2.5% RMS); a dot product of two such operands is off by about 3.5% RMS
  relative, whatever K. Bound: 6% relative L2 (measured 3.0-3.5% on these shapes).
* A random-weight decoder stream with the up blocks' convs in FP8 (reference backend) vs the same decoder
  in float32: errors of ~20 convs compound through the residual blocks; measured 12-16% relative L2 on these
  tiny default-initialised models (bf16 everywhere: 1.6-2%). Bound: 25%, to catch a broken path (a wrong scale or layout gives
  O(1)), not to certify the image quality, which docs/perf/vae/NOTES.md reports at full width.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from family_fixtures import rel

from cadence.kernels import conv_fp8
from cadence.model.vae import WanVAE, wan_vae_config
from cadence.runtime import vae_fast


def _operands(kt, b=2, c=32, n=24, t=2, h=4, w=5, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(kt * 10 + b)
    x = torch.randn(b, c, t + kt - 1, h, w, generator=g).to(dtype)
    wt = torch.randn(n, c, kt, 3, 3, generator=g) * 0.1
    bs = torch.randn(n, generator=g) if bias else None
    return x, wt, bs


needs_triton = pytest.mark.skipif(
    conv_fp8.why_not(torch.device("cuda" if torch.cuda.is_available() else "cpu"), "triton") != "",
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)


@needs_triton
@pytest.mark.parametrize(
    "kt,bias,dtype", [(3, True, torch.float32), (1, False, torch.float32), (1, True, torch.bfloat16)]
)
def test_triton_kernel_matches_reference(kt, bias, dtype):
    """Two batches, C = 2 K blocks, N = 24 (a partial N tile), a partial M tile, border rows dropped; the bf16
    output's rounding with kt = 1 (the interpreter's cost grows with the taps)."""
    x, w, b = _operands(kt, dtype=dtype, bias=bias)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, w = x.to(dev), w.to(dev)
    b = None if b is None else b.to(dev)
    wq, sw = conv_fp8.quantize_weight(w)
    q, sx, _ = conv_fp8.quantize_input(x)
    assert q.shape == (2, x.shape[2], 6, 7, 32) and q.is_contiguous() and q.dtype == conv_fp8.FP8
    assert float(q[:, :, 0].float().abs().max()) == 0.0 and float(q[:, :, :, -1].float().abs().max()) == 0.0
    ref = conv_fp8.conv3x3_fp8_reference(q, sx, wq, sw, b, kt, dtype)
    got = conv_fp8.conv3x3_fp8_triton(q, sx, wq, sw, b, kt, dtype)
    assert got.shape == ref.shape == (2, 2, 4, 5, 24) and got.dtype == dtype
    assert rel(got, ref) <= (4e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("kt", [3, 1])
def test_fp8_conv_close_to_the_float_conv(kt):
    """The FP8 path's own error: vs conv3d of the unquantised operands (causal frames already in front,
    spatial zero padding 1), layout and scales checked on the way."""
    x, w, b = _operands(kt, c=64, n=32)
    wq, sw = conv_fp8.quantize_weight(w)
    y = conv_fp8.conv3x3_fp8(x, wq, sw, b, kt, backend="reference")
    want = F.conv3d(x, w, b, padding=(0, 1, 1))
    assert y.shape == want.shape and y.is_contiguous(memory_format=torch.channels_last_3d)
    err = rel(y, want)
    assert 0.005 < err <= 0.06, err  # quantised for real (not a silent float path), within e4m3's error


def _vae(variant: str) -> WanVAE:
    torch.manual_seed(0)
    extra = {"decoder_base_dim": 16} if variant == "2.2" else {}
    vae = WanVAE(wan_vae_config(variant, base_dim=16, num_res_blocks=1, **extra)).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return vae


def _decode(vae, z, sizes):
    st = vae.stream()
    outs, i = [], 0
    for n in sizes:
        outs.append(st.decode_chunk(z[:, i : i + n]))
        i += n
    return torch.cat(outs, 1)


@pytest.mark.parametrize("variant,scaling", [("2.1", "call"), ("2.2", "delayed")])
def test_fp8_decoder_stream_close_to_float(variant, scaling):
    plain = _vae(variant)
    fast = copy.deepcopy(plain)
    n = vae_fast.fp8_convs(fast.decoder.up_blocks, "reference", scaling=scaling, decoder=fast.decoder)
    convs = [m for m in fast.modules() if isinstance(m, vae_fast._Fp8Conv)]
    assert n == len(convs) > 0 and {"Fp8CausalConv3d", "Fp8Conv2d"} <= {type(m).__name__ for m in convs}
    assert fast.state_dict().keys() == plain.state_dict().keys()  # the quantised copies are not weights
    z = torch.randn(plain.z_dim, 4, 4, 6, generator=torch.Generator().manual_seed(2))
    ref = _decode(plain, z, [1, 1, 2])
    got = _decode(fast, z, [1, 1, 2])
    assert got.shape == ref.shape
    assert 0.005 < rel(got, ref) <= 0.25
    recorded = [float(m.fp8_amax) for m in convs]
    assert all(a > 0 for a in recorded) if scaling == "delayed" else not any(recorded)
    if scaling == "delayed":  # the stream's later calls scaled by the amax its calls before recorded
        assert convs[0].fp8_streams.warm


def test_delayed_scales_follow_their_stream():
    """Fp8Streams (the decoder's pre-hook): a stream's first call scales per call; a later call of the same
    stream uses the amax recorded before; switching streams saves one stream's amax values and restores the
    other's, and a stream never seen with this decoder scales per call once."""

    class Mem:
        def __init__(self):
            self.first = True

    class Conv:
        def __init__(self, v):
            self.fp8_amax = torch.full((1,), v)

    convs = [Conv(1.0), Conv(2.0)]
    hook = vae_fast.Fp8Streams(convs)
    a, b = Mem(), Mem()
    hook(None, (None, a))
    assert not hook.warm
    a.first = False
    hook(None, (None, a))
    assert hook.warm
    hook(None, (None, b))  # b starts: per call; a's values saved
    assert not hook.warm and [float(t) for t in a.fp8_amax] == [1.0, 2.0]
    b.first = False
    for c, v in zip(convs, (5.0, 6.0)):  # b's calls record their own amax
        c.fp8_amax.fill_(v)
    hook(None, (None, a))  # back to a: its values restored, b's saved
    assert hook.warm and [float(c.fp8_amax) for c in convs] == [1.0, 2.0]
    hook(None, (None, b))
    assert hook.warm and [float(c.fp8_amax) for c in convs] == [5.0, 6.0]
    c = Mem()
    c.first = False  # a stream whose first call this decoder never saw
    hook(None, (None, c))
    assert not hook.warm


def test_fp8_conv_that_raises_falls_back_to_the_plain_conv_once(monkeypatch, caplog):
    plain = _vae("2.1")
    fast = copy.deepcopy(plain)
    vae_fast.fp8_convs(fast.decoder.up_blocks, "reference")
    calls = {"n": 0}

    def broken(*a, **k):
        calls["n"] += 1
        raise RuntimeError("no kernel image for this device\nsecond line")

    monkeypatch.setattr(conv_fp8, "conv3x3_fp8", broken)
    z = torch.randn(plain.z_dim, 3, 4, 6, generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.WARNING, logger="cadence.vae"):
        got = _decode(fast, z, [1, 2])
    n_fp8 = sum(1 for m in fast.modules() if isinstance(m, vae_fast._Fp8Conv))
    assert calls["n"] == n_fp8  # each conv tried once, then plain for good
    assert rel(got, _decode(plain, z, [1, 2])) <= 1e-5
    lines = [r for r in caplog.records if "FP8 conv" in r.getMessage()]
    assert len(lines) == n_fp8 and "second line" not in lines[0].getMessage()


def test_fp8_mode_without_a_backend_keeps_bf16_convs(monkeypatch, caplog):
    """On the CPU (no interpreter) the Triton backend cannot run: one log line, no conv swapped; the mode
    still compiles (checked through the report, without compiling here)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    vae = _vae("2.2")
    with caplog.at_level(logging.WARNING, logger="cadence.vae"):
        rep = vae_fast.accelerate_decoder(vae, "fp8")
    assert not any(isinstance(m, vae_fast._Fp8Conv) for m in vae.modules())
    assert "compile" in rep.applied and any("fp8 unavailable" in n for n in rep.notes)
    assert sum("FP8 convs unavailable" in r.getMessage() for r in caplog.records) == 1
    assert conv_fp8.why_not(torch.device("cpu"), "nope").startswith("unknown")


@needs_triton
@pytest.mark.parametrize("channels_last,delayed", [(True, False), (False, False), (True, True)])
def test_triton_quantisation_gives_torch_bytes(channels_last, delayed):
    """The opaque quantisation op writes the same e4m3 bytes, scale and amax as the torch version that
    torch.compile fuses (the interpreter rounds to the e4m3 grid itself: see quant_triton): per call (torch's
    amax pass first) and delayed (the scale from a previous amax, here a quarter of x's, so that the
    headroom is exceeded and +-448 clamps; x's amax recorded by the kernel's atomic max)."""
    x = torch.randn(2, 32, 4, 5, 7, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    prev = x.float().abs().amax().reshape(1) / 4 if delayed else None
    q1, s1, a1 = conv_fp8.quantize_input(x, prev)
    q2, s2, a2 = conv_fp8.quantize_input_triton(x, prev)
    assert torch.equal(s1, s2) and torch.equal(a1, a2) and q2.shape == q1.shape == (2, 4, 7, 9, 32)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    assert float(a1) == float(x.float().abs().max())
    clamped = float((q1.float().abs() == conv_fp8.FP8_MAX).float().mean())
    assert (clamped > 0.01) if delayed else (clamped < 1e-3)
