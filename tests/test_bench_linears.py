"""``cadence bench linears`` on CPU (the Triton interpreter, the tiny preset): every section runs, checks its
outputs and writes its JSON (timings on a CPU mean nothing; the GPU plan: `linears` in scripts/device_plans.toml)."""

from __future__ import annotations

import json

import pytest
import torch

from cadence.bench import linears as bl
from cadence.kernels import fp8_gemm as kg

pytestmark = pytest.mark.skipif(
    kg._triton_missing() != "" or torch.cuda.is_available() or not kg.interpreting(),
    reason="the CPU smoke test (TRITON_INTERPRET=1, no CUDA)",
)


def test_roles_are_the_tp_shards():
    r = {x.name: x for x in bl.roles("w57", 4)}
    assert (r["qkv"].m, r["qkv"].k, r["qkv"].n) == (748, 8192, 6144)
    assert (r["attn_out"].k, r["attn_out"].n) == (2048, 8192) and (r["cross_q"].k, r["cross_q"].n) == (
        8192,
        2048,
    )
    assert (r["fc1"].n, r["fc2"].k) == (6144, 6144) and not r["fc2"].fused_input and r["qkv"].fused_input
    assert (r["audio_kv"].m, r["audio_kv"].n) == (8, 4096) and r["audio_q"].per_layer == 0.25
    assert round(bl.chunk_flop("w57", 4, True) / 1e12, 1) == 72.3  # issue 27's figure
    assert bl.roles("w57", 1)[5].fused_input  # fc2 is fused at TP=1 only
    with pytest.raises(ValueError, match="must divide"):
        bl.roles("w57", 3)


def test_smoke_run_writes_json(tmp_path):
    args = bl.parse(["--presets", "tiny:1", "--sweep", "short", "--no-tiles", "--no-producers"])
    args.out_dir = str(tmp_path)
    res = bl.run(args)
    doc = json.loads(open(res["_path"]).read())
    assert doc["bench"] == "linears" and doc["results"]["chunks"]
    # the recipe of the plan's one (preset, TP): what `cadence serve --model tiny` builds here
    assert (
        doc["recipe"]["model"] == "tiny"
        and doc["recipe"]["tp"] == 1
        and "CADENCE_FP8_QUANT" in doc["recipe"]["env"]
    )
    for g in doc["results"]["gemms"]:
        assert isinstance(g["us"]["cublas"], float) and isinstance(g["us"]["bf16"], float)
        name = "triton:" + kg.INTERPRETER.text()
        assert isinstance(g["err"][name], float) and g["err"][name] <= bl.OK_REL, g
        assert g["backend"] in ("cublas", "triton")
        q = g[
            "rounds"
        ]  # cuBLAS against the best Triton config, interleaved; Triton only where it is "faster"
        assert q["rounds"] >= 5 and q["lo"] <= q["median"] <= q["hi"]
        assert (g["backend"] == "triton") == (q["verdict"] == "faster")
    c = doc["results"]["chunks"][0]
    assert all(isinstance(c["ms"][v], float) and c["ms"][v] > 0 for v in bl.CHUNK_VARIANTS), c
    assert not list(tmp_path.rglob("gemm-*.json"))  # no table from a CPU run


def test_tile_and_producer_rows():
    clock = bl.Clock(torch.device("cpu"), 2, 3, 60.0)
    t = bl.tile_row((16, 64, 32), clock)
    assert t["exact"] == {"owner": True, "both": True}
    assert all(
        isinstance(t["us"][k], float)
        for k in ("cublas", "tile_gemm", "emulated_owner", "emulated_both", "arm")
    )
    for kind in ("norm_modulate", "layer_norm", "gelu"):
        p = bl.producer_row(kind, 8, 64, clock, compiled=False)
        assert p["parity"]["max_steps_off"] <= 1.0 + 1e-3 and p["parity"]["bytes_differ"] <= 1, p
        assert isinstance(p["us"]["triton_fused"], float)


def test_bad_plan_is_one_clear_error():
    from cadence.cli import main

    for bad, msg in (("w57:3", "must divide"), ("w99:1", "unknown preset"), ("w57:x", "not 'preset:tp")):
        with pytest.raises(ValueError, match=msg):
            bl.plan(bl.parse(["--presets", bad]))
    assert main(["bench", "linears", "--presets", "w57:3", "--no-record"]) == 2
