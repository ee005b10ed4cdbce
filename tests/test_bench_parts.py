"""The benchmarks of one part (``cadence bench step | cache | attention | fused | linears``) on the one
engine-flag set: their words give an ``EngineSpec`` resolved by the recipe as ``cadence serve`` resolves the same
words (a bare ``bench step`` builds what a bare ``serve`` builds on the same device; another path is asked for
in words), and each run prints and records its recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.bench import step as bench_step
from cadence.cli import build_parser
from cadence.engine import flags
from cadence.engine.recipe import resolve


def step_recipe(words: list[str], device: str, layers: int | None = None):
    return resolve(bench_step.step_spec(bench_step.parse(words), layers), device)


def serve_recipe(words: list[str], device: str):
    return resolve(flags.spec_from_args(build_parser().parse_args(["serve", *words])), device)


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
@pytest.mark.parametrize("model", ["tiny", "w14", "character", "krea-14b"])
def test_a_bare_bench_step_builds_what_a_bare_serve_builds(model, device):
    """The same words, one resolution: no default of the benchmark's own, no edit after resolving."""
    step, serve = step_recipe(["--model", model], device), serve_recipe(["--model", model], device)
    assert step.fast == serve.fast and step.config == serve.config and step.notes == serve.notes
    assert not step.warmup  # (a part benchmark times the step, no warm-up stream)


# (words, device) -> (cache, kv_fp8, fp8_linears, graphs, compile, dtype): another path asked for in words
MEANINGS = [
    ([], "cuda:0", ("ring", True, True, True, False, "bfloat16")),  # what serve runs
    ([], "cpu", ("naive", False, False, False, False, "float32")),
    (["--no-kv-fp8", "--no-fp8", "--no-graphs"], "cuda:0", ("naive", False, False, False, False, "bfloat16")),
    (["--preset", "w14", "--cache", "naive", "--dtype", "bf16"], "cuda:0", ("naive", False, True, False, False, "bfloat16")),
    (["--preset", "w57", "--cache", "ring", "--no-kv-fp8"], "cuda:0", ("ring", False, True, True, False, "bfloat16")),
    (["--cache", "ring", "--no-graphs", "--no-kv-fp8"], "cuda:0", ("ring", False, True, False, False, "bfloat16")),
    (["--cache", "ring", "--kv-fp8", "--fp8", "--compile", "--graphs"], "cuda:0", ("ring", True, True, True, True, "bfloat16")),
    (["--cache", "naive", "--kv-fp8"], "cuda:0", ("naive", True, True, False, False, "bfloat16")),
    (["--cache", "ring", "--kv-fp8", "--fp8", "--graphs"], "cpu", ("ring", False, False, False, False, "float32")),
    (["--dtype", "fp16"], "cpu", ("naive", False, False, False, False, "float16")),
]  # fmt: skip


@pytest.mark.parametrize(
    "words,device,meaning", MEANINGS, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_bench_step_words_say_what_they_time(words, device, meaning):
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


def test_a_cpu_run_turns_the_cuda_options_off_with_notes_as_serve_does():
    words = ["--kv-fp8", "--fp8", "--gemm", "triton"]
    r = step_recipe(["--cache", "ring", *words], "cpu")
    assert not (r.fast.kv_fp8 or r.fast.fp8_linears) and r.fast.gemm == "auto"
    assert r.notes == serve_recipe(words, "cpu").notes and any("needs a CUDA worker" in n for n in r.notes)
    assert step_recipe(["--cache", "ring"], "cpu").notes == ()  # nothing asked: the CPU reference, no note
    # Krea's context rebuild runs on the naive cache: its rules win over the words on any device
    krea = step_recipe(["--model", "krea-14b", "--kv-fp8", "--fp8"], "cuda:0", layers=1)
    assert krea.config.stream.cache == "naive" and not krea.fast.kv_fp8 and krea.fast.fp8_linears


@pytest.mark.timeout(60)
def test_bench_step_prints_and_records_its_recipe(tmp_path, capsys):
    words = ["--preset", "tiny", "--cache", "ring", "--warmup", "0", "--iters", "1", "--profile-iters", "1"]
    r = bench_step.run(bench_step.parse([*words, "--fp8", "--layers", "1", "--out-dir", str(tmp_path)]))
    doc = json.loads(Path(r["_path"]).read_text())
    rec = doc["recipe"]
    assert rec["model"] == "tiny" and rec["geometry"]["layers"] == 1 and rec["cache"] == "ring"
    assert rec["fast"]["fp8_linears"] is False and rec["notes"] == [
        "fp8_linears: needs a CUDA worker (this one runs on cpu): off"
    ]  # as cadence serve --fp8 on the CPU
    assert doc["results"]["fp8"] is False and doc["results"]["layers_run"] == 1
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
        ("ring", False),  # FP8 K/V needs a CUDA worker: off here, with serve's note
    ]
    assert rec["ring_fp8"]["notes"] == ["kv_fp8: needs a CUDA worker (this one runs on cpu): off"]
    assert all(not v["fast"]["fp8_linears"] and not v["fast"]["graphs"] for v in rec.values())
    assert set(doc["results"]["steps"]) == {"naive", "ring_bf16", "ring_fp8"}
    args = cache.parse(["--model", "w14", "--attention", "sdpa", "--dtype", "bf16"])
    r = cache.variant_recipes(args, "cuda:0", 2)
    assert {k: v.fast.dtype for k, v in r.items()} == dict.fromkeys(cache.VARIANTS, "bfloat16")
    assert r["ring_fp8"].config.stream.attention == "sdpa" and r["ring_fp8"].config.model.num_layers == 2
    assert r["ring_fp8"].config.stream.kv_fp8 and not any(v.fast.fp8_linears for v in r.values())


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
