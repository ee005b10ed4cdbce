"""`cadence eval` (also `cadence bench eval`): the quality harness, lip sync and identity drift per configuration.

    cadence eval --preset tiny --clips 3 --reruns 2 --seconds 2 --drift-seconds 1 --no-record   # CPU, a minute
    cadence eval --preset character --device cuda                  # 50 held-out clips x 3 reruns, 60 s each
    cadence eval --preset w14 --weights dit.safetensors --configs reference,fp8_ring,fp8_ring_graphs
    torchrun --nproc_per_node 2 -m cadence eval --preset w14 ...  # adds the tensor-parallel configurations

Generates held-out synthetic clips under each configuration (``cadence.eval.harness.CONFIGS``: the
bf16 + naive-cache reference, FP8 + ring, + CUDA graphs, + TP fused), ``--reruns`` noise seeds per
clip, and reports per metric the mean and the rerun spread (range of the per-rerun clip-means), and a
verdict per configuration: it DIFFERS when |mean - reference mean| > max(both rerun spreads) on any
metric. A ground-truth row gives the metrics of the clips' own frames (the lip-sync ceiling). See
``cadence.eval.harness`` for the definitions. Results per docs/benchmarks.md (bench "eval"); a table last.

Under torchrun every rank runs every configuration (the same seeds, so the same numbers; the
tensor-parallel ones need all ranks); rank 0 prints and records.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_model_flags, spec_from_args
from cadence.errors import InputError, UsageParser


def _seconds_list(text: str) -> list[float]:
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds, got {text!r}") from None
    if not xs or any(not math.isfinite(x) or x <= 0 for x in xs):
        raise argparse.ArgumentTypeError(f"expected positive seconds, got {text!r}")
    return xs


def parse(argv: list[str], prog: str = "cadence bench eval") -> argparse.Namespace:
    from cadence.eval.harness import CONFIGS, DEFAULT_DRIFT_SECONDS

    p = UsageParser(
        prog=prog,
        description="Quality harness: lip sync and identity drift of held-out clips per engine "
        "configuration, with rerun spreads and verdicts against the reference.",
    )
    add_model_flags(p)  # --model / --preset, --weights (default: the model's own, else random from
    #                     --weights-seed), --weights-entry / --ema, the VAE and text files, --lora
    p.add_argument("--clips", type=int, default=50, help="held-out clips (default: 50)")
    p.add_argument(
        "--reruns", type=int, default=3, help="noise seeds per clip, >= 2: the spread needs two (default: 3)"
    )
    p.add_argument(
        "--seconds", type=float, default=None, help="seconds per clip (default: the largest --drift-seconds)"
    )
    p.add_argument(
        "--drift-seconds",
        type=_seconds_list,
        default=list(DEFAULT_DRIFT_SECONDS),
        help="comma list: identity measured this far into each stream (default: 1,10,60)",
    )
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma list of {', '.join(CONFIGS)} (default: all; the reference always runs)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu | cuda | cuda:N (default: cuda if available; under torchrun each rank's own GPU)",
    )
    p.add_argument(
        "--speech",
        default="synthetic",
        choices=("synthetic", "espeak"),
        help="clip speech: synthetic, or espeak-ng sentences (default: synthetic)",
    )
    p.add_argument("--prompt", default=None, help="text prompt (default: the harness's)")
    p.add_argument(
        "--split-seed", type=int, default=0, help="seed of the held-out split: which test clips (default: 0)"
    )
    p.add_argument("--noise-seed", type=int, default=0, help="rerun r uses noise seed N + r (default: 0)")
    p.add_argument(
        "--weights-seed", type=int, default=0, help="random weights' seed, without --weights (default: 0)"
    )
    add_record_flags(p)
    a = p.parse_args(argv)
    if a.clips < 1:
        p.error(f"--clips must be >= 1, got {a.clips}")
    if a.reruns < 2:
        p.error(f"--reruns must be >= 2 (the rerun spread needs two runs), got {a.reruns}")
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        p.error(f"unknown configuration(s) {bad or a.configs!r}; known: {', '.join(CONFIGS)}")
    a.configs = list(dict.fromkeys(names))
    a.seconds = a.seconds if a.seconds is not None else max(a.drift_seconds)
    if not (a.seconds > 0 and math.isfinite(a.seconds)):
        p.error(f"--seconds must be positive, got {a.seconds}")
    late = [s for s in a.drift_seconds if s > a.seconds]
    if late:
        p.error(
            f"--drift-seconds {','.join(f'{s:g}' for s in late)} is past the end of a {a.seconds:g} s clip "
            "(raise --seconds)"
        )
    return a


def preset_weights(cfg) -> str | None:
    """Weights a preset declares (``cfg.weights`` or ``cfg.model.weights``, e.g. the packaged default
    character's), if any."""
    from cadence.config import resolve_asset

    w = cfg.model.weights
    return resolve_asset(w) if w else None


def _progress(line: str) -> None:
    print(f"[eval] {line}", file=sys.stderr, flush=True)


def table(results: dict) -> list[str]:
    """The short table: one row per configuration, mean +- spread per metric, then the verdict."""
    metrics = results["metrics"]
    heads = ["config"] + [m.replace("lipsync_", "").replace("_frames", "") for m in metrics] + ["verdict"]
    rows = []
    for name, c in results["configs"].items():
        if "skipped" in c:
            rows.append([name] + ["-"] * len(metrics) + [c["verdict"]])
            continue
        cells = []
        for m in metrics:
            v = c.get(m)
            cells.append(
                "n/a"
                if v is None
                else f"{v['mean']:.3f} ±{v['rerun_spread']:.3f}" + ("*" if v.get("differs") else "")
            )
        verdict = c["verdict"] + (f" [{c['effective']}]" if c.get("effective", "eager") != "eager" else "")
        rows.append([name, *cells, verdict])
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads) - 1)]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths)) + "  " + r[-1] for r in [heads, *rows]]


