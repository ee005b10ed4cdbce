"""`cadence bench cache`: the naive cache against the ring cache, in one run, on one model.

    cadence bench cache --preset w57 --layers 48
    cadence bench cache --preset w14

Measures, with the same random weights and inputs: the steady-state chunk step with the naive cache
(bf16, the launch baseline), the ring cache with bf16 K/V (torch SDPA over the ring as it lies) and
the ring cache with FP8 K/V (Triton FP8 attention kernel): step time, cache upkeep and attention per
step (CUDA-event regions), cache memory; and, at the same attention shape, cuDNN bf16 SDPA against
the FP8 and bf16 ring kernels (TFLOP/s, relative error against a float64 reference). JSON per
BENCHMARKS.md under docs/perf/cache/.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from cadence.bench.attention import run_shape, summarise
from cadence.bench.common import median, print_table, record
from cadence.bench.results import add_record_flags, results_dir
from cadence.bench.step import DTYPES, layers_that_fit, measure_step
from cadence.config import get_preset


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, default=None, help="layers to run (scaled to the preset's count)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--attn-iters", type=int, default=30)
    p.add_argument(
        "--attention",
        default="auto",
        help="the ring's attention backend (FastPath.attention: cadence.kernels.attention_backends)",
    )
    add_record_flags(p)
    return p.parse_args(argv)


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    from cadence.model.weights import build_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    full = get_preset(args.preset)
    layers = min(args.layers or layers_that_fit(full, dtype, device), full.model.num_layers)
    scale = full.model.num_layers / layers
    base = full.with_overrides(model={"num_layers": layers})
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    iters = args.iters if args.iters is not None else (10 if device.type == "cuda" else 3)
    m = full.model
    print(
        f"[bench cache] {full.name}: attention at {m.num_heads} heads x {full.tokens_per_chunk} q x "
        f"{full.kv_tokens} kv",
        file=sys.stderr,
    )
    opts = argparse.Namespace(sweep=False, iters=args.attn_iters, seed=0, shape_budget_s=600.0)
    attn = run_shape(args.preset, 1, device, opts, log=lambda s: print(s, file=sys.stderr))
    print(f"[bench cache] steps: {layers}/{m.num_layers} layers, {dtype}", file=sys.stderr)
    model = build_model(base, device, dtype, seed=0)
    variants = {
        "naive": {"cache": "naive", "kv_fp8": False},
        "ring_bf16": {"cache": "ring", "kv_fp8": False, "attention": args.attention},
        "ring_fp8": {"cache": "ring", "kv_fp8": True, "attention": args.attention},
    }
    steps: dict[str, dict] = {}
    for name, st in variants.items():
        cfg = base.with_overrides(stream=st)
        r = measure_step(cfg, model, device, warmup, iters)
        step = median(r["times"]) * scale
        steps[name] = {
            "step_ms": step,
            "cache_upkeep_ms": r["region"]["cache"] * scale,
            "attention_ms": r["region"]["attention"] * scale,
            "linear_ms": r["region"]["linear"] * scale,
            "instrumented_step_ms": median(r["totals"]) * scale,
            "cache_mem_gib": r["cache_bytes"] * scale / 2**30,
            "host_sync_in_step": r["host_sync"],
        }
        if device.type == "cuda":
            torch.cuda.empty_cache()
    nv, rb, rf = steps["naive"], steps["ring_bf16"], steps["ring_fp8"]
    cud = attn["best"].get("sdpa_cudnn_bf16")
    best8 = attn["best"].get("triton_fp8")
    results = {
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
        "layers_full": m.num_layers,
        "scaled": scale != 1.0,
        "dtype": str(dtype).replace("torch.", ""),
    }
    rows = summarise(attn) + [
        (
            "step naive / ring bf16 / ring fp8",
            f"{nv['step_ms']:.1f} / {rb['step_ms']:.1f} / {rf['step_ms']:.1f} ms"
            + (" (scaled)" if scale != 1 else ""),
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
    print_table(rows, f"bench cache: {full.name} ({layers}/{m.num_layers} layers)")
    if not args.no_record:
        path = record(
            "cache",
            full.name,
            1,
            device,
            full.shape_summary(),
            results,
            out_dir=results_dir(args),
            command=args.command,
            headline=f"step naive {nv['step_ms']:.0f} -> ring bf16 {rb['step_ms']:.0f} / fp8 "
            f"{rf['step_ms']:.0f} ms; upkeep {nv['cache_upkeep_ms']:.1f} -> "
            f"{rb['cache_upkeep_ms']:.1f} / {rf['cache_upkeep_ms']:.1f} ms; FP8 kernel "
            f"{results['attn_speedup_vs_cudnn_bf16'] or 0:.2f}x cuDNN bf16",
        )
        print(f"wrote {path}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.command = "cadence bench cache " + " ".join(shlex.quote(a) for a in argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
