"""`cadence eval` (also `cadence bench eval`): lip sync and drift of held-out clips per engine configuration.

    cadence eval --model tiny --clips 2 --reruns 2 --seconds 2 --device cpu --no-record --png eval.png  # a minute
    cadence eval --device cuda                                 # the shipped character, 50 clips x 8 s x 3 reruns
    cadence eval --model self-forcing --weights self_forcing_dmd.pt --vae-weights Wan2.1_VAE.pth --clips 8 \\
        --configs reference,fp8_ring,fp8_ring_graphs --long 120 --images astronaut
    cadence eval --configs attention --device cuda --long 60   # reference vs per-token vs per-head FP8 attention
    torchrun --nproc_per_node 2 -m cadence eval --model w14 ...  # adds the tensor-parallel configurations
    cadence eval --measure-check --clips 20 --seconds 4 --size 256 --character-streams 8   # the measure itself

Streams held-out clips (``cadence.eval.clips``: synthetic faces never trained on, ``--images``, speech from
``--speech``) through each configuration (``cadence.eval.harness.CONFIGS``; ``--configs attention`` is the
per-head judgement: ``reference,ring_token,ring_fa3,ring_triton_head``), ``--reruns`` noise seeds per clip;
per stream the lip-sync offset (frames, > 0: audio late) and confidence from face landmarks, and the drift
of identity, colour and sharpness (``cadence.eval.measure``). Reports per metric the mean and the rerun
spread, and a verdict per configuration against the reference; ``--long SECONDS`` adds streams that long
for the drift curves. The JSON (docs/benchmarks.md bench "eval") gets a PNG beside it (``cadence.eval.report``).

``--measure-check`` checks the measure instead (``cadence.eval.validate``): known audio shifts on synthetic
faces and character streams, confidence of matched against mismatched audio and silence, and its runtime.

Under torchrun every rank runs every configuration (the same seeds, so the same numbers; the tensor-parallel
ones need all ranks); rank 0 prints and records.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_model_flags, spec_from_args
from cadence.errors import InputError, UsageParser


def _positive(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return x


def _add_run_flags(p) -> None:
    from cadence.eval.harness import ATTENTION_CONFIGS, CONFIGS

    p.add_argument(
        "--clips", type=int, default=None, help="held-out synthetic faces (default: 50; measure check: 20)"
    )
    p.add_argument(
        "--reruns", type=int, default=3, help="noise seeds per clip, >= 2: the spread needs two (default: 3)"
    )
    p.add_argument(
        "--seconds", type=_positive, default=None, help="seconds per clip (default: 8; measure check: 4)"
    )
    p.add_argument(
        "--long",
        type=_positive,
        default=0.0,
        metavar="SECONDS",
        help="also stream --long-clips clips this long per configuration for the drift curves (default: off)",
    )
    p.add_argument(
        "--long-clips", type=int, default=1, help="streams per configuration for --long (default: 1)"
    )
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma list of {', '.join(CONFIGS)}, or 'attention' (= {','.join(ATTENTION_CONFIGS)}) "
        "(default: all; the reference always runs)",
    )
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument(
        "--speech",
        default="synthetic",
        choices=("synthetic", "espeak"),
        help="clip speech (default: synthetic)",
    )
    p.add_argument(
        "--images",
        default="",
        help="comma list of extra reference images: 'astronaut' (scikit-image) or image files (default: none)",
    )
    p.add_argument(
        "--tracker",
        default="auto",
        choices=("auto", "landmarks", "pixels"),
        help="mouth and face tracker: MediaPipe landmarks, or the pixel measure (default: landmarks if installed)",
    )
    p.add_argument("--prompt", default=None, help="text prompt (default: the harness's)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the held-out split (default: 0)")
    p.add_argument("--noise-seed", type=int, default=0, help="rerun r uses noise seed N + r (default: 0)")
    p.add_argument(
        "--weights-seed", type=int, default=0, help="random weights' seed, without --weights (default: 0)"
    )
    p.add_argument("--png", default=None, help="write the picture here (default: beside the JSON record)")
    # issue 7's flag, in the README's command: drift is now measured every second (a note says so)
    p.add_argument("--drift-seconds", default=None, help=argparse.SUPPRESS)


def parse(argv: list[str], prog: str = "cadence bench eval") -> argparse.Namespace:
    from cadence.eval.harness import ATTENTION_CONFIGS, CONFIGS

    p = UsageParser(
        prog=prog,
        description="Quality harness: lip-sync offset and confidence from face landmarks, identity / colour / "
        "sharpness drift, per engine configuration, with rerun spreads and verdicts against the reference.",
    )
    add_model_flags(
        p
    )  # --model / --preset, --weights, --weights-entry / --ema, the VAE and text files, --lora
    _add_run_flags(p)
    g = p.add_argument_group("the measure itself")
    g.add_argument(
        "--measure-check", action="store_true", help="check the lip-sync measure instead (module doc)"
    )
    g.add_argument("--size", type=int, default=256, help="measure check: synthetic frame size (default: 256)")
    g.add_argument(
        "--character-streams", type=int, default=4, help="measure check: character streams (default: 4)"
    )
    add_record_flags(p)
    a = p.parse_args(argv)
    a.clips = a.clips if a.clips is not None else (20 if a.measure_check else 50)
    a.seconds = a.seconds if a.seconds is not None else (4.0 if a.measure_check else 8.0)
    if a.clips < 0 or (a.clips == 0 and not a.long):
        p.error(f"--clips must be >= 1 (or 0 with --long), got {a.clips}")
    if a.seconds <= 0:
        p.error(f"--seconds must be positive, got {a.seconds:g}")
    if a.reruns < 2:
        p.error(f"--reruns must be >= 2 (the rerun spread needs two runs), got {a.reruns}")
    if a.long_clips < 1:
        p.error(f"--long-clips must be >= 1, got {a.long_clips}")
    if a.measure_check and (a.size < 64 or a.character_streams < 0):
        p.error("--size must be >= 64 and --character-streams >= 0")
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    names = [x for c in names for x in (ATTENTION_CONFIGS if c == "attention" else (c,))]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        p.error(f"unknown configuration(s) {bad or a.configs!r}; known: {', '.join(CONFIGS)}, attention")
    a.configs = list(dict.fromkeys(names))
    a.images = [x.strip() for x in a.images.split(",") if x.strip()]
    return a


def _progress(line: str) -> None:
    print(f"[eval] {line}", file=sys.stderr, flush=True)


def _cell(v: dict | None) -> str:
    if not v or v.get("mean") is None:
        return "n/a"
    spread = v.get("rerun_spread")
    return (
        f"{v['mean']:.3f}"
        + (f" ±{spread:.3f}" if spread is not None else "")
        + ("*" if v.get("differs") else "")
    )


HEADS = {
    "sync_offset_frames": "offset",
    "sync_confidence": "confidence",
    "sync_corr": "corr",
    "drift_identity_geometry": "geometry",
    "drift_identity_embedding": "embedding",
    "drift_colour_shift": "colour",
    "drift_sharpness": "sharpness",
}


def table(results: dict) -> list[str]:
    """The short table: one row per configuration, mean ±spread per metric, then the verdict."""
    metrics = results["metrics"]
    heads = ["config"] + [HEADS.get(m, m) for m in metrics] + ["verdict"]
    rows = []
    for name, c in results["configs"].items():
        if "skipped" in c:
            rows.append([name] + ["-"] * len(metrics) + [c["verdict"]])
            continue
        verdict = c["verdict"] + (f" [{c['effective']}]" if c.get("effective", "eager") != "eager" else "")
        rows.append([name, *(_cell(c.get(m)) for m in metrics), verdict])
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads) - 1)]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths)) + "  " + r[-1] for r in [heads, *rows]]


def _device(args):
    """(device, TPInfo or None) for this process: a torchrun rank's GPU, or --device."""
    import os

    import torch

    if int(os.environ.get("WORLD_SIZE") or 1) >= 2:
        from cadence.parallel import init_tp

        info = init_tp(backend="gloo" if args.device == "cpu" else None)
        return info.device, info
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {args.device} requested but CUDA is not available")
    return device, None


