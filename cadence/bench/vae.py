"""Streaming VAE decode: time per further 4-frame chunk (one latent frame per call by default).

``cadence bench vae --variant 2.1|2.2 --height 704 --width 1088 --chunks N [--compare-diffusers]``
builds the Wan VAE decoder (random weights) or the TAEHV-style tiny decoder, decodes a stream's first
latent frame, then N further chunks through one :class:`StreamingDecoder`, each timed with CUDA
events (host clock on CPU). bf16 on a GPU, float32 on CPU (use a tiny --height/--width/--base-dim
there). With --compare-diffusers, diffusers' ``AutoencoderKLWan.decode`` of a whole latent of 1 and
1 + K frames gives its per-chunk cost (the slope); skipped with one log line where diffusers is not
installed. ``--decoder ltx`` times FlashHead Lite's LTX-Video VAE instead (whole 33-frame clips, per fast
mode, interleaved rounds: ``cadence.bench._vae_ltx``). Reference: docs/benchmarks.md measured diffusers at ~170 ms per further chunk at 704x1088 on
an H200; the deadline is 166.7 ms per 4-frame chunk at 24 fps.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys

import torch

from cadence.bench.common import Timer, median, p99, print_table, record
from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_fast_path_flags, fast_path_from_args
from cadence.errors import CadenceError

DEADLINE_MS = 4 / 24 * 1e3


def parse(argv: list[str]) -> argparse.Namespace:
    """The flags of ``cadence bench vae``; with ``--decoder ltx`` the LTX-Video VAE's own
    (``cadence.bench._vae_ltx.parse``)."""
    rest = _ltx(argv)
    if rest is not None:
        from cadence.bench._vae_ltx import parse as parse_ltx

        return parse_ltx(rest)
    p = argparse.ArgumentParser(
        prog="cadence bench vae",
        description=__doc__.split("\n\n")[0],
        epilog="--decoder ltx: FlashHead Lite's LTX-Video VAE instead, with its own flags "
        "(cadence bench vae --decoder ltx --help)",
    )
    p.add_argument("--variant", choices=["2.1", "2.2"], default="2.2", help="Wan VAE geometry")
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1088)
    p.add_argument("--chunks", type=int, default=20, help="timed further chunks")
    p.add_argument(
        "--latent-frames", type=int, default=1, help="latent frames per chunk (4 video frames each)"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed further chunks of a warm-up stream")
    p.add_argument(
        "--base-dim", type=int, default=None, help="override the decoder width (tiny CPU smoke runs)"
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--channels-last", action="store_true", help="channels_last(_3d) weights and activations")
    p.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder (eager on failure)")
    p.add_argument(
        "--compare-diffusers", action="store_true", help="also time diffusers' whole-latent decode"
    )
    p.add_argument(
        "--diffusers-frames", type=int, default=3, help="K: diffusers decodes 1 and 1 + K latent frames"
    )
    # the engine flags that concern a decoder (cadence.engine.flags): --dtype (auto / bf16 / ...), --decoder
    # (wan: the full Wan decoder, the default; taehv: the tiny one), --decoder-fast (alias --fast: the Wan
    # decoder's fast path as the pipeline applies it, cadence.runtime.vae_fast; it replaces --channels-last /
    # --compile for the wan decoder; fp8's backend from CADENCE_CONV_FP8)
    add_fast_path_flags(p, only=("dtype", "decoder", "decoder_fast"))
    add_record_flags(p)
    a = p.parse_args(argv)
    a.dtype = a.fast_dtype or "auto"
    a.decoder = a.fast_decoder or "wan"
    a.fast = a.fast_decoder_fast
    if a.decoder not in ("wan", "taehv"):
        p.error(f"--decoder must be wan or taehv here (the stand-in has no decoder to time), got {a.decoder}")
    return a


def recipe_of(args) -> dict:
    """The engine recipe these flags describe (the preset of the variant's geometry at this size): what
    ``bench pipeline`` would decode with, recorded with the figures."""
    import dataclasses

    from cadence.engine.recipe import EngineSpec, resolve

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    spec = EngineSpec(
        model="w14" if args.variant == "2.2" else "w1.3",
        overrides={"stream": {"height": args.height, "width": args.width}},
        fast=dataclasses.replace(fast_path_from_args(args), decoder=args.decoder),  # the decoder timed
    )
    return resolve(spec, device).describe()


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    return getattr(torch, names.get(name, name))


def _channels_last(module: torch.nn.Module) -> None:
    """channels_last_3d for 5D weights, channels_last for 4D (Module.to(memory_format=...) would
    refuse the 2D convs inside a 3D model: the reason diffusers' Wan VAE 'fails as is')."""
    for p in module.parameters():
        if p.dim() == 5:
            p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
        elif p.dim() == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)


def _compile_blocks(model, log) -> list:
    """torch.compile the Wan decoder's forward or the whole tiny decoder in place; returns what was
    touched, to undo on failure."""
    if hasattr(model, "decoder"):
        targets = [(model.decoder, "forward")]  # one graph per stream phase (first / second / steady)
    else:
        targets = [(model, "_run")]
    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit"):  # stream phases and block instances differ in shapes
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(64, getattr(dcfg, name)))
    done = []
    try:
        for obj, attr in targets:
            setattr(obj, attr, torch.compile(getattr(obj, attr), dynamic=False))
            done.append((obj, attr))
        log(f"torch.compile: {len(done)} decoder parts")
    except Exception as e:
        log(f"torch.compile unavailable ({type(e).__name__}: {e}); running eagerly")
        _uncompile(done)
        done = []
    return done


