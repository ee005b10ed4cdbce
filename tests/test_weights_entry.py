"""Issue 29 item 1: a family's default weights entry is the one its authors' inference reads (Self-Forcing:
``generator_ema``), ``--weights-entry NAME`` / ``--ema`` / ``--no-ema`` choose another, the entry served is
named (the recipe, ``GET /config``, the session report, the worker's ready info), and a file lacking the chosen
entry is one clear error listing the entries it has.

The checkpoint is made here, in Self-Forcing's own format (a ``.pt`` of state dicts with Wan's names under
``model.``), from tiny random tensors: the two entries differ, so a check that read the wrong one fails. The
key layout is taken from the committed fixture (its names and shapes only; its values are not used)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from cadence.engine.flags import add_engine_flags, spec_from_args
from cadence.engine.recipe import EngineSpec, resolve
from cadence.errors import ConfigError, InputError, WeightsError
from cadence.model.families import FAMILIES
from cadence.model.weights import build_model, convert_state_dict, load_weights

TEMPLATE = Path(__file__).parent / "fixtures" / "self_forcing" / "self_forcing_tiny.pt"
TINY = dict(dim=64, num_heads=2, head_dim=32, ffn_dim=128, num_layers=2, freq_dim=32, text_dim=32, text_len=8)
HW = dict(height=32, width=48)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, dict, dict]:
    """A Self-Forcing-format file whose 'generator' and 'generator_ema' are two different random state dicts."""
    layout = torch.load(TEMPLATE, weights_only=True)["generator"]
    g = torch.Generator().manual_seed(29)
    plain = {k: torch.randn(v.shape, generator=g).to(v.dtype) * 0.05 for k, v in layout.items()}
    ema = {k: torch.randn(v.shape, generator=g).to(v.dtype) * 0.05 for k, v in layout.items()}
    path = tmp_path_factory.mktemp("sf") / "self_forcing_dmd.pt"
    torch.save({"generator": plain, "generator_ema": ema}, path)
    return path, plain, ema


def spec(path: Path, *words: str) -> EngineSpec:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    s = spec_from_args(p.parse_args(["--model", "self-forcing", "--weights", str(path), *words]))
    over = dict(s.overrides, model=dict(s.overrides["model"], **TINY), stream=HW)
    return dataclasses.replace(s, overrides=over)


def loaded(recipe) -> torch.Tensor:
    """The self-attention q/k/v weight of block 0 the engine's loader puts into the model for ``recipe``."""
    model = build_model(recipe.config, "cpu", torch.float32, seed=None)
    load_weights(model, recipe.config.model.weights)
    return model.blocks[0].self_attn.qkv.weight


def expected(sd: dict) -> torch.Tensor:
    conv, _ = convert_state_dict({k.removeprefix("model."): v for k, v in sd.items()}, "wan")
    return conv["blocks.0.self_attn.qkv.weight"].float()


def test_the_default_entry_is_the_authors_and_another_can_be_chosen(ckpt):
    path, plain, ema = ckpt
    assert not torch.equal(expected(plain), expected(ema))  # the check below can fail
    r = resolve(spec(path), "cpu")
    assert r.weights_entry == "generator_ema" == r.config.model.weights_entry
    assert torch.equal(loaded(r), expected(ema))
    for words, entry, sd in (
        (("--weights-entry", "generator"), "generator", plain),
        (("--no-ema",), "generator", plain),
        (("--ema",), "generator_ema", ema),
    ):
        r = resolve(spec(path, *words), "cpu")
        assert r.weights_entry == entry and torch.equal(loaded(r), expected(sd)), words
    assert "entry generator_ema" in resolve(spec(path), "cuda:0").describe(env={}).text()


