"""A worker's cold start said and remembered (``cadence.engine.startup``): the compile caches in one per-user folder
(set only where the operator set nothing), the first start's line, the phases logged and kept, the second start's
estimate from the first."""

from __future__ import annotations

import json
import logging

from cadence.engine.recipe import EngineSpec, resolve
from cadence.engine.spec import FastPath
from cadence.engine.startup import announce, cache_root, remember, start_key, use_compile_cache


def test_the_compile_caches_go_to_one_folder_unless_set(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    got = use_compile_cache(env)
    assert got["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "cadence" / "compile" / "inductor")
    assert got["TRITON_CACHE_DIR"].endswith("compile/triton") and env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    mine = {"CADENCE_CACHE_DIR": str(tmp_path / "c"), "TRITON_CACHE_DIR": "/fast/triton"}
    got = use_compile_cache(mine)
    assert got["TRITON_CACHE_DIR"] == "/fast/triton"  # the operator's choice wins
    assert got["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "compile" / "inductor")
    assert cache_root({}).name == "cadence"


def test_a_second_start_is_told_what_the_first_took(tmp_path, caplog):
    env = {"CADENCE_CACHE_DIR": str(tmp_path)}
    r = resolve(EngineSpec("flashhead-lite", fast=FastPath(compile=True)), "cuda:0")
    caplog.set_level(logging.INFO, logger="cadence.startup")
    assert announce(r, "NVIDIA H200", "2.13", env) is None
    assert "no earlier start on record" in caplog.text and "minutes on a GPU" in caplog.text
    warm = {"ms": 95_000.0, "first_stream_ttff_ms": 80_000.0}
    rec = remember(r, "NVIDIA H200", "2.13", 12.5, warm, env)
    assert rec["ready_s"] == 107.5 and "ready in 107.5 s: build 12.5 s, warm-up 95.0 s" in caplog.text
    caplog.clear()
    assert announce(r, "NVIDIA H200", "2.13", env) == rec
    assert "the last start here took 108 s" in caplog.text
    data = json.loads((tmp_path / "starts.json").read_text())
    assert list(data) == [start_key(r, "NVIDIA H200", "2.13")]
    # another fast path, device or torch is another start (its kernels are other kernels)
    other = resolve(EngineSpec("flashhead-lite", fast=FastPath(compile=False)), "cuda:0")
    assert announce(other, "NVIDIA H200", "2.13", env) is None
    assert announce(r, "NVIDIA H100", "2.13", env) is None
