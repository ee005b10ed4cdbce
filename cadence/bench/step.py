"""`cadence bench step`: the steady-state chunk step (window full), timed and broken down.

    cadence bench step --preset w14 --cache naive --dtype bf16
    cadence bench step --preset w57 --layers 30      # W57 does not fit one H200 in bf16: run 30 of
                                                     # its 60 layers and scale (stated in the JSON)

One step = the passes of one chunk (plus the clean pass if the config commits that way) through a
cache holding the sink and a full window of random K/V, with random weights initialised on the
device. Reported (BENCHMARKS.md): step median / p99 (CUDA events), the split into attention, cache
upkeep, linear layers and other (from separately instrumented steps: region events per layer),
TFLOP per chunk, the floor (FP8 ceilings, as BENCHMARKS.md defines it; the bf16 floor too),
efficiency, peak memory, and whether the step made a host sync (checked with torch's sync debug
mode on CUDA).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import torch

from cadence.bench.common import CEILING, Timer, median, p99, print_table, record
from cadence.config import CadenceConfig, get_preset
from cadence.telemetry.spans import SpanRecorder

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "float32": torch.float32}


def chunk_flops(cfg: CadenceConfig) -> dict[str, float]:
    """FLOPs of one chunk step (all passes): linear layers and attention, counted from the shapes."""
    m, s = cfg.model, cfg.stream
    d, t = m.dim, cfg.tokens_per_chunk
    frames = s.latent_frames_per_chunk // m.patch[0]
    a = m.audio_tokens_per_frame * frames
    passes = s.passes + (1 if s.commit == "clean_pass" else 0)
    lin = attn = 0.0
    for i in range(m.num_layers):
        lin += 2 * t * d * (3 * d + d)  # qkv + out
        lin += 2 * t * d * (2 * d)  # cross q + out (text K/V once per session: not per chunk)
        lin += 2 * t * d * m.ffn_dim * 2  # ffn in + out
        attn += 4 * t * cfg.kv_tokens * d  # self: QK^T and PV
        attn += 4 * t * m.text_len * d  # cross
        if m.has_audio(i):
            lin += 2 * t * d * 2 * d + 2 * a * d * 2 * d  # audio q/out + audio K/V
            attn += 4 * t * m.audio_tokens_per_frame * d
    patch = m.in_channels * math.prod(m.patch)
    lin += 2 * t * patch * d * 2 + 2 * d * 7 * d  # patch embed, head, time MLP/proj
    if m.audio_every:
        lin += 2 * a * (m.audio_dim * d + d * d)
    return {"linear": lin * passes, "attention": attn * passes, "total": (lin + attn) * passes}


def fill_cache_random(cache, cfg: CadenceConfig, model, gen: torch.Generator) -> None:
    """Fill a cache's window with random K/V, as if window_chunks - 1 chunks had been made."""
    from cadence.cache.ring import RingCache

    m, s = cfg.model, cfg.stream
    if isinstance(cache, RingCache):
        for layer in range(m.num_layers):
            for buf, sc in ((cache.k[layer], cache.k_scale[layer]), (cache.v[layer], cache.v_scale[layer])):
                r = torch.randn(buf.shape, generator=gen, device=model.device, dtype=torch.bfloat16)
                if buf.dtype == torch.float8_e4m3fn:
                    buf.copy_((r * 100).clamp(-448, 448).to(buf.dtype))
                    sc.fill_(1.0 / 100)
                else:
                    buf.copy_(r)
        cache._chunks = s.window_chunks - 1  # the next chunk fills the window: steady state
        return
    shape = (1, cfg.tokens_per_chunk, model.blocks[0].self_attn.heads, m.head_dim)
    for layer in range(m.num_layers):
        cache.past[layer].clear()
        for j in range(s.window_chunks - 1):
            k = torch.randn(shape, generator=gen, device=model.device, dtype=model.dtype)
            v = torch.randn(shape, generator=gen, device=model.device, dtype=model.dtype)
            start = s.sink_frames + j * s.latent_frames_per_chunk
            cache.past[layer].append((k, v, start, s.latent_frames_per_chunk))


