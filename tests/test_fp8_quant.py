"""The one-launch FP8 activation quantisation kernels (cadence.kernels.quant) against their PyTorch
references, on CPU under the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py).

Tolerances, and why:

* ``quantize_rows_triton`` vs ``quantize_rows``: BITWISE equal, scales and FP8 bytes. The kernel
  does the reference's IEEE operations (exact amax, correctly rounded amax / 448 and 1 / scale via
  ``div_rn``, one float32 product, clamp) and rounds to the e4m3 grid itself, to nearest even, in
  float32 arithmetic, so the cast only meets representable values. That rounding step is what makes
  the interpreter agree: its own float32 -> e4m3 conversion rounds ties away from zero and drops the
  carry into the exponent (a value just under 128 becomes 64 when the exponent is odd), i.e. it
  differs from torch by one step at ties and by a whole binade at those carries; the hardware cast
  of sm89+ (``cvt.rn.satfinite``) rounds to nearest even like torch. Checked over every e4m3 value,
  every midpoint (tie), values 2^-12 either side of each, +-0, and subnormals.
* ``quantize_rows_modulated`` vs its reference (``F.layer_norm`` / rsqrt, modulation, ``.to(dt)``,
  ``quantize_rows``): the norm's sums run in another order and the kernel takes sqrt + a division
  where torch takes rsqrt, so the float32 value before rounding moves by a few ulps (measured: scales
  within 2.3e-7 relative in float32, bitwise equal in bf16 where the bf16 rounding absorbs them).
  An element next to a rounding boundary (bf16's or e4m3's) can then land one e4m3 step the other
  way (measured: 1 element in 98,304 over these cases). Asserted: scales within 1e-6 relative,
  dequantised values (in units of the row scale) within ONE e4m3 step of the reference
  (2^(floor(log2|q|) - 3), 2^-9 below 2^-6), and at most 0.1% of the bytes different.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cadence.kernels import quant as kq
from cadence.quant import fp8
from cadence.quant.fp8 import FP8Linear, QuantizedActivation, quantize_activations, quantize_rows
from cadence.telemetry import logs

pytestmark = pytest.mark.skipif(
    kq._triton_import_error() != "" or not kq.interpreting() and not torch.cuda.is_available(),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at each value (in the units of the row scale)."""
    a = q.float().abs().clamp_min(2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


@pytest.fixture
def fresh_quant_state(monkeypatch):
    monkeypatch.setattr(fp8, "_quant_backend", "auto")
    monkeypatch.setattr(fp8, "_quant_failed", None)
    monkeypatch.setattr(fp8, "_quant_logged", set())
    logs.forget(fp8.log)
    monkeypatch.setattr(fp8, "_op_unusable", {})


# ---- plain per-row quantisation ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(37, 128), (5, 1000), (64, 1536), (3, 8192), (2, 1)])
def test_quantize_rows_triton_bitwise(dtype, m, k):
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 4, m)[:, None]
    x[0] = 0.0  # an all-zero row: tiny scale, zeros, no 0/0
    if dtype == torch.float32 and m > 2:
        x[1, 0] = 1e30  # an outlier far past +-448 (fp32 only: bf16 / fp16 would round or overflow)
    x = x.to(dtype).to(DEV)
    q, s = kq.quantize_rows_triton(x)
    qr, sr = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (m, 1)
    assert torch.equal(s, sr), f"scales differ: max rel {((s - sr).abs() / sr).max().item():.2e}"
    assert torch.equal(_bytes(q), _bytes(qr)), f"{(_bytes(q) != _bytes(qr)).sum().item()} FP8 bytes differ"
    assert torch.isfinite(q.float()).all()


