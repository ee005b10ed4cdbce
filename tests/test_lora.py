"""LoRA merged at load time (``cadence.model.lora``, ``--lora PATH[:SCALE]``) against LongLive's own LoRA code
(fixture: tests/fixtures/lora, made by scripts/fixtures/make_lora.py from NVlabs/LongLive v1.0 + peft at the
commits in fixture.json).

The reference wraps LongLive's ``CausalWanModel`` (the Self-Forcing fixture's ``generator`` weights, sha256
checked) with LongLive's ``configure_lora_for_model`` (peft, every linear of the attention blocks), loads a
random rank-4, alpha-8 LoRA with ``peft.set_peft_model_state_dict`` exactly as LongLive's ``inference.py`` loads
``lora.pt``, and runs one forward pass un-merged (peft adds scaling * B(A(x)) beside each linear), at full and
at half strength (peft's ``scale_layer(0.5)``). Cadence merges the same file (LongLive's own format:
``generator_lora``, peft names) into its built, loaded model and runs the same pass.

Error measure: ||cadence - reference|| / ||reference||, float32 on the CPU; tolerance 1e-5, the issue's bound for
one forward pass (merged W + s B A vs peft's separate B(A(x)) differ only in float32 summation order). The LoRA
moves the output by 7e-2 (base vs LoRA), so the comparison tells a merged model from an unmerged one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from family_fixtures import frame_size, rel, tiny_model

from cadence.cache.naive import NaiveCache
from cadence.errors import ConfigError, InputError, WeightsError
from cadence.model.families import family_config, get_family
from cadence.model.lora import merge_lora_into, merge_loras, parse_lora_arg, read_lora_file
from cadence.model.weights import build_model, load_family_weights, load_weights

FIX = Path(__file__).parent / "fixtures" / "lora"
LORA = FIX / "longlive_lora_tiny.pt"
CKPT = Path(__file__).parent / "fixtures" / "self_forcing" / "self_forcing_tiny.pt"
META = json.loads((FIX / "fixture.json").read_text())
DATA = torch.load(FIX / "data.pt", weights_only=True)
C = META["config"]
ALPHA = META["lora"]["alpha"]
TINY_MODEL = tiny_model(C)
HW = frame_size(C)


def cfg_of(**model):
    return family_config("longlive", weights=str(CKPT), model=dict(TINY_MODEL, **model), stream=HW)


def base_model(cfg=None):
    cfg = cfg or cfg_of()
    model = build_model(cfg, "cpu", torch.float32, seed=None)
    load_family_weights(model, CKPT, get_family("longlive"))
    return model


def forward(model) -> torch.Tensor:
    cfg = model.cfg
    cache = NaiveCache.from_config(cfg, model)
    cache.begin_chunk(0, C["frames_per_block"])
    emb = torch.zeros(cfg.model.text_len, cfg.model.text_dim)
    e = DATA["prompt_embeds"]
    emb[: e.shape[0]] = e
    x = DATA["x"].permute(1, 0, 2, 3)  # reference [F, C, h, w] -> [C, F, h, w]
    with torch.no_grad():
        out = model.forward_chunk(
            x, torch.tensor([DATA["t"]]), model.prepare_text(emb[None]), None, cache, False
        )
    return out.permute(1, 0, 2, 3)


def test_fixture_base_is_the_self_forcing_weights():
    assert hashlib.sha256(CKPT.read_bytes()).hexdigest() == META["weights"]["sha256"]
    assert rel(forward(base_model()), DATA["base"]) <= 1e-5
    assert rel(DATA["base"], DATA["lora"]) > 1e-2  # the LoRA matters


@pytest.mark.parametrize(("scale", "ref"), [(1.0, "lora"), (0.5, "lora_half")])
def test_merged_lora_matches_longlive_peft(scale, ref):
    model = base_model()
    rep = merge_lora_into(model, LORA, scale=scale, alpha=ALPHA)
    assert rep["modules"] == META["lora"]["targets"] == 20 and rep["rank"] == [META["lora"]["rank"]]
    err = rel(forward(model), DATA[ref])
    assert err <= 1e-5, err


def test_kohya_names_with_alphas_through_the_config(tmp_path):
    """The same LoRA as a kohya / ComfyUI file (``diffusion_model.<module>.lora_down / lora_up``, ``.alpha``)
    given as ``--lora PATH:0.5`` in the config: merged by ``load_weights`` at half strength."""
    sd = read_lora_file(LORA)
    kohya = {}
    for k, t in sd.items():
        mod = k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        kohya[f"diffusion_model.{mod}.{'lora_down' if '.lora_A.' in k else 'lora_up'}.weight"] = t
        kohya[f"diffusion_model.{mod}.alpha"] = torch.tensor(ALPHA)
    f = tmp_path / "kohya.safetensors"
    from safetensors.torch import save_file

    save_file(kohya, str(f))
    cfg = cfg_of(lora=(f"{f}:0.5",))
    model = build_model(cfg, "cpu", torch.float32, seed=None)
    rep = load_weights(model, CKPT)
    assert rep["lora"][0]["scale"] == 0.5 and rep["lora"][0]["alpha"] == [ALPHA]
    assert rel(forward(model), DATA["lora_half"]) <= 1e-5


def test_diffusers_module_names(tmp_path):
    names = {
        "self_attn.q": "attn1.to_q",
        "self_attn.k": "attn1.to_k",
        "self_attn.v": "attn1.to_v",
        "self_attn.o": "attn1.to_out.0",
        "cross_attn.q": "attn2.to_q",
        "cross_attn.k": "attn2.to_k",
        "cross_attn.v": "attn2.to_v",
        "cross_attn.o": "attn2.to_out.0",
        "ffn.0": "ffn.net.0.proj",
        "ffn.2": "ffn.net.2",
    }
    out = {}
    for k, t in read_lora_file(LORA).items():
        mod, tail = k.removeprefix("base_model.model.").rsplit(".lora_", 1)
        blk, rest = mod.split(".", 2)[1], mod.split(".", 2)[2]
        out[f"transformer.blocks.{blk}.{names[rest]}.lora_{tail}"] = t
    model = base_model()
    merge_lora_into(model, out, alpha=ALPHA)
    assert rel(forward(model), DATA["lora"]) <= 1e-5


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, before) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_mismatches_fail_loudly_with_nothing_merged():
    good = read_lora_file(LORA)
    model = base_model()
    before = state(model)
    cases = {
        "no such linear": dict(
            good,
            **{"blocks.7.self_attn.q.lora_A.weight": torch.zeros(4, 64)},
            **{"blocks.7.self_attn.q.lora_B.weight": torch.zeros(64, 4)},
        ),
        "has only lora_A": {k: v for k, v in good.items() if not k.endswith("blocks.1.ffn.2.lora_B.weight")},
        "not LoRA factors": dict(good, **{"blocks.0.self_attn.q.diff": torch.zeros(64, 64)}),
        r"B @ A is \(64, 32\)": dict(
            good, **{"base_model.model.blocks.0.ffn.2.lora_A.weight": torch.zeros(4, 32)}
        ),
    }
    for what, sd in cases.items():
        with pytest.raises(WeightsError, match=r"nothing merged.*" + what):
            merge_lora_into(model, sd, source="bad")
        assert unchanged(model, before), what


def test_several_files_are_checked_before_any_merges(tmp_path):
    bad = dict(read_lora_file(LORA), **{"blocks.9.cross_attn.k.lora_A.weight": torch.zeros(4, 64)})
    f = tmp_path / "bad.pt"
    torch.save(bad, f)
    model = base_model()
    before = state(model)
    with pytest.raises(WeightsError, match="bad.pt"):
        merge_loras(model, [str(LORA), f"{f}:0.3"])
    assert unchanged(model, before)
    rep = merge_loras(
        model, [f"{LORA}:1", f"{LORA}:-1"], family=get_family("longlive")
    )  # +1 and -1: back to the base
    assert [r["alpha"] for r in rep] == [[4.0], [4.0]]  # no alphas in the file, rank 4 != LongLive's 256
    assert rel(forward(model), DATA["base"]) <= 1e-5


def test_family_alpha_applies_at_the_family_rank(tmp_path):
    sd = read_lora_file(LORA)
    f = tmp_path / "r4.pt"
    torch.save({"generator_lora": sd}, f)
    from dataclasses import replace

    from cadence.model import families

    fam = families.FAMILIES["longlive"]
    patched = replace(fam, checkpoint=replace(fam.checkpoint, lora_rank=4, lora_alpha=ALPHA))
    families.FAMILIES["longlive"] = patched
    try:
        model = base_model()
        assert merge_loras(model, [str(f)], family=get_family("longlive"))[0]["alpha"] == [ALPHA]
    finally:
        families.FAMILIES["longlive"] = fam
    assert rel(forward(model), DATA["lora"]) <= 1e-5


def test_parse_and_config_checks():
    assert parse_lora_arg("a/b.pt:0.5").scale == 0.5 and parse_lora_arg("a/b.pt").path == "a/b.pt"
    assert parse_lora_arg("C:/x/y.pt") == parse_lora_arg("C:/x/y.pt:1")
    with pytest.raises(InputError, match="finite"):
        parse_lora_arg("x.pt:nan")
    with pytest.raises(ConfigError, match="model.lora needs model.weights"):
        family_config("longlive", model=dict(lora=("x.pt",)))


def test_cli_lora_flag_reaches_the_config(tmp_path):
    import argparse

    from cadence.engine.flags import add_model_flags, spec_from_args

    p = argparse.ArgumentParser()
    add_model_flags(p)
    words = ["--model", "longlive", "--weights", str(CKPT), "--lora", f"{LORA}:0.25", "--lora", str(LORA)]
    got = spec_from_args(p.parse_args(words)).overrides
    assert got["model"]["lora"] == (f"{LORA.resolve()}:0.25", f"{LORA.resolve()}:1.0")
    assert got["model"]["weights"] == str(CKPT.resolve())
    with pytest.raises(InputError, match="no such file"):
        spec_from_args(p.parse_args(["--lora", str(tmp_path / "x.pt:2")]))
