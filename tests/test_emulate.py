"""The emulated TP rank's pieces on one CPU process: the stand-in collectives, the collective log, the link
fits and the comm estimate, the per-rank floors, nested and in-graph span regions, and
``cadence bench step --tp N --emulate`` at the tiny preset. (That an emulated rank records exactly the
shapes and collectives of a real gloo rank is tests/test_sp.py's.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fake_graph import FakeGraph

from cadence.config import get_preset
from cadence.parallel.emulate import (
    LINKS,
    EmulatedGroup,
    bus_factor,
    comm_estimate,
    estimate_us,
    fit,
    link_algo,
    time_standins,
)
from cadence.parallel.group import CollectiveLog

QUICK = ["--preset", "tiny", "--cache", "ring", "--warmup", "0", "--iters", "2", "--profile-iters", "1"]


def test_stand_ins_have_the_collectives_shapes_and_touch_every_byte():
    g = EmulatedGroup(4, rank=2)
    t = torch.full((3, 5), 2.0)
    g.all_reduce(t)
    assert torch.equal(t, torch.full((3, 5), 8.0))  # the sum of 4 equal partials
    part = torch.arange(6.0).view(2, 3)
    out = torch.full((8, 3), float("nan"))
    g.all_gather(out, part)
    assert torch.equal(out, part.repeat(4, 1))  # every slot written
    inp = torch.arange(24.0).view(8, 3)
    rs = torch.full((2, 3), float("nan"))
    g.reduce_scatter(rs, inp)
    assert torch.equal(rs, inp.view(4, 2, 3).sum(0))
    with pytest.raises(ValueError, match="all_gather"):
        g.all_gather(torch.empty(7, 3), part)
    with pytest.raises(ValueError, match="reduce_scatter"):
        g.reduce_scatter(torch.empty(3, 3), inp)
    for bad in ((0, 0), (2, 2), (4, -1)):
        with pytest.raises(ValueError, match="emulated group"):
            EmulatedGroup(*bad)
    assert g.symm_unavailable(torch.device("cpu")) and g.process_group is None


def test_collective_log_records_nests_and_scales_per_layer_counts():
    g = EmulatedGroup(2)
    with CollectiveLog() as outer:
        g.all_reduce(torch.zeros(4, 8), label="ffn.fc2", algo="two_shot")
        with CollectiveLog() as inner:
            g.all_gather(torch.zeros(4, 8), torch.zeros(2, 8), label="tokens.gather", per_layer=False)
        g.all_reduce(torch.zeros(4, 8), label="ffn.fc2", algo="two_shot")
    g.all_reduce(torch.zeros(1))  # no log active: nothing recorded, nothing fails
    assert [c.label for c in outer.calls] == ["ffn.fc2", "tokens.gather", "ffn.fc2"]
    assert [c.label for c in inner.calls] == ["tokens.gather"]
    s = outer.summary(layer_scale=5)
    assert [(c["label"], c["count"]) for c in s] == [("ffn.fc2", 10), ("tokens.gather", 1)]
    assert s[0]["nbytes"] == 4 * 8 * 4 and s[0]["total_bytes"] == 10 * 128 and s[0]["algo"] == "two_shot"


def test_link_fits_reproduce_the_measured_table():
    for algo, pts in LINKS.items():
        f = fit(algo)
        assert f.points == len(pts) == 12
        assert f.max_residual_us < 3.0, (algo, f)  # within ~2x the run-to-run spread of the source (~1-2 us)
        for nbytes, us in pts:
            assert abs(estimate_us("all_reduce", algo, nbytes, 2) - us) < 3.0
    # the fitted bandwidths are those of NVLink between two H200s (bus GB/s), two-shot the fastest
    assert fit("two_shot").bus_gb_s > fit("nccl").bus_gb_s > fit("one_shot").bus_gb_s > 150


def test_bus_factors_and_what_estimates_what():
    assert bus_factor("all_reduce", "nccl", 2) == bus_factor("all_reduce", "one_shot", 2) == 1.0
    assert bus_factor("all_reduce", "two_shot", 4) == 1.5 and bus_factor("all_reduce", "one_shot", 4) == 3.0
    assert bus_factor("reduce_scatter", "nccl", 4) == bus_factor("all_gather", "nccl", 4) == 0.75
    assert bus_factor("all_reduce", "nccl", 1) == 0.0 and estimate_us("all_reduce", "nccl", 10**7, 1) == 0.0
    assert link_algo("all_reduce", "tiles") == link_algo("all_reduce", "chunked4") == "two_shot"
    assert link_algo("all_gather", "nccl") == link_algo("reduce_scatter", "two_shot") == "nccl"
    mb12 = 748 * 8192 * 2
    ar2, ar4 = estimate_us("all_reduce", "two_shot", mb12, 2), estimate_us("all_reduce", "two_shot", mb12, 4)
    assert 40 < ar2 < 50 and ar4 > ar2  # 44 us measured at TP=2; more bus bytes at TP=4
    rs4 = estimate_us("reduce_scatter", "nccl", mb12, 4)
    assert fit("nccl").fixed_us < rs4 < estimate_us("all_reduce", "nccl", mb12, 4)


def test_comm_estimate_adds_up_and_names_its_source():
    g = EmulatedGroup(4)
    with CollectiveLog() as log:
        for _ in range(3):
            g.all_reduce(torch.zeros(748, 64, dtype=torch.bfloat16), label="self_attn.out", algo="two_shot")
        g.reduce_scatter(torch.zeros(188, 64), torch.zeros(752, 64), label="ffn.fc2")
    est = comm_estimate(log.summary(), 4)
    assert est["world"] == 4 and "docs/perf/fused" in est["source"]
    rows = est["collectives"]
    assert [r["count"] for r in rows] == [3, 1]
    assert est["total_ms"] == pytest.approx(sum(r["est_us"] * r["count"] for r in rows) / 1e3)
    ar = rows[0]["est_ms"]
    assert ar < est["total_ms_symm_halves"] < est["total_ms"]  # the RS priced as half a two-shot: cheaper
    assert set(est["by_kind_ms"]) == {"all_reduce", "reduce_scatter"} and set(est["fits"]) == {
        "two_shot",
        "nccl",
    }
    assert time_standins(log.summary(), torch.device("cpu")) is None  # a CUDA-graph timing: not on the CPU


def test_rank_floors_count_the_shards():
    from cadence.bench.floors import floors_ms, rank_bytes, rank_flops
    from cadence.bench.step import chunk_flops

    cfg = get_preset("w57")
    one, four = rank_flops(cfg, 1), rank_flops(cfg, 4)
    full = chunk_flops(cfg)
    assert one["linear"] == pytest.approx(full["linear"]) and one["attention"] == pytest.approx(
        full["attention"]
    )
    assert four["attention"] == pytest.approx(one["attention"] / 4)
    assert one["linear"] / 4 < four["linear"] < one["linear"] / 4 * 1.01  # the replicated parts are small
    tp, sp = rank_bytes(cfg, 4, False, True, True), rank_bytes(cfg, 4, True, True, True)
    assert (
        sp["elementwise"] < 0.5 * tp["elementwise"]
        and sp["quant"] < tp["quant"]
        and sp["cache"] == tp["cache"]
    )
    f = floors_ms(cfg, 4, True, True, True, comm_bus_bytes=45e9)
    assert f["comm"] == pytest.approx(100.0) and f["step"] == pytest.approx(
        sum(v for k, v in f.items() if k != "step")
    )
    assert 60 < f["linear"] < 66 and 20 < f["attention"] < 28  # W57 TP=4: ~75 TFLOP of linears at 1200


def test_nested_regions_are_exclusive_and_add_up():
    import time

    from cadence.telemetry.spans import SpanRecorder, region

    with SpanRecorder("cpu") as rec:
        with region("linear"):
            time.sleep(0.02)
            with region("quant"):
                time.sleep(0.03)
    t = rec.totals()
    assert 25 <= t["quant"] < 60 and 15 <= t["linear"] < 28, t  # linear's own 20 ms, not 50
    assert rec.counts() == {"linear": 1, "quant": 1}


def _tiny_session():
    from cadence.bench import step as bench_step
    from cadence.engine.session import StreamGenerator
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp

    cfg = get_preset("tiny").with_overrides(stream={"cache": "ring"})
    model = apply_tp(build_model(cfg, "cpu", torch.float32, seed=0), EmulatedGroup(2), sequence_parallel=True)
    g = torch.Generator().manual_seed(1)
    image = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    sess = StreamGenerator(cfg, model).session(image, "benchmark prompt", seed=0)
    bench_step.fill_cache_random(sess.cache, cfg, model, g)
    return sess, torch.randn(cfg.audio_samples_per_chunk, generator=g) * 0.1


def test_graph_split_plumbing_with_an_injected_capture():
    """On the CPU the capture is a stand-in (FakeGraph): the split comes from the capturing run (the real
    one, on CUDA, re-records its events at every replay); what is checked is the plumbing: the recorder is
    active only inside the capture, the runner then replays, and every region shows up."""
    from cadence.bench.step import measure_graph_split
    from cadence.telemetry import spans

    class Capturing(FakeGraph):  # like a real capture, the step runs once while capturing
        def __init__(self, fn):
            super().__init__(fn)
            self.output = fn()

    sess, audio = _tiny_session()
    r = measure_graph_split(sess, audio, torch.device("cpu"), capture=Capturing, replays=2)
    assert r["used"] and r["total_ms"] > 0 and spans._active is None
    assert {"linear", "attention", "cache", "allreduce"} <= set(r["regions"]) and r["region"]["allreduce"] > 0
    assert measure_graph_split(sess, audio, torch.device("cpu"))["used"] is False  # no CUDA: says why

    def broken(fn):
        raise RuntimeError("no external events in this torch")

    r = measure_graph_split(sess, audio, torch.device("cpu"), capture=broken)
    assert r["used"] is False and "capture" in r["reason"]


@pytest.mark.timeout(120)
def test_bench_step_emulated_tp4_with_sequence_parallelism():
    from cadence.bench import step as bench_step

    r = bench_step.run(
        bench_step.parse([*QUICK, "--tp", "4", "--emulate", "--sequence-parallel", "--no-record"])
    )
    m = get_preset("tiny").model
    assert r["emulated"] and r["emulated_rank"] == 0 and r["sequence_parallel"]
    passes = get_preset("tiny").stream.passes
    by = {(c["kind"], c["label"]): c for c in r["collectives"]}
    assert by[("reduce_scatter", "ffn.fc2")]["count"] == m.num_layers * passes
    assert (
        by[("all_gather", "tokens.gather")]["count"] == passes
        and not by[("all_gather", "tokens.gather")]["per_layer"]
    )
    assert by[("reduce_scatter", "ffn.fc2")]["shape"] == [64, m.dim]  # 4 ranks x 16 rows
    assert ("all_reduce", "ffn.fc2") not in by
    assert r["comm_estimate_ms"] > 0
    assert r["comm_estimate_ms"] == pytest.approx(sum(c["est_ms"] for c in r["collectives"]))
    assert r["step_estimate_ms"] == pytest.approx(r["compute_ms"] + r["comm_estimate_ms"])
    assert set(r["floors"]) == {"linear", "quant", "attention", "cache", "elementwise", "comm", "step"}
    assert r["split_mode"] == "eager" and set(r["split"]) >= {
        "linear_ms",
        "quant_ms",
        "elementwise_ms",
        "comm_ms",
    }
    assert r["tp_built"] == "meta"  # sharded on meta, as a real rank builds its shard


@pytest.mark.timeout(120)
def test_bench_step_emulated_scales_per_layer_collectives(tmp_path):
    import json

    from cadence.bench import step as bench_step

    r = bench_step.run(
        bench_step.parse([*QUICK, "--tp", "2", "--emulate", "--layers", "1", "--out-dir", str(tmp_path)])
    )
    passes = get_preset("tiny").stream.passes
    by = {(c["kind"], c["label"]): c for c in r["collectives"]}
    assert by[("all_reduce", "ffn.fc2")]["count"] == 2 * passes  # 1 layer run, scaled to the preset's 2
    doc = json.loads(Path(r["_path"]).read_text())
    assert "-tp2-emu-" in Path(r["_path"]).name and doc["results"]["emulated"] is True
    assert doc["results"]["comm_estimate"]["source"]


def test_bench_step_bad_flags_are_one_error_line(capsys):
    from cadence.cli import main

    for argv, msg in (
        (["--emulate"], "--emulate stands in for one rank"),
        (["--sequence-parallel"], "--sequence-parallel needs tensor parallelism"),
        (["--tp", "2", "--emulate", "--emulate-rank", "2"], "--emulate-rank 2 is outside --tp 2"),
        (["--tp", "2", "--emulate", "--comm", "multimem"], "unknown row-parallel comm mode"),
        (["--tp", "2"], "runs under torchrun"),
    ):
        assert main(["bench", "step", *QUICK, *argv, "--no-record"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err


def test_apply_tp_takes_a_group_of_one_and_the_default_layout():
    from cadence.model.layers import ALL_TOKENS
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp

    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    assert model.token_layout is ALL_TOKENS
    assert (
        apply_tp(model, EmulatedGroup(1), sequence_parallel=True) is model
        and model.token_layout is ALL_TOKENS
    )
    with pytest.raises(ValueError, match="size 3 must divide"):
        apply_tp(build_model(cfg, "cpu", torch.float32, seed=0), EmulatedGroup(3))