def test_rounding_edges_bitwise():
    """Every e4m3 value, every midpoint between neighbours (ties to even), values 2^-12 either side,
    +-0 and sub-subnormals, with the row scale 1 (amax 448), 2^-20 and 3."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pos = vals[torch.isfinite(vals) & (vals >= 0)].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([pos * (1 - 2.0**-12), pos * (1 + 2.0**-12)])
    extra = torch.tensor([-0.0, 0.0, 1e-30, -1e-30, 2.0**-10, -(2.0**-10), 3 * 2.0**-11, 448.0])
    row = torch.cat([pos, -pos, mids, -mids, near, -near, extra]).clamp(-448, 448)
    x = torch.stack([row, row * 2.0**-20, row * 3.0]).to(DEV)
    q, s = kq.quantize_rows_triton(x)
    qr, sr = quantize_rows(x)
    assert torch.equal(s, sr)  # the kernel forms the scale as its device's reference does
    # which is amax / 448 exactly on the CPU; on CUDA torch divides by a Python number as a multiply by its
    # float32 reciprocal: 1344 * fl(1/448) = 3.0000002, one ulp above 3 (measured on an H200)
    assert torch.allclose(s.cpu(), torch.tensor([[1.0], [2.0**-20], [3.0]]), rtol=2.0**-22, atol=0)
    if DEV == "cpu":
        assert s.flatten().tolist() == [1.0, 2.0**-20, 3.0]
    diff = (_bytes(q) != _bytes(qr)).nonzero().tolist()
    assert not diff, [(x[i, j].item(), q[i, j].float().item(), qr[i, j].float().item()) for i, j in diff[:8]]


def test_strided_rows_and_empty():
    base = torch.randn(40, 300, device=DEV, dtype=torch.bfloat16)
    x = base[3:33, 10:266]  # row stride 300, last dim contiguous
    assert not x.is_contiguous() and x.stride(-1) == 1
    q, s = kq.quantize_rows_triton(x)
    qr, sr = quantize_rows(x.contiguous())
    assert torch.equal(s, sr) and torch.equal(_bytes(q), _bytes(qr))
    q0, s0 = kq.quantize_rows_triton(x[:0])
    assert q0.shape == (0, 256) and s0.shape == (0, 1)


def test_triton_usable_reasons():
    x = torch.randn(4, 64)
    if DEV == "cpu":
        assert kq.triton_usable(x) == (False, "device cpu is not CUDA")
    x = x.to(DEV)
    assert kq.triton_usable(x, allow_interpreter=True) == (True, "")
    assert "not contiguous" in kq.triton_usable(x.t(), allow_interpreter=True)[1]
    assert (
        "row length" in kq.triton_usable(torch.zeros(1, kq.MAX_K + 1, device=DEV), allow_interpreter=True)[1]
    )
    assert "dtype" in kq.triton_usable(x.double(), allow_interpreter=True)[1]


def test_launch_config():
    # GPU defaults: whole rows, ~4096 elements a program for short rows, warps growing with the tile
    assert kq.launch_config(8192, False) == (1, 8192, 8)
    assert kq.launch_config(12288, False) == (1, 16384, 16)
    assert kq.launch_config(1536, False) == (2, 2048, 4)
    assert kq.launch_config(5120, False, modulated=True) == (1, 8192, 16)
    assert kq.launch_config(kq.MAX_K, False) == (1, 32768, 16)


# ---- the FP8 layer's dispatch ------------------------------------------------------------------
def test_fp8_linear_triton_path_equals_reference(fresh_quant_state):
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(256, 128).to(DEV)
    q = FP8Linear.from_linear(lin)
    x = torch.randn(2, 19, 256, generator=g).to(DEV)
    fp8.set_quant_backend("torch")
    want = q(x)
    fp8.set_quant_backend("triton")
    calls = []
    orig = kq.quantize_rows_triton

    def spy(t, **kw):
        calls.append(tuple(t.shape))
        return orig(t, **kw)

    kq.quantize_rows_triton = spy
    try:
        got = q(x)
    finally:
        kq.quantize_rows_triton = orig
    assert calls == [(38, 256)]
    assert torch.equal(got, want)


def test_quantize_activations_falls_back_once(fresh_quant_state, caplog, monkeypatch):
    x = torch.randn(8, 64, device=DEV)
    ref = quantize_rows(x)
    fp8.set_quant_backend("triton")
    n = []

    def broken(t, **kw):
        n.append(1)
        raise RuntimeError("PassManager::run failed\nmore lines")

    monkeypatch.setattr(kq, "quantize_rows_triton", broken)
    with caplog.at_level(logging.INFO, logger="cadence.quant.fp8"):
        for _ in range(3):
            q, s = quantize_activations(x)
            assert torch.equal(_bytes(q), _bytes(ref[0])) and torch.equal(s, ref[1])
    lines = [r.getMessage() for r in caplog.records if "FP8 activation quantisation" in r.getMessage()]
    assert len(lines) == 1 and "PassManager::run failed" in lines[0] and "more lines" not in lines[0]
    assert len(n) == 1  # not retried per call
    # a non-contiguous last dim falls back (its own reason, logged once), no kernel call
    fp8.set_quant_backend("triton")
    monkeypatch.setattr(kq, "quantize_rows_triton", lambda t, **kw: pytest.fail("kernel called"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cadence.quant.fp8"):
        quantize_activations(x.t())
        quantize_activations(x.t())
    assert sum("not contiguous" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8.set_quant_backend("cutlass")


@pytest.mark.skipif(DEV != "cpu", reason="CPU: the auto path is the reference")
def test_auto_on_cpu_is_reference_logged_once(fresh_quant_state, caplog):
    x = torch.randn(8, 64)
    with caplog.at_level(logging.INFO, logger="cadence.quant.fp8"):
        a = quantize_activations(x)
        quantize_activations(x)
    assert sum("device cpu is not CUDA" in r.getMessage() for r in caplog.records) == 1
    assert all(r.levelno == logging.INFO for r in caplog.records if "quantisation" in r.getMessage())
    assert torch.equal(_bytes(a[0]), _bytes(quantize_rows(x)[0]))


def test_whole_model_triton_quant_equals_reference(fresh_quant_state):
    """The tiny model with FP8 linears: the Triton quantisation path gives the same output."""
    from cadence.config import get_preset
    from cadence.model.weights import build_model
    from cadence.quant import apply_fp8

    cfg = get_preset("tiny")
    m = cfg.model
    g = torch.Generator().manual_seed(0)
    inputs = (
        torch.randn(1, 16, 1, *cfg.latent_hw, generator=g),
        torch.tensor([600.0]),
        torch.randn(1, m.text_len, m.text_dim, generator=g),
        torch.randn(1, 1, m.audio_tokens_per_frame, m.audio_dim, generator=g),
    )
    inputs = tuple(t.to(DEV) for t in inputs)
    model = build_model(cfg, DEV, torch.float32, seed=0)
    apply_fp8(model)
    with torch.no_grad():
        fp8.set_quant_backend("torch")
        want = model.forward_full(*inputs)
        fp8.set_quant_backend("triton")
        got = model.forward_full(*inputs)
    assert torch.equal(got, want)


# ---- norm + modulation + quantisation ----------------------------------------------------------
#: (x shape, modulation per sample or per token); per sample with B == 1 takes the kernel's shared-modulation
#: path (grid-stride over row blocks: 64 rows of 1 and 50 rows of 4 with a ragged tail over 4 programs here)
CASES = [
    ((1, 37, 128), "sample"),
    ((2, 5, 1000), "token"),
    ((1, 64, 1536), "sample"),
    ((3, 8192), "token"),
    ((50, 256), "sample"),
]


def _mod_inputs(shape, per, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3 + 0.5).to(dtype)
    if len(shape) == 2:
        mshape = shape if per == "token" else (1, shape[-1])
    else:
        mshape = shape if per == "token" else (shape[0], 1, shape[-1])
    shift = torch.randn(*mshape, generator=g) * 0.5
    scale = torch.randn(*mshape, generator=g) * 0.5
    return x.to(DEV), shift.to(DEV), scale.to(DEV)


def _assert_close_quant(q, s, qr, sr, what):
    rel = ((s - sr).abs() / sr).max().item()
    assert rel <= 1e-6, f"{what}: scales differ by {rel:.2e} relative"
    d = (q.float() * (s / sr) - qr.float()).abs()  # in units of the reference row scale
    worst = (d / e4m3_step(qr)).max().item()
    assert worst <= 1.0 + 1e-3, f"{what}: a value is {worst:.2f} e4m3 steps off"
    frac = (_bytes(q) != _bytes(qr)).float().mean().item()
    assert frac <= 1e-3, f"{what}: {frac:.2%} of the FP8 bytes differ"


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_modulated_parity(norm, dtype):
    for i, (shape, per) in enumerate(CASES):
        x, shift, scale = _mod_inputs(shape, per, dtype, seed=i)
        q, s = kq.quantize_rows_modulated(x, shift, scale, 1e-6, norm=norm, backend="triton")
        qr, sr = kq.quantize_rows_modulated_reference(x, shift, scale, 1e-6, norm=norm)
        m = x.numel() // x.shape[-1]
        assert q.shape == (m, x.shape[-1]) and s.shape == (m, 1)
        _assert_close_quant(q, s, qr, sr, f"{norm} {dtype} {shape} per {per}")


def test_modulated_rounds_to_fp16_and_float32():
    x, shift, scale = _mod_inputs((2, 9, 384), "token", torch.float32, seed=9)
    for out in (torch.float16, torch.float32, torch.bfloat16):
        q, s = kq.quantize_rows_modulated(x, shift, scale, 1e-6, out_dtype=out, backend="triton")
        qr, sr = kq.quantize_rows_modulated_reference(x, shift, scale, 1e-6, out_dtype=out)
        _assert_close_quant(q, s, qr, sr, f"out_dtype {out}")


def test_modulated_matches_the_model_block(fresh_quant_state):
    """The reference is the model's own arithmetic: the tiny model's first block, its norm1 and its
    adaLN table, per-sample and per-token timesteps; and the quantised activation handed to the
    block's FP8 qkv gives that layer's output on the eager input."""
    from cadence.config import get_preset
    from cadence.model.dit import _split_mod
    from cadence.model.weights import build_model
    from cadence.quant import apply_fp8

    cfg = get_preset("tiny")
    for dtype in (torch.bfloat16, torch.float32):
        model = build_model(cfg, DEV, dtype, seed=0)
        apply_fp8(model)
        blk = model.blocks[0]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 24, cfg.model.dim, generator=g).to(DEV, dtype)
        for temb6 in (
            torch.randn(2, 6, cfg.model.dim, generator=g),
            torch.randn(2, 24, 6, cfg.model.dim, generator=g),
        ):
            mod = _split_mod(blk.modulation, temb6.to(DEV))
            h = (blk.norm1(x) * (1 + mod.attn.scale) + mod.attn.shift).to(dtype)  # as Block.forward
            qr, sr = quantize_rows(h.reshape(-1, h.shape[-1]))
            q, s = kq.quantize_rows_modulated(
                x, mod.attn.shift, mod.attn.scale, blk.norm1.eps, backend="triton"
            )
            _assert_close_quant(q, s, qr, sr, f"block norm1 {dtype} temb {tuple(temb6.shape)}")
            with torch.no_grad():
                fp8.set_quant_backend("torch")
                want = blk.self_attn.qkv(h)
                got = blk.self_attn.qkv(QuantizedActivation(qr, sr, tuple(h.shape), h.dtype))
            assert torch.equal(got, want)


def test_modulated_auto_and_bad_inputs(caplog):
    x, shift, scale = _mod_inputs((1, 8, 64), "sample", torch.float32, seed=4)
    qa, sa = kq.quantize_rows_modulated(x, shift, scale, 1e-6)  # auto: reference on CPU, Triton on CUDA
    qr, sr = kq.quantize_rows_modulated_reference(x, shift, scale, 1e-6)
    _assert_close_quant(qa, sa, qr, sr, "auto")
    with pytest.raises(ValueError, match="does not broadcast"):
        kq.quantize_rows_modulated(x, shift[..., :32], scale, 1e-6, backend="triton")
    with pytest.raises(ValueError, match="norm must be one of"):
        kq.quantize_rows_modulated(x, shift, scale, 1e-6, norm="group", backend="triton")
    with pytest.raises(ValueError, match="QuantizedActivation wants"):
        QuantizedActivation(qr, sr, (1, 9, 64), torch.float32)


def test_bench_fused_quant_smoke(tmp_path):
    """``cadence bench fused --quant`` at a tiny shape: runs, checks parity, writes its JSON."""
    import json

    from cadence.bench import fused as bench_fused

    assert (
        bench_fused.main(
            [
                "--quant",
                "--quant-m",
                "8",
                "--quant-k",
                "64,40",
                "--reps",
                "3",
                "--warmup",
                "1",
                "--no-gemm",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    (path,) = (tmp_path / "fused").glob("*-quant.json")
    doc = json.loads(path.read_text())
    assert (
        doc["bench"] == "fused"
        and doc["tp"] == 1
        and doc["command"].startswith("cadence bench fused --quant")
    )
    rows = doc["results"]["quant"]
    assert [(r["m"], r["k"]) for r in rows] == [(8, 64), (8, 40)]
    for r in rows:
        assert r["triton_usable"] and r["parity"]["bytes_differ"] == 0 and r["parity"]["scales_equal"]
        assert r["parity_modulated"]["max_steps_off"] <= 1.0
        assert r["eager_us"] > 0 and r["triton_us"] > 0 and r["mod_triton_us"] > 0
        for name in ("eager", "mod_eager"):  # every "x faster" from >= 5 interleaved rounds (bench.rounds)
            q = r["rounds"][name]
            assert (
                q["rounds"] >= 5 and q["lo"] <= q["median"] <= q["hi"] and r[f"speedup_{name}"] == q["median"]
            )
        el = {"bfloat16": 2, "float32": 4}[r["dtype"]]
        assert r["bytes"]["triton"] == (el + 1) * r["m"] * r["k"]
        assert r["bytes"]["eager"] == (2 * el + 17) * r["m"] * r["k"]  # bf16: 21 bytes an element
