"""The recipe of a benchmark of one part (``cadence bench step | cache | attention | fused | linears``): the
words go through the one engine-flag set (``cadence.engine.flags``) into an ``EngineSpec``, resolved by the recipe
(``cadence.engine.recipe.resolve``) like every other entry point, printed (``describe().text()``) and recorded
(``"recipe"`` in the JSON; ``"recipes"``, one per preset and TP size, for the benchmarks that sweep several).

    spec = part_spec(args, overrides={"stream": {"cache": "ring"}})   # the parsed flags of add_part_flags
    recipe = resolve(spec, "cuda:0")                                  # what these words build on this device

One resolution: a part benchmark's words mean what the same words mean to ``cadence serve`` (automatic options
on for CUDA, off on the CPU, one note per option that cannot apply), so a bare ``cadence bench step`` times
the step a bare ``cadence serve`` runs on that device. A benchmark that times another path says so in its
words (``--no-kv-fp8 --no-fp8``: the bf16 reference; ``--cache naive``: the baseline cache), never through a
default of its own.

Torch-free (parsing a benchmark's words never imports torch).
"""

from __future__ import annotations

from collections.abc import Mapping

from cadence.engine.flags import fast_path_from_args
from cadence.engine.recipe import EngineRecipe, EngineSpec
from cadence.engine.spec import FastPath


def part_spec(args, overrides: dict | None = None, fast: FastPath | None = None, **fixed) -> EngineSpec:
    """The ``EngineSpec`` of a part benchmark's words: ``--model`` / ``--preset`` (``args.model``), random
    weights, ``overrides`` (its geometry: layers, cache), ``fast`` (default: the fast-path flags as given,
    ``None`` = automatic), no warm-up."""
    return EngineSpec(
        model=args.model,
        overrides=dict(overrides or {}),
        fast=fast if fast is not None else fast_path_from_args(args),
        warmup=False,
        **fixed,
    )


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