def _measure_info(tracker: str) -> dict:
    from cadence.eval import landmarks, sync

    return {
        "tracker_asked": tracker,
        "landmark_model": landmarks.model_info(),
        "max_offset_frames": sync.MAX_OFFSET,
        "window_frames": sync.WINDOW,
        "offset_sign": "> 0: the audio is late (the mouth moves that many frames before its sound)",
    }


def run(args, spec, cfg, device, progress) -> dict:
    """The clips, then every configuration over them, then (``--long``) the long streams."""
    from cadence.eval import harness
    from cadence.eval.clips import prepare_clips

    if args.speech == "espeak":
        import shutil

        if shutil.which("espeak-ng") is None:
            raise InputError("--speech espeak needs espeak-ng on PATH (apt-get install espeak-ng)")
    kw = dict(
        reruns=args.reruns,
        device=device,
        noise_seed=args.noise_seed,
        prompt=args.prompt or harness.PROMPT,
        tracker=args.tracker,
        progress=progress,
    )
    results: dict = {}
    if args.clips or args.images:
        clips = prepare_clips(
            cfg,
            args.clips,
            args.seconds,
            args.speech,
            args.split_seed,
            args.images,
            True,
            args.tracker,
            progress,
        )
        results = harness.evaluate(spec, args.configs, clips, **kw)
    if args.long:
        if progress:
            progress(f"long streams: {args.long_clips} x {args.long:g} s per configuration")
        long_clips = prepare_clips(
            cfg, args.long_clips, args.long, args.speech, args.split_seed + 1, (), False, args.tracker
        )
        long = harness.evaluate(spec, args.configs, long_clips, **kw)
        if not results:
            results = long
        else:
            results["long"] = long
    passes = [results["configs"]] + ([results["long"]["configs"]] if "long" in results else [])
    results["per_head_attention"] = harness.attention_verdict(passes)
    results.update(speech=args.speech, split_seed=args.split_seed, measure=_measure_info(args.tracker))
    return results


