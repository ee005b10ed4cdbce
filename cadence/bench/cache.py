"""`cadence bench cache`: the naive cache against the ring cache, in one run, on one model.

    cadence bench cache --preset w57 --layers 48
    cadence bench cache --preset w14

Measures, with the same random weights and inputs: the steady-state chunk step with the naive cache
(bf16, the launch baseline), the ring cache with bf16 K/V (torch SDPA over the ring as it lies) and
the ring cache with FP8 K/V (Triton FP8 attention kernel): step time, cache upkeep and attention per
step (CUDA-event regions), cache memory; and, at the same attention shape, cuDNN bf16 SDPA against
the FP8 and bf16 ring kernels (TFLOP/s, relative error against a float64 reference). JSON per
docs/benchmarks.md under docs/perf/cache/.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

import torch

from cadence.bench.attention import run_shape, summarise
from cadence.bench.common import median, print_table, record
from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_fast_path_flags, add_model_flags

#: The three caches timed: the stream overrides and FastPath fields of each (FP8 K/V asked for by name).
VARIANTS = {
    "naive": ({"cache": "naive"}, {"kv_fp8": False}),
    "ring_bf16": ({"cache": "ring"}, {"kv_fp8": False}),
    "ring_fp8": ({"cache": "ring"}, {"kv_fp8": True}),
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The benchmark's own flags, then ``--model`` / ``--preset``, ``--dtype`` and ``--attention`` (the ring's
    backend) from the one engine-flag set."""
    p = argparse.ArgumentParser(prog="cadence bench cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="layers to run (scaled to the preset's count)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--attn-iters", type=int, default=30)
    add_record_flags(p)
    add_model_flags(p, default="tiny", files=False)
    add_fast_path_flags(p, only=("dtype", "attention"))
    return p.parse_args(argv)


def variant_recipes(args, device: torch.device, layers: int | None) -> dict:
    """Each cache's recipe (``cadence.bench.recipes``): the words' model, dtype and attention backend, the
    variant's cache and FP8 K/V, and what this benchmark compares them on, stated per variant: no FP8 linears,
    no graphs (eager steps)."""
    from cadence.bench.recipes import part_spec
    from cadence.engine.flags import fast_path_from_args
    from cadence.engine.recipe import resolve

    over = {"model": {"num_layers": layers}} if layers else {}
    out = {}
    for name, (stream, fast) in VARIANTS.items():
        f = dataclasses.replace(fast_path_from_args(args), graphs=False, fp8_linears=False, **fast)
        out[name] = resolve(part_spec(args, {**over, "stream": stream}, f), str(device))
    return out


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    from cadence.bench.step import layers_that_fit
    from cadence.model.weights import build_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    full = variant_recipes(args, device, None)["naive"]
    dtype = getattr(torch, full.fast.dtype)
    m = full.config.model
    layers = min(args.layers or layers_that_fit(full.config, dtype, device), m.num_layers)
    recipes = variant_recipes(args, device, layers)
    print(recipes["ring_fp8"].describe().text(), file=sys.stderr)
    print(
        f"[bench cache] {full.config.name}: attention at {m.num_heads} heads x {full.config.tokens_per_chunk} q "
        f"x {full.config.kv_tokens} kv",
        file=sys.stderr,
    )
    opts = argparse.Namespace(sweep=False, iters=args.attn_iters, seed=0, shape_budget_s=600.0)
    attn = run_shape(args.model, 1, device, opts, log=lambda s: print(s, file=sys.stderr), cfg=full.config)
    print(f"[bench cache] steps: {layers}/{m.num_layers} layers, {dtype}", file=sys.stderr)
    model = build_model(recipes["naive"].config, device, dtype, seed=0)
    steps = time_steps(recipes, model, device, args, m.num_layers / layers)
    results = summary(steps, attn, layers, m.num_layers, dtype)
    print_table(
        _rows(results, steps, attn), f"bench cache: {full.config.name} ({layers}/{m.num_layers} layers)"
    )
    if not args.no_record:
        _record(args, full.config, recipes, results, device)
    return results


def time_steps(recipes: dict, model, device: torch.device, args, scale: float) -> dict[str, dict]:
    """The steady-state step of each cache on one model (``bench step``'s ``measure_step``), scaled to all
    layers: step, cache upkeep, attention and linears per step (CUDA-event regions), cache memory."""
    from cadence.bench.step import measure_step

    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    iters = args.iters if args.iters is not None else (10 if device.type == "cuda" else 3)
    steps: dict[str, dict] = {}
    for name, recipe in recipes.items():
        r = measure_step(recipe.config, model, device, warmup, iters)
        steps[name] = {
            "step_ms": median(r["times"]) * scale,
            "cache_upkeep_ms": r["region"]["cache"] * scale,
            "attention_ms": r["region"]["attention"] * scale,
            "linear_ms": r["region"]["linear"] * scale,
            "instrumented_step_ms": median(r["totals"]) * scale,
            "cache_mem_gib": r["cache_bytes"] * scale / 2**30,
            "host_sync_in_step": r["host_sync"],
        }
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return steps


def summary(steps: dict, attn: dict, layers: int, layers_full: int, dtype: torch.dtype) -> dict:
    """The JSON's ``results`` (docs/benchmarks.md bench "cache")."""
    nv, rb, rf = steps["naive"], steps["ring_bf16"], steps["ring_fp8"]
    cud = attn["best"].get("sdpa_cudnn_bf16")
    best8 = attn["best"].get("triton_fp8")
    return {
        "upkeep_naive_ms": nv["cache_upkeep_ms"],
        "upkeep_ring_ms": rf["cache_upkeep_ms"],
        "upkeep_ring_bf16_ms": rb["cache_upkeep_ms"],
        "attn_naive_ms": nv["attention_ms"],
        "attn_ring_ms": rf["attention_ms"],
        "attn_ring_bf16_ms": rb["attention_ms"],
        "upkeep_share": rf["cache_upkeep_ms"] / rf["step_ms"],
        "upkeep_share_ring_bf16": rb["cache_upkeep_ms"] / rb["step_ms"],
        "step_naive_ms": nv["step_ms"],
        "step_ring_bf16_ms": rb["step_ms"],
        "step_ring_fp8_ms": rf["step_ms"],
        "step_speedup_ring_bf16": nv["step_ms"] / rb["step_ms"],
        "step_speedup_ring_fp8": nv["step_ms"] / rf["step_ms"],
        "cache_mem_gib": {k: v["cache_mem_gib"] for k, v in steps.items()},
        "attn_cudnn_bf16_ms": cud["ms"] if cud else None,
        "attn_fp8_kernel_ms": best8["ms"] if best8 else None,
        "attn_speedup_vs_cudnn_bf16": (cud["ms"] / best8["ms"]) if cud and best8 else None,
        "rel_err_fp8": best8["rel_err"] if best8 else None,
        "rel_err_cudnn_bf16": cud["rel_err"] if cud else None,
        "attention_variants": attn,
        "steps": steps,
        "layers_run": layers,
        "layers_full": layers_full,
        "scaled": layers != layers_full,
        "dtype": str(dtype).replace("torch.", ""),
    }


def _rows(results: dict, steps: dict, attn: dict) -> list[tuple[str, str]]:
    nv, rb, rf = steps["naive"], steps["ring_bf16"], steps["ring_fp8"]
    return summarise(attn) + [
        (
            "step naive / ring bf16 / ring fp8",
            f"{nv['step_ms']:.1f} / {rb['step_ms']:.1f} / {rf['step_ms']:.1f} ms"
            + (" (scaled)" if results["scaled"] else ""),
        ),
        (
            "upkeep naive / ring bf16 / ring fp8",
            f"{nv['cache_upkeep_ms']:.1f} / {rb['cache_upkeep_ms']:.1f} / {rf['cache_upkeep_ms']:.1f} ms  "
            f"(ring fp8 share {results['upkeep_share']:.1%})",
        ),
        (
            "attention naive / ring bf16 / ring fp8",
            f"{nv['attention_ms']:.1f} / {rb['attention_ms']:.1f} / {rf['attention_ms']:.1f} ms",
        ),
        ("cache memory", ", ".join(f"{k} {v:.1f} GiB" for k, v in results["cache_mem_gib"].items())),
        ("host sync in step", ", ".join(f"{k} {v['host_sync_in_step']}" for k, v in steps.items())),
    ]


def _record(args, full, recipes: dict, results: dict, device: torch.device) -> None:
    """The JSON record, with the recipe of each cache (``recipes``: naive, ring_bf16, ring_fp8)."""
    from cadence.bench.recipes import recipe_fields

    s = results["steps"]
    nv, rb, rf = s["naive"], s["ring_bf16"], s["ring_fp8"]
    path = record(
        "cache",
        full.name,
        1,
        device,
        full.shape_summary(),
        results,
        out_dir=results_dir(args),
        command=args.command,
        extra=recipe_fields(recipes),
        headline=f"step naive {nv['step_ms']:.0f} -> ring bf16 {rb['step_ms']:.0f} / fp8 "
        f"{rf['step_ms']:.0f} ms; upkeep {nv['cache_upkeep_ms']:.1f} -> "
        f"{rb['cache_upkeep_ms']:.1f} / {rf['cache_upkeep_ms']:.1f} ms; FP8 kernel "
        f"{results['attn_speedup_vs_cudnn_bf16'] or 0:.2f}x cuDNN bf16",
    )
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.command = "cadence bench cache " + " ".join(shlex.quote(a) for a in argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
