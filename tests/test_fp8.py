"""FP8 linear layers against the high-precision reference, on random data.

Error budget. e4m3 keeps 3 mantissa bits: rounding to nearest puts each quantised element within a
relative 2^-4 of its value (~2.5% RMS over normally distributed values). Both operands carry that
noise independently (weight per output channel, activation per token), and a dot product over K
random-sign terms averages it like the signal, so a matmul output's relative L2 error on random
normal data is ~sqrt(2) x 2.5% ~ 3.5%, whatever K: measured 3.6-3.8% (K, N from 128 to 1024, fp32 and
bf16). We assert < 0.08 per layer, and > 0.005 so the test proves quantisation happened. The whole
tiny model (two blocks; embedders and head in high precision) measured 3.8% relative L2 on the
output, against 0.7% for bf16 alone; we assert < 0.10.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cadence.config import get_preset
from cadence.model.layers import Linear
from cadence.model.weights import build_model
from cadence.quant import fp8
from cadence.quant.fp8 import FP8_MAX, FP8Linear, apply_fp8, quantize_rows
from cadence.telemetry import logs

TINY = get_preset("tiny")
LAYER_BUDGET = 0.08
MODEL_BUDGET = 0.10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _lin(k: int, n: int, seed: int = 0, dtype=torch.float32) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        lin.bias.copy_(0.02 * torch.randn(n, generator=g))
    return lin


@pytest.fixture
def fresh_fallback_state(monkeypatch):
    """Isolate the warn-once flag and the op-unusable memo from other tests."""
    logs.forget(fp8.log)
    monkeypatch.setattr(fp8, "_op_unusable", {})


def _torch_version() -> tuple[int, int]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def test_scaled_mm_runs_on_cpu(fresh_fallback_state):
    """The fast path itself (torch._scaled_mm with row-wise scales) runs on CPU from torch 2.13; torch
    2.11's CPU kernel takes per-tensor scales only and must land in the fallback, without a crash."""
    lin = FP8Linear.from_linear(_lin(64, 32))
    x = torch.randn(8, 64)
    y = lin(x)
    assert y.shape == (8, 32) and y.dtype == torch.float32 and torch.isfinite(y).all()
    if _torch_version() >= (2, 13):
        assert lin.fallback_reason is None, lin.fallback_reason


def test_quantize_rows_bounds():
    x = torch.randn(16, 128) * torch.logspace(-3, 3, 16)[:, None]
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (16, 1)
    deq = q.float() * s
    # per element: relative rounding <= 2^-4 for normal e4m3 numbers (|q| >= 2^-6); tiny ones (subnormal)
    # are off by at most half the subnormal step 2^-10 (in units of the row's scale)
    err = (deq - x).abs()
    assert (err <= 2**-4 * x.abs() + 2**-10 * s).all()
    assert (q.float().abs().amax(-1) == FP8_MAX).all()  # each row's amax lands on the top of the range


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 40, 128), (1, 64, 256)])
def test_layer_error_budget(shape, dtype):
    *lead, k = shape
    for n, seed in ((128, 0), (384, 1)):
        ref = _lin(k, n, seed, dtype)
        q = FP8Linear.from_linear(ref)
        x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(seed + 10)).to(dtype)
        y = q(x)
        assert y.shape == (*lead, n) and y.dtype == dtype
        # against the float32 math on the same (possibly bf16-rounded) operands
        want = torch.nn.functional.linear(x.float(), ref.weight.float(), ref.bias.float())
        e = rel(y, want)
        assert 0.005 < e < LAYER_BUDGET, f"{shape} {dtype} n={n}: relative L2 error {e:.4f}"


def test_no_nan_far_beyond_fp8_range():
    """Activations of size 1e4 (far past +-448) are scaled per token, clamped, never NaN/inf."""
    ref = _lin(128, 64)
    q = FP8Linear.from_linear(ref)
    x = torch.randn(2, 16, 128) * 1e4
    x[0, 0, 0] = 3e5  # one outlier
    y = q(x)
    assert torch.isfinite(y).all()
    assert rel(y, ref(x)) < LAYER_BUDGET
    # an all-zero token stays zero (+ bias), no 0/0
    z = q(torch.zeros(1, 4, 128))
    assert torch.allclose(z, ref.bias.expand_as(z), atol=1e-6)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m = TINY.model
    x = torch.randn(1, 16, 2, *TINY.latent_hw, generator=g)
    t = torch.tensor([600.0])
    text = torch.randn(1, m.text_len, m.text_dim, generator=g)
    audio = torch.randn(1, 2, m.audio_tokens_per_frame, m.audio_dim, generator=g)
    return x, t, text, audio


