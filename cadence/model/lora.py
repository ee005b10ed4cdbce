"""LoRA files merged into a built model, all or nothing: ``--lora PATH[:SCALE]``.

    model = build_model(cfg, "cuda", torch.bfloat16, seed=None)
    load_weights(model, cfg.model.weights)
    report = merge_lora_into(model, "lora.pt", scale=1.0)        # W += scale * (alpha / r) * B @ A

The LoRA is merged into the weights of an already built (and loaded) :class:`~cadence.model.dit.WanDiT`, in
place, by parameter name: nothing in the model's code knows about it, and the step afterwards is the plain
model's (no extra matmuls per pass). Applied before tensor parallelism or FP8 linears (the full-width float
weights); a sharded or converted model does not fit and is refused.

Files (``.safetensors``, or a torch ``.pt`` holding the state dict directly or under ``generator_lora`` /
``lora`` / ``state_dict``) and their key names, as the families' LoRAs are published:

* peft: ``[base_model.model.]<module>.lora_A[.<adapter>].weight`` [r, in] and ``lora_B`` [out, r] (LongLive's
  ``lora.pt``: ``generator_lora``, made by peft over LongLive's ``CausalWanModel``);
* kohya / ComfyUI: ``[diffusion_model.]<module>.lora_down.weight`` / ``lora_up.weight``, with an optional
  ``<module>.alpha`` scalar;
* ``<module>``: Wan's own module names (``blocks.0.self_attn.q``) or diffusers' (``blocks.0.attn1.to_q``,
  optionally under ``transformer.``), mapped onto Cadence's parameters with the weight loader's key maps
  (``cadence.model.weights``): q / k / v land in their rows of the fused ``qkv`` (``kv``) weight.

alpha: the file's ``<module>.alpha`` when present, else the ``alpha`` argument (a family's shipped LoRA:
``CheckpointFormat.lora_alpha``), else the rank (alpha / r = 1, the kohya convention for a file without
alphas). Every key is checked before any weight changes: an unknown key, an unpaired factor, a module the
model lacks, or a shape that does not fit raises :class:`WeightsError` naming the file and the problems, with
the model untouched. Computed in float32, cast back to each weight's dtype.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cadence.errors import InputError, WeightsError

if TYPE_CHECKING:
    import torch

_PREFIXES = ("base_model.model.", "diffusion_model.", "transformer.", "model.")
_FACTOR = re.compile(r"^(.+)\.(lora_A|lora_B|lora_down|lora_up)(?:\.[A-Za-z_][\w-]*)?\.weight$")
_ALPHA = re.compile(r"^(.+)\.alpha$")
_FILE_KEYS = ("generator_lora", "lora", "state_dict")


@dataclass(frozen=True)
class LoraSpec:
    """One ``--lora`` argument: the file and its strength."""

    path: str
    scale: float = 1.0


def parse_lora_arg(arg: str) -> LoraSpec:
    """``PATH[:SCALE]`` -> LoraSpec. The scale is what follows the last ':' when it reads as a number (so a
    path with colons still works); InputError when it is not finite."""
    path, sep, tail = arg.rpartition(":")
    if sep and path:
        try:
            scale = float(tail)
        except ValueError:
            return LoraSpec(arg, 1.0)
        if scale != scale or scale in (float("inf"), float("-inf")):
            raise InputError(f"--lora {arg}: the scale must be a finite number")
        return LoraSpec(path, scale)
    return LoraSpec(arg, 1.0)


def read_lora_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The LoRA state dict in `path` (see the module docstring for the containers)."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"LoRA {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path))
        else:
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsError(f"cannot read LoRA {path}: {e}") from None
    if isinstance(obj, Mapping):
        for k in _FILE_KEYS:
            if isinstance(obj.get(k), Mapping):
                obj = obj[k]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(
            f"LoRA {path}: not a state dict of tensors (nor one under {', '.join(_FILE_KEYS)})"
        )
    return dict(obj)


def _strip(key: str) -> str:
    key = key.replace("_fsdp_wrapped_module.", "")
    for p in _PREFIXES:
        if key.startswith(p):
            key = key[len(p) :]
    return key


def _target(module: str, params: Mapping[str, torch.Tensor]) -> tuple[str, int, int] | None:
    """A Wan / diffusers module name -> (Cadence parameter, part index, parts) of its weight."""
    from cadence.model.keymaps import _FUSED, KEY_MAPS

    key = module + ".weight"
    for rules in (KEY_MAPS["wan"], KEY_MAPS["diffusers"]):
        for pat, tpl, slot in rules:
            m = re.match(pat + r"$", key)
            if m:
                dst = m.expand(tpl)
                if dst not in params:
                    return None
                if slot is None:
                    return dst, 0, 1
                order = _FUSED[dst.split(".")[-2]]
                return dst, order.index(m.expand(slot)), len(order)
    if key in params:  # Cadence's own names
        return key, 0, 1
    return None


def _few(xs: list[str], n: int = 4) -> str:
    return ", ".join(xs[:n]) + (f" ... and {len(xs) - n} more" if len(xs) > n else "")


@dataclass
class _Plan:
    name: str
    scale: float
    todo: list  # (weight, rows, A, B, factor, alpha)

    def report(self) -> dict:
        return {
            "file": self.name,
            "scale": self.scale,
            "modules": len(self.todo),
            "rank": sorted({t[2].shape[0] for t in self.todo}),
            "alpha": sorted({t[5] for t in self.todo}),
        }


def plan_lora(
    model: torch.nn.Module,
    lora: str | Path | Mapping[str, torch.Tensor],
    scale: float = 1.0,
    default_alpha: tuple[int | None, float] | None = None,
    source: str | None = None,
) -> _Plan:
    """Check `lora` against `model` and return what merging it would do (nothing is changed).
    `default_alpha` = (rank, alpha): the alpha of a module without its own ``.alpha`` whose rank is that
    rank (None: any rank; a family's shipped LoRA, e.g. LongLive's (256, 256)); other modules without one
    use alpha = rank."""

    name = source or (str(lora) if isinstance(lora, (str, Path)) else "LoRA")
    sd = read_lora_file(lora) if isinstance(lora, (str, Path)) else dict(lora)
    params = dict(model.named_parameters())
    factors: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, float] = {}
    unknown: list[str] = []
    for k, t in sd.items():
        key = _strip(str(k))
        m = _FACTOR.match(key)
        if m:
            ab = "A" if m.group(2) in ("lora_A", "lora_down") else "B"
            if ab in factors.setdefault(m.group(1), {}):
                unknown.append(f"{k} (a second lora_{ab} for {m.group(1)}: several adapters)")
            factors[m.group(1)][ab] = t
            continue
        m = _ALPHA.match(key)
        if m and t.numel() == 1:
            alphas[m.group(1)] = float(t.float().reshape(()))
            continue
        unknown.append(str(k))
    problems: list[str] = []
    if unknown:
        problems.append(f"{len(unknown)} key(s) that are not LoRA factors: {_few(unknown)}")
    if not factors and not unknown:
        problems.append("no lora_A / lora_B (lora_down / lora_up) weights")
    orphans = sorted(set(alphas) - set(factors))
    if orphans:
        problems.append(f"alpha without factors: {_few(orphans)}")
    todo = []
    for mod, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"{mod} has only lora_{''.join(ab)}")
            continue
        a, b = ab["A"], ab["B"]
        tgt = _target(mod, params)
        if tgt is None:
            problems.append(f"{mod}: the model has no such linear")
            continue
        pname, part, parts = tgt
        w = params[pname]
        rows = w.shape[0] // parts
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            problems.append(f"{mod}: factors {tuple(a.shape)} / {tuple(b.shape)} do not pair")
        elif w.ndim != 2 or (b.shape[0], a.shape[1]) != (rows, w.shape[1]):
            part_of = f" part {part + 1}/{parts}" if parts > 1 else ""
            problems.append(
                f"{mod}: B @ A is {(b.shape[0], a.shape[1])}, the weight ({pname}{part_of}) is "
                f"{(rows, w.shape[1]) if w.ndim == 2 else tuple(w.shape)}"
            )
        else:
            r = a.shape[0]
            if mod in alphas:
                al = alphas[mod]
            elif default_alpha is not None and default_alpha[0] in (None, r):
                al = float(default_alpha[1])
            else:
                al = float(r)
            todo.append((w, slice(part * rows, (part + 1) * rows), a, b, scale * al / r, al))
    if problems:
        raise WeightsError(
            f"LoRA {name} does not fit the model (nothing merged): "
            + "; ".join(problems[:6])
            + (f" ... and {len(problems) - 6} more" if len(problems) > 6 else "")
        )
    return _Plan(name, scale, todo)


def apply_plans(plans: list[_Plan]) -> list[dict]:
    """Merge checked plans (:func:`plan_lora`) into their weights, in order."""
    import torch

    for plan in plans:
        try:
            with torch.no_grad():
                for w, rows, a, b, f, _ in plan.todo:
                    delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
                    w[rows] = (w[rows].float() + f * delta).to(w.dtype)
        except Exception as e:  # a device failure mid-way: the model must not be used
            raise WeightsError(
                f"LoRA {plan.name}: merging failed part-way ({type(e).__name__}: {e}); the model's weights "
                "are partly merged: discard it"
            ) from e
    return [p.report() for p in plans]


def merge_lora_into(
    model: torch.nn.Module,
    lora: str | Path | Mapping[str, torch.Tensor],
    scale: float = 1.0,
    alpha: float | None = None,
    source: str | None = None,
) -> dict:
    """Merge `lora` (a file or a state dict) into `model`'s weights in place: W += scale * (alpha / r) * B @ A
    per module; `alpha` for modules without their own ``.alpha`` (None: the rank). Every key is checked
    first; on any problem :class:`WeightsError` is raised with the model unchanged. Returns {file, scale,
    modules, rank, alpha}."""
    plan = plan_lora(model, lora, scale, None if alpha is None else (None, alpha), source)
    return apply_plans([plan])[0]


def merge_loras(model: torch.nn.Module, specs, family=None) -> list[dict]:
    """Merge every ``--lora`` spec (``PATH[:SCALE]`` strings or :class:`LoraSpec`) into `model`, all files
    checked before any weight changes. A family (its registry entry, ``cadence.model.families.ModelFamily``)
    that ships a LoRA (``CheckpointFormat.lora_rank``) gives the alpha of same-rank modules without their own."""
    default = None
    if family is not None:
        ck = family.checkpoint
        default = (ck.lora_rank, ck.lora_alpha) if ck.lora_rank else None
    parsed = [parse_lora_arg(s) if isinstance(s, str) else s for s in specs]
    plans = [plan_lora(model, s.path, s.scale, default) for s in parsed]
    return apply_plans(plans)
