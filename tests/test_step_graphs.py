"""`cadence bench step` with CUDA graphs and FP8 counts, on the CPU.

* ``--graphs`` on the CPU falls back to the eager step with ONE log line (and says so in the JSON);
* the graphed measurement itself (``measure_graphed``: the graph runner, a capture agreed over the TP
  group) runs through an injected capture function: it captures once and replays, and a failing
  capture falls back to eager with one warning;
* under two gloo ranks a capture that fails on ONE rank makes every rank fall back (NCCL needs every
  rank to launch graphs derived from one collective capture; the symmetric-memory all-reduce needs
  both ranks on the same buffer), and the ranks still agree bitwise;
* the FP8 counts (how many FP8 linears ran ``torch._scaled_mm`` vs fell back) are in the JSON, and a
  row slice of a quantised activation (a misaligned scale pointer, docs/benchmarks.md's trap) reaches
  ``torch._scaled_mm`` 16-byte aligned.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))  # importable in spawned processes
import tp_worker
from fake_graph import FakeGraph

from cadence.bench import step as bench_step
from cadence.config import get_preset

TINY_RING = get_preset("tiny").with_overrides(stream={"cache": "ring"})
SPC = TINY_RING.audio_samples_per_chunk
QUICK = ["--preset", "tiny", "--cache", "ring", "--warmup", "0", "--iters", "2", "--profile-iters", "1"]


def _session(model, cfg=TINY_RING):
    from cadence.engine.session import StreamGenerator

    gen = StreamGenerator(cfg, model)
    g = torch.Generator().manual_seed(1)
    image = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    sess = gen.session(image, "benchmark prompt", seed=0)
    bench_step.fill_cache_random(sess.cache, cfg, model, g)
    audio = torch.randn(SPC, generator=g) * 0.1
    return sess, audio


@pytest.mark.timeout(60)
def test_cpu_graphs_flag_falls_back_to_eager_with_one_log_line(caplog):
    caplog.set_level(logging.INFO)
    r = bench_step.run(bench_step.parse([*QUICK, "--graphs", "--no-record"]))
    lines = [rec for rec in caplog.records if rec.name == "cadence.bench.step"]
    assert len(lines) == 1 and "CUDA device" in lines[0].getMessage(), [x.getMessage() for x in lines]
    g = r["graphs"]
    assert g["requested"] is True and g["tried"] is False and g["used"] is False and "CUDA" in g["reason"]
    assert r["step_mode"] == "eager" and r["step_graph_ms"] is None and r["graph_speedup"] is None
    assert r["step_ms"] == r["step_eager_ms"] > 0


@pytest.mark.timeout(60)
def test_cpu_default_is_eager_without_log_line(caplog):
    caplog.set_level(logging.INFO)
    r = bench_step.run(bench_step.parse([*QUICK, "--no-record"]))
    assert not [rec for rec in caplog.records if rec.name == "cadence.bench.step"]
    assert r["graphs"]["requested"] is None and r["graphs"]["used"] is False and r["step_mode"] == "eager"


@pytest.mark.timeout(60)
def test_fp8_counts_in_the_json(tmp_path, fp8_on_the_cpu):
    r = bench_step.run(bench_step.parse([*QUICK, "--fp8", "--out-dir", str(tmp_path)]))
    doc = json.loads(Path(r["_path"]).read_text())
    c = doc["results"]["fp8_counts"]
    assert c["fp8_linears"] == doc["results"]["fp8_layers"] > 0
    assert c["ran_fp8"] + c["fell_back"] + c["unused"] == c["fp8_linears"]
    assert c["scaled_mm_calls"] + c["fallback_calls"] > 0
    # every block linear runs in a step (no audio-less block skips its audio attention here)
    assert c["unused"] == 0
    assert set(c) >= {"mixed", "fallback_reasons", "refused"}
    assert "-fp8" in Path(r["_path"]).name


def test_fp8_report_counts_a_refused_shape(monkeypatch):
    from cadence.quant import fp8

    monkeypatch.setattr(fp8, "_op_unusable", {})
    a = fp8.FP8Linear.from_linear(torch.nn.Linear(32, 16))
    b = fp8.FP8Linear.from_linear(torch.nn.Linear(32, 16))
    real = fp8.FP8Linear._scaled_mm

    def refuses_m3(self, xq, xs, bias, out_dtype):
        if xq.shape[0] == 3:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED (emulated)")
        return real(self, xq, xs, bias, out_dtype)

    monkeypatch.setattr(fp8.FP8Linear, "_scaled_mm", refuses_m3)
    wrapper = torch.nn.Sequential(a, b)
    a(torch.randn(4, 32))
    a(torch.randn(3, 32))  # refused: falls back, remembered for M=3 only
    a(torch.randn(3, 32))  # not retried
    a(torch.randn(8, 32))  # other shapes still FP8
    r = fp8.fp8_report(wrapper)
    assert (r["fp8_linears"], r["ran_fp8"], r["fell_back"], r["mixed"], r["unused"]) == (2, 0, 1, 1, 1)
    assert (r["scaled_mm_calls"], r["fallback_calls"]) == (2, 2)
    assert len(r["refused"]) == 1 and "M=3" in next(iter(r["refused"].values()))
    assert list(r["fallback_reasons"].values()) == [1]


def test_row_slice_of_a_quantised_activation_reaches_scaled_mm_aligned(monkeypatch):
    from cadence.quant import fp8

    lin = fp8.FP8Linear.from_linear(torch.nn.Linear(32, 16))
    q, s = fp8.quantize_rows(torch.randn(9, 32))
    qa = fp8.QuantizedActivation(q[1:], s[1:], (8, 32), torch.float32)  # rows from 1: scale ptr + 4 bytes
    assert qa.scale.data_ptr() % 16 != 0
    seen = []
    real = torch._scaled_mm

    def checking(a, b, scale_a, scale_b, **kw):
        seen.append((a.data_ptr() % 16, scale_a.data_ptr() % 16))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", checking)
    y = lin(qa)
    if not seen:  # this torch has no CPU _scaled_mm: the fallback ran, nothing to check here
        pytest.skip("torch._scaled_mm unavailable on CPU in this torch")
    assert seen == [(0, 0)]
    ref = (q[1:].float() * s[1:]) @ lin.dequantized_weight().t() + lin.bias
    assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2)
    assert fp8.aligned16(s) is s


@torch.no_grad()
def test_measure_graphed_captures_once_and_replays():
    from cadence.model.weights import build_model

    model = build_model(TINY_RING, "cpu", torch.float32, seed=0)
    sess, audio = _session(model)
    r = bench_step.measure_graphed(sess, audio, torch.device("cpu"), warmup=1, iters=3, capture=FakeGraph)
    assert r["used"] and r["captures"] == 1 and r["capture_failures"] == 0
    assert r["replays"] == 1 + 1 + 3  # the capture's own replay, the warm-up, the timed steps
    assert r["output_finite"] and len(r["times"]) == 3


@torch.no_grad()
def test_measure_graphed_capture_failure_falls_back_with_one_warning(caplog):
    from cadence.model.weights import build_model

    caplog.set_level(logging.INFO)

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    model = build_model(TINY_RING, "cpu", torch.float32, seed=0)
    sess, audio = _session(model)
    r = bench_step.measure_graphed(sess, audio, torch.device("cpu"), warmup=1, iters=2, capture=broken)
    assert not r["used"] and r["captures"] == 0 and r["capture_failures"] == 1
    assert r["last"] == "eager:capture_failed" and len(r["times"]) == 2
    warnings = [x for x in caplog.records if x.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not permitted" in warnings[0].getMessage()


# ---- two gloo ranks: capture agreed across the group ---------------------------------------------------


@torch.no_grad()
def _agree_rank(rank: int, world: int, port: int, outdir: str) -> None:
    tp_worker.gloo_env(rank, world, port)
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp, destroy_tp, init_tp

    info = init_tp(backend="gloo")
    try:
        res = {}
        for case in ("both_ok", "rank1_fails"):
            tried = []

            def capture(fn, case=case, tried=tried):
                tried.append(1)
                if case == "rank1_fails" and rank == 1:
                    raise RuntimeError("emulated capture failure on rank 1")
                return FakeGraph(fn)

            model = apply_tp(build_model(TINY_RING, "cpu", torch.float32, seed=0), info.group)
            sess, audio = _session(model)
            r = bench_step.measure_graphed(
                sess, audio, torch.device("cpu"), warmup=0, iters=2, group=info.group, capture=capture
            )
            out = sess.step(audio)  # one more step after the timed ones: the ranks must still agree
            res[case] = {k: r[k] for k in ("used", "captures", "capture_failures", "last")}
            res[case]["tried"] = len(tried)
            res[case]["out"] = out
        torch.save(res, Path(outdir) / f"rank{rank}.pt")
    finally:
        destroy_tp()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_capture_is_agreed_across_tp_ranks(tmp_path):
    mp.spawn(_agree_rank, args=(2, tp_worker.free_port(), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in range(2):
        ok, bad = res[r]["both_ok"], res[r]["rank1_fails"]
        assert ok["used"] and ok["captures"] == 1 and ok["last"] == "replay", (r, ok)
        # rank 0 captured fine, rank 1 did not: BOTH drop the graph and run eagerly
        assert not bad["used"] and bad["captures"] == 0 and bad["capture_failures"] == 1, (r, bad)
        assert bad["tried"] == 1 and bad["last"] == "eager:capture_failed"
    for case in ("both_ok", "rank1_fails"):
        assert torch.equal(res[0][case]["out"], res[1][case]["out"]), case


# ---- --compile ------------------------------------------------------------------------------------------


def test_compile_flag_applies_after_fp8_and_records_the_report(monkeypatch, fp8_on_the_cpu):
    import types

    from cadence.quant.fp8 import FP8Linear

    seen = {}

    class Report:
        enabled, reason, blocks, norms, backend = True, "", 2, 0, "fake"

        def describe(self):
            return "fake compile"

        def status(self):
            return {"norm_modulate": "compiled (1 calls)"}

    def fake_apply(model):
        seen["fp8_linears"] = sum(isinstance(m, FP8Linear) for m in model.modules())
        return Report()

    from cadence.runtime.compile import apply_fused_quant  # the real one: --fp8 applies it too

    monkeypatch.setitem(
        sys.modules,
        "cadence.runtime.compile",
        types.SimpleNamespace(apply_compile=fake_apply, apply_fused_quant=apply_fused_quant),
    )
    r = bench_step.run(bench_step.parse([*QUICK, "--fp8", "--compile", "--no-record"]))
    assert seen["fp8_linears"] == r["fp8_layers"] > 0  # compiled after apply_fp8
    assert r["compile"]["describe"] == "fake compile" and r["compile"]["status"] == {
        "norm_modulate": "compiled (1 calls)"
    }


def test_compile_flag_without_the_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cadence.runtime.compile", None)  # import raises ImportError
    with pytest.raises(SystemExit, match="--compile needs cadence.runtime.compile.apply_compile"):
        bench_step.run(bench_step.parse([*QUICK, "--compile", "--no-record"]))