def main(argv: list[str] | None = None, prog: str = "cadence bench eval") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv, prog)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    import logging

    from cadence.engine.recipe import resolve

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    if args.drift_seconds is not None:
        print(
            "note: --drift-seconds is no longer used: drift is measured every second (curves in the JSON and PNG); "
            "--long SECONDS adds long streams",
            file=sys.stderr,
        )
    if args.measure_check:
        return measure_check(args, argv, prog)
    spec = spec_from_args(args, seed=args.weights_seed)  # files checked, one clear error for a bad name
    cfg = spec.config()
    device, info = _device(args)
    rank0 = info is None or info.rank == 0
    progress = _progress if rank0 else None
    recipe = resolve(spec, str(device))
    if rank0:
        print(recipe.describe().text(), file=sys.stderr)
        _progress(
            f"{cfg.name} on {device}: {args.clips} held-out clips x {args.seconds:g} s"
            + (f" + {len(args.images)} images" if args.images else "")
            + f", {args.reruns} reruns, configurations {', '.join(args.configs)}"
            + (f"; long: {args.long_clips} x {args.long:g} s" if args.long else "")
        )
    try:
        results = run(args, spec, cfg, device, progress)
    finally:
        if info is not None:
            from cadence.parallel import destroy_tp

            destroy_tp()
    if not rank0:
        return 0
    world = info.world_size if info is not None else 1
    path = None if args.no_record else _record(args, argv, prog, cfg, device, world, results, recipe)
    png = Path(args.png) if args.png else (path.with_suffix(".png") if path else None)
    if png:
        from cadence.eval.report import render_png

        print(f"wrote {render_png(results, png, f'cadence eval: {cfg.name} on {device}')}")
    _print(results, cfg, args)
    return 0