def _uncompile(done: list) -> None:
    for obj, attr in done:
        obj.__dict__.pop(attr, None)


def build_decoder(args, device: torch.device, dtype: torch.dtype):
    from cadence.model.vae import WanVAE, wan_vae_config

    cfg = wan_vae_config(args.variant)
    if args.base_dim:
        cfg.update(base_dim=args.base_dim, decoder_base_dim=args.base_dim)
    if args.decoder == "wan":
        model = WanVAE(cfg)
        z, stride = model.z_dim, model.stride
    else:
        from cadence.model.taehv import TAEHV

        z, stride = cfg["z_dim"], (4, 16, 16) if args.variant == "2.2" else (4, 8, 8)
        model = TAEHV(z, stride)
    return cfg, model.to(device=device, dtype=dtype).eval(), z, stride


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prepare(args, device: torch.device, dtype: torch.dtype):
    """The decoder as the flags ask (``--fast``: the pipeline's decoder fast path, which replaces
    ``--channels-last`` / ``--compile`` for the Wan decoder). Returns (cfg, model, z, stride, the fast path's
    report or None, what was compiled)."""
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    cfg, model, z, stride = build_decoder(args, device, dtype)
    if args.height % stride[1] or args.width % stride[2]:
        raise SystemExit(f"--height/--width must be multiples of {stride[1]} for variant {args.variant}")
    fast_rep = None
    if args.fast is not None and args.decoder == "wan":
        from cadence.runtime.vae_fast import accelerate_decoder

        fast_rep = accelerate_decoder(model, args.fast)
        args.channels_last = args.fast != "off"
        args.compile = False
    if args.channels_last and fast_rep is None:
        _channels_last(model)
    compiled = _compile_blocks(model, _log) if args.compile else []
    return cfg, model, z, stride, fast_rep, compiled


def _time_stream(args, model, lat, timer: Timer, compiled: list) -> tuple[float, list[float], list]:
    """A warm-up stream (a compile that fails at its first call: eager, one line), then the timed one: its
    first latent frame, then ``--chunks`` further chunks. Returns (first ms, per-chunk ms, what stayed
    compiled)."""
    lf = args.latent_frames

    def warm() -> None:
        st = model.stream()
        st.decode_chunk(lat[:, :1])
        for i in range(args.warmup):
            st.decode_chunk(lat[:, 1 + i * lf : 1 + (i + 1) * lf])

    try:
        warm()
    except Exception as e:
        if not compiled:
            raise
        _log(
            f"torch.compile failed at first call ({type(e).__name__}: {str(e).splitlines()[0][:200]}); eager"
        )
        _uncompile(compiled)
        compiled = []
        warm()
    timer.sync()
    if timer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(timer.device)
    st = model.stream()
    first = timer.run(lambda: st.decode_chunk(lat[:, :1]), warmup=0, iters=1)[0]
    times: list[float] = []
    for i in range(args.chunks):
        sl = lat[:, 1 + i * lf : 1 + (i + 1) * lf]
        times += timer.run(lambda sl=sl: st.decode_chunk(sl), warmup=0, iters=1)
        print(f"\rchunk {i + 1}/{args.chunks} ({times[-1]:.1f} ms)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return first, times, compiled


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype, device)
    cfg, model, z, stride, fast_rep, compiled = _prepare(args, device, dtype)
    lh, lw = args.height // stride[1], args.width // stride[2]
    g = torch.Generator(device="cpu").manual_seed(0)
    lf = args.latent_frames
    lat = torch.randn(z, 1 + lf * (args.warmup + args.chunks), lh, lw, generator=g).to(device, dtype)
    timer = Timer(device)
    first, times, compiled = _time_stream(args, model, lat, timer, compiled)
    frames_per_chunk = stride[0] * lf
    per = median(times)
    results = {
        "variant": args.variant,
        "decoder": args.decoder,
        "height": args.height,
        "width": args.width,
        "dtype": str(dtype).replace("torch.", ""),
        "latent_frames_per_chunk": lf,
        "frames_per_chunk": frames_per_chunk,
        "first_chunk_ms": first,
        "per_chunk_ms": per,
        "per_chunk_p99_ms": p99(times),
        "per_chunk_mean_ms": float(statistics.mean(times)),
        "per_frame_ms": per / frames_per_chunk,
        "deadline_ms": DEADLINE_MS * lf,
        "meets_deadline": per <= DEADLINE_MS * lf,
        "chunks": args.chunks,
        "channels_last": args.channels_last,
        "cudnn_benchmark": args.cudnn_benchmark,
        "compiled": bool(compiled) or (fast_rep is not None and "compile" in fast_rep.applied),
        "fast": fast_rep.describe() if fast_rep is not None else None,
        "base_dim": args.base_dim or cfg["base_dim"],
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "chunk_ms": times,
    }
    if args.compare_diffusers:
        results.update(_diffusers(args, cfg, model, lat, device, dtype, timer, _log))
    _print(args, results, compiled, fast_rep)
    if not args.no_record:
        _record(args, results, compiled, fast_rep, device, z, lh, lw, stride)
    return results