def main(argv: list[str] | None = None, prog: str = "cadence bench eval") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv, prog)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    import logging
    import os

    import torch

    from cadence.engine.recipe import entry_for, resolve
    from cadence.eval import harness

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    spec = spec_from_args(args, seed=args.weights_seed)  # files checked, one clear error for a bad name
    cfg = entry_for(spec.config(), spec.weights_entry)[0]  # what each harness setting starts from
    weights = preset_weights(cfg)
    if args.speech == "espeak":
        import shutil

        if shutil.which("espeak-ng") is None:
            raise InputError("--speech espeak needs espeak-ng on PATH (apt-get install espeak-ng)")
    info = None
    if int(os.environ.get("WORLD_SIZE") or 1) >= 2:
        from cadence.parallel import init_tp

        info = init_tp(backend="gloo" if args.device == "cpu" else None)
        device = info.device
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"--device {args.device} requested but CUDA is not available")
    rank0 = info is None or info.rank == 0
    progress = _progress if rank0 else None
    recipe = resolve(spec, str(device))  # the engine the words build here (each harness setting: its own)
    if rank0:
        print(recipe.describe().text(), file=sys.stderr)
    try:
        if progress:
            progress(
                f"{cfg.name} on {device}: {args.clips} held-out clips x {args.seconds:g} s, {args.reruns} reruns, "
                f"configurations {', '.join(args.configs)}; weights: {weights or 'random'}"
            )
        clips = harness.prepare_clips(
            cfg, args.clips, args.seconds, args.drift_seconds, args.speech, args.split_seed, progress
        )
        results = harness.evaluate(
            cfg,
            args.configs,
            clips,
            args.reruns,
            device,
            args.drift_seconds,
            weights=weights,
            weights_seed=args.weights_seed,
            noise_seed=args.noise_seed,
            prompt=args.prompt or harness.PROMPT,
            progress=progress,
        )
    finally:
        if info is not None:
            from cadence.parallel import destroy_tp

            destroy_tp()
    if not rank0:
        return 0
    results["speech"] = args.speech
    results["split_seed"] = args.split_seed
    if not args.no_record:
        _record(args, argv, prog, cfg, device, info, results, recipe)
    print(
        f"eval: {cfg.name}, {args.clips} clips x {args.seconds:g} s, {args.reruns} reruns "
        "(mean ±rerun spread; * = differs from the reference by more than the spread)"
    )
    for line in table(results):
        print("  " + line)
    return 0


def _record(args, argv, prog: str, cfg, device, info, results: dict, recipe) -> None:
    """The JSON record (docs/benchmarks.md bench "eval", with the recipe of the words) and its README line."""
    from cadence.bench.common import record
    from cadence.eval import harness

    world = info.world_size if info is not None else 1
    verdicts = "; ".join(
        f"{n}: {c['verdict']}"
        for n, c in results["configs"].items()
        if n not in (harness.GROUND_TRUTH, harness.REFERENCE)
    )
    path = record(
        "eval",
        cfg.name,
        world,
        device,
        cfg.shape_summary(),
        results,
        variant=args.speech,
        out_dir=results_dir(args),
        world=world,
        command=prog + " " + " ".join(map(shlex.quote, argv)),
        extra={"recipe": recipe.describe().as_dict()},
        headline=f"lipsync corr reference {results['lipsync_corr_reference']:.3f} (ground truth "
        f"{results['lipsync_corr_ground_truth']:.3f}), {args.clips} clips x {args.reruns} reruns; {verdicts}",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
