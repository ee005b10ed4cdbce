"""``cadence bench vae --decoder ltx``: FlashHead Lite's LTX-Video VAE, per fast mode, in interleaved rounds.

    cadence bench vae --decoder ltx [--weights VAE_LTX/] [--modes off,cl,compile] [--rounds 5]
    cadence bench vae --decoder ltx --height 64 --width 64 --widths 16,32,64,64 --latent-channels 8  # CPU

What FlashHead runs per 33-frame clip: the decode of the clip's latents (5 latent frames -> 33 frames) and the
encode of its last 9 frames (-> 2 motion latents); also the streaming decode (:class:`LTXDecodeStream`, pieces
of ``--stream-chunk`` frames): time to its first pixel chunk and in all. Weights: the released folder
(``--weights``) or random at the released config (the 0.9.0 VAE: widths 128/256/512/512, 128 latent
channels), the widths / latent channels / layers overridable for small runs. Each mode
(``cadence.runtime.ltx_fast``: off = the plain module, cl, compile, fp8) gets its own copy of the same weights,
warmed up (compiles happen there), then every round times every mode once, in turn. bf16 on a GPU, float32 on
the CPU. The record holds every round, the median and range per mode, each mode's ratio to ``off``
(``faster`` only where its worst round beats off's best), the multiply-adds counted on the meta device
(decode, encode, and the share of the decode done before the stream's first chunk).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from cadence.bench.common import Timer, print_table, record
from cadence.bench.results import add_record_flags, results_dir
from cadence.errors import UsageParser
from cadence.model.ltx_vae import RELEASED_CONFIG, LTXVAEConfig, LTXVideoVAE


def parse(argv: list[str]) -> argparse.Namespace:
    p = UsageParser(prog="cadence bench vae --decoder ltx", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default=None, help="a VAE_LTX/ folder (default: random weights)")
    p.add_argument(
        "--config", default=None, help="a config.json for random weights (default: the released one)"
    )
    p.add_argument("--widths", default=None, help="override block_out_channels, e.g. 16,32,64,64")
    p.add_argument("--latent-channels", type=int, default=None)
    p.add_argument("--layers", default=None, help="override layers_per_block, e.g. 1,1,1,1,1")
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--frames", type=int, default=33, help="frames per clip (FlashHead: 33)")
    p.add_argument(
        "--motion-frames", type=int, default=9, help="frames re-encoded per clip (FlashHead Lite: 9)"
    )
    p.add_argument("--modes", default="off,cl,compile", help="comma list of off, cl, compile, fp8")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each times every mode once)")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed calls per mode first (compiles happen here)"
    )
    p.add_argument(
        "--stream-chunk", type=int, default=8, help="frames per streamed piece (0: no stream timing)"
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    p.add_argument(
        "--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True (process-wide)"
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="the modes' layouts / FP8 convs without torch.compile (e.g. FP8's error on a CPU, where compiling "
        "takes minutes)",
    )
    p.add_argument(
        "--error",
        action="store_true",
        help="also each mode's decode error vs the plain module in float32 (relative L2, PSNR over [-1, 1])",
    )
    add_record_flags(p)
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    from cadence.runtime.ltx_fast import MODES

    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        p.error(f"--modes takes {', '.join(MODES)}; got {a.modes}")
    if a.rounds < 1 or a.frames < 1 or a.motion_frames < 1 or a.stream_chunk < 0:
        p.error("--rounds, --frames and --motion-frames must be >= 1, --stream-chunk >= 0")
    return a


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def config_of(args) -> dict:
    cfg = dict(RELEASED_CONFIG)
    if args.config:
        cfg = json.loads(Path(args.config).read_text())
    if args.widths:
        cfg["block_out_channels"] = _ints(args.widths)
    if args.latent_channels:
        cfg["latent_channels"] = args.latent_channels
    if args.layers:
        cfg["layers_per_block"] = _ints(args.layers)
    return cfg


def count_work(cfg: LTXVAEConfig, frames: int, motion: int, h: int, w: int, chunk: int) -> dict:
    """Multiply-adds of the decode / encodes at this geometry, counted on the meta device (no memory), and
    the share of the decode done when the stream (pieces of ``chunk``) yields its first chunk."""
    with torch.device("meta"):
        vae = LTXVideoVAE(cfg)
    macs = [0]

    def hook(m, _i, o):
        macs[0] += (
            o.numel() * m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1] * m.kernel_size[2]
        )

    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.register_forward_hook(hook)
    lat = torch.zeros(vae.latent_shape(frames, h, w), device="meta")
    vae.decode(lat)
    dec = macs[0]
    out = {"decode_gmac": dec / 1e9}
    if chunk:
        macs[0] = 0
        next(iter(vae.stream_decode(lat, chunk)))
        out["stream_first_chunk_work_share"] = macs[0] / dec
    for name, t in (("encode_motion_gmac", motion), ("encode_clip_gmac", frames)):
        macs[0] = 0
        vae.encode(torch.zeros(cfg.in_channels, t, h, w, device="meta"), sample=False)
        out[name] = macs[0] / 1e9
    return out


def _stream_once(vae: LTXVideoVAE, lat: torch.Tensor, chunk: int, timer: Timer) -> tuple[float, float]:
    """(ms to the first pixel chunk, ms in all) of one streamed decode (host clock, device synced)."""
    timer.sync()
    t0 = time.perf_counter()
    it = vae.stream_decode(lat, chunk)
    next(it)
    timer.sync()
    first = (time.perf_counter() - t0) * 1e3
    for _ in it:
        pass
    timer.sync()
    return first, (time.perf_counter() - t0) * 1e3


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def build(args, device: torch.device, dtype: torch.dtype) -> LTXVideoVAE:
    if args.weights:
        return LTXVideoVAE.from_folder(args.weights, device=device, dtype=dtype)
    torch.manual_seed(0)
    return LTXVideoVAE.from_config(config_of(args), device=device, dtype=dtype)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare(args, device, dtype) -> tuple[LTXVideoVAE, dict, dict]:
    """(the plain VAE, {mode: its accelerated copy}, {mode: the fast path's description})."""
    from cadence.runtime.ltx_fast import accelerate_ltx

    base = build(args, device, dtype)
    vaes, described = {}, {}
    for mode in args.modes:
        v = base if mode == "off" and len(args.modes) == 1 else copy.deepcopy(base)
        rep = accelerate_ltx(v, mode)
        if args.eager and "compile" in rep.applied:
            for part in (v.decoder, v.encoder):
                part.forward = part.forward.eager
            rep.applied.remove("compile")
            rep.notes.append("compile skipped (--eager)")
        described[mode] = rep.describe()
        vaes[mode] = v
    return base, vaes, described


def decode_error(base: LTXVideoVAE, vaes: dict, lat: torch.Tensor) -> dict:
    """Each mode's decode of ``lat`` vs the plain module in float32 (same weights): relative L2 and PSNR."""
    ref_vae = copy.deepcopy(base).float()
    ref = ref_vae.decode(lat.float())
    del ref_vae
    out = {}
    for m, v in vaes.items():
        d = v.decode(lat).float() - ref
        mse = float(d.pow(2).mean())
        psnr = 10 * math.log10(4 / mse) if mse > 0 else None  # None: identical
        out[m] = {"rel_l2": float(d.norm() / ref.norm()), "psnr_db": psnr}
    return out


def _time_rounds(args, vaes: dict, lat, clip, timer: Timer) -> dict:
    """Warm-up per mode, then ``--rounds`` rounds, each timing every mode once (decode, encode, stream)."""
    keys = ["decode_ms", "encode_ms"] + (["stream_first_ms", "stream_total_ms"] if args.stream_chunk else [])
    times: dict = {m: {k: [] for k in keys} for m in vaes}

    def one(m: str, v: LTXVideoVAE) -> None:
        times[m]["decode_ms"] += timer.run(lambda: v.decode(lat), warmup=0, iters=1)
        times[m]["encode_ms"] += timer.run(lambda: v.encode(clip, sample=False), warmup=0, iters=1)
        if args.stream_chunk:
            first, total = _stream_once(v, lat, args.stream_chunk, timer)
            times[m]["stream_first_ms"].append(first)
            times[m]["stream_total_ms"].append(total)

    for m, v in vaes.items():
        for _ in range(args.warmup):
            v.decode(lat)
            v.encode(clip, sample=False)
        _log(f"warm: {m}")
    for r in range(args.rounds):
        for m, v in vaes.items():
            one(m, v)
        _log(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {times[m]['decode_ms'][-1]:.1f}" for m in vaes)
        )
    return times


def summarise(times: dict) -> dict:
    """Per mode and figure: median / min / max; per mode vs 'off': the median ratio and 'faster' (the mode's
    worst round beats off's best)."""
    out: dict = {}
    for m, figs in times.items():
        out[m] = {
            k: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
            for k, v in figs.items()
        }
    if "off" in times:
        for m, figs in times.items():
            if m == "off":
                continue
            for k, v in figs.items():
                base = times["off"][k]
                out[m][k]["vs_off"] = statistics.median(base) / statistics.median(v)
                out[m][k]["faster"] = max(v) < min(base)
    return out


@torch.no_grad()
def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype, device)
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    base, vaes, described = prepare(args, device, dtype)
    s = base.spatial_stride
    if args.height % s or args.width % s:
        raise SystemExit(f"error: --height/--width must be multiples of {s} (the VAE's spatial stride)")
    g = torch.Generator().manual_seed(1)
    shape = base.latent_shape(args.frames, args.height, args.width)
    lat = torch.randn(shape, generator=g).to(device, dtype)
    clip = (torch.rand(3, args.motion_frames, args.height, args.width, generator=g) * 2 - 1).to(device, dtype)
    work = count_work(
        base.config, args.frames, args.motion_frames, args.height, args.width, args.stream_chunk
    )
    timer = Timer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _time_rounds(args, vaes, lat, clip, timer)
    error = decode_error(base, vaes, lat) if args.error else None
    results = {
        "modes": described,
        "dtype": str(dtype).replace("torch.", ""),
        "frames": args.frames,
        "motion_frames": args.motion_frames,
        "latent": list(shape),
        "rounds": args.rounds,
        "stream_chunk": args.stream_chunk,
        "weights": args.weights or "random",
        "config": base.config.__dict__,
        "work": work,
        "per_mode": summarise(times),
        "decode_error_vs_fp32": error,
        "eager": args.eager,
        "cudnn_benchmark": args.cudnn_benchmark,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    _print(args, results)
    if not args.no_record:
        _record(args, results, device)
    return results


def _print(args, results: dict) -> None:
    rows = []
    for m, figs in results["per_mode"].items():
        for k, f in figs.items():
            ratio = f" ({f['vs_off']:.2f}x off{', faster' if f['faster'] else ''})" if "vs_off" in f else ""
            rows.append((f"{m} {k}", f"{f['median']:9.2f} ms  [{f['min']:.2f}-{f['max']:.2f}]{ratio}"))
    w = results["work"]
    rows.append(
        (
            "work (GMAC)",
            f"decode {w['decode_gmac']:.4g}, encode {args.motion_frames} frames {w['encode_motion_gmac']:.4g}, "
            f"encode {args.frames} frames {w['encode_clip_gmac']:.4g}",
        )
    )
    for m, e in (results["decode_error_vs_fp32"] or {}).items():
        db = "identical" if e["psnr_db"] is None else f"{e['psnr_db']:.1f} dB"
        rows.append((f"{m} decode vs fp32", f"{100 * e['rel_l2']:.2f}% rel L2, {db}"))
    if "stream_first_chunk_work_share" in w:
        rows.append(
            ("stream: work before 1st chunk", f"{100 * w['stream_first_chunk_work_share']:.1f}% of decode")
        )
    print_table(rows, f"bench vae --decoder ltx: {args.frames}x{args.height}x{args.width} {results['dtype']}")


def _record(args, results: dict, device: torch.device) -> None:
    variant = "-".join(
        ["ltx", results["dtype"], *args.modes]
        + (["eager"] if args.eager else [])
        + (["cudnnbench"] if args.cudnn_benchmark else [])
        + ([] if args.weights else ["random"])
    )
    shape = {"height": args.height, "width": args.width, "frames": args.frames, "latent": results["latent"]}
    dec = results["per_mode"]
    best = min(dec, key=lambda m: dec[m]["decode_ms"]["median"])
    path = record(
        "vae",
        "flashhead-lite",
        1,
        device,
        shape,
        results,
        variant=variant,
        out_dir=results_dir(args),
        command=args.command,
        headline=f"LTX decode {dec[best]['decode_ms']['median']:.1f} ms per {args.frames}-frame clip ({best}), "
        f"encode {dec[best]['encode_ms']['median']:.1f} ms per {args.motion_frames} frames",
    )
    print(f"wrote {path}")
    results["_path"] = str(path)


def run_cli(argv: list[str]) -> int:
    """``argv`` without ``--decoder ltx`` (cadence.bench.vae hands it over)."""
    args = parse(argv)
    args.command = "cadence bench vae --decoder ltx " + " ".join(shlex.quote(a) for a in argv)
    run(args)
    return 0
