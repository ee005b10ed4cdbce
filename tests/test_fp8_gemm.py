"""The FP8 GEMM backend seam (cadence.kernels.fp8_gemm, FP8Linear.matmul): the Triton GEMM on CPU under
the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) against the exact product, the per-shape
choice from a measured table, and the fallbacks.

Tolerance of the Triton GEMM, per element, against the float64 product of the same FP8 operands and
scales (``exact``): the kernel accumulates in float32 (an error of at most K u32 sum_k |a_k b_k| sa sb,
u32 = 2^-24, for any summation order; split-K only changes the order), multiplies by the two scales and
adds the bias in float32 (a few u32 of |exact| + |bias|), then rounds once to the output dtype (half a
unit in the last place: 2^-9 |y| in bf16, 2^-24 in float32). Asserted: |y - exact| <= u_out |exact| +
K u_acc sum|a b| sa sb + 4 u32 (|exact| + |bias|) + 1e-30, with u_out = 2^-8 (bf16) or 2^-24 (float32) and
u_acc = u32 on the CPU; on a GPU (sm90) both the Triton FP8 dot and cuBLAS with ``use_fast_accum`` keep
fewer mantissa bits in the tensor core's accumulator (about 14: DeepSeek-V3's measurement on Hopper), so
there u_acc = 2^-14."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from cadence.kernels import fp8_gemm as kg
from cadence.quant import fp8
from cadence.quant.fp8 import FP8Linear, apply_fp8, quantize_rows, set_gemm_backend
from cadence.telemetry import logs

pytestmark = pytest.mark.skipif(
    kg._triton_missing() != "" or not kg.interpreting() and not torch.cuda.is_available(),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
U32 = 2.0**-24
DEV = "cuda" if torch.cuda.is_available() else "cpu"
U_ACC = 2.0**-14 if DEV == "cuda" else U32


@pytest.fixture
def fresh(monkeypatch):
    logs.forget(fp8.log)
    monkeypatch.setattr(fp8, "_op_unusable", {})
    monkeypatch.setattr(fp8, "_triton_refused", {})
    monkeypatch.setattr(fp8, "_gemm_logged", set())
    kg.reset()
    yield
    kg.reset()


def operands(m, k, n, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :3] = torch.tensor([400.0, -1e-3, 0.0])[: min(3, k)]  # a large value, a tiny one and a zero
    w = torch.randn(n, k, generator=g) / k**0.5
    a, sa = quantize_rows(x)
    b, sb = quantize_rows(w)
    bvec = torch.randn(n, generator=g) if bias else None
    return (
        a.to(DEV),
        b.to(DEV),
        sa.to(DEV),
        sb.t().contiguous().to(DEV),
        None if bvec is None else bvec.to(DEV),
    )


def check(y, a, b, sa, sb, bias):
    ad, bd = a.double() * sa.double(), (b.double() * sb.double().reshape(-1, 1))
    exact = ad @ bd.t() + (bias.double() if bias is not None else 0.0)
    mag = ad.abs() @ bd.abs().t()
    u = 2.0**-8 if y.dtype == torch.bfloat16 else U32
    bnd = (
        u * exact.abs()
        + a.shape[1] * U_ACC * mag
        + 4 * U32 * (exact.abs() + (0 if bias is None else bias.abs().double()))
    )
    err = (y.double() - exact).abs()
    assert (err <= bnd + 1e-30).all(), f"max excess {(err - bnd).max().item():.3g}"


#: small tiles (K steps of 32: the smallest an FP8 MMA takes, so these also compile on a GPU)
CONFIGS = [
    None,  # the interpreter default (on a GPU: the 128x128x128 default)
    kg.GemmConfig(16, 32, 32, group_m=2, split_k=1, warps=4, stages=1, tma=True),
    kg.GemmConfig(32, 16, 32, group_m=1, split_k=3, warps=4, stages=1, tma=False),
    kg.GemmConfig(16, 16, 32, group_m=4, split_k=2, warps=4, stages=1, tma=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.text() if c else "default")
@pytest.mark.parametrize("m,k,n", [(37, 96, 70), (5, 64, 48), (64, 80, 33)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_gemm_matches_the_exact_product(m, k, n, cfg, out_dtype):
    """Ragged M / N / K (masks, descriptors' zero fill, K not a multiple of BK), split-K of 1-3 with an
    empty last split (K = 64: two K steps over three splits), pointer loads and descriptors, bias and none."""
    a, b, sa, sb, bias = operands(m, k, n, seed=m + k + n)
    for bv in (bias, None):
        y = kg.triton_gemm(a, b, sa, sb, bv, out_dtype, cfg)
        assert y.shape == (m, n) and y.dtype == out_dtype
        check(y, a, b, sa, sb, bv)


@pytest.mark.skipif(DEV == "cuda", reason="the interpreter ignores the tl.range options; a GPU compiles them")
def test_flatten_and_warp_specialize_branches():
    """The persistent loop's three forms (plain range, tl.range(flatten), tl.range(warp_specialize)) compute
    the same product (on the CPU their options are no-ops: this checks the kernel's structure)."""
    a, b, sa, sb, bias = operands(20, 64, 40, seed=9)
    base = kg.GemmConfig(16, 16, 32, group_m=2, split_k=2, warps=4, stages=1, tma=True)
    want = kg.triton_gemm(a, b, sa, sb, bias, torch.float32, base)
    for kw in ({"flatten": True}, {"flatten": True, "ws": True}):
        got = kg.triton_gemm(a, b, sa, sb, bias, torch.float32, kg.with_config(base, **kw))
        assert torch.equal(got, want), kw


def test_split_k_is_deterministic_and_leaves_the_counters_clean():
    cfg = kg.GemmConfig(16, 16, 32, group_m=2, split_k=4, warps=4, stages=1, tma=False)
    a, b, sa, sb, bias = operands(40, 128, 24, seed=5)
    y1 = kg.triton_gemm(a, b, sa, sb, bias, torch.float32, cfg)
    y2 = kg.triton_gemm(a, b, sa, sb, bias, torch.float32, cfg)
    assert torch.equal(y1, y2)
    ws, cnt = kg._split_scratch(a.device, 0, 0)
    assert int(cnt.abs().sum()) == 0
    check(y1, a, b, sa, sb, bias)


def test_out_argument_and_row_stride():
    a, b, sa, sb, bias = operands(9, 32, 40, seed=2)
    big = torch.full((9, 64), 7.0, device=DEV)
    y = kg.triton_gemm(a, b, sa, sb, bias, torch.float32, out=big[:, 8:48])
    assert y.data_ptr() == big[:, 8:48].data_ptr()
    check(big[:, 8:48], a, b, sa, sb, bias)
    assert (big[:, :8] == 7).all() and (big[:, 48:] == 7).all()  # nothing outside the view written
    with pytest.raises(ValueError, match="out must be"):
        kg.triton_gemm(a, b, sa, sb, out=big)


def test_config_text_roundtrip_and_errors():
    for c in kg.SWEEP + (kg.DEFAULT, kg.INTERPRETER):
        assert kg.GemmConfig.parse(c.text()) == c
        assert c.smem_bytes() <= 227 * 1024
    assert kg.GemmConfig.parse("64x128x128:k2:w4:s5") == kg.GemmConfig(64, 128, 128, 8, 2, 4, 5, tma=False)
    with pytest.raises(ValueError, match="want BMxBNxBK"):
        kg.GemmConfig.parse("128x128:g8")
    with pytest.raises(ValueError, match="power of two"):
        kg.GemmConfig(96, 128, 128)
    assert kg.GemmConfig(128, 128).tiles(748, 6144) == 6 * 48  # W57 TP=4 QKV: 288 tiles, 2.2 waves


def test_usable_says_why_not():
    a, b, *_ = operands(4, 32, 16)
    if DEV == "cpu":
        assert "not CUDA" in kg.usable(a, b)  # the interpreter only when asked for
    assert kg.usable(a, b, allow_interpreter=True) is None
    assert "e4m3" in kg.usable(a.float(), b, allow_interpreter=True)
    assert "[M, K]" in kg.usable(a, b[:, :16].contiguous(), allow_interpreter=True)


def _layer(m=12, k=64, n=48, seed=1):
    lin = torch.nn.Linear(k, n).to(DEV)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(DEV)
    return FP8Linear.from_linear(lin), x


def test_fp8_linear_triton_backend_equals_the_cublas_path(fresh):
    """Forced 'triton' (the interpreter) and the default ('cublas' on CPU: torch._scaled_mm) give the same
    product within the GEMM tolerance; the counters say which ran."""
    q, x = _layer()
    want = q(x)
    assert q.scaled_mm_calls == 1 and q.triton_calls == 0
    q.gemm = "triton"
    got = q(x)
    assert q.triton_calls == 1 and q.scaled_mm_calls == 1
    xq, xs = quantize_rows(x)
    check(got, xq, q.weight_fp8, xs, q.weight_scale, q.bias)
    check(want, xq, q.weight_fp8, xs, q.weight_scale, q.bias)


def test_triton_failure_falls_back_to_cublas_once(fresh, monkeypatch, caplog):
    q, x = _layer()
    want = q(x)
    q.gemm = "triton"

    def broken(*a, **k):
        raise RuntimeError("compile error in this triton")

    monkeypatch.setattr(kg, "triton_gemm", broken)
    with caplog.at_level(logging.INFO, logger="cadence.quant.fp8"):
        y1, y2 = q(x), q(x)
    assert torch.equal(y1, want) and torch.equal(y2, want)
    assert q.scaled_mm_calls == 3 and q.triton_calls == 0
    assert len([r for r in caplog.records if "Triton backend cannot run" in r.message]) == 1
    assert "compile error" in next(iter(fp8._triton_refused.values()))


def test_shape_cublas_refuses_runs_triton_where_usable(fresh, monkeypatch):
    """W57's audio K/V (M = 8): cuBLAS refuses rowwise FP8; "auto" then runs the Triton GEMM instead of
    the dequantised matmul (here the interpreter stands in for a GPU)."""
    q, x = _layer(m=8)

    def picky(*a, **k):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(torch, "_scaled_mm", picky)
    monkeypatch.setattr(kg, "usable", lambda a, b, allow_interpreter=False: None)
    y = q(x)
    assert q.triton_calls == 1 and q.fallback_calls == 0
    xq, xs = quantize_rows(x)
    check(y, xq, q.weight_fp8, xs, q.weight_scale, q.bias)
    monkeypatch.setattr(kg, "usable", lambda a, b, allow_interpreter=False: "not here")
    q(x)
    assert q.fallback_calls == 1  # neither backend: the dequantised matmul, warn-once
    assert fp8.fp8_report(torch.nn.Sequential(q))["fell_back"] == 1


def test_auto_reads_the_measured_table(fresh, tmp_path, monkeypatch, caplog):
    table = {
        "kind": "fp8-gemm-table",
        "source": "2026-12-01-nvidia-h200-all-tp1.json",
        "entries": [
            {"m": 748, "n": 6144, "k": 8192, "backend": "triton", "config": "64x128x128:g8:k2:w4:s5:tma"},
            {"m": 748, "n": 8192, "k": 2048, "backend": "cublas", "us": {"cublas": 20.1, "triton": 22.0}},
            {"m": 748, "n": 2048, "k": 8192, "backend": "triton", "config": "nonsense"},
        ],
    }
    p = tmp_path / "gemm-test.json"
    p.write_text(json.dumps(table))
    monkeypatch.setattr(kg, "table_path", lambda device: p if device.type == "cuda" else None)
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="cadence.kernels.fp8_gemm"):
        c = kg.choose(748, 6144, 8192, cuda)
        assert c.backend == "triton" and c.config == kg.GemmConfig(64, 128, 128, 8, 2, 4, 5, tma=True)
        assert kg.choose(748, 6144, 8192, cuda) is c  # decided once
        assert kg.choose(600, 6144, 8192, cuda).backend == "triton"  # nearest M within 2x
        assert kg.choose(4680, 6144, 8192, cuda).backend == "cublas"  # too far: no entry
        assert kg.choose(748, 8192, 2048, cuda).backend == "cublas"
        assert "unusable" in kg.choose(748, 2048, 8192, cuda).why
        assert kg.choose(748, 6144, 8192, torch.device("cpu")).backend == "cublas"
        assert kg.choose(748, 6144, 8192, cuda, "cublas").backend == "cublas"
        forced = kg.choose(748, 6144, 8192, cuda, "triton")
        assert forced.backend == "triton" and forced.config.split_k == 2  # forced: the table's config
    assert len([r for r in caplog.records if "748x8192->6144" in r.message]) == 4  # auto, cublas, triton, cpu
    assert "748x8192->6144 (auto)" in kg.choices()
    with pytest.raises(ValueError, match="backend must be one of"):
        kg.choose(1, 16, 16, cuda, "cutlass")


def test_apply_fp8_and_set_gemm_backend():
    from cadence.config import get_preset
    from cadence.model.weights import build_model

    model = build_model(get_preset("tiny"), "cpu", torch.float32, seed=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        apply_fp8(model, gemm="cutlass")
    n = apply_fp8(model, gemm="cublas")
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert n == len(layers) > 0 and all(m.gemm == "cublas" for m in layers)
    assert set_gemm_backend(model, "triton") == n and all(m.gemm == "triton" for m in layers)
    with pytest.raises(ValueError):
        set_gemm_backend(model, "fast")


def test_fast_path_gemm_field():
    from cadence.engine.spec import GEMMS, FastPath
    from cadence.errors import ConfigError

    assert GEMMS == kg.BACKENDS  # the torch-free copy
    assert FastPath().gemm == "auto"
    with pytest.raises(ConfigError, match="gemm must be one of auto, cublas, triton"):
        FastPath(gemm="cutlass")
    fast, notes = FastPath(gemm="triton").resolve("cpu")  # FP8 linears are CUDA only
    assert fast.gemm == "auto" and any(n.startswith("gemm: triton needs FP8 linears") for n in notes)
    fast, notes = FastPath(gemm="triton", fp8_linears=True).resolve("cuda:0")
    assert fast.gemm == "triton" and not any(n.startswith("gemm") for n in notes)
