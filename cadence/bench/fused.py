"""`cadence bench fused`: the row-parallel projection (GEMM + all-reduce) in every comm mode.

    torchrun --nproc_per_node 2 -m cadence bench fused                 # all shapes, bf16 and FP8
    cadence bench fused --nproc 2                                      # same: spawns its own 2 ranks
    torchrun --nproc_per_node 2 -m cadence bench fused --tiny --no-record   # 20 s smoke test

Launch: under torchrun (RANK/WORLD_SIZE set) it runs as that rank; without torchrun it spawns
`--nproc` ranks itself with torch.multiprocessing (loopback rendezvous). Rank 0 prints and records.

Shapes (TP = the group size): the row-parallel layers of W57 and W14 at 748 tokens and W1.3 at
4680: attention out (M x dim/TP -> dim) and FFN out (M x ffn/TP -> dim). Per shape, in bf16 and in
FP8 (``torch._scaled_mm`` rowwise: weights per output channel, activations per token, fast
accumulation, clamp before the cast; activation quantisation counted in the layer's time):
GEMM alone, the all-reduce alone (NCCL, symm-mem two-shot and one-shot), unfused (GEMM + NCCL),
and every fused mode of :mod:`cadence.parallel.fused`; hidden_fraction = (unfused - best fused) /
NCCL all-reduce. Timing: CUDA events around each call, calls queued back to back (the host runs
ahead, as in the model), warm-up first, median of `--reps` (>= 50). Random inputs. Every mode's
output is also compared with the NCCL reference (`rel_err`), and a mode that fell back to NCCL is
marked and never "best". A shape sweep (token counts 64 .. 1496, twice) checks that changing M
neither fails, nor disagrees with NCCL, nor grows memory, nor outgrows the buffer cache.

Writes (rank 0, unless --no-record): docs/perf/fused/<date>-<kind>-all-tp<N>.json per docs/benchmarks.md
and the chooser's table docs/perf/fused/chooser-<kind>-tp<N>.json (read by comm="auto").

``--quant`` (one process, no torchrun): the FP8 activation quantisation before the FP8 GEMMs
(issue 4), eager PyTorch (``quantize_rows``) against the one-launch Triton kernel
(``cadence.kernels.quant``), and the model's LayerNorm + adaLN modulation + bf16 cast + quantisation
eager against the fused ``quantize_rows_modulated``, at M in --quant-m (748, 4680) and K in
--quant-k (1536, 5120, 8192, 12288), bf16 activations, per-sample modulation (the stream's case).
Each variant: CUDA events around calls queued back to back (``*_us``: what eager execution pays,
launch overhead included) and the same calls replayed from a CUDA graph (``*_graph_us``: GPU time
only, as under the runtime's graphs); bytes moved (counted) and the floor at 4.2 TB/s; the FP8 GEMM
M x K -> K for scale; byte-for-byte parity with the reference. ``--quant-sweep`` also times the
kernels' launch configurations. On CPU it is a smoke test at tiny shapes (Triton interpreter).
Writes docs/perf/fused/<date>-<kind>-<all|tiny>-tp1-quant.json.

    PYTHONPATH=. python3 -m cadence bench fused --quant [--quant-sweep] [--no-record]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist

from cadence.bench.results import add_record_flags, results_dir
from cadence.net import free_port

FUSED_MODES = ["two_shot", "one_shot", "rs_ag", "chunked2", "chunked4", "tiles"]
SWEEP_M = [64, 128, 80, 37, 512, 748, 1496, 64]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench fused", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="w57,w14,w1.3", help="comma list of presets whose shapes to run")
    p.add_argument("--tiny", action="store_true", help="one small shape only (smoke test)")
    p.add_argument("--dtypes", default="bf16,fp8", help="comma list: bf16, fp8")
    p.add_argument("--modes", default=",".join(FUSED_MODES), help="fused modes to time")
    p.add_argument("--m", type=int, default=None, help="override the token count M of every shape")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-sweep", action="store_true", help="skip the changing-M sweep")
    p.add_argument("--sweep-mode", default="two_shot", help="the comm mode the changing-M sweep runs")
    p.add_argument(
        "--timing",
        default="graph",
        choices=["graph", "eager"],
        help="graph (CUDA default): calls replayed from a CUDA graph, GPU time only, as in a graphed "
        "step; eager: events around each Python call (host launch time included)",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    add_record_flags(p)
    p.add_argument(
        "--quant",
        action="store_true",
        help="time FP8 activation quantisation (eager vs one-launch Triton), one process; see above",
    )
    p.add_argument("--quant-m", default=None, help="--quant: comma list of token counts (default 748,4680)")
    p.add_argument(
        "--quant-k", default=None, help="--quant: comma list of row lengths (default 1536,5120,8192,12288)"
    )
    p.add_argument(
        "--quant-sweep", action="store_true", help="--quant: also sweep the kernels' launch configs"
    )
    p.add_argument("--no-gemm", action="store_true", help="--quant: skip the FP8 GEMM timed for scale")
    return p.parse_args(argv)


def shapes(args, world: int) -> list[dict]:
    from cadence.config import get_preset

    if args.tiny:
        m = args.m or 64
        return [
            {"name": "tiny attn_out", "m": m, "n": 256, "k": 256 // world},
            {"name": "tiny ffn_out", "m": m, "n": 256, "k": 1024 // world},
        ]
    out = []
    for p in [s.strip() for s in args.presets.split(",") if s.strip()]:
        cfg = get_preset(p)
        m = args.m or cfg.tokens_per_chunk
        d, f = cfg.model.dim, cfg.model.ffn_dim
        out.append({"name": f"{p} attn_out", "m": m, "n": d, "k": d // world})
        out.append({"name": f"{p} ffn_out", "m": m, "n": d, "k": f // world})
    return out


class Bench:
    """Times one call. Eager (default on CPU): CUDA events around each call, calls queued back to back,
    so host time the GPU waits for (Python, the FP8 layer's quantisation launches) is counted.
    Graphed (default on CUDA, ``--timing graph``): ``inner`` calls captured in one CUDA graph per
    rank and replayed; the median replay divided by ``inner`` is GPU time only, which is what a
    graph-replayed chunk step pays. Every rank captures or none does (a failed capture anywhere: that
    measurement is timed eagerly on every rank, noted in ``graph_failures``)."""

    def __init__(
        self, device: torch.device, warmup: int, reps: int, timing: str = "eager", group=None, inner: int = 20
    ):
        self.device, self.warmup, self.reps = device, warmup, reps
        self.cuda = device.type == "cuda"
        self.timing = timing if self.cuda else "eager"
        self.group, self.inner = group, inner
        self.graph_failures: list[str] = []
        self.eager_timed = 0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_us(self, fn) -> float:
        """Median microseconds of fn() (CUDA events per call, calls queued back to back)."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        dist.barrier()
        self.sync()
        if self.timing == "graph":
            t = self._graph_us(fn)
            if t is not None:
                dist.barrier()
                return t
            self.eager_timed += 1
        if self.cuda:
            evs = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(self.reps)
            ]
            for a, b in evs:
                a.record()
                fn()
                b.record()
            self.sync()
            ts = sorted(a.elapsed_time(b) * 1e3 for a, b in evs)
        else:
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            ts.sort()
        dist.barrier()
        return float(ts[len(ts) // 2])

    def _graph_us(self, fn) -> float | None:
        from cadence.parallel.graphs import all_ranks_ok

        graph, err = None, None
        try:
            graph = _capture_calls(fn, self.inner, warm=0)  # time_us warmed up already
        except Exception as e:  # noqa: BLE001  (agree first, then time eagerly)
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if not all_ranks_ok(err is None, self.group):
            self.graph_failures.append(err or "capture failed on another rank")
            return None
        dist.barrier()
        return _replay_us(graph, self.inner, max(5, self.reps // 5))


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _fallbacks() -> int:
    from cadence.parallel import fused

    return sum(fused.fallback_warnings().values())


def _safe(results: dict, key: str, fn):
    """Run a measurement; on error record it and return None (the table still prints)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        results.setdefault("errors", {})[key] = msg
        print(f"[bench fused] {key} failed: {msg}", file=sys.stderr, flush=True)
        return None


@torch.no_grad()
def measure_shape(sh: dict, dt: str, modes: list[str], bench: Bench, group, world: int) -> dict:
    """One shape in one dtype: the GEMM alone, the all-reduce alone (NCCL, symm-mem two-shot and one-shot),
    unfused (GEMM + NCCL) and every mode of ``modes``, each output against NCCL's."""
    from cadence.model.layers import Linear
    from cadence.parallel.tp import RowParallelLinear
    from cadence.quant.fp8 import FP8Linear

    dev = bench.device
    m, n, k = sh["m"], sh["n"], sh["k"]
    act = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(1234 + dist.get_rank())  # each rank its own shard
    lin = Linear(k, n, bias=False, device=dev, dtype=act)
    lin.weight.normal_(0.0, (k * world) ** -0.5, generator=g)
    lin.requires_grad_(False)
    if dt == "fp8":
        lin = FP8Linear.from_linear(lin)
    rpl = RowParallelLinear(lin, None, group, comm="nccl")
    x = torch.randn(m, k, device=dev, dtype=act, generator=g)
    r: dict = {
        "name": sh["name"],
        "m": m,
        "n": n,
        "k": k,
        "dtype": dt,
        "act_dtype": str(act).replace("torch.", ""),
    }
    _time_gemms(r, lin, x, dt, modes, bench)
    _time_allreduces(r, torch.randn(m, n, device=dev, dtype=act, generator=g), bench, group)
    _time_modes(r, rpl, x, modes, bench)
    if dt == "fp8":  # did this layer really run torch._scaled_mm (every mode, every call), or fall back?
        r["fp8_scaled_mm_calls"], r["fp8_fallback_calls"] = lin.scaled_mm_calls, lin.fallback_calls
        r["fp8_fallback_reason"] = lin.fallback_reason
    return r


def _time_gemms(r: dict, lin, x, dt: str, modes: list[str], bench: Bench) -> None:
    """``gemm_us`` (the layer), and on CUDA: FP8's activation quantisation alone and its GEMM kernel alone, the
    tile kernel's GEMM with its exchange off (with mode 'tiles')."""
    from cadence.quant.fp8 import quantize_rows

    r["gemm_us"] = _safe(r, "gemm", lambda: bench.time_us(lambda: lin(x)))
    if dt == "fp8" and bench.cuda:
        from cadence.quant.fp8 import quantize_activations

        # the activation quantisation alone (the one-launch Triton kernel where usable): gemm_us is
        # about quant_us + gemm_kernel_us + the layer's Python / launch overhead
        r["quant_us"] = _safe(r, "quant", lambda: bench.time_us(lambda: quantize_activations(x)))
        xq, xs = quantize_rows(x)

        def kernel():
            return torch._scaled_mm(
                xq,
                lin.weight_fp8.t(),
                scale_a=xs,
                scale_b=lin.weight_scale,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )

        r["gemm_kernel_us"] = _safe(r, "gemm_kernel", lambda: bench.time_us(kernel))
    if "tiles" in modes and bench.cuda:
        # the tile kernel's own GEMM with the exchange switched off: what it hides the all-reduce under
        # (its gap to cuBLAS's gemm_kernel_us is the price of a hand-written GEMM)
        from cadence.kernels import gemm_allreduce as gar

        if dt == "fp8":
            xq, xs = quantize_rows(x)
            args_ = (xq, lin.weight_fp8, xs.reshape(-1), lin.weight_scale.reshape(-1))
        else:
            args_ = (x, lin.weight, None, None)
        r["tiles_gemm_us"] = _safe(r, "tiles_gemm", lambda: bench.time_us(lambda: gar.gemm_only(*args_)))


def _time_allreduces(r: dict, y0, bench: Bench, group) -> None:
    """The all-reduce of the layer's output alone: NCCL, and symm-mem two-shot / one-shot where usable."""
    from cadence.parallel import fused

    dev = bench.device
    m, n = y0.shape
    r["allreduce_us"] = _safe(
        r, "allreduce_nccl", lambda: bench.time_us(lambda: dist.all_reduce(y0, group=group))
    )
    if fused.symm_unavailable_reason(dev, group) is not None:
        r["allreduce_two_shot_us"] = r["allreduce_one_shot_us"] = None
        return
    gname = fused.group_name(group)

    def symm_buf():
        b = fused.symm_cache().get(m, n, y0.dtype, dev, group)[: m * n].view(m, n)
        b.copy_(y0)
        return b

    def two_shot() -> float:
        b = symm_buf()  # one buffer for every timed call
        return bench.time_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", gname))

    def one_shot() -> float:
        b = symm_buf()
        return bench.time_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(b, "sum", gname))

    r["allreduce_two_shot_us"] = _safe(r, "allreduce_two_shot", two_shot)
    r["allreduce_one_shot_us"] = _safe(r, "allreduce_one_shot", one_shot)


def _time_modes(r: dict, rpl, x, modes: list[str], bench: Bench) -> None:
    """Unfused (GEMM + NCCL) and each fused mode (its error against NCCL's output, whether it fell back),
    then the best mode and the share of the all-reduce it hides."""
    rpl.comm = "nccl"
    ref = rpl(x)
    r["unfused_us"] = _safe(r, "unfused", lambda: bench.time_us(lambda: rpl(x)))
    r["modes"] = {"nccl": r["unfused_us"]}
    r["rel_err"] = {}
    r["fell_back"] = []
    for mode in modes:

        def run_mode(mode=mode):
            rpl.comm = mode
            before = _fallbacks()
            y = rpl(x)
            fell = _fallbacks() != before
            err = _rel(y, ref)
            t = bench.time_us(lambda: rpl(x))
            return t, fell, err

        out = _safe(r, mode, run_mode)
        if out is None:
            r["modes"][mode] = None
            continue
        t, fell, err = out
        r["modes"][mode] = t
        r["rel_err"][mode] = err
        if fell:
            r["fell_back"].append(mode)
    rpl.comm = "nccl"
    usable = {md: t for md, t in r["modes"].items() if t is not None and md not in r["fell_back"]}
    fused_only = {md: t for md, t in usable.items() if md != "nccl"}
    r["best_mode"] = min(usable, key=usable.get) if usable else "nccl"
    r["best_fused_mode"] = min(fused_only, key=fused_only.get) if fused_only else None
    r["fused_us"] = fused_only[r["best_fused_mode"]] if fused_only else None
    if r["fused_us"] is not None and r["unfused_us"] and r["allreduce_us"]:
        r["hidden_fraction"] = (r["unfused_us"] - r["fused_us"]) / r["allreduce_us"]
    else:
        r["hidden_fraction"] = None


@torch.no_grad()
def shape_sweep(dev: torch.device, group, world: int, mode: str) -> dict:
    """Changing M through one layer in `mode` (twice): outputs vs nccl, cache bound, memory growth."""
    from cadence.model.layers import Linear
    from cadence.parallel import fused
    from cadence.parallel.tp import RowParallelLinear

    act = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n, k = 1024, 512
    g = torch.Generator(device=dev).manual_seed(99 + dist.get_rank())
    lin = Linear(k, n, bias=False, device=dev, dtype=act).requires_grad_(False)
    lin.weight.normal_(0.0, k**-0.5, generator=g)
    rpl = RowParallelLinear(lin, torch.randn(n, device=dev, dtype=act, generator=g), group, comm=mode)
    ref = RowParallelLinear(lin, rpl.bias, group, comm="nccl")
    errs, mem = [], []
    before = _fallbacks()
    for _ in range(2):
        for m in SWEEP_M:
            x = torch.randn(m, k, device=dev, dtype=act, generator=g)
            errs.append(_rel(rpl(x), ref(x)))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            mem.append(torch.cuda.memory_allocated(dev))
    info = fused.symm_cache_info()
    return {
        "mode": mode,
        "token_counts": SWEEP_M,
        "max_rel_err": max(errs),
        "cache": info,
        "fell_back": _fallbacks() != before,
        "tile_states": fused.tile_states_info(),
        "mem_after_round_bytes": mem,
        "mem_growth_bytes": (mem[1] - mem[0]) if len(mem) == 2 else None,
        "ok": max(errs) < 2e-2
        and info["entries"] <= info["max_entries"]
        and (len(mem) < 2 or mem[1] <= mem[0]),
    }


def _f(v, w=8, d=1) -> str:
    return f"{v:{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"


def print_summary(rows: list[dict], modes: list[str], world: int, sweep) -> None:
    hdr = (
        f"{'shape':<16}{'dt':>5}{'M':>6}{'K':>7}{'N':>6}{'gemm':>8}{'AR':>8}{'AR2sh':>8}{'AR1sh':>8}"
        f"{'unfused':>8}" + "".join(f"{md[:8]:>9}" for md in modes) + f"{'best':>10}{'hidden':>8}"
    )
    print(f"\nbench fused: row-parallel GEMM + all-reduce, TP={world}, microseconds (medians)")
    print(hdr)
    for r in rows:
        cells = ""
        for md in modes:
            t = (r.get("modes") or {}).get(md)
            mark = "*" if md in r.get("fell_back", []) else " "
            cells += _f(t, 8) + mark
        hf = r.get("hidden_fraction")
        print(
            f"{r['name']:<16}{r['dtype']:>5}{r['m']:>6}{r['k']:>7}{r['n']:>6}{_f(r.get('gemm_us'))}"
            f"{_f(r.get('allreduce_us'))}{_f(r.get('allreduce_two_shot_us'))}{_f(r.get('allreduce_one_shot_us'))}"
            f"{_f(r.get('unfused_us'))}{cells}{r.get('best_mode', '-'):>10}{_f(hf, 8, 2)}"
        )
    print(
        "AR = NCCL all-reduce alone; AR2sh / AR1sh = symm-mem two-/one-shot alone; * = fell back to nccl;"
        " hidden = (unfused - best fused) / AR"
    )
    if any(r.get("tiles_gemm_us") for r in rows):
        print(
            "tiles: the tile kernel's GEMM alone (no exchange) vs cuBLAS: "
            + ", ".join(
                f"{r['name']} {r['dtype']} {_f(r.get('tiles_gemm_us'), 1, 1).strip()} vs "
                f"{_f(r.get('gemm_kernel_us') or r.get('gemm_us'), 1, 1).strip()}"
                for r in rows
                if r.get("tiles_gemm_us")
            )
        )
    errs = {md: max((r.get("rel_err") or {}).get(md, 0.0) for r in rows) for md in modes}
    print("max relative error vs nccl: " + ", ".join(f"{md} {e:.1e}" for md, e in errs.items()))
    if sweep:
        print(
            f"shape sweep ({sweep['mode']}, M={sweep['token_counts']} x2): ok={sweep['ok']} max_rel_err="
            f"{sweep['max_rel_err']:.1e} cache={sweep['cache']['entries']}/{sweep['cache']['max_entries']} entries "
            f"{sweep['cache']['bytes'] / 2**20:.1f} MiB, memory growth {sweep['mem_growth_bytes']}"
        )


def shape_recipes(args, world: int, device: torch.device) -> dict:
    """The recipe of each preset whose shapes run ('w57 tp2' -> what ``cadence serve --model w57 --tp 2``
    builds on this device: its geometry, comm 'auto', the kernel switches in effect, e.g. the CADENCE_TILES_*
    variants): printed and recorded (``recipes``); the modes and dtypes timed are this benchmark's own."""
    from cadence.engine.recipe import EngineSpec, resolve

    names = ["tiny"] if args.tiny else [s.strip() for s in args.presets.split(",") if s.strip()]
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    return {f"{p} tp{world}": resolve(EngineSpec(model=p, tp=world), dev) for p in names}


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    from cadence.bench.recipes import print_recipes
    from cadence.parallel import destroy_tp, fused, init_tp

    info = init_tp()
    rank, world, dev = info.rank, info.world_size, info.device
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cadence.parallel.fused").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:
        modes = [md.strip() for md in args.modes.split(",") if md.strip()]
        for md in modes:
            fused.parse_mode(md)
        bench = Bench(dev, args.warmup, max(args.reps, 5), timing=args.timing, group=info.group)
        recipes = shape_recipes(args, world, dev)
        if rank == 0:
            print_recipes(recipes, sys.stderr)
            print(
                f"[bench fused] TP={world} {info.backend} on {dev}; torch {torch.__version__}; "
                f"symm-mem: {fused.symm_unavailable_reason(dev, info.group) or 'available'}",
                file=sys.stderr,
                flush=True,
            )
        rows = _measure_rows(args, bench, info, modes)
        sweep = None
        if not args.no_sweep:
            sweep = _safe({}, "sweep", lambda: shape_sweep(dev, info.group, world, args.sweep_mode))
        results = _results(rows, modes, bench, sweep)
        if rank == 0:
            print_summary(rows, modes, world, sweep)
        if rank == 0 and not args.no_record:
            _record_fused(args, results, recipes, dev, world)
        return results
    finally:
        destroy_tp()


def _measure_rows(args, bench: Bench, info, modes: list[str]) -> list[dict]:
    """Every shape in every dtype of ``--dtypes`` (:func:`measure_shape`), rank 0 printing a line per row."""
    world = info.world_size
    rows = []
    for sh in shapes(args, world):
        for dt in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            t0 = time.perf_counter()
            r = measure_shape(sh, dt, modes, bench, info.group, world)
            rows.append(r)
            if info.rank == 0:
                print(
                    f"[bench fused] {sh['name']} {dt}: unfused {_f(r['unfused_us'], 1)} us, best "
                    f"{r['best_mode']} ({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def _results(rows: list[dict], modes: list[str], bench: Bench, sweep) -> dict:
    from cadence.parallel import fused
    from cadence.quant import fp8 as fp8_mod

    return {
        "shapes": rows,
        "modes_timed": modes,
        "timing": bench.timing,
        "graph_failures": bench.graph_failures,
        "eager_timed_after_capture_failure": bench.eager_timed,
        "shape_sweep": sweep,
        "symm_cache": fused.symm_cache_info(),
        "fallback_warnings": fused.fallback_warnings(),
        "fp8_quant_backend": fp8_mod.quant_backend(),
        "fp8_refused": {" ".join(str(k) for k in key): why for key, why in fp8_mod._op_unusable.items()},
    }


def _record_fused(args, results: dict, recipes: dict, dev: torch.device, world: int) -> None:
    """The JSON record (with the recipes) and the chooser's table beside it (read by comm 'auto')."""
    from cadence.bench.common import device_kind, record
    from cadence.bench.recipes import recipe_fields

    rows = results["shapes"]
    kind = device_kind(dev, world)
    good = [r for r in rows if r.get("hidden_fraction") is not None]
    headline = ", ".join(
        f"{r['name']} {r['dtype']} {r['best_mode']} hidden {r['hidden_fraction']:.2f}" for r in good[:4]
    )
    path = record(
        "fused",
        "tiny" if args.tiny else "all",
        world,
        dev,
        {"shapes": [{k: s[k] for k in ("name", "m", "n", "k")} for s in shapes(args, world)]},
        results,
        out_dir=results_dir(args),
        world=world,
        command=getattr(args, "command", None),
        extra=recipe_fields(recipes),
        headline=headline or "no fused mode measured",
    )
    print(f"wrote {path}")
    table = {
        "kind": "chooser",
        "device": kind,
        "world": world,
        "torch": torch.__version__,
        "source": str(path.name),
        "entries": [
            {
                "m": r["m"],
                "n": r["n"],
                "k": r["k"],
                "dtype": r["dtype"],
                "world": world,
                "best_mode": r["best_mode"],
                "modes_us": r["modes"],
                **({"fp8_fallback_calls": r.get("fp8_fallback_calls")} if r["dtype"] == "fp8" else {}),
            }
            for r in rows
        ],
    }
    tpath = path.parent / f"chooser-{kind}-tp{world}.json"
    tpath.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {tpath}")
    results["_path"] = str(path)


def _spawned(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    if not torch.cuda.is_available():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    args = parse(argv)
    args.command = "cadence bench fused " + " ".join(shlex.quote(a) for a in argv)
    run(args)


# ---- --quant: FP8 activation quantisation, eager vs one launch ----------------------------------
QUANT_M = (748, 4680)
QUANT_K = (1536, 5120, 8192, 12288)
TINY_QUANT_M = (64,)
TINY_QUANT_K = (128, 320)
HBM_TBPS = 4.2  # docs/benchmarks.md: device copy, read + write
LN_EPS = 1e-6


def quant_bytes(m: int, k: int, el: int = 2, per_token_mod: bool = False) -> dict[str, int]:
    """Bytes each variant moves through HBM for an [m, k] activation of `el`-byte elements (counted
    from the ops; the [m, 1] scale vectors and the per-sample modulation rows are negligible).

    eager quantize_rows: inf-norm (read x), x * (1/scale) promoted to float32 (read x, write 4 B),
    clamp_ in place (read + write 4 B), cast (read 4 B, write 1 B): 2 + 2 + 4 + 8 + 5 = 21 B/elem.
    Triton: read x, write 1 B: 3 B/elem. Eager modulated chain as Block.forward runs it:
    x.float() (2 + 4), layer_norm (read 4, write 4), * (1 + scale) (4 + 4), + shift (4 + 4),
    .to(bf16) (4 + 2), then quantize_rows: 36 + 21 = 57 B/elem. Fused: 3 B/elem (+ 8 B/elem of
    shift / scale when they are per token)."""
    n = m * k
    mod = 8 * n if per_token_mod else 0
    return {
        "eager": (el + el + 4 + 8 + 5) * n,
        "triton": (el + 1) * n,
        "mod_eager": (el + 4 + 8 + 8 + 8 + 4 + el) * n + (el + el + 4 + 8 + 5) * n + mod,
        "mod_triton": (el + 1) * n + mod,
    }


def _time_calls_us(fn, warmup: int, reps: int, cuda: bool) -> float:
    """Median microseconds per call, calls queued back to back (CUDA events) or host-timed (CPU)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        evs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for a, b in evs:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        ts = sorted(a.elapsed_time(b) * 1e3 for a, b in evs)
    else:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        ts.sort()
    return float(ts[len(ts) // 2])


def _capture_calls(fn, inner: int, warm: int = 3) -> torch.cuda.CUDAGraph:
    """`warm` eager calls on a side stream, then `inner` calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    return g


def _replay_us(g: torch.cuda.CUDAGraph, inner: int, replays: int) -> float:
    """Median microseconds per captured call over `replays` timed replays of `g` (GPU time only)."""
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    evs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)
    ]
    for a, b in evs:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1e3 / inner for a, b in evs)
    return float(ts[len(ts) // 2])


def _time_graph_us(fn, inner: int = 20, replays: int = 20) -> float:
    """Median microseconds per call of `inner` calls captured in one CUDA graph (GPU time only)."""
    return _replay_us(_capture_calls(fn, inner), inner, replays)


def _quant_parity(q, s, qr, sr) -> dict:
    bq, br = q.view(torch.uint8), qr.view(torch.uint8)
    d = (q.float() * (s / sr) - qr.float()).abs()
    step = torch.exp2(torch.floor(torch.log2(qr.float().abs().clamp_min(2.0**-6))) - 3)
    return {
        "bytes_differ": int((bq != br).sum().item()),
        "elements": bq.numel(),
        "scales_equal": bool(torch.equal(s, sr)),
        "scale_max_rel": float(((s - sr).abs() / sr).max().item()) if s.numel() else 0.0,
        "max_steps_off": float((d / step).max().item()) if d.numel() else 0.0,
    }


def _sweep(fn_of_cfg, cfgs, cuda: bool, warmup: int, reps: int) -> dict:
    out = {}
    for cfg in cfgs:
        key = ",".join(f"{k}={v}" for k, v in cfg.items())
        try:
            call = functools.partial(fn_of_cfg, **cfg)
            out[key] = _time_graph_us(call) if cuda else _time_calls_us(call, 1, max(1, reps // 5), False)
        except Exception as e:  # noqa: BLE001  (a config a kernel rejects: recorded, not fatal)
            out[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


@torch.no_grad()
def measure_quant(m: int, k: int, dev: torch.device, warmup: int, reps: int, sweep: bool, gemm: bool) -> dict:
    """One (M, K): eager vs Triton quantisation, plain and modulated (eager calls, graph replays), their
    parity, the FP8 GEMM for scale (``gemm``), bytes and floors, and with ``sweep`` the launch configs."""
    from cadence.kernels import quant as kq
    from cadence.quant.fp8 import quantize_rows

    cuda = dev.type == "cuda"
    act = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(m * 131 + k)
    x = torch.randn(m, k, device=dev, dtype=act, generator=g)
    x3 = x.view(1, m, k)
    shift = torch.randn(1, 1, k, device=dev, generator=g) * 0.1  # per sample, float32 (BlockMod)
    scale = torch.randn(1, 1, k, device=dev, generator=g) * 0.1
    r: dict = {"m": m, "k": k, "dtype": str(act).replace("torch.", ""), "modulation": "per_sample"}
    ok, why = kq.triton_usable(x, allow_interpreter=True)
    r["triton_usable"], r["triton_why_not"] = ok, why or None
    by = quant_bytes(m, k, x.element_size())
    r["bytes"] = by
    r["floor_us"] = {name: b / (HBM_TBPS * 1e12) * 1e6 for name, b in by.items()}
    fns = {
        "eager": lambda: quantize_rows(x),
        "mod_eager": lambda: kq.quantize_rows_modulated_reference(x3, shift, scale, LN_EPS),
        "triton": lambda: kq.quantize_rows_triton(x),
        "triton_hwcast": lambda: kq.quantize_rows_triton(x, grid_round=False),
        "mod_triton": lambda: kq.quantize_rows_modulated_triton(x3, shift, scale, LN_EPS),
    }
    r.update(_time_quant(r, fns, ok, cuda, warmup, reps))
    if cuda and gemm:
        r["gemm_fp8_us"] = _safe(r, "gemm_fp8", lambda: _time_fp8_gemm(x, g, warmup, reps))
    if ok:
        r.update(_quant_ratios(r, fns, cuda, reps))
    for name, key in (("triton", "triton_graph_us"), ("mod_triton", "mod_triton_graph_us")):
        if r.get(key):
            r[f"{name}_tbps"] = by[name] / (r[key] * 1e-6) / 1e12
    if sweep and ok:
        r.update(_quant_sweeps(x, x3, shift, scale, cuda, warmup, reps))
    return r


def _time_quant(r: dict, fns: dict, ok: bool, cuda: bool, warmup: int, reps: int) -> dict:
    """The timings of :func:`measure_quant` (``<name>_us`` eager calls, ``<name>_graph_us`` graph replays on
    CUDA; the Triton ones only where ``ok``) and the parity fields it writes into ``r``."""
    eager, mod_eager, trit, trit_hw, mod_trit = (
        fns[n] for n in ("eager", "mod_eager", "triton", "triton_hwcast", "mod_triton")
    )
    res: dict = {}
    res["eager_us"] = _safe(r, "eager", lambda: _time_calls_us(eager, warmup, reps, cuda))
    res["mod_eager_us"] = _safe(r, "mod_eager", lambda: _time_calls_us(mod_eager, warmup, reps, cuda))
    if ok:
        r["parity"] = _safe(r, "parity", lambda: _quant_parity(*trit(), *eager()))
        r["parity_modulated"] = _safe(r, "parity_modulated", lambda: _quant_parity(*mod_trit(), *mod_eager()))
        res["triton_us"] = _safe(r, "triton", lambda: _time_calls_us(trit, warmup, reps, cuda))
        res["mod_triton_us"] = _safe(r, "mod_triton", lambda: _time_calls_us(mod_trit, warmup, reps, cuda))
        if cuda:
            r["parity_hwcast"] = _safe(r, "parity_hwcast", lambda: _quant_parity(*trit_hw(), *eager()))
            res["triton_hwcast_us"] = _safe(
                r, "triton_hwcast", lambda: _time_calls_us(trit_hw, warmup, reps, cuda)
            )
    if cuda:
        res["eager_graph_us"] = _safe(r, "eager_graph", lambda: _time_graph_us(eager))
        res["mod_eager_graph_us"] = _safe(r, "mod_eager_graph", lambda: _time_graph_us(mod_eager))
        if ok:
            res["triton_graph_us"] = _safe(r, "triton_graph", lambda: _time_graph_us(trit))
            res["triton_hwcast_graph_us"] = _safe(r, "triton_hwcast_graph", lambda: _time_graph_us(trit_hw))
            res["mod_triton_graph_us"] = _safe(r, "mod_triton_graph", lambda: _time_graph_us(mod_trit))
    return res


def _quant_ratios(r: dict, fns: dict, cuda: bool, reps: int, n_rounds: int = 5) -> dict:
    """Every "x faster" of :func:`measure_quant` from interleaved rounds (``cadence.bench.rounds``: eager and
    Triton alternating, >= 5 rounds, each round one graph capture's replays on CUDA / a few calls on the CPU):
    ``speedup_<name>`` is the median of the per-round ratios, ``rounds[<name>]`` has its min-max and the
    verdict (faster only where the Triton kernel's worst round beats the eager path's best)."""
    from cadence.bench.rounds import compare, interleave

    out: dict = {"rounds": {}}
    pairs = [("eager", "eager", "triton"), ("mod_eager", "mod_eager", "mod_triton")]
    if cuda:
        pairs += [("eager_graph", "eager", "triton"), ("mod_eager_graph", "mod_eager", "mod_triton")]
    for name, base, var in pairs:
        variants = {
            n: functools.partial(_one_round, fns[n], name.endswith("_graph"), cuda, reps) for n in (base, var)
        }
        times = _safe(r, f"rounds_{name}", functools.partial(interleave, variants, n_rounds))
        ratio = compare(times, base, var) if isinstance(times, dict) else None
        if ratio is not None:
            out["rounds"][name] = ratio.as_dict()
            out[f"speedup_{name}"] = ratio.median
    return out


def _one_round(fn, graph: bool, cuda: bool, reps: int) -> float:
    """One round of an interleaved comparison: a graph capture's replays (GPU time) or a few calls."""
    if graph:
        return _time_graph_us(fn, replays=max(5, reps // 4))
    return _time_calls_us(fn, 1, max(3, reps // 4), cuda)


def _time_fp8_gemm(x, g, warmup: int, reps: int) -> float:
    """The FP8 GEMM M x K -> K (cuBLAS rowwise, fast accumulation) for scale, in microseconds (CUDA)."""
    from cadence.quant.fp8 import quantize_rows

    k = x.shape[1]
    w = torch.randn(k, k, device=x.device, generator=g) * k**-0.5
    wq, ws = quantize_rows(w)
    del w
    xq, xs = quantize_rows(x)
    wst = ws.t().contiguous()  # [1, K], scale_b's layout (as FP8Linear keeps it)
    return _time_calls_us(
        lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=xs, scale_b=wst, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        warmup,
        reps,
        True,
    )


def _quant_sweeps(x, x3, shift, scale, cuda: bool, warmup: int, reps: int) -> dict:
    """``--quant-sweep``: the quantisation kernels' launch configurations (block rows x warps [x programs per
    SM for the modulated one])."""
    from cadence.kernels import quant as kq

    bk = kq.launch_config(x.shape[1], not cuda)[1]
    bms = [bm for bm in (1, 2, 4, 8) if bm * bk <= 32768]
    nws = (4, 8, 16) if cuda else (None,)
    return {
        "sweep_triton": _sweep(
            lambda block_m, num_warps: kq.quantize_rows_triton(x, block_m=block_m, num_warps=num_warps),
            [{"block_m": bm, "num_warps": nw} for bm in bms for nw in nws],
            cuda,
            warmup,
            reps,
        ),
        "sweep_mod_triton": _sweep(
            lambda block_m, num_warps, programs_per_sm: kq.quantize_rows_modulated_triton(
                x3,
                shift,
                scale,
                LN_EPS,
                block_m=block_m,
                num_warps=num_warps,
                programs_per_sm=programs_per_sm,
            ),
            [
                {"block_m": bm, "num_warps": nw, "programs_per_sm": p}
                for bm in bms
                for nw in nws
                for p in (1, 2, 4, 8)
            ],
            cuda,
            warmup,
            reps,
        ),
    }


def run_quant(args: argparse.Namespace) -> dict:
    """``cadence bench fused --quant``: one process, CUDA if available, else a CPU smoke test through
    the Triton interpreter at tiny shapes."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported
    from cadence.bench.common import record

    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tiny = args.tiny or not cuda
    ms = (
        [int(v) for v in args.quant_m.split(",")] if args.quant_m else list(TINY_QUANT_M if tiny else QUANT_M)
    )
    ks = (
        [int(v) for v in args.quant_k.split(",")] if args.quant_k else list(TINY_QUANT_K if tiny else QUANT_K)
    )
    reps = max(args.reps, 5) if cuda else 3
    warmup = args.warmup if cuda else min(args.warmup, 2)
    print(
        f"[bench fused --quant] {dev} torch {torch.__version__}; M {ms} x K {ks}; reps {reps}"
        + ("" if cuda else " (CPU: Triton interpreter, a smoke test; times mean nothing)"),
        file=sys.stderr,
        flush=True,
    )
    rows = []
    for m in ms:
        for k in ks:
            t0 = time.perf_counter()
            r = measure_quant(m, k, dev, warmup, reps, args.quant_sweep, cuda and not args.no_gemm)
            rows.append(r)
            print(
                f"[bench fused --quant] M={m} K={k}: eager {_f(r.get('eager_us'), 1)} us, triton "
                f"{_f(r.get('triton_us'), 1)} us; modulated eager {_f(r.get('mod_eager_us'), 1)} us, fused "
                f"{_f(r.get('mod_triton_us'), 1)} us ({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    print_quant_summary(rows, cuda)
    from cadence.engine.recipe import kernel_switches

    # no model's engine here (M x K shapes): the kernel switches in effect (CADENCE_FP8_QUANT, ...) instead
    results = {
        "quant": rows,
        "hbm_tbps_assumed": HBM_TBPS,
        "ln_eps": LN_EPS,
        "env": kernel_switches(os.environ),
    }
    if not args.no_record:
        key = next((r for r in rows if r["m"] == 748 and r["k"] == 8192), rows[0])
        headline = (
            f"quant M={key['m']} K={key['k']}: eager {_f(key.get('eager_us'), 1).strip()} us vs triton "
            f"{_f(key.get('triton_us'), 1).strip()} us; modulated {_f(key.get('mod_eager_us'), 1).strip()} "
            f"vs {_f(key.get('mod_triton_us'), 1).strip()} us (graph: {_f(key.get('eager_graph_us'), 1).strip()}"
            f" vs {_f(key.get('triton_graph_us'), 1).strip()}, {_f(key.get('mod_eager_graph_us'), 1).strip()} vs "
            f"{_f(key.get('mod_triton_graph_us'), 1).strip()})"
        )
        path = record(
            "fused",
            "tiny" if tiny else "all",
            1,
            dev,
            {"quant_m": ms, "quant_k": ks},
            results,
            variant="quant",
            out_dir=results_dir(args),
            command=getattr(args, "command", None),
            headline=headline,
        )
        print(f"wrote {path}")
        results["_path"] = str(path)
    return results


def print_quant_summary(rows: list[dict], cuda: bool) -> None:
    print("\nbench fused --quant: FP8 activation quantisation, microseconds (medians)")
    cols = [
        ("eager", "eager_us"),
        ("triton", "triton_us"),
        ("x", "speedup_eager"),
        ("eager_g", "eager_graph_us"),
        ("triton_g", "triton_graph_us"),
        ("x", "speedup_eager_graph"),
        ("floor", None),
        ("mod_eag", "mod_eager_us"),
        ("mod_tri", "mod_triton_us"),
        ("mod_eag_g", "mod_eager_graph_us"),
        ("mod_tri_g", "mod_triton_graph_us"),
        ("x", "speedup_mod_eager_graph"),
        ("gemm", "gemm_fp8_us"),
    ]
    print(f"{'M':>6}{'K':>7}" + "".join(f"{c:>10}" for c, _ in cols) + "   parity")
    for r in rows:
        cells = ""
        for c, key in cols:
            v = r.get("floor_us", {}).get("triton") if key is None else r.get(key)
            cells += _f(v, 10, 2 if c == "x" else 1)
        p, pm = r.get("parity") or {}, r.get("parity_modulated") or {}
        par = (
            f"bytes differ {p.get('bytes_differ', '-')}/{p.get('elements', '-')}, scales equal {p.get('scales_equal', '-')}; "
            f"modulated {pm.get('bytes_differ', '-')} differ, <= {_f(pm.get('max_steps_off'), 1, 2).strip()} steps"
        )
        print(f"{r['m']:>6}{r['k']:>7}{cells}   {par}")
    print(
        "_g = replayed from a CUDA graph (GPU time only); floor = Triton bytes at 4.2 TB/s; x = eager / triton, "
        "median of interleaved rounds (min-max below); gemm = FP8 GEMM M x K -> K"
        + ("" if cuda else "  [CPU: interpreter smoke test]")
    )
    for r in rows:
        for name, q in (r.get("rounds") or {}).items():
            print(
                f"  {r['m']:>6} x {r['k']:>5} {name:>16}: {q['median']:.2f}x ({q['lo']:.2f}-{q['hi']:.2f}x, "
                f"{q['rounds']} rounds): {q['verdict']}"
            )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.command = "cadence bench fused " + " ".join(shlex.quote(a) for a in argv)
    if args.quant:
        run_quant(args)
        return 0
    if "WORLD_SIZE" in os.environ:  # under torchrun
        run(args)
        return 0
    import torch.multiprocessing as mp

    if torch.cuda.is_available() and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"error: --nproc {args.nproc} but {torch.cuda.device_count()} CUDA device(s)")
    mp.spawn(_spawned, args=(args.nproc, free_port(), argv), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
