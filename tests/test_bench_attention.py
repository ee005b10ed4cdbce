"""`cadence bench attention` on the CPU (the tiny preset): the record it writes, its checks, and the table
it makes for `auto` (cadence/kernels/attention_table.json). The Triton rows are left out here (the
interpreter runs each call for seconds; tests/test_ring_kernels.py checks those kernels)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cadence.bench import attention as ba
from cadence.kernels import attention_backends as ab
from cadence.kernels import attention_registry as registry


@pytest.fixture
def no_triton(monkeypatch):
    """The registry's backends but the Triton ones (the interpreter runs each call for seconds)."""
    every = ba.bench_backends
    monkeypatch.setattr(ba, "bench_backends", lambda: [b for b in every() if not b.name.startswith("triton")])


def with_budget(monkeypatch, backend: str, storage: str, value: float) -> None:
    b = registry.BACKENDS[backend]
    monkeypatch.setitem(
        registry.BACKENDS, backend, dataclasses.replace(b, budget={**b.budget, storage: value})
    )


def test_cpu_smoke_record_and_ring_check(no_triton, tmp_path, capsys):
    argv = ["--preset", "tiny", "--device", "cpu", "--iters", "1", "--check", "--ring-check"]
    rc = ba.main([*argv, "--out-dir", str(tmp_path)])
    assert rc == 0
    (path,) = (tmp_path / "attention").glob("*-cpu-tiny-tp1.json")
    doc = json.loads(path.read_text())
    assert doc["bench"] == "attention" and doc["device_kind"] == "cpu"
    res = doc["results"]
    assert res["shape"] == dict(preset="tiny", tp=1, heads=4, q_tokens=64, kv_tokens=320, head_dim=32)
    assert res["variants"]["sdpa_default_bf16"]["rel_err"] < 1e-5  # float32 on the CPU: exact
    assert res["best"]["sdpa_default_bf16"]["variant"] == "sdpa_default_bf16"
    rc_ = res["ring_check"]
    assert {k: r["backend"] for k, r in rc_.items()}["fp8_fa3"] == "reference"  # no fa3-fwd here
    assert all(r["ok"] for r in rc_.values()) and rc_["fp8_triton"]["max_rel_err"] > 1e-3
    out = capsys.readouterr()
    assert "attention tiny tp1: 4 heads, 64 q x 320 kv, d 32" in out.out
    # the recipe of the shape (what `cadence serve --model tiny` builds here), printed and recorded
    assert doc["recipe"]["model"] == "tiny" and doc["recipe"]["geometry"]["tokens_per_chunk"] == 64
    assert out.err.startswith("recipe: tiny on cpu, tp 1")


