"""Building the model on its device, random initialisation there, and checkpoint loading.

``build_model`` constructs on the ``meta`` device (no memory, no time), allocates directly on the
target device in the target dtype (norm weights, modulation tables and the timestep MLP stay
float32, as Wan keeps them) and initialises there with a seeded device generator: a W57 model is
ready on one H200 in seconds, never built on the CPU first.

``load_weights`` reads safetensors written with diffusers' ``WanTransformer3DModel`` names, the
original Wan names, or Cadence's own, maps them onto Cadence's modules (q/k/v fused into one
matrix, the patch convolution flattened into a linear) and fails with a message that lists
missing and unexpected keys and shape mismatches.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from cadence.config import CadenceConfig
from cadence.errors import WeightsError
from cadence.model.dit import WanDiT

log = logging.getLogger(__name__)


def build_model(cfg: CadenceConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                seed: int | None = 0) -> WanDiT:
    """A WanDiT on `device` in `dtype`, randomly initialised there (seed None: left uninitialised,
    for loading a checkpoint next)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = WanDiT(cfg, device="meta", dtype=dtype)
    model = model.to_empty(device=device)
    model.rope.to(device)
    if seed is not None and device.type != "meta":
        init_random(model, seed)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random(model: WanDiT, seed: int = 0, only=None) -> None:
    """Random weights on the model's device: linears N(0, 1/fan_in), biases N(0, 0.02^2), norms 1/0,
    modulation tables N(0, 1/dim) (diffusers' init for them). `only(name)` restricts which."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if only is not None and not only(name):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("modulation"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        elif ".norm" in name or name.startswith("norm"):
            p.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "weight":
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)


# ---- key maps --------------------------------------------------------------------------------
# Each rule: (regex on a source key, cadence key template, slot in a fused group or None).
_FUSED = {"qkv": ("q", "k", "v"), "kv": ("k", "v")}

_DIFFUSERS: list[tuple[str, str, str | None]] = [
    (r"patch_embedding\.(weight|bias)", r"patch_embed.\1", None),
    (r"condition_embedder\.time_embedder\.linear_1\.(\w+)", r"time_embed.fc1.\1", None),
    (r"condition_embedder\.time_embedder\.linear_2\.(\w+)", r"time_embed.fc2.\1", None),
    (r"condition_embedder\.time_proj\.(\w+)", r"time_proj.\1", None),
    (r"condition_embedder\.text_embedder\.linear_1\.(\w+)", r"text_embed.fc1.\1", None),
    (r"condition_embedder\.text_embedder\.linear_2\.(\w+)", r"text_embed.fc2.\1", None),
    (r"blocks\.(\d+)\.attn1\.to_q\.(\w+)", r"blocks.\1.self_attn.qkv.\2", "q"),
    (r"blocks\.(\d+)\.attn1\.to_k\.(\w+)", r"blocks.\1.self_attn.qkv.\2", "k"),
    (r"blocks\.(\d+)\.attn1\.to_v\.(\w+)", r"blocks.\1.self_attn.qkv.\2", "v"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.(\w+)", r"blocks.\1.self_attn.out.\2", None),
    (r"blocks\.(\d+)\.attn1\.norm_(q|k)\.weight", r"blocks.\1.self_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.attn2\.to_q\.(\w+)", r"blocks.\1.cross_attn.q.\2", None),
    (r"blocks\.(\d+)\.attn2\.to_k\.(\w+)", r"blocks.\1.cross_attn.kv.\2", "k"),
    (r"blocks\.(\d+)\.attn2\.to_v\.(\w+)", r"blocks.\1.cross_attn.kv.\2", "v"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.(\w+)", r"blocks.\1.cross_attn.out.\2", None),
    (r"blocks\.(\d+)\.attn2\.norm_(q|k)\.weight", r"blocks.\1.cross_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.norm2\.(weight|bias)", r"blocks.\1.norm2.\2", None),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.(\w+)", r"blocks.\1.ffn.fc1.\2", None),
    (r"blocks\.(\d+)\.ffn\.net\.2\.(\w+)", r"blocks.\1.ffn.fc2.\2", None),
    (r"blocks\.(\d+)\.scale_shift_table", r"blocks.\1.modulation", None),
    (r"proj_out\.(\w+)", r"head.proj.\1", None),
    (r"scale_shift_table", r"head.modulation", None),
]

# The original Wan checkpoints (Wan-Video/Wan2.1 `wan/modules/model.py`). Note the swapped norm
# names: Wan's `norm3` is the affine norm before cross-attention (Cadence/diffusers `norm2`).
_WAN: list[tuple[str, str, str | None]] = [
    (r"patch_embedding\.(weight|bias)", r"patch_embed.\1", None),
    (r"time_embedding\.0\.(\w+)", r"time_embed.fc1.\1", None),
    (r"time_embedding\.2\.(\w+)", r"time_embed.fc2.\1", None),
    (r"time_projection\.1\.(\w+)", r"time_proj.\1", None),
    (r"text_embedding\.0\.(\w+)", r"text_embed.fc1.\1", None),
    (r"text_embedding\.2\.(\w+)", r"text_embed.fc2.\1", None),
    (r"blocks\.(\d+)\.self_attn\.(q|k|v)\.(\w+)", r"blocks.\1.self_attn.qkv.\3", "\\2"),
    (r"blocks\.(\d+)\.self_attn\.o\.(\w+)", r"blocks.\1.self_attn.out.\2", None),
    (r"blocks\.(\d+)\.self_attn\.norm_(q|k)\.weight", r"blocks.\1.self_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.cross_attn\.q\.(\w+)", r"blocks.\1.cross_attn.q.\2", None),
    (r"blocks\.(\d+)\.cross_attn\.(k|v)\.(\w+)", r"blocks.\1.cross_attn.kv.\3", "\\2"),
    (r"blocks\.(\d+)\.cross_attn\.o\.(\w+)", r"blocks.\1.cross_attn.out.\2", None),
    (r"blocks\.(\d+)\.cross_attn\.norm_(q|k)\.weight", r"blocks.\1.cross_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.norm3\.(weight|bias)", r"blocks.\1.norm2.\2", None),
    (r"blocks\.(\d+)\.ffn\.0\.(\w+)", r"blocks.\1.ffn.fc1.\2", None),
    (r"blocks\.(\d+)\.ffn\.2\.(\w+)", r"blocks.\1.ffn.fc2.\2", None),
    (r"blocks\.(\d+)\.modulation", r"blocks.\1.modulation", None),
    (r"head\.head\.(\w+)", r"head.proj.\1", None),
    (r"head\.modulation", r"head.modulation", None),
]

KEY_MAPS: dict[str, list[tuple[str, str, str | None]]] = {"diffusers": _DIFFUSERS, "wan": _WAN}


def detect_format(keys) -> str:
    keys = set(keys)
    if any(k.startswith("condition_embedder.") or ".attn1." in k for k in keys):
        return "diffusers"
    if any(k.startswith(("time_projection.", "text_embedding.", "head.head.")) for k in keys):
        return "wan"
    return "cadence"


def convert_state_dict(sd: Mapping[str, torch.Tensor], fmt: str | None = None
                       ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Source state dict -> (Cadence state dict, source keys no rule matched). Fused groups are
    concatenated in q, k, v order; a group with a missing part raises WeightsError."""
    fmt = fmt or detect_format(sd.keys())
    if fmt == "cadence":
        return dict(sd), []
    rules = [(re.compile(p + r"$"), tpl, slot) for p, tpl, slot in KEY_MAPS[fmt]]
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unmatched: list[str] = []
    for key, t in sd.items():
        for rx, tpl, slot in rules:
            mt = rx.match(key)
            if mt:
                dst = mt.expand(tpl)
                if slot is None:
                    out[dst] = t
                else:
                    groups.setdefault(dst, {})[mt.expand(slot)] = t
                break
        else:
            unmatched.append(key)
    for dst, parts in groups.items():
        order = _FUSED[dst.split(".")[-2]]
        missing = [p for p in order if p not in parts]
        if missing:
            raise WeightsError(f"checkpoint ({fmt} names) lacks the {'/'.join(missing)} part(s) of {dst}")
        if len({tuple(parts[p].shape[1:]) for p in order}) > 1 or len({parts[p].shape[0] for p in order}) > 1:
            shapes = ", ".join(f"{p} {tuple(parts[p].shape)}" for p in order)
            raise WeightsError(f"checkpoint ({fmt} names): the parts of {dst} differ in shape: {shapes}")
        out[dst] = torch.cat([parts[p] for p in order], dim=0)
    if "patch_embed.weight" in out and out["patch_embed.weight"].ndim == 5:
        out["patch_embed.weight"] = out["patch_embed.weight"].flatten(1)
    return out, unmatched


