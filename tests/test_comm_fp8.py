"""The FP8-payload all-reduce (``cadence.parallel.comm_fp8``, comm mode ``two_shot_fp8``) against exact sums,
the bf16-free reference all-reduce and TP=1, and its comm estimate (``cadence.parallel.emulate``).

Tolerance. e4m3 keeps 3 mantissa bits: one round-to-nearest quantisation of a normal value moves it by at most
2^-4 of itself; a value below 2^-6 of its block's scale is subnormal, off by at most 2^-10 x that scale. The
reduce quantises every partial once and the summed shard once, so elementwise
``|y~ - y| <= 2^-4 SUM_i |p_i| + 2^-4 |S| + subnormal terms + the output dtype's rounding`` (``error_bound``;
S is the sum before its requantisation). The checks assert that bound ELEMENTWISE on partials with outlier rows
and an outlier channel, at TP=2 and 4, as threads (shared-memory exchanges) and as gloo processes (the uint8
all-to-all and all-gather), and bitwise equality across ranks. The tiny model's forward with every
row-parallel sum in FP8 is held to the FP8 budget of tests/test_fp8.py (10% relative L2 against the float32
reference); measured numbers are in docs/perf/comm/NOTES.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import comm_fp8_worker
from test_tp_fusions import ThreadGroup, rel, run_ranks

from cadence.parallel import comm_fp8 as cf
from cadence.parallel import emulate, fused
from cadence.parallel.emulate import EmulatedGroup, comm_estimate, fp8_reduce_parts
from cadence.parallel.group import CollectiveLog

FP8_BUDGET = 0.10  # tests/test_fp8.py's budget for FP8 against float32


def _a2a(self, out, inp):  # the thread group's all-to-all: block j of out <- rank j's block `rank`
    parts = self._exchange(inp)
    out.copy_(torch.cat([p.view(self.world, -1, *p.shape[1:])[self.rank] for p in parts]))


ThreadGroup._all_to_all = _a2a


def test_quantise_round_trip_within_e4m3_rounding():
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 16)[:, None]
    x[2, 7] = 1e4  # an outlier inside one block
    q, s = cf.quantize_blocks(x, 128)
    assert q.dtype == torch.uint8 and s.shape == (16, 2)
    y = cf.dequantize_blocks(q, s, 128)
    assert torch.isfinite(y).all()
    assert y[2, 7] == x[2, 7]  # the block's largest magnitude maps to exactly +-448
    sub = (s.repeat_interleave(128, 1) * 2.0**-10).mul_(1 + 1e-6)
    assert ((y - x).abs() <= 2.0**-4 * x.abs() * (1 + 1e-6) + sub).all()
    # values the scale division would push past 448 are clamped, never NaN
    q2, _ = cf.quantize_blocks(torch.full((1, 128), 3.0e38), 128)
    assert torch.isfinite(q2.view(torch.float8_e4m3fn).float()).all()
    # packing keeps the bytes
    pq, ps = cf.unpack(cf.pack(q, s), 256)
    assert torch.equal(pq, q) and torch.equal(ps, s)
    assert cf.block_for(96) == 96 and cf.block_for(8192) == 128 and cf.packed_row_bytes(8192) == 8192 + 256


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_all_reduce_within_the_bound_threads(world, dtype):
    m, n = 75, 512  # rows not divisible by 4: a zero-padded tail
    ps = [p.to(dtype) for p in comm_fp8_worker.partials(world, m, n)]
    outs = run_ranks(world, lambda g: cf.fp8_all_reduce(ps[g.rank].clone(), g, "x"))
    exact = sum(p.float() for p in ps)
    bound = cf.error_bound(ps, out_dtype=dtype)
    for o in outs:
        assert o.dtype == dtype and torch.equal(o, outs[0])  # every rank: bitwise the same
    err = (outs[0].float() - exact).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    assert rel(outs[0], exact) < 2 * 2.0**-4  # L2: far inside; measured ~2-3% (NOTES)


def test_w57_scale_partials_error_budget():
    """[748, 8192] partials at TP=4 with outlier rows (a residual stream's scale): inside the elementwise
    bound, and the relative L2 error against the exact sum under 2^-4 (measured in the NOTES)."""
    world, ps = 4, comm_fp8_worker.partials(4, 748, 8192)
    ps = [p.bfloat16() for p in ps]
    outs = run_ranks(world, lambda g: cf.fp8_all_reduce(ps[g.rank].clone(), g, "x"))
    exact = sum(p.float() for p in ps)
    assert ((outs[1].float() - exact).abs() <= cf.error_bound(ps, out_dtype=torch.bfloat16)).all()
    bf16_err = rel(exact.bfloat16(), exact)  # what the bf16 all-reduce's output rounding alone costs
    assert bf16_err < rel(outs[1], exact) < 2.0**-4


def test_emulated_rank_runs_the_local_arithmetic_and_records_one_reduce():
    t = torch.randn(40, 256)
    with CollectiveLog() as log:
        out = cf.fp8_all_reduce(t.clone(), EmulatedGroup(4), "ffn.fc2")
    # the stand-ins: this rank's shard (rows 0-9) is the sum of 4 equal partials, and the all-gather's stand-in
    # hands back that shard in every slot (values of the right scale, as emulate's table says)
    bound = cf.error_bound([t[:10]] * 4)
    assert ((out[:10] - 4 * t[:10]).abs() <= bound).all()
    assert torch.equal(out.view(4, 10, 256), out[:10].expand(4, 10, 256))
    (c,) = log.summary()
    assert (c["kind"], c["algo"], c["label"], c["shape"]) == (
        "all_reduce",
        "two_shot_fp8",
        "ffn.fc2",
        [40, 256],
    )


@torch.no_grad()
def test_row_parallel_mode_and_chooser(monkeypatch):
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(10, 64)
    with CollectiveLog() as log:
        y = fused.row_parallel(lin, x, None, EmulatedGroup(2), "two_shot_fp8", "o")
        ref = lin(x)[:5]  # rank 0's shard of the 10 rows (the all-gather's stand-in repeats it)
    assert ((y[:5] - 2 * ref).abs() <= cf.error_bound([ref] * 2)).all()
    assert [c["algo"] for c in log.summary()] == ["two_shot_fp8"]
    # "auto" never picks it, even where a table names it best
    fused.reset_chooser()
    entry = {"m": 748, "n": 8192, "k": 2048, "dtype": "bf16", "world": 4, "best_mode": "two_shot_fp8"}
    monkeypatch.setattr(fused, "load_table", lambda world: [entry])
    try:
        assert fused.choose_mode(748, 8192, 2048, "bf16", 4, "cuda") != "two_shot_fp8"
    finally:
        fused.reset_chooser()


def test_comm_estimate_of_the_fp8_mode_w57_arithmetic():
    """The W57 TP=4 chunk's 780 row-parallel reduces of [748, 8192] bf16: the estimate's pieces from the fits."""
    two, nccl = emulate.fit("two_shot"), emulate.fit("nccl")
    p = fp8_reduce_parts((748, 8192), 4)
    wire = 748 * (8192 + 4 * 64)
    assert p["wire_bytes"] == wire
    assert p["link_symm_us"] == pytest.approx(two.fixed_us + two.us_per_mb * wire / 1e6 * 1.5)
    assert p["link_nccl_us"] == pytest.approx(2 * (nccl.fixed_us + nccl.us_per_mb * wire / 1e6 * 0.75))
    hbm = (2 * 748 * 8192 + wire) * 2 + wire * 1.25
    assert p["local_us"] == pytest.approx(hbm / emulate.HBM_BYTES_S * 1e6)
    bf16 = emulate.estimate_us("all_reduce", "two_shot", 748 * 8192 * 2, 4)
    assert p["symm_epilogue_us"] < p["symm_fused_us"] < p["symm_us"] < bf16 < p["as_built_us"]
    row = {"kind": "all_reduce", "label": "ffn.fc2", "shape": [748, 8192], "dtype": "bfloat16",
           "nbytes": 748 * 8192 * 2, "world": 4, "per_layer": True, "count": 780}  # fmt: skip
    base = comm_estimate([{**row, "algo": "two_shot"}], 4)
    mine = comm_estimate([{**row, "algo": "two_shot_fp8"}], 4)
    assert base["total_ms"] == pytest.approx(780 * bf16 / 1e3)
    assert mine["total_ms"] == pytest.approx(780 * p["as_built_us"] / 1e3)
    for k in emulate.FP8_VARIANTS:  # the same alternatives whichever mode ran
        assert base["total_ms_fp8"][k] == pytest.approx(mine["total_ms_fp8"][k])
    assert base["total_ms_fp8"]["symm"] == pytest.approx(780 * p["symm_us"] / 1e3)
    assert mine["collectives"][0]["link_bytes"] == wire and mine["fp8"]["block"] == cf.BLOCK


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: ~14 s
@pytest.mark.timeout(180)
def test_gloo_ranks_against_exact_sums_and_tp1(world, tmp_path):
    res = comm_fp8_worker.spawn(tmp_path, world)
    for m, n in ((37, 256), (64, 96)):
        ps = comm_fp8_worker.partials(world, m, n)
        exact, bound = sum(ps), cf.error_bound(ps)
        for r in range(world):
            assert torch.equal(res[r][(m, n)], res[0][(m, n)])
        assert ((res[0][(m, n)] - exact).abs() <= bound).all()
    assert res[0]["algos"] == [("two_shot_fp8", "float32")]
    ref = res[0]["tp1"]
    assert rel(res[0]["nccl"], ref) < 1e-5  # the reference all-reduce: float32 reordering only
    e = rel(res[0]["fp8"], ref)
    assert 1e-4 < e < FP8_BUDGET, (
        f"TP={world} FP8 comm vs TP=1: {e:.3g}"
    )  # it changed the numbers, within budget
    for r in range(1, world):
        assert torch.equal(res[r]["fp8"], res[0]["fp8"])
    print(f"TP={world}: FP8 comm vs TP=1 {e:.4f}; reference {rel(res[0]['nccl'], ref):.2e}")
