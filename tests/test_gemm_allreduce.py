"""The tile-flag GEMM + all-reduce kernel (cadence/kernels/gemm_allreduce.py) on CPU: the two ranks
simulated in one process under the Triton interpreter (conftest.py sets TRITON_INTERPRET=1), phase by
phase, against the unfused reference (each rank's GEMM rounded to bf16, then the sum of the partials).

Tolerance, per element: the kernel rounds twice (the peer's partial to bf16, the sum to bf16) where the
reference rounds three times (both partials, the sum), and the float32 accumulation order differs, so
|out - ref| <= 3 u (|p0| + |p1|) with u = 2^-8, bf16's unit roundoff, and p_r the exact partials.
Both ranks must hold the same bytes (the owner of a tile rounds once and sends its result)."""

import pytest
import torch

pytest.importorskip("triton", reason="needs triton (and TRITON_INTERPRET=1 without CUDA)")

from cadence.kernels import gemm_allreduce as gar

U = 2.0**-8


def _partials(a, b, sa=None, sb=None):
    out = []
    for r in range(2):
        y = a[r].double() @ b[r].double().t()
        if sa is not None:
            y = y * sa[r].double().reshape(-1, 1) * sb[r].double().reshape(1, -1)
        out.append(y)
    return out


def _check(outs, a, b, sa=None, sb=None):
    assert torch.equal(outs[0], outs[1]), "the two ranks disagree"
    ref = gar.reference(a, b, sa, sb)
    p0, p1 = _partials(a, b, sa, sb)
    bound = 3 * U * (p0.abs() + p1.abs()) + 1e-5
    err = (outs[0].double() - ref.double()).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    # and against the exact sum, within the kernel's own two roundings
    exact = p0 + p1
    assert ((outs[0].double() - exact).abs() <= 2 * U * (p0.abs() + p1.abs()) + 1e-5).all()


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize(
    "m,k,n,programs", [(70, 64, 96, None), (33, 40, 72, 1), (64, 96, 32, 3), (5, 32, 200, 2)]
)
def test_bf16_two_ranks_match_the_unfused_all_reduce(m, k, n, programs, tma):
    """Odd tile counts, M / N / K not multiples of the tile (masks or the descriptors' zero fill, the
    uneven-K loop), 1-4 programs sharing the tile counter; masked pointer loads and tensor descriptors."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    a = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _ in range(2)]
    b = [(torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(2)]
    outs, state = gar.simulate_two_ranks(a, b, programs=programs, tma=tma)
    _check(outs, a, b)
    # the flags were consumed and the counters reset: the buffers are clean for the next call
    assert all(int(f.abs().sum()) == 0 for f in state["flags"])
    assert all(int(c.abs().sum()) == 0 for c in state["counters"])


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_fp8_rowwise_scales_and_repeated_calls_on_the_same_buffers(tma):
    from cadence.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(7)
    m, k, n = 48, 64, 80
    xs = [torch.randn(m, k, generator=g) * 3 for _ in range(2)]
    ws = [torch.randn(n, k, generator=g) / k**0.5 for _ in range(2)]
    a, sa = zip(*(quantize_rows(x) for x in xs), strict=True)
    b, sb = zip(*(quantize_rows(w) for w in ws), strict=True)
    a, b = list(a), list(b)
    sa, sb = [s.reshape(-1) for s in sa], [s.reshape(-1) for s in sb]
    assert a[0].dtype == torch.float8_e4m3fn
    once, _ = gar.simulate_two_ranks(a, b, sa, sb, tma=tma)
    _check(once, a, b, sa, sb)
    thrice, state = gar.simulate_two_ranks(a, b, sa, sb, calls=3, tma=tma)
    assert torch.equal(thrice[0], once[0]) and torch.equal(thrice[1], once[1])
    assert all(int(f.abs().sum()) == 0 for f in state["flags"])


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_gemm_phase_alone_matches_a_matmul(tma, monkeypatch):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(37, 72, generator=g).to(torch.bfloat16)
    b = torch.randn(50, 72, generator=g).to(torch.bfloat16)
    monkeypatch.setenv("CADENCE_TILES_TMA", "1")
    assert gar.tma_ok(a, b) and not gar.tma_ok(a[:, :70].contiguous(), b)  # 140-byte rows: not 16-aligned
    monkeypatch.delenv("CADENCE_TILES_TMA")
    assert not gar.tma_ok(a, b)  # opt-in
    y = gar.gemm_only(a, b, tma=tma)
    exact = a.double() @ b.double().t()
    assert ((y.double() - exact).abs() <= U * exact.abs() + 1e-5).all()


def test_usable_says_why_not():
    assert "2 ranks" in gar.usable(torch.device("cpu"), 4)
    assert gar.usable(torch.device("cpu"), 2) is None  # the interpreter (conftest)


def test_config_text():
    assert gar.parse_config("128x256x64:4:8:3") == (128, 256, 64, 4, 8, 3)
    assert gar.parse_config("64x128x128")[:3] == (64, 128, 128)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("m,k,n,programs", [(70, 64, 96, None), (33, 48, 72, 1), (5, 32, 200, 3)])
def test_both_protocol_is_exactly_the_sum_of_the_rounded_partials(m, k, n, programs, fp8):
    """The "both" exchange: every rank sums every tile from the two bf16 partials, so the result is
    exactly bf16(p0 + p1) of the kernel's own rounded partials (its GEMM alone, phase 4) on both ranks
    (what an NCCL all-reduce of those partials gives), flags and counters clean after two calls."""
    from cadence.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(m + k + n)
    xs = [torch.randn(m, k, generator=g) for _ in range(2)]
    ws = [torch.randn(n, k, generator=g) / k**0.5 for _ in range(2)]
    if fp8:
        a, sa = (list(v) for v in zip(*(quantize_rows(x) for x in xs), strict=True))
        b, sb = (list(v) for v in zip(*(quantize_rows(w) for w in ws), strict=True))
        sa, sb = [s.reshape(-1) for s in sa], [s.reshape(-1) for s in sb]
    else:
        a, b = [x.to(torch.bfloat16) for x in xs], [w.to(torch.bfloat16) for w in ws]
        sa = sb = None
    outs, state = gar.simulate_two_ranks(a, b, sa, sb, programs=programs, calls=2, proto="both")
    parts = [
        gar.gemm_only(a[r], b[r], None if sa is None else sa[r], None if sb is None else sb[r])
        for r in range(2)
    ]
    expect = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
    assert torch.equal(outs[0], expect) and torch.equal(outs[1], expect)
    _check(outs, a, b, sa, sb)
    assert all(int(f.abs().sum()) == 0 for f in state["flags"])
    assert all(int(c.abs().sum()) == 0 for c in state["counters"])


def test_protocol_setting(monkeypatch):
    assert gar.protocol() == "owner"
    monkeypatch.setenv("CADENCE_TILES_PROTOCOL", "both")
    assert gar.protocol() == "both"
    monkeypatch.setenv("CADENCE_TILES_PROTOCOL", "nope")
    with pytest.raises(ValueError, match="owner, both"):
        gar.protocol()


@pytest.mark.parametrize("proto", ["owner", "both"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_emulated_peer_runs_the_one_launch_path(proto, fp8):
    """EmulatedPeer (the single-GPU timing of the fused kernel): phase 0, the whole protocol in one launch,
    with the peer's flags raised beforehand, its partials zero and its finished tiles given: the output is
    exactly the kernel's own GEMM (own tiles: acc + 0, rounded once; the peer's: copied from ``fin``), twice
    on the same buffers; the counter is back at zero and exactly the flags this rank waits for are
    consumed (owner: its own tiles' partial flags and the peer tiles' sum flags; both: one per tile)."""
    from cadence.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(11)
    m, k, n = 70, 64, 96
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    if fp8:
        (a, sa), (b, sb) = quantize_rows(x), quantize_rows(w)
        sa, sb = sa.reshape(-1), sb.reshape(-1)
    else:
        a, b, sa, sb = x.to(torch.bfloat16), w.to(torch.bfloat16), None, None
    ref = gar.gemm_only(a, b, sa, sb)
    em = gar.EmulatedPeer(m, n, a.device, proto=proto)
    t = gar.tiles(m, n)
    for _ in range(2):
        em.arm(ref)
        assert torch.equal(em(a, b, sa, sb), ref)
        assert int(em.counter.abs().sum()) == 0
        assert int(em.flags.sum()) == 2 * t - t  # owner: ceil(t/2) + floor(t/2) consumed; both: t