def _is_audio_key(k: str) -> bool:
    return k.startswith(("audio_embed.", "audio_pos")) or ".audio_attn." in k or ".norm_audio." in k


def _summarise(keys: list[str], n: int = 8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


@torch.no_grad()
def load_state_dict_into(model: WanDiT, sd: Mapping[str, torch.Tensor], fmt: str | None = None,
                         allow_missing_audio: bool = True) -> dict:
    """Load a (diffusers / Wan / Cadence) state dict into `model` in place, casting each tensor to
    the parameter's dtype and device. Returns a report {format, loaded, audio_zeroed}.

    Audio-branch weights (Cadence-only) may be missing when `allow_missing_audio`: the audio
    attention's output projection is then zeroed, so that branch adds nothing until trained.
    """
    fmt = fmt or detect_format(sd.keys())
    conv, unmatched = convert_state_dict(sd, fmt)
    params = dict(model.named_parameters())
    expected = set(params)
    missing = sorted(expected - set(conv))
    audio_missing = [k for k in missing if _is_audio_key(k)] if allow_missing_audio else []
    missing = [k for k in missing if k not in set(audio_missing)]
    unexpected = sorted(set(conv) - expected) + unmatched
    mismatched = [f"{k}: checkpoint {tuple(conv[k].shape)} vs model {tuple(params[k].shape)}"
                  for k in sorted(expected & set(conv)) if tuple(conv[k].shape) != tuple(params[k].shape)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {_summarise(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_summarise(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {_summarise(mismatched, 4)}")
    if problems:
        raise WeightsError(f"checkpoint ({fmt} names) does not fit the model: " + "; ".join(problems))
    for k, t in conv.items():
        p = params[k]
        p.copy_(t.to(device=p.device, dtype=p.dtype))
    zeroed = False
    if audio_missing:
        # give the whole branch defined values (the model may have been built uninitialised), then
        # zero its output projections so that the branch adds exactly nothing until trained
        init_random(model, seed=0, only=_is_audio_key)
        for blk in model.blocks:
            if blk.audio_attn is not None:
                blk.audio_attn.out.weight.zero_()
                blk.audio_attn.out.bias.zero_()
        zeroed = True
        log.info("checkpoint has no audio-branch weights (%d keys); audio attention output zeroed", len(audio_missing))
    return {"format": fmt, "loaded": len(conv), "audio_zeroed": zeroed}


def load_weights(model: WanDiT, path: str | Path, fmt: str | None = None, allow_missing_audio: bool = True) -> dict:
    """Load one safetensors file, or a directory of them (sharded checkpoints), into `model`."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise WeightsError(f"no safetensors checkpoint at {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for k in fh.keys():
                    sd[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightsError(f"cannot read checkpoint {f}: {e}") from None
    return load_state_dict_into(model, sd, fmt, allow_missing_audio)


def save_weights(model: WanDiT, path: str | Path) -> None:
    """Write the model's weights as safetensors with Cadence's names."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(path))