def _print(results: dict, cfg, args) -> None:
    for label, r in (("clips", results), ("long", results.get("long"))):
        if not r:
            continue
        print(
            f"eval ({label}): {cfg.name}, {r['clips']} clips x {r['seconds']:g} s, {r['reruns']} reruns "
            "(mean ±rerun spread; * = differs from the reference by more than the spread)"
        )
        for line in table(r):
            print("  " + line)
    v = results["per_head_attention"]
    print(f"per-head attention: {v['decision']} ({v['why']})")


def _record(args, argv, prog: str, cfg, device, world: int, results: dict, recipe) -> Path:
    """The JSON record (docs/benchmarks.md bench "eval", with the recipe of the words) and its README line."""
    from cadence.bench.common import record
    from cadence.eval import harness

    verdicts = "; ".join(
        f"{n}: {c['verdict']}"
        for n, c in results["configs"].items()
        if n not in (harness.GROUND_TRUTH, harness.REFERENCE)
    )
    ref = results["configs"].get(harness.REFERENCE, {})
    conf = (ref.get("sync_confidence") or {}).get("mean")
    path = record(
        "eval",
        cfg.name,
        world,
        device,
        cfg.shape_summary(),
        _json_safe(results),
        variant=args.speech + ("-long" if args.long else ""),
        out_dir=results_dir(args),
        world=world,
        command=prog + " " + " ".join(map(shlex.quote, argv)),
        extra={"recipe": recipe.describe().as_dict()},
        headline=f"sync confidence reference {conf if conf is None else round(conf, 3)}, {results['clips']} "
        f"clips x {args.reruns} reruns; {verdicts}",
    )
    print(f"wrote {path}")
    return path


def _json_safe(x):
    """NaN / inf -> None (strict JSON), recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def measure_check(args, argv, prog: str) -> int:
    """``--measure-check``: ``cadence.eval.validate`` on synthetic faces and character streams; JSON + summary."""
    import torch

    from cadence.eval import validate

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    checks, runtime = validate.synthetic(args.clips, args.seconds, args.size, args.split_seed, _progress)
    results = {"synthetic": checks, "runtime": runtime, "measure": _measure_info("auto")}
    if args.character_streams:
        results["character"] = validate.character(
            args.character_streams, args.seconds, device, args.split_seed, _progress
        )
    for name in ("synthetic", "character"):
        r = results.get(name)
        if r:
            m, x = r["confidence_matched"], r["confidence_mismatched"]
            print(
                f"{name}: known shifts recovered {r['recovered']}/{r['of']} ({r['clips']} clips, k in -5..5); "
                f"confidence matched {m['min']:.3f}..{m['max']:.3f} (median {m['median']:.3f}), mismatched "
                f"{x['min']:.3f}..{x['max']:.3f} (median {x['median']:.3f}), silence max "
                f"{r['confidence_silence']['max']:.3f}; separated: {r['separated']}"
            )
    print(
        f"runtime at {runtime['size']} ({runtime['tracker']}): tracker {runtime['tracker_fps']:.1f} frames/s, "
        f"tracker + drift {runtime['measure_fps']:.1f} frames/s (wall, load average "
        f"{runtime['load_average_1min'][0]:.1f}); per CPU second {runtime['tracker_fps_per_cpu_second']:.1f} / "
        f"{runtime['measure_fps_per_cpu_second']:.1f}"
    )
    if not args.no_record:
        from cadence.bench.common import record

        path = record(
            "eval",
            "measure",
            1,
            device,
            {"size": runtime["size"], "seconds": args.seconds},
            _json_safe(results),
            variant="check",
            out_dir=results_dir(args),
            command=prog + " " + " ".join(map(shlex.quote, argv)),
            headline=f"known shifts {checks['recovered']}/{checks['of']}, tracker {runtime['tracker_fps']:.1f} fps",
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