def test_check_fails_over_budget(no_triton, tmp_path, monkeypatch, capsys):
    with_budget(monkeypatch, "sdpa", "bf16", 0.0)  # nothing passes a zero budget
    assert ba.main(["--preset", "tiny", "--device", "cpu", "--iters", "1", "--check", "--no-record"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: over budget: tiny tp1 sdpa_default_bf16")


def test_best_of_skips_variants_over_budget():
    v = {
        "sdpa_cudnn_bf16": dict(family="sdpa_cudnn_bf16", ms=1.0, rel_err=0.004, budget=0.01, config={}),
        "triton_fp8_a": dict(family="triton_fp8", ms=0.5, rel_err=0.3, budget=0.08, config={"split": 2}),
        "triton_fp8_b": dict(family="triton_fp8", ms=0.8, rel_err=0.05, budget=0.08, config={"split": 1}),
    }
    out = ba.best_of(v)
    assert out["over_budget"] == {"triton_fp8_a": 0.3}
    assert out["best"]["triton_fp8"]["variant"] == "triton_fp8_b"
    assert out["best"]["triton_fp8"]["speedup_vs_cudnn_bf16"] == pytest.approx(1.25)


def test_table_from_a_record_feeds_auto(tmp_path, monkeypatch):
    """A record's best rows become table entries (ring backends only; cuDNN FP8 and the fixed-length FA3
    row are comparisons), ranked by speedup for `auto`."""
    best = {
        "sdpa_cudnn_bf16": dict(ms=0.26, rel_err=0.004, config={}, speedup_vs_cudnn_bf16=1.0),
        "triton_fp8": dict(
            ms=0.2, rel_err=0.05, config={"block_m": 64, "split": 4}, speedup_vs_cudnn_bf16=1.3
        ),
        "fa3_fp8": dict(ms=0.25, rel_err=0.05, config={"num_splits": 3}, speedup_vs_cudnn_bf16=1.04),
        "cudnn_fp8": dict(ms=0.2, rel_err=0.07, config={}, speedup_vs_cudnn_bf16=1.3),
        "fa3_fp8_fixed": dict(ms=0.2, rel_err=0.05, config={}, speedup_vs_cudnn_bf16=1.3),
    }
    shape = dict(preset="w57", tp=4, heads=16, q_tokens=748, kv_tokens=15708, head_dim=128)
    rec = {
        "device": "NVIDIA H200",
        "device_kind": "nvidia-h200",
        "git": "abc",
        "torch": "2.11",
        "command": "x",
    }
    rec["results"] = {"best": best, "shape": shape}
    src = tmp_path / "2026-12-01-nvidia-h200-w57-tp4.json"
    src.write_text(json.dumps(rec))
    out = tmp_path / "table.json"
    assert ba.main(["--table-from", str(src), "--table-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {(e["backend"], e["storage"]) for e in doc["entries"]} == {
        ("cudnn", "bf16"),
        ("triton", "fp8"),
        ("fa3", "fp8"),
    }
    assert src.name in doc["sources"] and "git abc" in doc["sources"][src.name]
    monkeypatch.setattr(ab, "TABLE_PATH", out)
    ab.table.cache_clear()
    try:
        ranked = ab.ranking("nvidia-h200", 16, 748, 15708, 128, "fp8")
        assert [(e["backend"], e["config"]) for e in ranked] == [
            ("triton", {"block_m": 64, "split": 4}),
            ("fa3", {"num_splits": 3}),
        ]
    finally:
        ab.table.cache_clear()


def test_table_from_needs_an_output(capsys):
    assert ba.main(["--table-from", "x.json"]) == 2
    assert capsys.readouterr().err.strip() == "error: --table-from needs --table-out"


def _opts(**kw):
    import argparse

    return argparse.Namespace(**{"sweep": True, "iters": 1, "seed": 0, "shape_budget_s": 1e9, **kw})


def test_fa3_rows_through_the_stub(no_triton, monkeypatch):
    """The bench's FA3 rows (ring layout with seqused_k, each num_splits; the fixed-length call; bf16) on
    the stub with FA3's contract: every row runs and is within its budget (bf16: 2% here, where 40 queries
    over 200 keys of head dim 32 average the bf16 roundings of q, k, v and the output less than the serving
    shapes do: seen 1.03%)."""
    import torch
    from fa3_stub import fake_fa3

    from cadence.kernels import fa3_adapter

    monkeypatch.setitem(__import__("sys").modules, fa3_adapter.MODULE, fake_fa3())
    monkeypatch.setattr(fa3_adapter, "why_not", lambda d, h, f: "")
    with_budget(monkeypatch, "fa3", "bf16", 0.02)
    fa3_adapter.forget()
    try:
        res = ba.run_dims(2, 40, 200, 32, torch.device("cpu"), _opts())
    finally:
        fa3_adapter.forget()
    fa3 = {k: r for k, r in res["variants"].items() if k.startswith("fa3")}
    assert set(fa3) == {f"fa3_fp8_s{s}" for s in (0, 1, 2, 3, 4, 6)} | {"fa3_fp8_fixed_s1"} | {
        f"fa3_bf16_s{s}" for s in (0, 1, 2)
    }, res["failed"]
    assert not res["failed"] and not res["over_budget"]
    assert all(r["rel_err"] > 1e-3 for k, r in fa3.items() if "fp8" in k)  # FP8 really happened


def test_a_setup_that_fails_is_one_line_not_the_run(no_triton, monkeypatch):
    import torch

    def broken(*a, **k):
        raise TypeError("sdpa_fp8() got an unexpected keyword argument 'scale_o'")
        yield  # a generator, as the real one

    monkeypatch.setattr(ba, "cudnn_fp8_variant", broken)
    res = ba.run_dims(2, 40, 200, 32, torch.device("cpu"), _opts())
    assert res["failed"] == {"broken": "TypeError: sdpa_fp8() got an unexpected keyword argument 'scale_o'"}
    assert "sdpa_default_bf16" in res["variants"]


@pytest.mark.skipif(
    not __import__("cadence.kernels.ring_attention", fromlist=["x"]).triton_usable(
        __import__("torch").device("cpu"), 16, allow_interpreter=True
    )[0],
    reason="triton cannot run here",
)
def test_every_device_sweep_config_is_exact_on_float32_storage():
    """Each Triton config the device sweep times (block shapes, splits, dual, pv_bf16, ws) runs, here under
    the interpreter at a small shape, and on float32 storage equals the reference to 1e-5: the device
    run measures configs that are all correct."""
    import torch

    from cadence.kernels import ring_attention as ra

    g = torch.Generator().manual_seed(0)
    h, m, n, d = 1, 130, 270, 16
    q, k, v = (torch.randn(h, s, d, generator=g) for s in (m, n, n))
    n_alloc = 384
    K, VT = torch.zeros(h, n_alloc, d), torch.zeros(h, d, n_alloc)
    K[:, :n], VT[:, :, :n] = k, v.transpose(1, 2)
    qs, ks = torch.ones(h, m), torch.ones(h, n_alloc)
    nv = torch.tensor([n - 7], dtype=torch.int32)
    ref = ra.ring_attention_reference(q, qs, K, ks, VT, ks, n - 7)
    seen = set()
    for kernel in (ab.TRITON, ab.TRITON_HEAD):
        for cfg in kernel.configs(torch.device("cuda"), "fp8", sweep=True, ctas=100):
            key = tuple(sorted((a, b) for a, b in cfg.items() if a not in ("num_warps", "num_stages")))
            if key in seen:
                continue
            seen.add(key)
            out = ra.ring_attention(q, qs, K, ks, VT, ks, nv, out_dtype=torch.float32, **cfg)
            assert rel(out, ref) < 1e-5, cfg
    assert len(seen) >= 20


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_warm_up_survives_a_failing_parallel_compile(no_triton, monkeypatch):
    """The warm-up's worker processes are an optimisation: when they fail the measuring process compiles
    everything itself, with one line."""
    import concurrent.futures

    import torch

    def pool(*a, **k):
        raise RuntimeError("no CUDA in the worker")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", pool)
    lines = []
    secs = ba.warm(torch.device("cpu"), _opts(compile_workers=2), log=lines.append)
    assert secs > 0 and len(lines) == 2
    assert "parallel compile failed" in lines[0] and "variants ready" in lines[1]
