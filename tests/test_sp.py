"""Sequence parallelism (cadence.parallel.sp) and the emulated TP rank (cadence.parallel.emulate), against
real gloo ranks on the CPU: TP=2 in the default tier (two spawned ranks, the 63-token geometry), TP=4 in
the slow tier (four ranks on two cores, both geometries).

Each rank (tests/sp_worker.py) runs the tiny float32 model sharded with and without sequence parallelism,
at three token counts: 64 a chunk (tiny: no padding), 63 (a 112x144 stream: P = 32 rows a rank at TP=2,
16 at TP=4, the last rank holding padding) and a 748-token whole-sequence forward (W57's chunk: 374 rows
a rank at TP=2, 187 padded to 188 at TP=4), per-frame timesteps (per-token modulation, split with the
tokens), the audio attention's per-frame groups, five streamed chunks through the cache (the window
slides).

Tolerances, and why:
* SP vs TP=1 (float32): sequence parallelism only moves the per-token math to the rank that owns the
  token (row-local: the same arithmetic on the same row) and turns each all-reduce into a reduce-scatter
  of the same partial products (gloo sums them in its own order); so it sits where plain TP sits, a few
  float32 ulps from TP=1 (tests/test_tp.py: measured 2.8e-7 forward, 1.7e-7 stream). Asserted < 1e-5,
  as there. Measured here: bitwise equal to plain TP at TP=2; 1.5-1.9e-7 from it at TP=4 where the rows
  are padded (the four-rank reduce-scatter adds in another order than the all-reduce).
* SP vs TP (same group size, float32): asserted < 1e-6 (measured 0 and <= 1.9e-7).
* FP8 linears: the column-parallel inputs are quantised per token on the rank that owns the token and
  gathered as e4m3 bytes + scales, which are exactly the bytes quantising the gathered rows gives
  (scales are per row); the row-parallel inputs are those of plain TP. So SP+FP8 equals TP+FP8 up to the
  float32 reordering above, unless a value sits within an ulp of an e4m3 rounding boundary. Measured: 0 at
  TP=2, 3.6e-8 at TP=4; asserted < 1e-5 (one flipped e4m3 step in one element of these outputs would be
  ~1e-4). Against the float32 reference, the FP8 budget of tests/test_tp.py (10%; measured 2.8-3.1%).
* Every rank must hold bitwise the same outputs (the gathers hand every rank the same rows).
* The emulated rank (one process, ``EmulatedGroup``) must record exactly the per-op shapes (every module
  call's input and output shapes, every cache.attend's q / k / v) and the collective list (kind, label,
  shape, dtype, bytes, algorithm, order) of the real gloo rank it stands for, ranks 0 and world - 1, with
  and without SP, bf16 and FP8 linears: equality, no tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import sp_worker
import tp_worker

TP_TOL = 1e-5
SP_VS_TP = 1e-6
FP8_SP_VS_TP = 1e-5
FP8_BUDGET = 0.10

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["tp2", "tp4"])
def ranks(request, tmp_path_factory):
    world = request.param
    return world, sp_worker.spawn(tmp_path_factory.mktemp(f"sp{world}"), world, light=_light(world))


def _light(world):
    """The default tier's TP=2 run keeps to the 63-token geometry (padded rows at both sizes); the slow
    tier's TP=4 run adds the unpadded 64-token one."""
    return world == 2


def _names(world):
    return list(sp_worker.configs(light=_light(world)))


@pytest.mark.timeout(300)
def test_sp_matches_tp1_and_tp(ranks):
    world, res = ranks
    for name in _names(world):
        ref = res[0][("ref", name)]
        for key in ("full", "stream", "full748"):
            for r in range(world):
                sp, tp = res[r][(name, True)][key], res[r][(name, False)][key]
                e = tp_worker.rel_err(sp, ref[key])
                assert e < TP_TOL, f"TP={world} rank {r} {name} {key}: SP vs TP=1 {e:.2e}"
                e = tp_worker.rel_err(sp, tp)
                assert e < SP_VS_TP, f"TP={world} rank {r} {name} {key}: SP vs TP {e:.2e}"
                assert torch.equal(sp, res[0][(name, True)][key]), f"rank {r} differs from rank 0"


def test_rows_per_rank_are_padded_to_four():
    from cadence.parallel.sp import rows_per_rank

    assert rows_per_rank(748, 4) == 188 and rows_per_rank(748, 2) == 376  # W57 / W14 chunks
    assert rows_per_rank(64, 4) == 16 and rows_per_rank(63, 4) == 16 and rows_per_rank(63, 2) == 32
    assert rows_per_rank(4680, 2) == 2340 and rows_per_rank(5, 4) == 4
    for t in range(1, 200):
        for w in (1, 2, 3, 4, 8):
            p = rows_per_rank(t, w)
            assert p % 4 == 0 and p * w >= t and (p - 4) * w < t, (t, w, p)


def test_rows_recorded_by_the_ranks(ranks):
    world, res = ranks
    from cadence.parallel.sp import rows_per_rank

    for name in _names(world):
        assert res[0][("rows", name)] == rows_per_rank(63 if name == "uneven" else 64, world)


def test_fp8_sp_equals_fp8_tp(ranks):
    world, res = ranks
    ref32 = res[0][("ref", "uneven")]["full"]
    for r in range(world):
        sp, tp = res[r][("fp8", True)], res[r][("fp8", False)]
        assert torch.isfinite(sp).all()
        assert tp_worker.rel_err(sp, tp) < FP8_SP_VS_TP, f"rank {r}: {tp_worker.rel_err(sp, tp):.2e}"
        assert tp_worker.rel_err(sp, ref32) < FP8_BUDGET
        assert torch.equal(sp, res[0][("fp8", True)])


