"""The recipe of a benchmark of one part (``cadence bench step | cache | attention | fused | linears``): the
words go through the one engine-flag set (``cadence.engine.flags``) into an ``EngineSpec``, resolved by the recipe
(``cadence.engine.recipe.resolve``) like every other entry point, printed (``describe().text()``) and recorded
(``"recipe"`` in the JSON; ``"recipes"``, one per preset and TP size, for the benchmarks that sweep several).

    spec = part_spec(args, overrides={"stream": {"cache": "ring"}})   # the parsed flags of add_part_flags
    recipe = part_recipe(spec, "cuda:0")                             # what these words build on this device

Two rules make a part benchmark keep the meaning its words always had (README, docs/perf, scripts/device_plans.toml):

* **FP8 is off unless asked** (:data:`OFF_UNLESS_ASKED`: ``kv_fp8``, ``fp8_linears``): a bare
  ``cadence bench step`` times the bf16 reference step, as it always did, where ``cadence serve`` on CUDA turns
  both on (``FastPath``'s ``None``). ``--kv-fp8`` / ``--fp8`` turn them on; a recorded command means what it
  meant when it was recorded.
* **On the CPU, what was asked runs**: ``FastPath.resolve`` turns the CUDA-only options off for a CPU *worker*
  (nothing to serve with them there); a benchmark on the CPU is the smoke test of the GPU's command, so the FP8
  K/V and FP8 linears asked for explicitly stay on (their CPU code paths: the reference fallbacks), with one note
  saying so, unless the family's rules exclude them (a clip stream, a context rebuild). CUDA graphs stay off on
  the CPU (nothing to capture); each benchmark logs its own line for that.

Torch-free (parsing a benchmark's words never imports torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from cadence.engine.flags import fast_path_from_args
from cadence.engine.recipe import EngineRecipe, EngineSpec, resolve
from cadence.engine.spec import FastPath
from cadence.model.families import KVStream

#: ``FastPath`` fields a part benchmark keeps off unless its words turn them on (``None`` -> False).
OFF_UNLESS_ASKED = ("kv_fp8", "fp8_linears")
#: CUDA-only fields that a CPU run of a part benchmark keeps when asked for explicitly (graphs: never).
KEPT_ON_CPU = ("kv_fp8", "fp8_linears")


def part_fast(args, **fixed) -> FastPath:
    """The ``FastPath`` of the parsed flags with :data:`OFF_UNLESS_ASKED` off where not given; ``fixed``: fields
    the benchmark decides itself (e.g. its own graphs rule)."""
    fast = fast_path_from_args(args)
    off = {k: False for k in OFF_UNLESS_ASKED if getattr(fast, k) is None}
    return dataclasses.replace(fast, **off, **fixed)


def part_spec(args, overrides: dict | None = None, fast: FastPath | None = None, **fixed) -> EngineSpec:
    """The ``EngineSpec`` of a part benchmark's words: ``--model`` / ``--preset`` (``args.model``), random
    weights, ``overrides`` (its geometry: layers, cache), ``fast`` (default :func:`part_fast`), no warm-up."""
    return EngineSpec(
        model=args.model,
        overrides=dict(overrides or {}),
        fast=fast if fast is not None else part_fast(args),
        warmup=False,
        **fixed,
    )


def part_recipe(spec: EngineSpec, device: str) -> EngineRecipe:
    """``resolve(spec, device)``; on the CPU, the options of :data:`KEPT_ON_CPU` asked for explicitly (True in
    ``spec.fast``) stay on where the family's rules allow them, their notes replaced by one that says so."""
    r = resolve(spec, str(device))
    if str(device).startswith("cuda"):
        return r
    kept = [k for k in KEPT_ON_CPU if getattr(spec.fast, k) is True and not getattr(r.fast, k)]
    if not kept or not isinstance(r.stream, KVStream) or r.rebuild is not None:
        return r
    fast = dataclasses.replace(r.fast, **{k: True for k in kept})
    if "fp8_linears" in kept:
        fast = dataclasses.replace(fast, gemm=spec.fast.gemm)
    cfg = r.config
    if "kv_fp8" in kept:
        cfg = cfg.with_overrides(stream={"cache": "ring", "kv_fp8": True})
    dropped = tuple(f"{k}:" for k in kept) + (("gemm:",) if "fp8_linears" in kept else ())
    notes = tuple(n for n in r.notes if not n.startswith(dropped)) + (
        f"{', '.join(kept)}: kept on {device}, as asked (a benchmark runs its words: the CPU code paths of the "
        "CUDA ones, a smoke test; its times mean nothing)",
    )
    return dataclasses.replace(r, fast=fast, config=cfg, notes=notes)


def recipe_fields(recipes: Mapping[str, EngineRecipe]) -> dict:
    """The JSON fields of the recipes a benchmark ran: ``{"recipe": ...}`` for one, ``{"recipes": {name: ...}}``
    for several (``name``: e.g. 'w57 tp4')."""
    described = {k: r.describe().as_dict() for k, r in recipes.items()}
    if len(described) == 1:
        return {"recipe": next(iter(described.values()))}
    return {"recipes": described}


def print_recipes(recipes: Mapping[str, EngineRecipe], out) -> None:
    """Each recipe's block (``describe().text()``) on ``out`` (a benchmark's stderr)."""
    for r in recipes.values():
        print(r.describe().text(), file=out)