def test_each_family_writes_down_where_its_authors_say_so():
    for name, fam in FAMILIES.items():
        ck = fam.checkpoint
        assert ck.default_entry_source, name  # a repository, a commit, the line followed
        assert (ck.default_entry is not None) == bool(ck.state_keys), name
        if ck.default_entry:
            assert ck.default_entry in (*ck.state_keys, ck.ema_key), name
            assert (
                f"'{ck.default_entry}'" in ck.default_entry_source
                or f'"{ck.default_entry}"' in (ck.default_entry_source.replace("\\", ""))
                or ck.default_entry in ck.default_entry_source
            ), name
    assert FAMILIES["self-forcing"].checkpoint.default_entry == "generator_ema"
    assert FAMILIES["causvid"].checkpoint.default_entry == "generator"
    assert FAMILIES["longlive"].checkpoint.default_entry == "generator"
    assert FAMILIES["krea-14b"].checkpoint.default_entry is None  # one state dict per file


def test_a_file_without_the_entry_is_one_error_listing_its_entries(ckpt, tmp_path):
    path, plain, _ = ckpt
    only = tmp_path / "plain_only.pt"
    torch.save({"generator": plain, "step": torch.tensor(7)}, only)
    with pytest.raises(WeightsError, match=r"no 'generator_ema' entry.*the entries it has: generator$"):
        loaded(resolve(spec(only), "cpu"))
    with pytest.raises(WeightsError, match=r"no 'nope' entry.*the entries it has: generator, generator_ema"):
        loaded(resolve(spec(path, "--weights-entry", "nope"), "cpu"))


def test_entry_words_that_cannot_apply_are_clear_errors(ckpt):
    path, _, _ = ckpt
    with pytest.raises(InputError, match="not both"):
        spec(path, "--ema", "--weights-entry", "generator")
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    with pytest.raises(InputError, match="'causvid' has no EMA"):
        spec_from_args(p.parse_args(["--model", "causvid", "--ema"]))
    with pytest.raises(InputError, match="one state dict"):
        spec_from_args(p.parse_args(["--model", "krea-14b", "--no-ema"]))
    with pytest.raises(ConfigError, match="krea-14b's checkpoint is one state dict"):
        resolve(EngineSpec("krea-14b", weights_entry="generator"), "cpu")


def test_the_server_names_the_entry_it_serves(ckpt):
    """``GET /config`` (its ``weights_entry``), each worker group's recipe and the session report (through the
    engine configuration the web side keeps) name the entry."""
    pytest.importorskip("fastapi")
    from cadence.serve.app import create_app
    from cadence.serve.config import ServeConfig, worker_spec

    path, _, _ = ckpt
    cfg = ServeConfig(engine=spec(path), port=0)
    ws, _ = worker_spec(cfg, "cpu")
    assert ws.recipe.config.model.weights_entry == "generator_ema"
    assert ws.recipe.describe(env={}).as_dict()["weights_entry"] == "generator_ema"
    app = create_app(cfg)
    route = next(r for r in app.routes if getattr(r, "path", "") == "/config")
    body = asyncio.run(route.endpoint())
    assert body["weights_entry"] == "generator_ema" and body["weights"]["model"] == str(path.resolve())
    plain = create_app(ServeConfig(engine=spec(path, "--no-ema"), port=0))
    route = next(r for r in plain.routes if getattr(r, "path", "") == "/config")
    assert asyncio.run(route.endpoint())["weights_entry"] == "generator"


def test_the_worker_start_line_names_the_entry(ckpt, caplog):
    """The worker's start log line (shown whatever CADENCE_WORKER_LOG says) names the model and the entry."""
    import logging

    from cadence.engine.recipe import WorkerSpec
    from cadence.engine.worker import _start_line

    path, _, _ = ckpt
    with caplog.at_level(logging.INFO, logger="cadence.serve.worker"):
        _start_line(WorkerSpec(resolve(spec(path), "cpu")))
        _start_line(WorkerSpec(resolve(EngineSpec("tiny"), "cpu")))
    assert f"self-forcing (self-forcing), weights {path.resolve()} (entry generator_ema)" in caplog.text
    assert "tiny (tiny), random weights (seed 0)" in caplog.text