def layers_that_fit(cfg: CadenceConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Largest layer count whose weights + cache (+ working room) fit the device's free memory."""
    if device.type != "cuda":
        return cfg.model.num_layers
    m, s = cfg.model, cfg.stream
    el = torch.tensor([], dtype=dtype).element_size()
    per_layer_params = 4 * m.dim**2 * 2 + 2 * m.dim * m.ffn_dim + (4 * m.dim**2 if m.audio_every else 0) / max(
        m.audio_every, 1)
    cache = 2 * cfg.kv_tokens * m.dim * el
    free, _ = torch.cuda.mem_get_info(device)
    room = free - 20 * 2**30  # activations, concatenated windows, allocator slack
    return max(1, min(m.num_layers, int(room // (per_layer_params * el + cache))))


@torch.no_grad()
def measure_step(cfg: CadenceConfig, model, device: torch.device, warmup: int, iters: int,
                 profile_iters: int = 3) -> dict:
    """Time the steady-state chunk step of `cfg` (its cache choice) on a built model: median over
    `iters` uninstrumented steps, the region split from `profile_iters` instrumented ones, and a
    host-sync check (CUDA)."""
    from cadence.engine.generate import StreamGenerator

    gen = StreamGenerator(cfg, model)
    g = torch.Generator(device=device).manual_seed(1)
    image = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g, device=device) * 2 - 1
    sess = gen.session(image, "benchmark prompt", seed=0)
    fill_cache_random(sess.cache, cfg, model, g)
    audio = torch.randn(cfg.audio_samples_per_chunk, generator=g, device=device) * 0.1
    timer = Timer(device)

    def step():
        return sess.step(audio)

    times = timer.run(step, warmup, iters, progress="steps")
    splits: list[dict[str, float]] = []
    totals: list[float] = []
    for _ in range(profile_iters):
        with SpanRecorder(device) as rec:
            t = timer.run(step, 0, 1)[0]
        splits.append(rec.totals())
        totals.append(t)
    region = {k: median([s.get(k, 0.0) for s in splits]) for k in ("attention", "cache", "linear")}
    host_sync = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            host_sync = False
        except RuntimeError as e:
            host_sync = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    cache_bytes = sess.cache.memory_bytes()
    del sess
    return {"times": times, "region": region, "totals": totals, "host_sync": host_sync, "cache_bytes": cache_bytes}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--cache", default="naive", choices=["naive", "ring"])
    p.add_argument("--kv-fp8", action="store_true", help="FP8 K/V (ring: FP8 attention kernel)")
    p.add_argument("--sink-policy", default="follow", choices=["follow", "absolute"])
    p.add_argument("--dtype", default=None, help="bf16 (default on CUDA) | fp32 (default on CPU) | fp16")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (only 1 for now)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--layers", type=int, default=None,
                   help="run this many layers and scale to the preset's count (default: all that fit)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--profile-iters", type=int, default=3, help="instrumented steps for the breakdown")
    p.add_argument("--out-dir", default=None, help="where docs/perf lives (default: the repo's)")
    p.add_argument("--no-record", action="store_true", help="print only; write no JSON")
    p.add_argument("--png", action="store_true", help="also draw the breakdown as a PNG beside the JSON")
    return p.parse_args(argv)


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    from cadence.model.weights import build_model

    if args.tp != 1:
        raise SystemExit("error: --tp > 1 is not available yet (tensor parallelism is a later issue)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    full = get_preset(args.preset).with_overrides(stream={"cache": args.cache, "kv_fp8": args.kv_fp8,
                                                          "sink_policy": args.sink_policy})
    layers = args.layers or layers_that_fit(full, dtype, device)
    layers = min(layers, full.model.num_layers)
    cfg = full.with_overrides(model={"num_layers": layers})
    scale = full.model.num_layers / layers
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    iters = args.iters if args.iters is not None else (20 if device.type == "cuda" else 5)

    print(f"[bench step] {full.name}: {layers}/{full.model.num_layers} layers, {dtype}, cache={args.cache}, "
          f"{device}", file=sys.stderr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(cfg, device, dtype, seed=0)
    m = measure_step(cfg, model, device, warmup, iters, args.profile_iters)
    times, region, totals, host_sync, cache_bytes = (m["times"], m["region"], m["totals"], m["host_sync"],
                                                     m["cache_bytes"])
    step_ms = median(times)
    fl = chunk_flops(full)
    floor_ms = (fl["linear"] / (CEILING["fp8_gemm"] * 1e12) + fl["attention"] / (CEILING["fp8_attn"] * 1e12)) * 1e3
    floor_bf16 = (fl["linear"] / (CEILING["bf16_gemm"] * 1e12) + fl["attention"] / (CEILING["bf16_attn"] * 1e12)) * 1e3
    s_step = step_ms * scale
    regions_scaled = {k: v * scale for k, v in region.items()}
    instrumented = median(totals) * scale
    # The split comes from the instrumented steps (events around every region add a little time):
    # other = instrumented step - the regions; step_ms itself is the uninstrumented median.
    other = max(instrumented - sum(regions_scaled.values()), 0.0)
    results = {
        "step_ms": s_step,
        "step_p99_ms": p99(times) * scale,
        "attention_ms": regions_scaled["attention"],
        "cache_upkeep_ms": regions_scaled["cache"],
        "linear_ms": regions_scaled["linear"],
        "comm_ms": 0.0,
        "other_ms": other,
        "instrumented_step_ms": instrumented,
        "tflop_per_chunk": fl["total"] / 1e12,
        "tflop_linear": fl["linear"] / 1e12,
        "tflop_attention": fl["attention"] / 1e12,
        "tflops_per_gpu": fl["total"] / (s_step * 1e-3) / 1e12,
        "floor_ms": floor_ms,
        "floor_bf16_ms": floor_bf16,
        "efficiency": floor_ms / s_step,
        "efficiency_vs_bf16_floor": floor_bf16 / s_step,
        "cache": args.cache,
        "kv_fp8": args.kv_fp8,
        "cache_mem_gib": cache_bytes * scale / 2**30,
        "fp8": False,
        "fused": False,
        "dtype": str(dtype).replace("torch.", ""),
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
        "layers_run": layers,
        "layers_full": full.model.num_layers,
        "scaled": scale != 1.0,
        "scale_factor": scale,
        "host_sync_in_step": host_sync,
        "iters": iters,
        "warmup": warmup,
        "raw_step_ms_unscaled": times,
    }
    rows = [
        ("step (median)", f"{s_step:9.2f} ms" + (f"   (scaled x{scale:.2f} from {layers} layers)" if scale != 1 else "")),
        ("step p99", f"{results['step_p99_ms']:9.2f} ms"),
        ("attention", f"{results['attention_ms']:9.2f} ms  {results['attention_ms'] / s_step:6.1%}"),
        ("cache upkeep", f"{results['cache_upkeep_ms']:9.2f} ms  {results['cache_upkeep_ms'] / s_step:6.1%}"),
        ("linear", f"{results['linear_ms']:9.2f} ms  {results['linear_ms'] / s_step:6.1%}"),
        ("other", f"{other:9.2f} ms  {other / s_step:6.1%}"),
        ("instrumented step", f"{instrumented:9.2f} ms  (the split above is of this)"),
        ("TFLOP / chunk", f"{results['tflop_per_chunk']:9.2f}  ({results['tflops_per_gpu']:.0f} TFLOP/s)"),
        ("floor (FP8) / bf16", f"{floor_ms:9.2f} ms / {floor_bf16:.2f} ms  efficiency {results['efficiency']:.1%}"),
        ("peak memory", f"{results['peak_mem_gib']:.1f} GiB" if results["peak_mem_gib"] else "n/a (CPU)"),
        ("host sync in step", str(host_sync)),
    ]
    print_table(rows, f"bench step: {full.name} tp1 cache={args.cache}{' fp8 K/V' if args.kv_fp8 else ''} "
                      f"{results['dtype']}")
    if not args.no_record:
        variant = f"{args.cache}{'-fp8kv' if args.kv_fp8 else ''}-{results['dtype']}"
        path = record("step", full.name, args.tp, device, full.shape_summary(), results, variant=variant,
                      out_dir=args.out_dir, command=getattr(args, "command", None),
                      headline=f"step {s_step:.1f} ms, attention {results['attention_ms']:.1f}, cache "
                               f"{results['cache_upkeep_ms']:.1f}, linear {results['linear_ms']:.1f} ms"
                               + (f" (scaled from {layers} layers)" if scale != 1 else ""))
        print(f"wrote {path}")
        if args.png:
            draw_png(path.with_suffix(".png"), results, f"{full.name} step ({results['dtype']}, {args.cache})")
        results["_path"] = str(path)
    return results


def draw_png(path: Path, r: dict, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    parts = [("attention", r["attention_ms"]), ("cache upkeep", r["cache_upkeep_ms"]), ("linear", r["linear_ms"]),
             ("other", r["other_ms"])]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for name, v in parts:
        ax.barh([0], [v], left=left, label=f"{name} {v:.1f} ms")
        left += v
    ax.axvline(r["floor_ms"], color="k", ls="--", lw=1, label=f"floor {r['floor_ms']:.0f} ms")
    ax.set_yticks([])
    ax.set_xlabel("ms per chunk step")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.55), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.command = "cadence bench step " + " ".join(shlex.quote(a) for a in argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
