"""The ``cadence`` command line: ``cadence generate``, ``serve``, ``eval``, ``train`` and ``bench <name>``.

Errors meant for the user (``CadenceError``: bad files, bad counts, unknown presets) print as one
line, ``error: <message>``, on stderr with exit status 2 and no traceback. Heavy modules (the
engine, benchmarks) are imported inside the handler that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import math
import pkgutil
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cadence.errors import EXIT_USAGE, CadenceError, InputError
from cadence.errors import UsageParser as _Parser


def build_parser() -> argparse.ArgumentParser:
    """The full ``cadence`` parser (subcommands: generate, serve, bench, eval, models, recipe, train, fleet)."""
    from cadence.fleet.cli import add_parser as add_fleet_parser  # (Ray is imported only when it runs)

    parser = _Parser(
        prog="cadence", description="Real-time chunk-causal video diffusion for live talking characters."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_generate(sub)
    _add_serve(sub)
    add_fleet_parser(sub)  # cadence fleet status|drain|undrain|down
    b = sub.add_parser(
        "bench",
        help="run a benchmark: cadence bench <name> [args...]",
        description="Run cadence.bench.<name>.main(args). Benchmarks write JSON and print a table.",
    )
    b.add_argument("name", help="benchmark module in cadence.bench (e.g. step)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=cmd_bench)
    # The options live in cadence.bench.eval (imported only when run); '+' as the prefix hands every
    # argument, --help included, through to it.
    e = sub.add_parser(
        "eval",
        help="quality harness: lip sync and identity drift per engine configuration",
        description="cadence eval [--preset P] [--clips N] [--reruns R] ... (see 'cadence eval "
        "--help'); the same as 'cadence bench eval'.",
        add_help=False,
        prefix_chars="+",
    )
    e.add_argument("args", nargs=argparse.REMAINDER, help="arguments of cadence.bench.eval")
    e.set_defaults(func=cmd_eval)
    m = sub.add_parser(
        "models",
        help="list the models --model takes: Cadence's presets and the open model families",
        description="The models --model (alias --preset) takes: the presets, and each family's reference "
        "code, files, default weights entry and status.",
    )
    m.set_defaults(func=cmd_models)
    _add_recipe(sub)
    tr = sub.add_parser(
        "train",
        help="train the default character (small VAE + DiT on synthetic talking faces)",
        description="cadence train --out DIR [--minutes M] [--device cuda] [--toy] ... (see "
        "'cadence train --help')",
        add_help=False,
        prefix_chars="+",
    )
    tr.add_argument("args", nargs=argparse.REMAINDER, help="arguments of cadence.train.character")
    tr.set_defaults(func=cmd_train)
    return parser


def _add_generate(sub) -> None:
    from cadence.engine.flags import add_engine_flags  # torch-free

    g = sub.add_parser(
        "generate",
        help="render a talking-character clip to an MP4 file",
        description="Generate chunks from a reference image and driving audio; write H.264 + AAC MP4.",
    )
    g.add_argument(
        "--image",
        type=Path,
        default=None,
        help="reference image (any format Pillow reads; cropped to cover the frame). "
        "Default: a built-in drawn face",
    )
    g.add_argument(
        "--audio",
        type=Path,
        default=None,
        help="driving audio (any file FFmpeg decodes). Default: synthetic speech as long as the clip "
        "(--chunks; 2 s without it)",
    )
    g.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="chunks to generate (4 frames = 166.7 ms each at tiny). Default: enough to cover the audio",
    )
    g.add_argument("--out", type=Path, default=Path("out.mp4"), help="output MP4 path (default: out.mp4)")
    g.add_argument("--prompt", default="a person talking to the camera", help="text prompt")
    g.add_argument("--seed", type=int, default=0, help="random seed: noise and random weights (default: 0)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    add_engine_flags(g, tp=False, warmup=False)
    g.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    from cadence.engine.flags import add_engine_flags  # torch-free, no serving packages
    from cadence.serve.config import add_deployment_flags, add_serve_flags

    s = sub.add_parser(
        "serve",
        help="serve live characters over WebRTC (HTTP API + browser page)",
        description="Start the HTTP API (FastAPI + uvicorn; OpenAPI at /openapi.json) and WebRTC "
        "(aiortc), with the browser page at /. Defaults: the shipped character on loopback "
        "with the built-in reference face; nothing to download.",
    )
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1); a non-loopback address needs an API key",
    )
    _add_access_flags(s)
    _add_agent_flags(s)
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000; 0 = any free port)")
    s.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="sessions admitted at once = worker groups (default: 1 on the CPU, one per GPU "
        "with --device cuda, --sessions-per-gpu N per GPU)",
    )
    s.add_argument("--device", default="cpu", help="cpu or cuda: where the worker groups run (default: cpu)")
    s.add_argument(
        "--idle-timeout",
        type=float,
        default=120.0,
        help="close a session after this many seconds with no request or media from its client "
        "(default: 120)",
    )
    s.add_argument(
        "--max-duration",
        type=float,
        default=600.0,
        help="close a session this many seconds after it started (default: 600)",
    )
    s.add_argument(
        "--lead-ms",
        type=float,
        default=100.0,
        help="plan each chunk this long before it is due (default: 100)",
    )
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_engine_flags(s)
    add_serve_flags(s, sharing=True)
    add_deployment_flags(s)  # --deploy local|ray and each deployment's own (--ray ADDR, --fleet-*)
    s.set_defaults(func=cmd_serve)


def _add_access_flags(s) -> None:
    a = s.add_argument_group("access (each session's routes always need the token its creator got)")
    a.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="the operator key, read from this file (its first line): needed to create sessions, "
        "list them and see per-session metrics; required on a non-loopback --host",
    )
    a.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="the operator key itself (visible to other local users in the process list: prefer "
        "--api-key-file or the CADENCE_API_KEY environment variable)",
    )
    a.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback --host without an API key (anyone who reaches it can start "
        "sessions; logged as a WARNING)",
    )


def _add_agent_flags(s) -> None:
    ag = s.add_argument_group("the 'talk' agent (talk to the character through an OpenAI-compatible API)")
    ag.add_argument(
        "--agent-url",
        default=None,
        metavar="URL",
        help="OpenAI-compatible API base for the 'talk' agent's LLM, e.g. http://127.0.0.1:8080/v1 "
        "(llama.cpp, vLLM, Ollama or a cloud API; key from $CADENCE_AGENT_API_KEY)",
    )
    ag.add_argument("--agent-model", default="default", metavar="NAME", help="LLM model name")
    ag.add_argument(
        "--agent-stt-model",
        default=None,
        metavar="NAME",
        help="speech-to-text model at --agent-url (default: none; the LLM is told how long the user spoke)",
    )
    ag.add_argument(
        "--agent-tts-model",
        default=None,
        metavar="NAME",
        help="text-to-speech model at --agent-url (default: espeak-ng on the server)",
    )


def _add_recipe(sub) -> None:
    from cadence.engine.flags import add_engine_flags

    r = sub.add_parser(
        "recipe",
        help="print what an engine would build on a device (no model is built)",
        description="Resolve the engine flags for a device and print the recipe every entry point builds "
        "from the same words (cadence.engine.recipe); --env lists the kernel switches.",
    )
    r.add_argument("--device", default="cpu", help="cpu, cuda:N, or a group cuda:0+cuda:1 (default: cpu)")
    r.add_argument("--json", action="store_true", help="print the recipe as JSON")
    r.add_argument("--env", action="store_true", help="list the CADENCE_* kernel switches (defaults, values)")
    add_engine_flags(r)
    r.set_defaults(func=cmd_recipe)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cadence`` / ``python -m cadence``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    try:
        return int(args.func(args) or 0)
    except CadenceError as e:
        _error(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


# ---- generate ---------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    """Validate every input, build the engine, stream chunks into the MP4, print a summary."""
    from tqdm import tqdm

    from cadence.config import AUDIO_SAMPLE_RATE
    from cadence.engine.flags import cpu_note, require_weights, spec_from_args
    from cadence.engine.recipe import resolve
    from cadence.media.audio import fit_audio, load_audio, synthetic_speech
    from cadence.media.image import default_reference_image, load_reference_image
    from cadence.media.video import Mp4Writer

    device = _check_device(args.device)
    if args.chunks is not None and args.chunks <= 0:
        raise InputError(f"--chunks must be a positive number of chunks, got {args.chunks}")
    out = _check_output(args.out)
    spec = spec_from_args(args, seed=args.seed, warmup=False)  # files checked; a clear error for a bad name
    require_weights(spec, args.random_weights)  # a family without its checkpoint: one error line, at once
    recipe = resolve(spec, device)
    cfg = recipe.config

    # Inputs first: a bad file fails in milliseconds, before any model is built.
    height, width = cfg.stream.height, cfg.stream.width
    image = (
        load_reference_image(args.image, height, width)
        if args.image is not None
        else default_reference_image(height, width)
    )
    per_chunk = cfg.audio_samples_per_chunk
    wanted = args.chunks * per_chunk if args.chunks is not None else None
    audio = (  # the built-in speech lasts as long as the clip asked for (2 s when --chunks is not given)
        load_audio(args.audio, AUDIO_SAMPLE_RATE, max_samples=wanted)
        if args.audio is not None
        else synthetic_speech(wanted / AUDIO_SAMPLE_RATE if wanted else 2.0, AUDIO_SAMPLE_RATE)
    )
    chunks = args.chunks if args.chunks is not None else max(1, math.ceil(audio.shape[0] / per_chunk))
    track = fit_audio(audio, chunks * per_chunk)

    from cadence.engine.build import build_engine

    print(recipe.describe().text(), file=sys.stderr)
    if (note := cpu_note(spec, device)) is not None:
        print(note, file=sys.stderr)
    t_build = time.perf_counter()
    eng = build_engine(recipe, device)
    t_start = time.perf_counter()
    build_s = t_start - t_build

    partial = out.with_name(out.name + ".partial")
    done = False
    try:
        with Mp4Writer(partial, width, height, fps=cfg.stream.fps, sample_rate=AUDIO_SAMPLE_RATE) as writer:
            produced = 0
            stream = eng.stream(image, args.prompt, track, num_chunks=chunks, seed=args.seed)
            # a progress bar on a terminal only: into a log or a pipe it is noise (issue 39)
            bar = tqdm(stream, total=chunks, desc="chunks", unit="chunk", disable=not sys.stderr.isatty())
            for chunk in bar:
                writer.write_frames(chunk.frames)
                writer.write_audio(track[produced * per_chunk : (produced + 1) * per_chunk])
                produced += 1
        if produced != chunks:
            raise RuntimeError(f"the engine yielded {produced} chunks, expected {chunks}")
        partial.replace(out)
        done = True
    finally:
        eng.close()
        if not done:
            partial.unlink(missing_ok=True)
    wall = time.perf_counter() - t_start

    rate = chunks / wall if wall > 0 else float("inf")
    need = cfg.stream.fps / cfg.video_frames_per_chunk
    print(
        f"wrote {out}: {writer.frames_written} frames, {writer.seconds:.2f} s at {cfg.stream.fps} fps "
        f"({cfg.name}, {width}x{height}, {chunks} chunks) in {wall:.2f} s; {rate:.2f} chunks/s "
        f"(real time needs {need:.2f}); model build {build_s:.2f} s"
    )
    return 0


def _check_device(device: str) -> str:
    """``cpu`` / ``cuda`` / ``cuda:N``, with CUDA actually present."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise InputError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(
                f"--device {device} requested but CUDA is not available "
                f"(torch {torch.__version__}, {torch.cuda.device_count()} GPUs visible)"
            )
        if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
            raise InputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def _check_output(out: Path) -> Path:
    """The output path, with an existing parent directory and not itself a directory."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.exists():
        raise InputError(f"output directory does not exist: {parent}")
    if not parent.is_dir():
        raise InputError(f"output parent is not a directory: {parent}")
    if out.is_dir():
        raise InputError(f"output path is a directory: {out}")
    return out


# ---- models -----------------------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    """``cadence models``: the presets, then one block per family (name, what it is, its files, the weights
    entry served and where its authors' code says so, what is proven, what is not)."""
    from cadence.config import PRESETS
    from cadence.model.families import list_families

    print(f"presets (--model or --preset): {', '.join(PRESETS)}")
    for f in list_families():
        print(f"{f.name}: {f.title} [{f.status}]")
        print(f"    reference: {f.reference}")
        ck = f.checkpoint
        if ck.default_entry:
            others = [k for k in (*ck.state_keys, ck.ema_key) if k and k != ck.default_entry]
            print(f"    weights entry: {ck.default_entry} (--weights-entry {' | '.join(others)} for another)")
        if ck.default_entry_source:
            print(f"    authors' inference: {ck.default_entry_source}")
        if f.prompt_free:
            print(
                "    text encoder: none (prompt-free: audio and a reference image drive it; a prompt is ignored)"
            )
        if f.builder is not None:
            print(f"    weights: --weights DIR, the released folder ({f.builder.about})")
        for note in f.notes if isinstance(f.notes, (list, tuple)) else [f.notes]:
            if note:
                print(f"    {note}")
    print(
        "serve one: cadence serve --model NAME --weights FILE --text-encoder PATH --vae-weights PATH "
        "(a prompt-free family: --weights DIR alone; docs/models.md)"
    )
    return 0


def cmd_recipe(args: argparse.Namespace) -> int:
    """``cadence recipe [engine flags] --device DEV``: what the words build there (no model is built)."""
    import json

    from cadence.engine.flags import spec_from_args
    from cadence.engine.recipe import KERNEL_SWITCHES, resolve

    recipe = resolve(spec_from_args(args), args.device)
    desc = recipe.describe()
    print(json.dumps(desc.as_dict(), indent=1) if args.json else desc.text())
    if args.env:
        for sw in KERNEL_SWITCHES:
            v = desc.as_dict()["env"][sw.name]
            now = f"= {v['value']}" if v["set"] else "unset"
            print(f"  {sw.name} {now} (default {sw.default or 'unset'}; {sw.module}): {sw.what}")
    return 0


# ---- serve ------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """``cadence serve``: validate the flags, then run uvicorn in the foreground until interrupted."""
    from cadence.engine.flags import cpu_note, require_weights, spec_from_args
    from cadence.serve.config import ServeConfig, deployment_from_args, placements_from_args, share_words

    spec = spec_from_args(
        args
    )  # a clear error for an unknown model or a missing file, before anything starts
    require_weights(spec, args.random_weights)  # a family without its checkpoint: one error line, at once
    if args.device not in ("cpu", "cuda"):
        raise InputError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.max_sessions is not None and args.max_sessions < 1:
        raise InputError(f"--max-sessions must be >= 1, got {args.max_sessions}")
    deployment = deployment_from_args(args)  # local (this machine) or ray (a fleet's groups): by name
    groups = placements_from_args(
        deployment, args.device, spec.tp, args.max_sessions, spec.decode_gpu, args.sessions_per_gpu
    )
    cfg = ServeConfig(
        engine=spec,
        host=args.host,
        port=args.port,
        groups=groups,
        idle_timeout_s=args.idle_timeout,
        max_duration_s=args.max_duration,
        lead_ms=args.lead_ms,
        cut_in=args.cut_in,
        api_key=_api_key(args),
        insecure_no_auth=args.insecure_no_auth,
        deployment=deployment,
        agent_url=args.agent_url,
        agent_model=args.agent_model,
        agent_stt_model=args.agent_stt_model,
        agent_tts_model=args.agent_tts_model,
        frame_transport=args.frame_transport,
        **share_words(args),
    )
    from cadence.serve.server import run

    if groups and (note := cpu_note(spec, groups[0].devices[0])) is not None:
        print(note, file=sys.stderr)
    run(cfg, log_level=args.log_level)  # prints what group 0 builds: the recipe its groups are made with
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """The operator key from --api-key-file, --api-key or $CADENCE_API_KEY (at most one of them), checked
    (``check_api_key``); None when none is given. ServeConfig then refuses a non-loopback host without it."""
    import os

    from cadence.serve.config import check_api_key

    env = os.environ.get("CADENCE_API_KEY") or None
    given = [
        name
        for name, v in (
            ("--api-key-file", args.api_key_file),
            ("--api-key", args.api_key),
            ("CADENCE_API_KEY", env),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise InputError(f"give the API key one way, not {' and '.join(given)}")
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(
                f"cannot read --api-key-file {args.api_key_file}: {type(e).__name__}: {e}"
            ) from None
        key = text.strip().split("\n", 1)[0].strip() if text.strip() else ""
        if not key:
            raise InputError(f"--api-key-file {args.api_key_file} is empty")
        return check_api_key(key)
    key = args.api_key if args.api_key is not None else env
    return check_api_key(key) if key is not None else None


# ---- bench ------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    """``cadence bench <name> ...`` -> ``cadence.bench.<name>.main(args)``, imported only now."""
    name = args.name
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise InputError(f"unknown benchmark {name!r}")
    modname = f"cadence.bench.{name}"
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name != modname:
            raise
        available = ", ".join(_benchmarks()) or "none"
        raise InputError(f"unknown benchmark {name!r}; available: {available}") from None
    if not hasattr(module, "main"):
        raise InputError(f"benchmark {name!r} has no main()")
    return int(module.main(list(args.args)) or 0)


def cmd_train(args: argparse.Namespace) -> int:
    """``cadence train ...`` -> ``cadence.train.character.main(args)``."""
    from cadence.train.character import main as train_main

    return int(train_main(list(args.args)) or 0)


def cmd_eval(args: argparse.Namespace) -> int:
    """``cadence eval ...`` -> ``cadence.bench.eval.main(args)`` (the same as ``cadence bench eval``)."""
    from cadence.bench.eval import main as eval_main

    return int(eval_main(list(args.args), prog="cadence eval") or 0)


def _benchmarks() -> list[str]:
    import cadence.bench

    return sorted(m.name for m in pkgutil.iter_modules(cadence.bench.__path__) if not m.name.startswith("_"))


def _error(message: str) -> None:
    print("error: " + " ".join(message.split()), file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
