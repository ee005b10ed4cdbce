"""Building the model on its device, random initialisation there, and checkpoint loading.

``build_model`` constructs on the ``meta`` device (no memory, no time), allocates directly on the
target device in the target dtype (norm weights, modulation tables and the timestep MLP stay
float32, as Wan keeps them) and initialises there with a seeded device generator: a W57 model is
ready on one H200 in seconds, never built on the CPU first.

``load_weights`` reads safetensors written with diffusers' ``WanTransformer3DModel`` names, the
original Wan names, or Cadence's own, maps them onto Cadence's modules (q/k/v fused into one
matrix, the patch convolution flattened into a linear) and fails with a message that lists
missing and unexpected keys and shape mismatches.

``load_family_weights`` reads a model family's own file (``cadence.model.families``): a Self-Forcing /
CausVid / LongLive ``.pt`` (a dict whose ``generator`` / ``generator_ema`` entry is the diffusion
wrapper's state dict: Wan's names under ``model.``, FSDP's ``_fsdp_wrapped_module.`` stripped), Krea's
safetensors (the same names), with a family's LoRA merged into the weights at load
(W + alpha/rank * B @ A). A file that is not the family's format fails before anything is loaded, with
one message naming the file, the family expected, what the file holds and which family it looks like.
``.pt`` files are read with ``weights_only=True`` (no code runs from a checkpoint).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cadence.config import CadenceConfig
from cadence.errors import WeightsError
from cadence.model.dit import WanDiT
from cadence.model.keymaps import _FUSED, KEY_MAPS  # noqa: F401 (KEY_MAPS: re-exported)

if TYPE_CHECKING:
    from cadence.model.families import ModelFamily

log = logging.getLogger(__name__)


def build_model(
    cfg: CadenceConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int | None = 0,
) -> WanDiT:
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


# ---- key maps: cadence.model.keymaps (shared with LoRA merging) ------------------------------------


def detect_format(keys) -> str:
    keys = set(keys)
    if any(k.startswith("condition_embedder.") or ".attn1." in k for k in keys):
        return "diffusers"
    if any(
        k.startswith(("time_projection.", "text_embedding.", "head.head.", "patch_embedding.")) for k in keys
    ):
        return "wan"
    return "cadence"


def convert_state_dict(
    sd: Mapping[str, torch.Tensor], fmt: str | None = None
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
def load_state_dict_into(
    model: WanDiT, sd: Mapping[str, torch.Tensor], fmt: str | None = None, allow_missing_audio: bool = True
) -> dict:
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
    mismatched = [
        f"{k}: checkpoint {tuple(conv[k].shape)} vs model {tuple(params[k].shape)}"
        for k in sorted(expected & set(conv))
        if tuple(conv[k].shape) != tuple(params[k].shape)
    ]
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
        log.info(
            "checkpoint has no audio-branch weights (%d keys); audio attention output zeroed",
            len(audio_missing),
        )
    return {"format": fmt, "loaded": len(conv), "audio_zeroed": zeroed}


def load_weights(
    model: WanDiT,
    path: str | Path,
    fmt: str | None = None,
    allow_missing_audio: bool = True,
    family: ModelFamily | None = None,
) -> dict:
    """Load one safetensors file, or a directory of them (sharded checkpoints), into `model`, as its registry
    entry ``family`` says (the recipe's ``EngineRecipe.entry``; default: the configuration's,
    ``families.entry_of``): a family reads its own format (:func:`load_family_weights`), a preset any
    safetensors names. The configuration's LoRA files (``ModelConfig.lora``) are then merged
    (``cadence.model.lora``). A family's multi-entry file reads ``ModelConfig.weights_entry``, else the
    family's default entry (``CheckpointFormat.default_entry``: what its authors' inference reads)."""
    if family is None:
        from cadence.model.families import entry_of

        family = entry_of(model.cfg)
    if family.kind == "family" and fmt is None:
        # the entry the configuration names, else the one the family's authors serve
        entry = model.cfg.model.weights_entry or family.checkpoint.default_entry
        rep = load_family_weights(model, path, family, entry=entry)
    else:
        rep = load_state_dict_into(model, _read_safetensors(Path(path)), fmt, allow_missing_audio)
    loras = getattr(model.cfg.model, "lora", ())
    if loras:  # the LoRA files of the config (--lora), merged into the loaded weights, all or nothing
        from cadence.model.lora import merge_loras

        rep["lora"] = merge_loras(model, loras, family if family.kind == "family" else None)
    return rep


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

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
    return sd


# ---- model families' own files --------------------------------------------------------------------

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def _kind(path: Path) -> str:
    if path.is_dir():
        return ".safetensors"
    return ".pt" if path.suffix.lower() in PICKLE_SUFFIXES else path.suffix.lower() or "(no suffix)"


def _read_any(path: Path) -> tuple[str, dict]:
    """(kind, top-level object) of a checkpoint file: '.pt' -> the unpickled dict (tensors and plain
    containers only), '.safetensors' (or a folder of them) -> the state dict."""
    if not path.exists():
        raise WeightsError(f"checkpoint {path} does not exist")
    kind = _kind(path)
    if kind == ".pt":
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # not a zip/pickle, or holds objects other than tensors and containers
            raise WeightsError(f"cannot read checkpoint {path} as a torch file: {e}") from None
        if not isinstance(obj, dict):
            raise WeightsError(f"checkpoint {path} holds a {type(obj).__name__}, not a dict of state dicts")
        return kind, obj
    if kind == ".safetensors":
        return kind, _read_safetensors(path)
    raise WeightsError(f"checkpoint {path}: unknown file kind {kind!r} (expected .pt / .pth or .safetensors)")


def _strip(key: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes:
        if p.startswith("_fsdp"):  # FSDP's wrapper may sit at any depth
            key = key.replace(p, "")
        elif key.startswith(p):
            key = key[len(p) :]
    return key


def describe_checkpoint(sd: Mapping[str, torch.Tensor]) -> dict:
    """What a (prefix-stripped) transformer state dict is: its key names and geometry (for messages and
    family detection): {names, dim, layers, in_channels, text_dim, ffn_dim}."""
    names = detect_format(sd.keys())
    out = {"names": names}
    pe = {
        "wan": "patch_embedding.weight",
        "diffusers": "patch_embedding.weight",
        "cadence": "patch_embed.weight",
    }
    w = sd.get(pe[names])
    if w is not None:
        out["dim"] = int(w.shape[0])
        out["in_channels"] = int(w.shape[1]) if w.ndim == 5 else None
    idx = [int(m.group(1)) for k in sd for m in [re.match(r"blocks\.(\d+)\.", k)] if m]
    out["layers"] = max(idx) + 1 if idx else 0
    ffn = {
        "wan": "blocks.0.ffn.0.weight",
        "diffusers": "blocks.0.ffn.net.0.proj.weight",
        "cadence": "blocks.0.ffn.fc1.weight",
    }.get(names)
    if ffn in sd:
        out["ffn_dim"] = int(sd[ffn].shape[0])
    return out


def _geometry(d: dict) -> str:
    ffn = f", ffn {d['ffn_dim']}" if d.get("ffn_dim") else ""
    return f"dim {d.get('dim')}, {d.get('layers')} layers{ffn}"


def guess_family(kind: str, top_keys, desc: dict) -> list[str]:
    """Families whose own file could be this one (kind, top-level keys of a '.pt', names and geometry at
    the family's default size). The 1.3B ``.pt`` families share one format: they come back together."""
    from cadence.model.families import family_config, list_families

    out = []
    for fam in list_families():
        ck = fam.checkpoint
        if kind not in ck.kinds or desc.get("names") != ck.names:
            continue
        if (
            kind == ".pt"
            and ck.state_keys
            and not set(top_keys) & set(ck.state_keys + ((ck.ema_key,) if ck.ema_key else ()))
        ):
            continue
        m = family_config(fam.name).model
        if desc.get("dim") == m.dim and desc.get("layers") == m.num_layers:
            out.append(fam.name)
    return out


def read_family_checkpoint(
    path: str | Path, family: ModelFamily, ema: bool = False, entry: str | None = None
) -> dict[str, torch.Tensor]:
    """The transformer state dict inside `family`'s own file at `path`, prefixes stripped (Wan's names),
    without its LoRA. ``entry`` names the '.pt' entry to read (one error listing the file's entries when it
    lacks it); without it, the EMA entry (``ema``) or the first of the family's ``state_keys`` found.
    Raises :class:`WeightsError` naming the file and the family when the file is not that family's format
    (wrong kind, no generator entry, other key names)."""
    return _read_family_entry(path, family, ema, entry)[0]


def _read_family_entry(
    path: str | Path, fam: ModelFamily, ema: bool, entry: str | None
) -> tuple[dict[str, torch.Tensor], str | None]:
    """:func:`read_family_checkpoint` and the entry it read (None: the file is one state dict)."""
    ck = fam.checkpoint
    path = Path(path)
    kind, obj = _read_any(path)
    where = f"checkpoint {path} (family {fam.name!r} expects {' or '.join(ck.kinds)}"
    if ".pt" in ck.kinds and ck.state_keys:
        where += f" with {' / '.join(ck.state_keys + ((ck.ema_key,) if ck.ema_key else ()))}"
    where += ")"

    def _fail(what: str, sd_for_guess: Mapping | None = None) -> WeightsError:
        hint = ""
        if sd_for_guess is not None:
            desc = describe_checkpoint(
                {_strip(k, ck.prefixes): v for k, v in sd_for_guess.items() if isinstance(v, torch.Tensor)}
            )
            guess = [
                g for g in guess_family(kind, obj.keys() if kind == ".pt" else (), desc) if g != fam.name
            ]
            hint = f"; it holds {desc['names']} names, {_geometry(desc)}"
            if guess:
                hint += f": it looks like {' / '.join(guess)}"
        return WeightsError(f"{where}: {what}{hint}")

    if kind not in ck.kinds:
        inner = obj
        if kind == ".pt":
            inner = next(
                (obj[k] for k in ("generator", "generator_ema", "model") if isinstance(obj.get(k), dict)), obj
            )
        raise _fail(f"it is a {kind} file", inner)
    if entry is not None and not (kind == ".pt" and ck.state_keys):
        raise WeightsError(f"{where}: weights entry {entry!r} asked for, but the file is one state dict")
    if kind == ".pt" and ck.state_keys:
        keys = (entry,) if entry is not None else (ck.ema_key,) if ema else ck.state_keys
        if ema and entry is None and not ck.ema_key:
            raise WeightsError(f"{where}: family {fam.name!r} has no EMA weights entry")
        found = next((k for k in keys if isinstance(obj.get(k), dict)), None)
        if found is None and entry is not None:
            has = ", ".join(sorted(str(k) for k, v in obj.items() if isinstance(v, dict))) or "none"
            raise WeightsError(f"{where}: no {entry!r} entry (--weights-entry); the entries it has: {has}")
        if found is None:
            top = ", ".join(sorted(map(str, obj.keys()))[:8]) or "nothing"
            lora_like = any(
                isinstance(v, dict) and any(".lora_" in kk for kk in v) for v in obj.values()
            ) or any(".lora_" in str(k) for k in obj)
            extra = " (this is a LoRA file: pass it as the LoRA)" if lora_like else ""
            raise WeightsError(f"{where}: no {' / '.join(keys)} entry; its top-level keys are {top}{extra}")
        raw = obj[found]
    else:
        raw, found = obj, None
    sd = {_strip(k, ck.prefixes): v for k, v in raw.items()}
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise WeightsError(f"{where}: entries that are not tensors: {_summarise(bad)}")
    names = detect_format(sd.keys())
    if names != ck.names:
        raise _fail(
            f"its keys are {names} names, not {ck.names} names (first keys: {_summarise(list(sd), 4)})", raw
        )
    return sd, found


def read_lora(path: str | Path, fam: ModelFamily) -> dict[str, torch.Tensor]:
    """The LoRA state dict of family ``fam`` (its registry entry) at `path` (a '.pt' holding it directly or
    under one of the family's ``lora_keys``; safetensors as is)."""
    if not fam.checkpoint.lora_rank:
        raise WeightsError(f"LoRA {path}: family {fam.name!r} has no LoRA")
    kind, obj = _read_any(Path(path))
    for k in fam.checkpoint.lora_keys:
        if kind == ".pt" and isinstance(obj.get(k), dict):
            obj = obj[k]
            break
    if not any(".lora_A" in str(k) for k in obj):
        raise WeightsError(
            f"LoRA {path} (family {fam.name!r}): no lora_A / lora_B weights; its first keys are "
            f"{_summarise(list(map(str, obj)), 4)}"
        )
    return obj


_LORA_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?(.+)\.lora_([AB])(?:\.[A-Za-z_]+)?\.weight$")


@torch.no_grad()
def merge_lora(
    sd: dict[str, torch.Tensor],
    lora: Mapping[str, torch.Tensor],
    rank: int,
    alpha: float,
    source: str = "LoRA",
) -> int:
    """Merge a peft-style LoRA (``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r],
    optionally under ``base_model.model.`` and with an adapter name) into the Wan-named weights `sd` in
    place: W += (alpha / rank) * B @ A, computed in float32. Returns how many matrices changed; raises
    :class:`WeightsError` on an unpaired factor, a module the weights lack, or a rank or shape that
    does not fit."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for k, t in lora.items():
        m = _LORA_KEY.match(_strip(str(k), ("_fsdp_wrapped_module.",)))
        if not m:
            unknown.append(str(k))
            continue
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} key(s) that are not lora_A / lora_B weights: {_summarise(unknown, 4)}"
        )
    scale = alpha / rank
    todo = []
    for mod, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"{mod} has only lora_{''.join(ab)}")
            continue
        w = sd.get(mod + ".weight")
        a, b = ab["A"], ab["B"]
        if w is None:
            problems.append(f"{mod}: no such weight in the base checkpoint")
        elif a.shape[0] != rank or b.shape[1] != rank:
            problems.append(f"{mod}: rank {a.shape[0]} / {b.shape[1]}, the family's LoRA has rank {rank}")
        elif (b.shape[0], a.shape[1]) != tuple(w.shape):
            problems.append(f"{mod}: B @ A is {(b.shape[0], a.shape[1])}, the weight is {tuple(w.shape)}")
        else:
            todo.append((mod, w, a, b))
    if problems:
        raise WeightsError(
            f"{source} does not fit the base weights: "
            + "; ".join(problems[:6])
            + (f" ... and {len(problems) - 6} more" if len(problems) > 6 else "")
        )
    for mod, w, a, b in todo:
        sd[mod + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return len(todo)


def load_family_weights(
    model: WanDiT,
    path: str | Path,
    family: ModelFamily,
    ema: bool = False,
    lora: str | Path | None = None,
    entry: str | None = None,
) -> dict:
    """Load ``family``'s own checkpoint (``family``: its registry entry) at `path` (and its LoRA file, merged)
    into `model`; ``entry`` / ``ema``
    pick a multi-entry file's state dict (:func:`read_family_checkpoint`). The model's geometry must match
    the file's (a Krea 14B file into a 1.3B model is refused with both geometries named). Returns the
    loader's report plus {family, file, entry, ema, lora_merged} (``entry``: the one read, None for a file
    that is one state dict)."""
    fam = family
    ck = fam.checkpoint
    sd, entry = _read_family_entry(path, fam, ema, entry)
    desc = describe_checkpoint(sd)
    m = model.cfg.model
    if (desc.get("dim"), desc.get("layers")) != (m.dim, m.num_layers):
        kind = _kind(Path(path))
        guess = guess_family(kind, ("generator",) if kind == ".pt" else (), desc)
        hint = f" (it looks like {' / '.join(guess)})" if guess and fam.name not in guess else ""
        raise WeightsError(
            f"checkpoint {path} (family {fam.name!r}): {_geometry(desc)}{hint}; the model is "
            f"dim {m.dim}, {m.num_layers} layers, ffn {m.ffn_dim}"
        )
    merged = 0
    if lora is not None:
        ck = fam.checkpoint
        merged = merge_lora(sd, read_lora(lora, fam), ck.lora_rank, ck.lora_alpha, source=f"LoRA {lora}")
    try:
        rep = load_state_dict_into(model, sd, fam.checkpoint.names, allow_missing_audio=True)
    except WeightsError as e:
        raise WeightsError(f"checkpoint {path} (family {fam.name!r}): {e}") from None
    read_ema = entry is not None and entry == ck.ema_key
    return dict(rep, family=fam.name, file=str(path), entry=entry, ema=read_ema, lora_merged=merged)


def save_weights(model: WanDiT, path: str | Path) -> None:
    """Write the model's weights as safetensors with Cadence's names."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(path))
