"""Bad checkpoints and checkpoints of another family: one clear WeightsError naming the file, the family
expected and what is wrong; LoRA merged at load equals the merged weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cadence.errors import WeightsError
from cadence.model.families import family_config, get_family
from cadence.model.weights import (
    build_model,
    load_family_weights,
    merge_lora,
    read_family_checkpoint,
    save_weights,
)

FIX = Path(__file__).parent / "fixtures" / "self_forcing"
CKPT = FIX / "self_forcing_tiny.pt"
TINY_MODEL = dict(
    dim=64, num_heads=2, head_dim=32, ffn_dim=128, num_layers=2, freq_dim=32, text_dim=32, text_len=8
)


def tiny_model(family="self-forcing", **model):
    cfg = family_config(family, model=dict(TINY_MODEL, **model), stream=dict(height=32, width=48))
    return build_model(cfg, "cpu", torch.float32, seed=None)


def generator_sd():
    return torch.load(CKPT, weights_only=True)["generator"]


def geometry_only(dim: int, layers: int) -> dict:
    """A state dict with just enough of a real family's geometry for detection (not loadable)."""
    return {
        "model.patch_embedding.weight": torch.zeros(dim, 16, 1, 2, 2, dtype=torch.bfloat16),
        f"model.blocks.{layers - 1}.self_attn.norm_q.weight": torch.zeros(dim, dtype=torch.bfloat16),
    }


def test_missing_file_names_file_and_family(tmp_path):
    with pytest.raises(WeightsError, match=r"does not exist"):
        load_family_weights(tiny_model(), tmp_path / "nope.pt", get_family("self-forcing"))


def test_krea_file_passed_as_self_forcing_is_detected(tmp_path):
    f = tmp_path / "krea-realtime-video-14b.safetensors"
    save_file(geometry_only(5120, 40), str(f))
    with pytest.raises(WeightsError) as e:
        load_family_weights(tiny_model(), f, get_family("self-forcing"))
    msg = str(e.value)
    assert (
        str(f) in msg
        and "'self-forcing' expects .pt with generator / model / generator_ema)" in msg
        and "it is a .safetensors file" in msg
    )
    assert "dim 5120, 40 layers" in msg and "looks like krea-14b" in msg


def test_self_forcing_file_passed_as_krea_is_detected(tmp_path):
    f = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator": geometry_only(1536, 30), "generator_ema": geometry_only(1536, 30)}, f)
    with pytest.raises(WeightsError) as e:
        load_family_weights(tiny_model("krea-14b"), f, get_family("krea-14b"))
    msg = str(e.value)
    assert "'krea-14b' expects .safetensors" in msg and "it is a .pt file" in msg
    assert "looks like self-forcing / causvid / longlive" in msg


def test_cadence_safetensors_passed_as_family(tmp_path):
    f = tmp_path / "dit.safetensors"
    save_weights(tiny_model(), f)
    with pytest.raises(
        WeightsError, match=r"expects \.pt with .*it is a \.safetensors file; it holds cadence names"
    ):
        load_family_weights(tiny_model(), f, get_family("self-forcing"))


def test_pt_without_generator_entry(tmp_path):
    f = tmp_path / "odd.pt"
    torch.save({"state": generator_sd(), "step": torch.tensor(3)}, f)
    with pytest.raises(WeightsError, match=r"no generator / model entry; its top-level keys are state, step"):
        load_family_weights(tiny_model(), f, get_family("self-forcing"))


