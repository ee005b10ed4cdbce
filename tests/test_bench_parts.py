"""The benchmarks of one part (``cadence bench step | cache | attention | fused | linears``) on the one
engine-flag set: their words give an ``EngineSpec`` resolved by the recipe (``cadence.bench.recipes``), the words
recorded in README / docs / scripts keep the meaning they had (FP8 off unless asked, the step's cache and graphs
rules, the CUDA-only options asked for kept on a CPU smoke run), and each run prints and records its recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.bench import step as bench_step
from cadence.bench.recipes import part_recipe


def step_recipe(words: list[str], device: str, layers: int | None = None):
    return part_recipe(bench_step.step_spec(bench_step.parse(words), layers), device)


# (words, device) -> (cache, kv_fp8, fp8_linears, graphs, compile, dtype): what `bench step` built before the
# flag set (its own flags: --kv-fp8 / --fp8 / --compile store_true, graphs on with CUDA and the ring cache)
MEANINGS = [
    ([], "cuda:0", ("naive", False, False, False, False, "bfloat16")),
    ([], "cpu", ("naive", False, False, False, False, "float32")),
    (["--preset", "w14", "--cache", "naive", "--dtype", "bf16"], "cuda:0", ("naive", False, False, False, False, "bfloat16")),
    (["--preset", "w57", "--cache", "ring"], "cuda:0", ("ring", False, False, True, False, "bfloat16")),
    (["--preset", "w57", "--cache", "ring", "--kv-fp8"], "cuda:0", ("ring", True, False, True, False, "bfloat16")),
    (["--cache", "ring", "--no-graphs", "--fp8"], "cuda:0", ("ring", False, True, False, False, "bfloat16")),
    (["--cache", "ring", "--kv-fp8", "--fp8", "--compile", "--graphs"], "cuda:0", ("ring", True, True, True, True, "bfloat16")),
    (["--cache", "naive", "--kv-fp8"], "cuda:0", ("naive", True, False, False, False, "bfloat16")),
    (["--graphs"], "cuda:0", ("naive", False, False, False, False, "bfloat16")),  # graphs need the ring: eager
    (["--cache", "ring", "--kv-fp8", "--fp8", "--graphs"], "cpu", ("ring", True, True, False, False, "float32")),
    (["--dtype", "fp16"], "cpu", ("naive", False, False, False, False, "float16")),
]  # fmt: skip


@pytest.mark.parametrize(
    "words,device,meaning", MEANINGS, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_bench_step_words_keep_the_meaning_they_had(words, device, meaning):
    r = step_recipe(words, device)
    got = (r.config.stream.cache, r.config.stream.kv_fp8, r.fast.fp8_linears, r.fast.graphs, r.fast.compile)
    assert got + (r.fast.dtype,) == meaning
    assert r.tp == 1 and not r.warmup


def test_bench_step_takes_the_fast_path_flags_of_a_step_with_their_docstrings(capsys):
    with pytest.raises(SystemExit):
        bench_step.parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in bench_step.FAST_FIELDS:
        assert f"--{name.replace('_', '-')}" in out, name
    assert "--fp8 " in out and "--preset" in out and "--decoder-fast" not in out and "--weights" not in out
    assert "FP8 block linears (``cadence.quant.fp8.apply_fp8``)" in out  # FastPath.fp8_linears' docstring
    r = step_recipe(["--cache", "ring", "--fp8", "--gemm", "triton", "--attention", "sdpa"], "cuda:0")
    assert r.fast.gemm == "triton" and r.config.stream.attention == "sdpa"
    r = step_recipe(["--tp", "4", "--emulate", "--sequence-parallel", "--comm", "two_shot"], "cuda:0")
    assert r.tp == 4 and r.fast.sequence_parallel and r.fast.comm == "two_shot"


def test_a_cpu_run_keeps_what_was_asked_unless_the_family_rules_it_out():
    r = step_recipe(["--cache", "ring", "--kv-fp8", "--fp8", "--gemm", "triton"], "cpu")
    assert r.fast.kv_fp8 and r.fast.fp8_linears and r.fast.gemm == "triton"
    assert len(r.notes) == 1 and "kept on cpu, as asked" in r.notes[0]
    # nothing asked: the CPU reference (and nothing to note)
    assert step_recipe(["--cache", "ring"], "cpu").notes == ()
    # Krea's context rebuild runs on the naive cache: its rules win over the words on any device
    krea = step_recipe(["--model", "krea-14b", "--kv-fp8", "--fp8"], "cpu", layers=1)
    assert krea.config.stream.cache == "naive" and not krea.fast.fp8_linears
    assert not any("kept" in n for n in krea.notes)


def test_serve_and_bench_step_differ_only_where_the_step_says_so():
    """A bare `bench step` is the reference step, not what a bare `cadence serve` runs on CUDA (the README says
    so): the FP8 options differ, the geometry is the model's."""
    from cadence.engine.recipe import EngineSpec, resolve

    serve = resolve(EngineSpec(model="w14"), "cuda:0")
    step = step_recipe(["--preset", "w14"], "cuda:0")
    assert serve.fast.fp8_linears and serve.fast.kv_fp8 and not (step.fast.fp8_linears or step.fast.kv_fp8)
    assert serve.config.model == step.config.model
    same = step_recipe(["--preset", "w14", "--cache", "ring", "--kv-fp8", "--fp8"], "cuda:0")
    keys = ("kv_fp8", "fp8_linears", "graphs", "dtype", "comm", "attention", "gemm")
    assert {k: getattr(same.fast, k) for k in keys} == {k: getattr(serve.fast, k) for k in keys}
    assert same.config.stream == serve.config.stream