def _print(args, results: dict, compiled: list, fast_rep) -> None:
    lf, fpc = results["latent_frames_per_chunk"], results["frames_per_chunk"]
    rows = [
        ("first chunk (1 frame)", f"{results['first_chunk_ms']:9.2f} ms"),
        (
            f"per further chunk ({fpc} frames)",
            f"{results['per_chunk_ms']:9.2f} ms  p99 {results['per_chunk_p99_ms']:.2f}  (deadline "
            f"{DEADLINE_MS * lf:.1f} ms)",
        ),
    ]
    if results.get("diffusers_per_chunk_ms") is not None:
        rows.append(
            (
                "diffusers per chunk",
                f"{results['diffusers_per_chunk_ms']:9.2f} ms (whole-latent decode slope)",
            )
        )
    print_table(
        rows,
        f"bench vae: {args.decoder} {args.variant} {args.height}x{args.width} {results['dtype']}"
        f"{' channels_last' if args.channels_last else ''}{' compiled' if compiled else ''}"
        + (f" fast={fast_rep.describe()}" if fast_rep is not None else ""),
    )


def _record(args, results: dict, compiled: list, fast_rep, device, z: int, lh: int, lw: int, stride) -> None:
    """The JSON record (docs/benchmarks.md bench "vae"), with the recipe of the decoder timed."""
    lf, per = results["latent_frames_per_chunk"], results["per_chunk_ms"]
    variant = "-".join(
        [args.variant, args.decoder, results["dtype"]]
        + (["cl"] if args.channels_last else [])
        + (["compile"] if compiled else [])
        + ([f"fast{args.fast}"] if fast_rep is not None else [])
        + (
            [os.environ.get("CADENCE_CONV_FP8", "triton")]
            if fast_rep is not None and args.fast == "fp8"
            else []
        )
        + ([f"lf{lf}"] if lf != 1 else [])
        + (["cudnnbench"] if args.cudnn_benchmark else [])
    )
    shape = {"height": args.height, "width": args.width, "latent": [z, lf, lh, lw], "stride": list(stride)}
    diff = results.get("diffusers_per_chunk_ms")
    path = record(
        "vae",
        f"wan{args.variant}",
        1,
        device,
        shape,
        results,
        variant=variant,
        out_dir=results_dir(args),
        command=getattr(args, "command", None),
        extra={"recipe": args.recipe.as_dict()} if getattr(args, "recipe", None) else None,
        headline=f"{args.decoder} decode {per:.1f} ms per {results['frames_per_chunk']}-frame chunk"
        + (f" (diffusers {diff:.1f})" if diff is not None else ""),
    )
    print(f"wrote {path}")
    results["_path"] = str(path)


def _diffusers(args, cfg, model, lat, device, dtype, timer, log) -> dict:
    try:
        from diffusers import AutoencoderKLWan
    except ImportError:
        log("diffusers is not installed here: skipping --compare-diffusers")
        return {"diffusers_per_chunk_ms": None}
    ref = AutoencoderKLWan(**{k: v for k, v in cfg.items()}).to(device=device, dtype=dtype).eval()
    if args.decoder == "wan":
        ref.load_state_dict(model.state_dict(), strict=True)
    k = max(1, args.diffusers_frames)
    z1, zk = lat[None, :, :1], lat[None, :, : 1 + k]
    t1 = median(timer.run(lambda: ref.decode(z1), warmup=1, iters=3))
    tk = median(timer.run(lambda: ref.decode(zk), warmup=1, iters=3))
    return {"diffusers_first_ms": t1, f"diffusers_1p{k}_ms": tk, "diffusers_per_chunk_ms": (tk - t1) / k}


def _ltx(argv: list[str]) -> list[str] | None:
    """``argv`` without ``--decoder ltx`` when it asks for the LTX VAE (its own flags), else None."""
    for i, a in enumerate(argv):
        if a == "--decoder=ltx":
            return argv[:i] + argv[i + 1 :]
        if a == "--decoder" and i + 1 < len(argv) and argv[i + 1] == "ltx":
            return argv[:i] + argv[i + 2 :]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = _ltx(argv)
    if rest is not None:  # FlashHead Lite's LTX-Video VAE: whole-clip decode / encode per fast mode
        from cadence.bench._vae_ltx import run_cli

        return run_cli(rest)
    args = parse(argv)
    args.command = "cadence bench vae " + " ".join(shlex.quote(a) for a in argv)
    try:
        args.recipe = recipe_of(args)
        print(args.recipe.text(), file=sys.stderr)
    except CadenceError as e:  # a size no preset takes (not a multiple of its patch): the figures still stand
        args.recipe = None
        print(f"(no engine recipe for this geometry: {e})", file=sys.stderr)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