def test_lora_file_passed_as_generator(tmp_path):
    f = tmp_path / "lora.pt"
    torch.save(
        {"generator_lora": {"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 64)}}, f
    )
    with pytest.raises(WeightsError, match=r"this is a LoRA file"):
        load_family_weights(tiny_model("longlive"), f, get_family("longlive"))


def test_diffusers_names_under_generator(tmp_path):
    f = tmp_path / "diffusers_inside.pt"
    torch.save(
        {
            "generator": {
                "model.condition_embedder.time_proj.weight": torch.zeros(4, 4),
                "model.blocks.0.attn1.to_q.weight": torch.zeros(4, 4),
            }
        },
        f,
    )
    with pytest.raises(WeightsError, match=r"its keys are diffusers names, not wan names"):
        read_family_checkpoint(f, get_family("self-forcing"))


def test_ema_of_a_family_without_ema():
    with pytest.raises(WeightsError, match=r"'causvid' has no EMA weights entry"):
        read_family_checkpoint(CKPT, get_family("causvid"), ema=True)


def test_missing_unexpected_and_misshaped_keys_in_one_message(tmp_path):
    sd = generator_sd()
    del sd["model.blocks.1.ffn.2.bias"]
    sd["model.blocks.0.extra.weight"] = torch.zeros(3)
    sd["model.blocks.0.cross_attn.o.weight"] = torch.zeros(64, 60)
    f = tmp_path / "broken.pt"
    torch.save({"generator": sd}, f)
    with pytest.raises(WeightsError) as e:
        load_family_weights(tiny_model(), f, get_family("self-forcing"))
    msg = str(e.value)
    assert str(f) in msg and "'self-forcing'" in msg
    assert "1 missing key(s): blocks.1.ffn.fc2.bias" in msg
    assert "1 unexpected key(s): blocks.0.extra.weight" in msg
    assert "blocks.0.cross_attn.out.weight: checkpoint (64, 60) vs model (64, 64)" in msg


def test_geometry_mismatch_names_both():
    with pytest.raises(WeightsError, match=r"dim 64, 2 layers, ffn 128; the model is dim 64, 3 layers"):
        load_family_weights(tiny_model(num_layers=3), CKPT, get_family("self-forcing"))


def _lora_for(sd: dict, rank: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, w in sd.items():
        if k.startswith("model.blocks.") and k.endswith(".weight") and w.ndim == 2:
            mod = k[len("model.") : -len(".weight")]
            out[f"base_model.model.{mod}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.1
            out[f"base_model.model.{mod}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.1
    return out


def test_lora_merged_at_load_equals_merged_weights(tmp_path):
    from dataclasses import replace

    import cadence.model.families as fams

    # a LongLive-format LoRA at a tiny rank: the family's rank and alpha, scaled down for the fixture
    fam = fams.FAMILIES["longlive"]
    small = replace(fam, checkpoint=replace(fam.checkpoint, lora_rank=4, lora_alpha=8.0))
    fams.FAMILIES["longlive-tiny-lora"] = replace(small, name="longlive-tiny-lora")
    try:
        sd = generator_sd()
        lora = _lora_for(sd, rank=4)
        lf = tmp_path / "lora.pt"
        torch.save({"generator_lora": lora}, lf)
        m = tiny_model("longlive")
        rep = load_family_weights(m, CKPT, get_family("longlive-tiny-lora"), lora=lf)
        n_linear = sum(1 for k in lora if k.endswith("lora_A.weight"))
        assert (
            rep["lora_merged"] == n_linear == 2 * (4 + 4 + 2)
        )  # per block: self q,k,v,o; cross q,k,v,o; ffn 0,2
        # the same by hand: W + alpha/rank * B @ A on the Wan-named weights
        w = sd["model.blocks.1.ffn.0.weight"]
        a, b = (
            lora["base_model.model.blocks.1.ffn.0.lora_A.weight"],
            lora["base_model.model.blocks.1.ffn.0.lora_B.weight"],
        )
        assert torch.allclose(m.blocks[1].ffn.fc1.weight, w + 2.0 * b @ a, atol=1e-6)
        q = sd["model.blocks.0.self_attn.k.weight"]
        a, b = (
            lora["base_model.model.blocks.0.self_attn.k.lora_A.weight"],
            lora["base_model.model.blocks.0.self_attn.k.lora_B.weight"],
        )
        assert torch.allclose(m.blocks[0].self_attn.qkv.weight[64:128], q + 2.0 * b @ a, atol=1e-6)
        # a LoRA of another rank is refused with the module named
        bad = tmp_path / "bad.pt"
        torch.save(_lora_for(sd, rank=3), bad)
        with pytest.raises(WeightsError, match=r"blocks\.0\..*rank 3 / 3, the family's LoRA has rank 4"):
            load_family_weights(tiny_model("longlive"), CKPT, get_family("longlive-tiny-lora"), lora=bad)
    finally:
        del fams.FAMILIES["longlive-tiny-lora"]


def test_merge_lora_refuses_unknown_modules_and_unpaired_factors():
    sd = {"blocks.0.self_attn.q.weight": torch.zeros(4, 4)}
    with pytest.raises(WeightsError, match=r"blocks\.0\.self_attn\.v: no such weight"):
        merge_lora(
            sd,
            {
                "blocks.0.self_attn.v.lora_A.weight": torch.zeros(2, 4),
                "blocks.0.self_attn.v.lora_B.weight": torch.zeros(4, 2),
            },
            2,
            2.0,
        )
    with pytest.raises(WeightsError, match=r"has only lora_A"):
        merge_lora(sd, {"blocks.0.self_attn.q.lora_A.default.weight": torch.zeros(2, 4)}, 2, 2.0)


def test_model_package_imports_downward_only():
    """cadence/model/ imports nothing above it (cache, quant, runtime, engine, parallel, serve, cli) and never
    torch.distributed; the one known exception is dit.py's forward_full using cache/full.py."""
    import ast

    root = Path(__file__).resolve().parents[1] / "cadence" / "model"
    above = (
        "cadence.cache",
        "cadence.quant",
        "cadence.runtime",
        "cadence.engine",
        "cadence.parallel",
        "cadence.serve",
        "cadence.cli",
        "cadence.bench",
        "cadence.train",
    )
    bad = []
    for f in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for n in names:
                if n.startswith("torch.distributed") or (
                    n.startswith(above) and not (f.name == "dit.py" and n == "cadence.cache.full")
                ):
                    bad.append(f"{f.name}: {n}")
    assert not bad, bad