@pytest.mark.timeout(60)
def test_bench_step_prints_and_records_its_recipe(tmp_path, capsys):
    words = ["--preset", "tiny", "--cache", "ring", "--warmup", "0", "--iters", "1", "--profile-iters", "1"]
    r = bench_step.run(bench_step.parse([*words, "--fp8", "--layers", "1", "--out-dir", str(tmp_path)]))
    doc = json.loads(Path(r["_path"]).read_text())
    rec = doc["recipe"]
    assert rec["model"] == "tiny" and rec["geometry"]["layers"] == 1 and rec["cache"] == "ring"
    assert rec["fast"]["fp8_linears"] is True and rec["fast"]["kv_fp8"] is False
    assert doc["results"]["fp8"] is True and doc["results"]["layers_run"] == 1
    assert capsys.readouterr().err.startswith("recipe: tiny on cpu, tp 1")


@pytest.mark.timeout(60)
def test_bench_cache_times_three_recipes(tmp_path):
    from cadence.bench import cache

    argv = [
        "--preset",
        "tiny",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--attn-iters",
        "1",
        "--out-dir",
        str(tmp_path),
    ]
    assert cache.main(argv) == 0
    (path,) = (tmp_path / "cache").glob("*-cpu-tiny-tp1.json")
    doc = json.loads(path.read_text())
    rec = doc["recipes"]
    assert [(rec[k]["cache"], rec[k]["kv_fp8"]) for k in ("naive", "ring_bf16", "ring_fp8")] == [
        ("naive", False),
        ("ring", False),
        ("ring", True),
    ]
    assert all(not v["fast"]["fp8_linears"] and not v["fast"]["graphs"] for v in rec.values())
    assert set(doc["results"]["steps"]) == {"naive", "ring_bf16", "ring_fp8"}
    args = cache.parse(["--model", "w14", "--attention", "sdpa", "--dtype", "bf16"])
    r = cache.variant_recipes(args, "cuda:0", 2)
    assert {k: v.fast.dtype for k, v in r.items()} == dict.fromkeys(cache.VARIANTS, "bfloat16")
    assert r["ring_fp8"].config.stream.attention == "sdpa" and r["ring_fp8"].config.model.num_layers == 2


def test_the_sweeping_benchmarks_record_the_recipe_of_each_shape():
    import argparse

    import torch

    from cadence.bench import attention, fused, linears

    a = attention.shape_recipes(attention.parse(["--model", "w57", "--tp", "4"]), torch.device("cpu"))
    assert list(a) == [("w57", 4)] and a[("w57", 4)].tp == 4
    f = fused.shape_recipes(argparse.Namespace(tiny=False, presets="w57,w14"), 2, torch.device("cpu"))
    assert list(f) == ["w57 tp2", "w14 tp2"] and all(r.tp == 2 for r in f.values())
    pl = linears.plan(linears.parse(["--presets", "w57:1,4;w1.3:1"]))
    assert list(linears.plan_recipes(pl, torch.device("cpu"))) == ["w57 tp1", "w57 tp4", "w1.3 tp1"]
    # the recipes are serve's (automatic for the device): FP8 on for a CUDA shape
    assert linears.plan_recipes([("w14", 2)], torch.device("cuda", 0))["w14 tp2"].fast.fp8_linears


@pytest.mark.parametrize(
    "module,options",
    [
        ("cache", ("--model", "--preset", "--dtype", "--attention")),
        ("attention", ("--model", "--preset", "--tp")),
    ],
)
def test_the_part_benchmarks_take_the_flag_set_s_spellings(module, options, capsys):
    import importlib

    mod = importlib.import_module(f"cadence.bench.{module}")
    with pytest.raises(SystemExit):
        mod.parse(["--help"])
    out = capsys.readouterr().out
    assert all(o in out for o in options), out
    assert mod.parse(["--preset", "w14"]).model == mod.parse(["--model", "w14"]).model == "w14"