def test_apply_fp8_swaps_block_linears_only():
    model = build_model(TINY, "cpu", torch.float32, seed=0)
    m = TINY.model
    per_block = 2 + 3 + 2  # self qkv/out, cross q/kv/out, ffn fc1/fc2
    expected = m.num_layers * per_block + 3 * sum(m.has_audio(i) for i in range(m.num_layers))
    assert apply_fp8(model) == expected == 20
    swapped = [n for n, mod in model.named_modules() if isinstance(mod, FP8Linear)]
    assert len(swapped) == expected and all(n.startswith("blocks.") for n in swapped)
    # embedders and head untouched
    for name in (
        "patch_embed",
        "time_proj",
        "time_embed.fc1",
        "text_embed.fc2",
        "audio_embed.fc1",
        "head.proj",
    ):
        assert type(model.get_submodule(name)) is Linear
    # nothing left to swap; min_features keeps narrow layers in high precision
    assert apply_fp8(model) == 0
    # every tiny block linear has min(in, out) = dim = 128: the threshold is inclusive
    assert apply_fp8(build_model(TINY, "cpu", torch.float32, seed=0), min_features=128) == expected
    assert apply_fp8(build_model(TINY, "cpu", torch.float32, seed=0), min_features=129) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_model_error_budget(dtype):
    ref = build_model(TINY, "cpu", dtype, seed=0)
    model = build_model(TINY, "cpu", dtype, seed=0)
    apply_fp8(model)
    x, t, text, audio = _inputs()
    with torch.no_grad():
        want = ref.forward_full(x, t, text, audio).float()
        got = model.forward_full(x, t, text, audio).float()
    assert torch.isfinite(got).all()
    e = rel(got, want)
    assert 0.005 < e < MODEL_BUDGET, f"{dtype}: whole-model relative error {e:.4f}"


def test_fallback_logs_once_and_matches(monkeypatch, caplog, fresh_fallback_state):
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise NotImplementedError("no FP8 GEMM for this device")

    ref = _lin(64, 48)
    q1, q2 = FP8Linear.from_linear(ref), FP8Linear.from_linear(_lin(64, 48, seed=1))
    x = torch.randn(5, 64)
    fast = q1(x)  # the real _scaled_mm result (or torch 2.11 CPU's own fallback), for comparison
    logs.forget(fp8.log)
    monkeypatch.setattr(fp8, "_op_unusable", {})
    caplog.clear()  # torch 2.11's CPU kernel already fell back (and warned) in the call above
    monkeypatch.setattr(torch, "_scaled_mm", broken)
    with caplog.at_level(logging.WARNING, logger="cadence.quant.fp8"):
        slow = q1(x)
        q1(x)
        q2(x)
    warnings = [r for r in caplog.records if "FP8 fast path inactive" in r.getMessage()]
    assert len(warnings) == 1
    assert "no FP8 GEMM" in warnings[0].getMessage()
    assert len(calls) == 1  # the failure is remembered: not retried on every call
    assert q1.fallback_reason and q2.fallback_reason
    # the fallback computes the same quantised numbers (only the accumulation order differs)
    assert torch.allclose(slow, fast, rtol=1e-4, atol=1e-5)
    assert rel(slow, ref(x)) < LAYER_BUDGET


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_layer_and_unaligned_fallback(caplog, fresh_fallback_state):
    ref = _lin(256, 384, dtype=torch.bfloat16).cuda()
    q = FP8Linear.from_linear(ref)
    x = torch.randn(2, 37, 256, device="cuda", dtype=torch.bfloat16)
    y = q(x)
    e = rel(y, torch.nn.functional.linear(x.float(), ref.weight.float(), ref.bias.float()))
    cap = torch.cuda.get_device_capability()
    if cap >= (8, 9):
        assert q.fallback_reason is None, q.fallback_reason
    assert 0.005 < e < LAYER_BUDGET
    assert torch.isfinite(q(x * 1e4)).all()
    odd = FP8Linear.from_linear(_lin(72, 40, dtype=torch.bfloat16).cuda())  # not multiples of 16
    with caplog.at_level(logging.WARNING, logger="cadence.quant.fp8"):
        odd(x[..., :72])
        odd(x[..., :72])
    assert odd.fallback_reason and "divisible by 16" in odd.fallback_reason
    assert sum("FP8 fast path inactive" in r.getMessage() for r in caplog.records) == 1


def test_shape_specific_failure_stays_with_that_shape(monkeypatch, caplog):
    """cuBLAS refusing one shape (RuntimeError, e.g. CUBLAS_STATUS_NOT_SUPPORTED) demotes only calls of that
    (M, K, N): other shapes and other layers keep the fast path (an H200 run at TP=2 once lost every FP8
    GEMM of the process to one refused call)."""
    real = torch._scaled_mm
    calls = []

    def picky(a, b, **kw):
        calls.append(a.shape[0])
        if a.shape[0] == 7:
            raise RuntimeError(
                "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic"
            )
        return real(a, b, **kw)

    q = FP8Linear.from_linear(_lin(64, 48))
    logs.forget(fp8.log)
    monkeypatch.setattr(fp8, "_op_unusable", {})
    monkeypatch.setattr(torch, "_scaled_mm", picky)
    with caplog.at_level(logging.WARNING, logger="cadence.quant.fp8"):
        q(torch.randn(7, 64))
        q(torch.randn(7, 64))
        q(torch.randn(5, 64))
    assert calls == [7, 5]  # the refused shape is not retried; another M still calls the op
    assert list(fp8._op_unusable) == [("cpu", torch.float32, 7, 64, 48, True)]
    assert "M=7 K=64 N=48" in q.fallback_reason
