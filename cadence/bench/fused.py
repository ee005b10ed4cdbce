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

Writes (rank 0, unless --no-record): docs/perf/fused/<date>-<kind>-all-tp<N>.json per BENCHMARKS.md
and the chooser's table docs/perf/fused/chooser-<kind>-tp<N>.json (read by comm="auto").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import socket
import sys
import time

import torch
import torch.distributed as dist

FUSED_MODES = ["two_shot", "one_shot", "rs_ag", "chunked2", "chunked4"]
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
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--out-dir", default=None, help="where docs/perf lives (default: the repo's)")
    p.add_argument("--no-record", action="store_true")
    return p.parse_args(argv)


def shapes(args, world: int) -> list[dict]:
    from cadence.config import get_preset

    if args.tiny:
        m = args.m or 64
        return [{"name": "tiny attn_out", "m": m, "n": 256, "k": 256 // world},
                {"name": "tiny ffn_out", "m": m, "n": 256, "k": 1024 // world}]
    out = []
    for p in [s.strip() for s in args.presets.split(",") if s.strip()]:
        cfg = get_preset(p)
        m = args.m or cfg.tokens_per_chunk
        d, f = cfg.model.dim, cfg.model.ffn_dim
        out.append({"name": f"{p} attn_out", "m": m, "n": d, "k": d // world})
        out.append({"name": f"{p} ffn_out", "m": m, "n": d, "k": f // world})
    return out


class Bench:
    def __init__(self, device: torch.device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps
        self.cuda = device.type == "cuda"

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
        if self.cuda:
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(self.reps)]
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
    from cadence.model.layers import Linear
    from cadence.parallel import fused
    from cadence.parallel.tp import RowParallelLinear
    from cadence.quant.fp8 import FP8Linear, quantize_rows

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
    r: dict = {"name": sh["name"], "m": m, "n": n, "k": k, "dtype": dt, "act_dtype": str(act).replace("torch.", "")}

    r["gemm_us"] = _safe(r, "gemm", lambda: bench.time_us(lambda: lin(x)))
    if dt == "fp8" and dev.type == "cuda":
        xq, xs = quantize_rows(x)
        r["gemm_kernel_us"] = _safe(r, "gemm_kernel", lambda: bench.time_us(lambda: torch._scaled_mm(
            xq, lin.weight_fp8.t(), scale_a=xs, scale_b=lin.weight_scale, out_dtype=torch.bfloat16,
            use_fast_accum=True)))
    y0 = torch.randn(m, n, device=dev, dtype=act, generator=g)
    r["allreduce_us"] = _safe(r, "allreduce_nccl", lambda: bench.time_us(lambda: dist.all_reduce(y0, group=group)))
    symm_ok = fused.symm_unavailable_reason(dev, group) is None
    if symm_ok:
        gname = fused.group_name(group)

        def symm_buf():
            b = fused.symm_cache().get(m, n, act, dev, group)[: m * n].view(m, n)
            b.copy_(y0)
            return b

        r["allreduce_two_shot_us"] = _safe(r, "allreduce_two_shot", lambda: bench.time_us(
            lambda b=symm_buf(): torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", gname)))
        r["allreduce_one_shot_us"] = _safe(r, "allreduce_one_shot", lambda: bench.time_us(
            lambda b=symm_buf(): torch.ops.symm_mem.one_shot_all_reduce(b, "sum", gname)))
    else:
        r["allreduce_two_shot_us"] = r["allreduce_one_shot_us"] = None

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
    usable = {md: t for md, t in r["modes"].items() if t is not None and md not in r["fell_back"]}
    fused_only = {md: t for md, t in usable.items() if md != "nccl"}
    r["best_mode"] = min(usable, key=usable.get) if usable else "nccl"
    r["best_fused_mode"] = min(fused_only, key=fused_only.get) if fused_only else None
    r["fused_us"] = fused_only[r["best_fused_mode"]] if fused_only else None
    if r["fused_us"] is not None and r["unfused_us"] and r["allreduce_us"]:
        r["hidden_fraction"] = (r["unfused_us"] - r["fused_us"]) / r["allreduce_us"]
    else:
        r["hidden_fraction"] = None
    rpl.comm = "nccl"
    return r


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
    lin.weight.normal_(0.0, k ** -0.5, generator=g)
    rpl = RowParallelLinear(lin, torch.randn(n, device=dev, dtype=act, generator=g), group, comm=mode)
    ref = RowParallelLinear(lin, rpl.bias, group, comm="nccl")
    errs, mem = [], []
    for rnd in range(2):
        for m in SWEEP_M:
            x = torch.randn(m, k, device=dev, dtype=act, generator=g)
            errs.append(_rel(rpl(x), ref(x)))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            mem.append(torch.cuda.memory_allocated(dev))
    info = fused.symm_cache_info()
    return {"mode": mode, "token_counts": SWEEP_M, "max_rel_err": max(errs), "cache": info,
            "mem_after_round_bytes": mem, "mem_growth_bytes": (mem[1] - mem[0]) if len(mem) == 2 else None,
            "ok": max(errs) < 2e-2 and info["entries"] <= info["max_entries"]
            and (len(mem) < 2 or mem[1] <= mem[0])}


def _f(v, w=8, d=1) -> str:
    return f"{v:{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"


def print_summary(rows: list[dict], modes: list[str], world: int, sweep) -> None:
    hdr = (f"{'shape':<16}{'dt':>5}{'M':>6}{'K':>7}{'N':>6}{'gemm':>8}{'AR':>8}{'AR2sh':>8}{'AR1sh':>8}"
           f"{'unfused':>8}" + "".join(f"{md[:8]:>9}" for md in modes) + f"{'best':>10}{'hidden':>8}")
    print(f"\nbench fused: row-parallel GEMM + all-reduce, TP={world}, microseconds (medians)")
    print(hdr)
    for r in rows:
        cells = ""
        for md in modes:
            t = (r.get("modes") or {}).get(md)
            mark = "*" if md in r.get("fell_back", []) else " "
            cells += _f(t, 8) + mark
        hf = r.get("hidden_fraction")
        print(f"{r['name']:<16}{r['dtype']:>5}{r['m']:>6}{r['k']:>7}{r['n']:>6}{_f(r.get('gemm_us'))}"
              f"{_f(r.get('allreduce_us'))}{_f(r.get('allreduce_two_shot_us'))}{_f(r.get('allreduce_one_shot_us'))}"
              f"{_f(r.get('unfused_us'))}{cells}{r.get('best_mode', '-'):>10}{_f(hf, 8, 2)}")
    print("AR = NCCL all-reduce alone; AR2sh / AR1sh = symm-mem two-/one-shot alone; * = fell back to nccl;"
          " hidden = (unfused - best fused) / AR")
    errs = {md: max((r.get("rel_err") or {}).get(md, 0.0) for r in rows) for md in modes}
    print("max relative error vs nccl: " + ", ".join(f"{md} {e:.1e}" for md, e in errs.items()))
    if sweep:
        print(f"shape sweep ({sweep['mode']}, M={sweep['token_counts']} x2): ok={sweep['ok']} max_rel_err="
              f"{sweep['max_rel_err']:.1e} cache={sweep['cache']['entries']}/{sweep['cache']['max_entries']} entries "
              f"{sweep['cache']['bytes'] / 2**20:.1f} MiB, memory growth {sweep['mem_growth_bytes']}")


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    from cadence.bench.common import device_kind, record
    from cadence.parallel import destroy_tp, fused, init_tp

    info = init_tp()
    rank, world, dev = info.rank, info.world_size, info.device
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cadence.parallel.fused").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:
        modes = [md.strip() for md in args.modes.split(",") if md.strip()]
        for md in modes:
            fused.parse_mode(md)
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        bench = Bench(dev, args.warmup, max(args.reps, 5))
        if rank == 0:
            print(f"[bench fused] TP={world} {info.backend} on {dev}; torch {torch.__version__}; "
                  f"symm-mem: {fused.symm_unavailable_reason(dev, info.group) or 'available'}", file=sys.stderr,
                  flush=True)
        rows = []
        for sh in shapes(args, world):
            for dt in dtypes:
                t0 = time.perf_counter()
                r = measure_shape(sh, dt, modes, bench, info.group, world)
                rows.append(r)
                if rank == 0:
                    print(f"[bench fused] {sh['name']} {dt}: unfused {_f(r['unfused_us'], 1)} us, best "
                          f"{r['best_mode']} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        sweep = None
        if not args.no_sweep:
            sweep = _safe({}, "sweep", lambda: shape_sweep(dev, info.group, world, "two_shot"))
        results = {"shapes": rows, "modes_timed": modes, "shape_sweep": sweep, "symm_cache": fused.symm_cache_info(),
                   "fallback_warnings": fused.fallback_warnings()}
        if rank == 0:
            print_summary(rows, modes, world, sweep)
        if rank == 0 and not args.no_record:
            preset = "tiny" if args.tiny else "all"
            kind = device_kind(dev, world)
            good = [r for r in rows if r.get("hidden_fraction") is not None]
            headline = ", ".join(f"{r['name']} {r['dtype']} {r['best_mode']} hidden {r['hidden_fraction']:.2f}"
                                 for r in good[:4])
            path = record("fused", preset, world, dev, {"shapes": [{k: s[k] for k in ("name", "m", "n", "k")}
                                                               for s in shapes(args, world)]},
                          results, out_dir=args.out_dir, world=world, command=getattr(args, "command", None),
                          headline=headline or "no fused mode measured")
            print(f"wrote {path}")
            table = {"kind": "chooser", "device": kind, "world": world, "torch": torch.__version__,
                     "source": str(path.name),
                     "entries": [{"m": r["m"], "n": r["n"], "k": r["k"], "dtype": r["dtype"], "world": world,
                                  "best_mode": r["best_mode"], "modes_us": r["modes"]} for r in rows]}
            tpath = path.parent / f"chooser-{kind}-tp{world}.json"
            tpath.write_text(json.dumps(table, indent=2) + "\n")
            print(f"wrote {tpath}")
            results["_path"] = str(path)
        return results
    finally:
        destroy_tp()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if not torch.cuda.is_available():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    args = parse(argv)
    args.command = "cadence bench fused " + " ".join(shlex.quote(a) for a in argv)
    run(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.command = "cadence bench fused " + " ".join(shlex.quote(a) for a in argv)
    if "WORLD_SIZE" in os.environ:  # under torchrun
        run(args)
        return 0
    import torch.multiprocessing as mp

    if torch.cuda.is_available() and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"error: --nproc {args.nproc} but {torch.cuda.device_count()} CUDA device(s)")
    mp.spawn(_spawned, args=(args.nproc, _free_port(), argv), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