def test_sp_collectives_replace_the_all_reduces(ranks):
    """Under SP no row-parallel layer all-reduces: each reduce-scatters, each column-parallel shard gathers
    its rows first (FP8: bytes + scales), the q/k norm sums stay all-reduces, one gather before the head."""
    from cadence.parallel.sp import rows_per_rank

    world, res = ranks
    for sp in (False, True):
        calls = res[0][("record", "uneven", sp)]["collectives"]
        kinds = {(c["kind"], c["label"]) for c in calls}
        rows = {("all_reduce", f"{a}.out") for a in ("self_attn", "cross_attn", "audio_attn")}
        rows.add(("all_reduce", "ffn.fc2"))
        # the self-attention's q and k sums in one collective (tp.QKVNormStats); the text K: once per session,
        # outside the steps; the audio K/V is made before its q: two
        norms = {("all_reduce", x) for x in ("self_attn.norm_qk", "cross_attn.norm_q", "audio_attn.norm_q")}
        norms.add(("all_reduce", "audio_attn.norm_k"))
        if not sp:
            assert kinds == rows | norms
            continue
        scatters = {("reduce_scatter", label) for _, label in rows}
        gathers = {("all_gather", x) for x in ("self_attn.qkv", "cross_attn.q", "audio_attn.q", "ffn.fc1")}
        assert kinds == scatters | gathers | norms | {("all_gather", "tokens.gather")}
        p = rows_per_rank(63, world)
        for c in calls:
            if c["kind"] != "all_reduce":
                assert c["shape"][0] == world * p and c["shape"][1] == 128
    # FP8: each column-parallel gather moves the rows packed as [K e4m3 bytes | 4 scale bytes], once
    fp8 = [c for c in res[0][("record_fp8", True)]["collectives"] if c["kind"] == "all_gather"]
    cols = [c for c in fp8 if c["label"] != "tokens.gather"]
    assert cols and all(c["dtype"] == "uint8" for c in cols)
    assert {c["shape"][1] for c in cols} == {128 + 4}  # K = dim = 128 for qkv, q, fc1
    assert {c["label"] for c in cols} == {"self_attn.qkv", "cross_attn.q", "audio_attn.q", "ffn.fc1"}


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_emulated_rank_records_what_a_real_rank_does(ranks, fp8):
    from cadence.parallel.emulate import EmulatedGroup

    world, res = ranks
    cfgs = sp_worker.configs()
    for rank in (0, world - 1):
        for sp in (False, True):
            for name in ["uneven"] if fp8 else _names(world):
                em = sp_worker.step_record(
                    sp_worker.build(cfgs[name], EmulatedGroup(world, rank), sp, fp8), cfgs[name]
                )
                real = res[rank][("record_fp8", sp)] if fp8 else res[rank][("record", name, sp)]
                assert len(em["ops"]) == len(real["ops"]) > 100
                assert em["ops"] == real["ops"], f"rank {rank} sp={sp} {name}: per-op shapes differ"
                assert em["collectives"] == real["collectives"], f"rank {rank} sp={sp} {name}: collectives"
                assert em["summary"] == real["summary"]


def test_the_engine_applies_sequence_parallelism(ranks):
    """``FastPath.sequence_parallel`` through ``build_engine`` (at TP=2; the four-rank run skips it)."""
    world, res = ranks
    if "engine" not in res[0]:
        pytest.skip("the engine check runs at TP=2")
    for r in range(world):
        plain, sp = res[r]["engine"][False], res[r]["engine"][True]
        assert sp["applied"]["sequence_parallel"] is True and plain["applied"]["sequence_parallel"] is False
        assert sp["applied"]["tp"] == world
        e = tp_worker.rel_err(sp["stream"], plain["stream"])
        assert e < SP_VS_TP, f"rank {r}: engine stream SP vs TP {e:.2e}"
        assert torch.equal(sp["stream"], res[0]["engine"][True]["stream"])


def test_sequence_parallel_without_tp_is_a_note():
    from cadence.config import get_preset
    from cadence.engine.build import build_engine
    from cadence.engine.spec import FastPath
    from cadence.errors import ConfigError

    eng = build_engine(
        get_preset("tiny").with_overrides(model={"num_layers": 1}),
        "cpu",
        FastPath(threads=1, sequence_parallel=True),
    )
    try:
        assert any("sequence_parallel: needs tensor parallelism" in str(n) for n in eng.notes)
        assert "sequence_parallel" not in eng.applied
    finally:
        eng.close()
    with pytest.raises(ConfigError, match="sequence_parallel must be true or false"):
        FastPath(sequence_parallel="yes")


def test_a_prequantised_input_is_gathered_as_it_is():
    """A column-parallel FP8 shard under SP takes a QuantizedActivation (a fused norm + quantisation
    kernel's output) of its rank's rows and gathers those bytes: the same output as from the tensor."""
    from cadence.parallel.emulate import EmulatedGroup
    from cadence.parallel.sp import ColumnParallelLinear, ShardedTokens
    from cadence.quant.fp8 import FP8Linear, QuantizedActivation, quantize_rows

    tokens = ShardedTokens(EmulatedGroup(2))
    x = torch.randn(1, 63, 32)
    local, _ = tokens.scatter(x, torch.zeros(1, 6, 32))
    col = ColumnParallelLinear(FP8Linear.from_linear(torch.nn.Linear(32, 16)), tokens, "ffn.fc1")
    q, s = quantize_rows(local.reshape(-1, 32))
    y_q = col(QuantizedActivation(q, s, tuple(local.shape), local.dtype))
    assert y_q.shape == (1, 63, 16) and torch.equal(y_q, col(local))
    with pytest.raises(ValueError, match="rows"):
        col(torch.randn(1, 5, 32))
