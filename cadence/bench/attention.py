"""`cadence bench attention`: every attention kernel at a serving shape, in one process, on the same inputs.

    cadence bench attention --preset w57 --tp 4            # one shape, each backend's default config
    cadence bench attention --preset w1.3 --sweep          # + the Triton config space and FA3's num_splits
    cadence bench attention --all-shapes --sweep --check --ring-check --table-out T.json   # the device plan
    cadence bench attention --table-from A.json B.json --table-out cadence/kernels/attention_table.json

Shape: one chunk of queries (``tokens_per_chunk``) over the full window (``kv_tokens``), heads / tp, the
preset's head dim. Inputs: q, k, v ~ N(0, 1), one seed; the reference is float64 attention of those
unquantised inputs, and every variant's relative L2 error is against it. The variants:

* every backend of the registry (``cadence.kernels.attention_registry``) over each storage it reads, in the
  layout a ring read by it stores, written by the ring's own write kernel, through the backend's own call:
  ``sdpa_default_bf16``, ``sdpa_cudnn_bf16`` (the bar: every speedup is against it, same run), ``triton_fp8``
  (per-token scales, V^T), ``triton_head_fp8`` (per-head scales), ``triton_short_fp8`` /
  ``triton_short_head_fp8`` (the short-query kernel, per-token / per-head), ``triton_bf16``, ``fa3_fp8`` (per-head
  descales, V [H, N, D], the length on the device) and ``fa3_bf16``; each kernel's default config, or with
  ``--sweep`` its whole config space (``AttentionKernel.configs``: Triton block shapes x warps x stages x key
  splits and the dual / pv_bf16 / ws variants; FA3's num_splits);
* comparisons, not ring backends: ``sdpa_flash_bf16``, ``fa3_fp8_fixed`` (no seqused_k: what reading the
  length costs), when fa3-fwd imports, and ``cudnn_fp8``: cuDNN's own FP8 SDPA (cudnn frontend; per-tensor
  scales, FP8 output on Hopper, dequantised for the error), when the frontend imports.

Each row: median ms (CUDA events), TFLOP/s (4 M N D H / t), speedup vs cuDNN bf16, relative error. A variant
that fails to compile or run is reported and skipped. ``--check``: every variant within its budget (a
backend's registry entry; :data:`BUDGET` for the comparisons) or exit 1. ``--ring-check``: a RingCache per
backend (1 layer, window 3, the shape's heads and tokens) against the naive float32 cache, end to end. JSON
(docs/benchmarks.md) under <out>/attention/.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cadence.bench.common import Timer, git_commit, median, print_table, record
from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_model_flags
from cadence.kernels import attention_backends as ab
from cadence.kernels import attention_registry as registry
from cadence.kernels import fa3_adapter
from cadence.kernels import ring_attention as ra
from cadence.model.families import model_config

#: The serving shapes of the device plan: (preset, tp).
SHAPES = (("w1.3", 1), ("w57", 4), ("w14", 2), ("w57", 2), ("w57", 1), ("w14", 1))
#: Relative-error budgets against the float64 reference on N(0, 1) inputs: a ring backend's is its registry
#: entry's (``AttentionBackend.budget``); the comparisons' are here: cuDNN FP8 (+ its FP8 output, ~7%) and
#: the bf16 / FP8 rows of the libraries' own calls. Under TRITON_INTERPRET=1 (CPU smoke runs) FP8 casts
#: truncate: ~11-14% at the tiny preset, so FP8 budgets widen to ``INTERPRETED_FP8``.
BUDGET = {"bf16": registry.BF16_BUDGET, "fp8": registry.FP8_BUDGET, "cudnn_fp8": 0.15}
INTERPRETED_FP8 = 0.2


def budget(storage: str, base: float) -> float:
    """``base`` (a backend's budget for ``storage``), widened for FP8 under the Triton interpreter."""
    return max(base, INTERPRETED_FP8) if storage == "fp8" and ra.interpreting() else base


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@dataclass
class Inputs:
    q: torch.Tensor  # [M, H, D] float32
    k: torch.Tensor  # [N, H, D]
    v: torch.Tensor
    ref: torch.Tensor  # [M, H, D] float32 (computed in float64)
    flops: float

    @property
    def shape(self) -> tuple[int, int, int, int]:
        m, h, d = self.q.shape
        return h, m, self.k.shape[0], d


def make_inputs(heads: int, m: int, n: int, d: int, device: torch.device, seed: int = 0) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(s, heads, d, generator=g, device=device) for s in (m, n, n))
    ref = torch.empty(m, heads, d, device=device)
    step = 4 if device.type == "cuda" else heads  # bounds the float64 score matrix
    for h0 in range(0, heads, step):
        sl = slice(h0, h0 + step)
        qs, ks, vs = (x[:, sl].transpose(0, 1).double() for x in (q, k, v))
        ref[:, sl] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).float()
    return Inputs(q, k, v, ref, 4.0 * m * n * d * heads)


def ring_buffers(
    inp: Inputs,
    storage: str,
    v_transposed: bool,
    scales: str,
    q_per_head: bool = False,
    float_dtype: torch.dtype | None = None,
) -> dict:
    """The buffers a ring of this layout holds for these inputs, written by the ring's write kernel (the
    PyTorch reference where Triton cannot run): Q [H, M, D] + scales, K [H, N_alloc, D], V^T or V."""
    h, m, n, d = inp.shape
    dev = inp.q.device
    fp8 = storage == "fp8"
    dt = ra.FP8 if fp8 else (float_dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32))
    n_alloc = (n + 127) // 128 * 128 if fp8 else n
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    Q = torch.zeros(h, m, d, device=dev, dtype=dt)
    K = torch.zeros(h, n_alloc, d, device=dev, dtype=dt)
    V = torch.zeros((h, d, n_alloc) if v_transposed else (h, n_alloc, d), device=dev, dtype=dt)
    f = ra.HEAD_HEADROOM / ra.FP8_MAX
    QS = (ra.head_amax_bound(inp.q, False) / ra.FP8_MAX) if q_per_head else torch.ones(h, m, device=dev)
    KS = ra.head_amax_bound(inp.k, False) * f if scales == "head" else torch.ones(h, n_alloc, device=dev)
    VS = ra.head_amax_bound(inp.v, False) * f if scales == "head" else torch.ones(h, n_alloc, device=dev)
    for x, out, s, tr in ((inp.q, Q, QS, False), (inp.k, K, KS, False), (inp.v, V, VS, v_transposed)):
        if ra.triton_usable(dev, d, allow_interpreter=True)[0]:
            ra.rope_quant_write(x, None, None, out, s, zero, transpose_out=tr)
            continue
        vals, sc = ra.rope_quant_reference(x, None, None, fp8, dt, s if s.dim() == 1 else None)
        (out.transpose(1, 2) if tr else out)[:, : x.shape[0]] = vals
        if s.dim() == 2:
            s[:, : x.shape[0]] = sc
    nv = torch.tensor([n], dtype=torch.int32, device=dev)
    return dict(q=Q, qs=QS, k=K, ks=KS, v=V, vs=VS, n_valid=nv, n=n)


@dataclass
class Variant:
    name: str  # unique row name
    family: str  # sdpa_cudnn_bf16, triton_fp8, fa3_fp8, ... (best-of group)
    storage: str  # bf16 or fp8
    fn: Callable[[], torch.Tensor]  # returns [M, H, D] (or [1, M, H, D]) comparable to the reference
    config: dict
    budget: float | None = None  # relative error budget (None: the storage's, BUDGET)


# ---- the variants -----------------------------------------------------------------------------------------
def bench_backends() -> list:
    """The registry's backends this benchmark times (every one that may be asked for)."""
    return [b for b in registry.BACKENDS.values() if b.choosable]


def config_name(cfg: dict) -> str:
    """m64n128w4s3x2 (+dual, pvbf16, ws), or s0 (FA3's num_splits): a kernel config's options in short."""
    keys = (("block_m", "m"), ("block_n", "n"), ("num_warps", "w"), ("num_stages", "s"), ("split", "x"))
    keys += (("maxnreg", "r"), ("num_ctas", "c"), ("num_splits", "s"))
    name = "".join(f"{t}{cfg[k]}" for k, t in keys if cfg.get(k) is not None) or "default"
    return name + "".join(f"-{k.replace('_', '')}" for k in ("dual", "pv_bf16", "ws") if cfg.get(k))


def backend_variants(inp: Inputs, device: torch.device, sweep: bool, log=print) -> Iterator[Variant]:
    """Every registered backend over each storage it reads, in the layout a ring read by it stores (written by
    the ring's own write kernel), once per kernel config (``AttentionKernel.configs``; ``sweep``: the whole
    space), through the kernel's own call. Float storage is the model dtype of the device (bf16 on CUDA,
    float32 on the CPU: exact there) where the kernel reads it, else bf16. A backend that cannot run here is
    one line."""
    h, m, n, d = inp.shape
    native = torch.bfloat16 if device.type == "cuda" else torch.float32
    for b in bench_backends():
        kernel = b.load()
        for storage, lay in b.layouts.items():
            fam = b.bench.get(storage, f"{b.name}_{storage}")
            why, dt = "", native
            for dt in dict.fromkeys((native, torch.bfloat16)):
                why = kernel.why_not(device, d, storage, True, dt)
                if not why:
                    break
            if why:
                log(f"  {fam}: skipped ({why})")
                continue
            buf = ring_buffers(inp, storage, lay.v_transposed, lay.scales, lay.q_scales == "head", dt)
            host_n = None if lay.length_on_device else n
            configs = kernel.configs(device, storage, sweep, -(-m // 64) * h)
            for cfg in configs or [{}]:
                name = f"{fam}_{config_name(cfg)}" if configs else fam

                def fn(buf=buf, cfg=cfg, lay=lay, kernel=kernel, host_n=host_n):
                    qkv = (buf["q"], buf["qs"], buf["k"], buf["ks"], buf["v"], buf["vs"])
                    return kernel.attend(*qkv, buf["n_valid"], host_n, lay, cfg, native)

                yield Variant(name, fam, storage, fn, cfg, budget(storage, b.budget[storage]))


def sdpa_flash_variant(inp: Inputs, device: torch.device) -> Iterator[Variant]:
    """torch SDPA pinned to its flash backend (not a ring backend: a comparison)."""
    if device.type != "cuda":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qb, kb, vb = (x.transpose(0, 1)[None].to(torch.bfloat16).contiguous() for x in (inp.q, inp.k, inp.v))

    def call():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qb, kb, vb)[0].transpose(0, 1)

    yield Variant("sdpa_flash_bf16", "sdpa_flash_bf16", "bf16", call, {}, BUDGET["bf16"])


def fa3_fixed_variant(inp: Inputs, device: torch.device) -> Iterator[Variant]:
    """FA3's FP8 call without seqused_k (what reading the length on the device costs; a comparison)."""
    h, m, n, d = inp.shape
    if fa3_adapter.why_not(device, d, True):
        return
    mod = fa3_adapter.load()
    b8 = ring_buffers(inp, "fp8", False, "head", q_per_head=True)
    views = [fa3_adapter._view(x[:, :n]) for x in (b8["q"], b8["k"], b8["v"])]
    d1 = {k: b8[s].unsqueeze(0) for k, s in (("q_descale", "qs"), ("k_descale", "ks"), ("v_descale", "vs"))}
    fp8 = budget("fp8", BUDGET["fp8"])
    yield Variant(
        "fa3_fp8_fixed_s1", "fa3_fp8_fixed", "fp8", lambda: mod.flash_attn_func(*views, **d1), {}, fp8
    )


def _cudnn_fp8_graph(cudnn, h: int, m: int, n: int, d: int, device: torch.device):
    """The cudnn-frontend FP8 SDPA graph for [1, H, S, D] e4m3 q, k, v with per-tensor scale tensors
    (names dq, dk, dv, ds, ss, so) and an e4m3 output; raises where cuDNN has no engine for it."""
    handle = cudnn.create_handle()
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    tq, tk, tv = (
        g.tensor(name=nm, dim=[1, h, s, d], stride=[h * s * d, s * d, d, 1], data_type=e4m3)
        for nm, s in (("q", m), ("k", n), ("v", n))
    )
    ts = {k: g.tensor(name=k, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for k in SCALE_NAMES}
    o, _, amax_s, amax_o = g.sdpa_fp8(
        q=tq,
        k=tk,
        v=tv,
        descale_q=ts["dq"],
        descale_k=ts["dk"],
        descale_v=ts["dv"],
        descale_s=ts["ds"],
        scale_s=ts["ss"],
        scale_o=ts["so"],
        is_inference=True,
        attn_scale=1.0 / math.sqrt(d),
        use_causal_mask=False,
    )
    o.set_output(True).set_dim([1, h, m, d]).set_stride([h * m * d, m * d, d, 1]).set_data_type(e4m3)
    for t in (amax_s, amax_o):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    ws = torch.empty(max(1, g.get_workspace_size()), device=device, dtype=torch.uint8)
    return g, handle, ws, dict(q=tq, k=tk, v=tv, o=o, amax_s=amax_s, amax_o=amax_o, **ts)


SCALE_NAMES = ("dq", "dk", "dv", "ds", "ss", "so")


def cudnn_fp8_variant(inp: Inputs, device: torch.device, log) -> Iterator[Variant]:
    """cuDNN's FP8 SDPA (cudnn frontend graph, built once per shape). It takes one scale per tensor, so the
    inputs are quantised per tensor here (not the ring's per-head buffers); P is scaled by 256 into FP8
    (unit scales flush small probabilities: the ~7% error measured before), O by 448 / amax(V) (Hopper has
    FP8 output only), dequantised for the error. Not a ring backend: a comparison."""
    if device.type != "cuda":
        return
    try:
        import cudnn
    except Exception as e:  # ImportError, or a frontend that cannot find its library
        log(f"  cudnn_fp8: skipped (cudnn frontend not importable: {type(e).__name__})")
        return
    h, m, n, d = inp.shape
    amax = [x.abs().amax() for x in (inp.q, inp.k, inp.v)]
    q8, k8, v8 = (
        (x / (a / ra.FP8_MAX)).clamp(-ra.FP8_MAX, ra.FP8_MAX).transpose(0, 1).to(ra.FP8).contiguous()
        for x, a in zip((inp.q, inp.k, inp.v), amax)
    )
    vals = (amax[0] / ra.FP8_MAX, amax[1] / ra.FP8_MAX, amax[2] / ra.FP8_MAX, 1 / 256.0, 256.0)
    vals += (ra.FP8_MAX / amax[2],)
    sc = {k: torch.as_tensor(v, device=device).float().reshape(1, 1, 1, 1) for k, v in zip(SCALE_NAMES, vals)}
    try:
        g, handle, ws, t = _cudnn_fp8_graph(cudnn, h, m, n, d, device)
    except Exception as e:
        log(
            f"  cudnn_fp8: not supported here ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
        )
        return
    out = torch.empty(1, h, m, d, device=device, dtype=ra.FP8)
    am = [torch.empty(1, 1, 1, 1, device=device) for _ in range(2)]
    binds = {t["q"]: q8, t["k"]: k8, t["v"]: v8, t["o"]: out, t["amax_s"]: am[0], t["amax_o"]: am[1]}
    binds.update({t[k]: sc[k] for k in SCALE_NAMES})

    def fn():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        g.execute(binds, ws, handle=handle)
        return out

    def dequant():
        return fn()[0].transpose(0, 1).float() * (amax[2] / ra.FP8_MAX)

    yield Variant("cudnn_fp8", "cudnn_fp8", "cudnn_fp8", fn, {"_error_fn": dequant}, BUDGET["cudnn_fp8"])


# ---- measuring --------------------------------------------------------------------------------------------
def measure(var: Variant, inp: Inputs, timer: Timer, iters: int) -> dict:
    err_fn = var.config.get("_error_fn", var.fn)
    out = err_fn()
    if out.dim() == 4:  # [1, M, H, D] (FA3)
        out = out[0]
    err = _rel(out, inp.ref)
    ts = timer.run(var.fn, 2, iters)
    ms = median(ts)
    cfg = {k: v for k, v in var.config.items() if not k.startswith("_")}
    return dict(
        family=var.family,
        storage=var.storage,
        config=cfg,
        ms=ms,
        tflops=inp.flops / ms / 1e9,
        rel_err=err,
        budget=BUDGET[var.storage] if var.budget is None else var.budget,
    )


def run_shape(preset: str, tp: int, device: torch.device, args, log=print, cfg=None) -> dict:
    """Every variant at one serving shape: {variants, best, failed, over_budget, shape, seconds}. ``cfg``: the
    configuration of ``preset`` (default: the registry's: ``cadence.model.families.model_config``)."""
    cfg = cfg if cfg is not None else model_config(preset)
    heads = cfg.model.num_heads // tp
    m, n, d = cfg.tokens_per_chunk, cfg.kv_tokens, cfg.model.head_dim
    log(f"[bench attention] {preset} tp{tp}: {heads} heads x {m} q x {n} kv, d {d}")
    res = run_dims(heads, m, n, d, device, args, log)
    res["shape"] = dict(preset=preset, tp=tp, heads=heads, q_tokens=m, kv_tokens=n, head_dim=d)
    return res


def _guarded(gen: Iterator[Variant], failed: dict, log) -> Iterator[Variant]:
    """The variants of one generator; an exception while setting them up (a library whose API differs, a
    graph it cannot build) ends that generator with one line, not the run."""
    name = getattr(gen, "__name__", "variants")
    try:
        yield from gen
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        log(f"  {name}: setup failed ({failed[name]})")


def run_dims(heads: int, m: int, n: int, d: int, device: torch.device, args, log=print) -> dict:
    inp = make_inputs(heads, m, n, d, device, seed=args.seed)
    timer, t0 = Timer(device), time.monotonic()
    gens = [backend_variants(inp, device, args.sweep, log), sdpa_flash_variant(inp, device)]
    gens += [fa3_fixed_variant(inp, device), cudnn_fp8_variant(inp, device, log)]
    res: dict = {"variants": {}, "failed": {}, "skipped_for_time": 0}
    for var in (v for gen in gens for v in _guarded(gen, res["failed"], log)):
        if time.monotonic() - t0 > args.shape_budget_s:
            res["skipped_for_time"] += 1
            continue
        try:
            res["variants"][var.name] = r = measure(var, inp, timer, args.iters)
        except Exception as e:  # a config the compiler rejects, a library that refuses the shape
            res["failed"][var.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log(f"  {var.name}: failed ({res['failed'][var.name]})")
            continue
        print(
            f"\r  {var.name}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s err {r['rel_err']:.4f}    ",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)
    res.update(best_of(res["variants"]))
    res["seconds"] = time.monotonic() - t0
    return res


WARM_DIMS = (4, 100, 1000, 128)  # heads, queries, keys, head dim: the serving shapes' specialisation


def _compile_part(part: int, parts: int, sweep: bool) -> int:
    """(A spawned process) compile every `parts`-th kernel variant of the warm shape (into Triton's disk cache)."""
    dev = torch.device("cuda")
    inp = make_inputs(*WARM_DIMS, dev)
    done = 0
    for i, var in enumerate(backend_variants(inp, dev, sweep, log=lambda s: None)):
        if i % parts == part:
            try:
                var.fn()
                done += 1
            except Exception:  # reported by the measuring process, which compiles it again
                pass
    torch.cuda.synchronize()
    return done


def warm(device: torch.device, args, log=print) -> float:
    """Compile every variant once at a small shape of the serving shapes' specialisation (query and key
    counts not multiples of 16, heads x queries one; head dim 128), so that each shape's time budget
    measures rather than compiles: first in ``--compile-workers`` spawned processes in parallel (into
    Triton's disk cache), then once here (cache hits). Returns the seconds it took."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.monotonic()
    parts = max(1, args.compile_workers)
    if parts > 1:
        try:
            with cf.ProcessPoolExecutor(parts, mp_context=mp.get_context("spawn")) as pool:
                done = sum(pool.map(_compile_part, range(parts), [parts] * parts, [args.sweep] * parts))
            log(
                f"[bench attention] {done} Triton variants compiled in {parts} processes, {time.monotonic() - t0:.0f} s"
            )
        except Exception as e:  # an optimisation only: this process compiles what is missing
            log(f"[bench attention] parallel compile failed ({type(e).__name__}: {e}); compiling here")
    opts = argparse.Namespace(**{**vars(args), "iters": 1, "shape_budget_s": 1e9})
    res = run_dims(*WARM_DIMS, device, opts, log=lambda s: None)
    log(f"[bench attention] warm-up: {len(res['variants'])} variants ready in {time.monotonic() - t0:.0f} s")
    return time.monotonic() - t0


def best_of(variants: dict) -> dict:
    """Per family the fastest variant within its error budget; speedups against sdpa_cudnn_bf16."""
    over = {k: round(r["rel_err"], 4) for k, r in variants.items() if r["rel_err"] > r["budget"]}
    best: dict = {}
    for name, r in variants.items():
        if name in over:
            continue
        cur = best.get(r["family"])
        if cur is None or r["ms"] < cur["ms"]:
            best[r["family"]] = {"variant": name, **r}
    bar = best.get("sdpa_cudnn_bf16")
    for r in [*best.values(), *variants.values()]:
        r["speedup_vs_cudnn_bf16"] = bar["ms"] / r["ms"] if bar else None
    return {"best": best, "over_budget": over}


def summarise(res: dict) -> list[tuple[str, str]]:
    rows = []
    for fam, r in sorted(res["best"].items(), key=lambda kv: kv[1]["ms"]):
        sp = f"{r['speedup_vs_cudnn_bf16']:.2f}x" if r["speedup_vs_cudnn_bf16"] else "  -  "
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())
        rows.append(
            (fam, f"{r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s {sp:>6}  err {r['rel_err']:.4f}  [{cfg}]")
        )
    for name, e in res["over_budget"].items():
        rows.append((name, f"OVER BUDGET: rel err {e} > {res['variants'][name]['budget']}"))
    if res["failed"]:
        rows.append(("failed", ", ".join(res["failed"])))
    return rows


# ---- the ring end to end ---------------------------------------------------------------------------------
def ring_backends() -> list[tuple[str, str]]:
    """(storage, backend) for every backend of the registry and each storage it reads, then 'auto' per storage."""
    ring = [(s, b.name) for b in registry.BACKENDS.values() if b.choosable for s in b.layouts]
    return ring + [("fp8", "auto"), ("bf16", "auto")]


def ring_check(preset: str, tp: int, device: torch.device, log=print, chunks: int = 4, cfg=None) -> dict:
    """A RingCache per (storage, backend) (1 layer, window 3, the shape's heads, tokens and sink) against the
    naive float32 cache on the same q/k/v (rounded to the model dtype for the ring): sink, then `chunks`
    chunks with a non-committing pass before each commit (past one wraparound). Max relative error per
    call, the backend the plan chose, and pass/fail against :data:`BUDGET`."""
    from cadence.cache.naive import NaiveCache
    from cadence.cache.ring import RingCache
    from cadence.model.rope import Rope3D

    cfg = cfg if cfg is not None else model_config(preset)
    mc, s = cfg.model, cfg.stream
    heads, fpc, sink = mc.num_heads // tp, s.latent_frames_per_chunk, s.sink_frames
    rope = Rope3D(mc.rope_split, mc.rope_theta, device=device)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    tpf = cfg.token_grid[0] * cfg.token_grid[1]

    def qkv(frames):
        x = torch.randn(3, 1, frames * tpf, heads, mc.head_dim, generator=g, device=device)
        return x[0], x[1], x[2]

    data = [qkv(sink)] + [qkv(fpc) for _ in range(chunks)]
    out = {}
    for storage, backend in ring_backends():
        ring = RingCache(
            1,
            3,
            cfg.token_grid,
            rope,
            device,
            heads,
            mc.head_dim,
            fpc,
            sink,
            model_dtype=dt,
            dtype=storage,
            sink_policy="absolute",
            attention=backend,
        )
        naive = NaiveCache(1, 3, cfg.token_grid, rope, device)
        errs = []
        for i, (q, k, v) in enumerate(data):
            is_sink = i == 0
            start = 0 if is_sink else sink + (i - 1) * fpc
            for c in (ring, naive):
                c.begin_chunk(start, sink if is_sink else fpc, sink=is_sink)
            low = [x.to(dt) for x in (q, k, v)]
            if not is_sink:
                ring.attend(0, *low, commit=False)
            got = ring.attend(0, *low, commit=True)
            errs.append(_rel(got, naive.attend(0, q, k, v, commit=True)))
        key = f"{storage}_{backend}"
        used = registry.get(ring.plan.backend).budget[storage]  # the budget of the backend that ran
        limit = budget(storage, used) + (0.01 if dt == torch.bfloat16 else 0.0)  # the inputs' bf16 rounding
        out[key] = dict(
            backend=ring.plan.backend, why=ring.plan.why, max_rel_err=max(errs), ok=max(errs) < limit
        )
        log(
            f"  ring {key}: {ring.plan.backend} max rel err {max(errs):.4f} {'ok' if out[key]['ok'] else 'FAIL'}"
        )
        del ring, naive
    return out


# ---- the table auto reads ---------------------------------------------------------------------------------
def table_entries(doc: dict, source: str) -> list[dict]:
    """attention_table.json entries from one bench record (its ``results``: one shape)."""
    res, gpu = doc["results"], doc.get("device_kind", "")
    sh = res["shape"]
    rows = []
    for fam, r in res["best"].items():
        ring = registry.bench_families().get(fam)  # (backend, storage); None: a comparison, not in the table
        if ring is None or r.get("speedup_vs_cudnn_bf16") is None:
            continue
        backend, storage = ring
        rows.append(
            dict(
                gpu=gpu,
                heads=sh["heads"],
                q_tokens=sh["q_tokens"],
                kv_tokens=sh["kv_tokens"],
                head_dim=sh["head_dim"],
                storage=storage,
                backend=backend,
                config=r["config"],
                ms=round(r["ms"], 4),
                speedup_vs_cudnn_bf16=round(r["speedup_vs_cudnn_bf16"], 3),
                rel_err=round(r["rel_err"], 4),
                source=source,
            )
        )
    return rows


def table_from(paths: list[str]) -> dict:
    sources, entries = {}, []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        src = Path(p).name
        sources[src] = (
            f"{doc.get('device')} | git {doc.get('git')} | torch {doc.get('torch')} | `{doc.get('command')}`"
        )
        entries += table_entries(doc, src)
    about = ab.table().get("about", "")
    return {"about": about, "sources": sources, "entries": entries}


# ---- the command ------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="heads are num_heads / tp (one rank's shard)")
    p.add_argument("--all-shapes", action="store_true", help=f"every serving shape: {SHAPES}")
    p.add_argument("--sweep", action="store_true", help="the Triton config space and FA3's num_splits")
    p.add_argument("--iters", type=int, default=None, help="timed calls per variant (default 20 CUDA, 3 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present"
    )
    p.add_argument(
        "--shape-budget-s", type=float, default=600.0, help="stop adding variants at a shape after this"
    )
    p.add_argument(
        "--compile-workers",
        type=int,
        default=8,
        help="spawned processes that compile the Triton variants first",
    )
    p.add_argument("--check", action="store_true", help="exit 1 if any variant is over its error budget")
    p.add_argument("--ring-check", action="store_true", help="also the RingCache end to end per backend")
    p.add_argument(
        "--table-out", default=None, help="write the auto table (attention_table.json format) here"
    )
    p.add_argument(
        "--table-from", nargs="+", default=None, help="bench JSONs to build the table from (no run)"
    )
    add_record_flags(p)
    add_model_flags(p, default="tiny", files=False)  # the engine-flag set's --model / --preset: the shape's
    a = p.parse_args(argv)
    if a.tp < 1:
        p.error(f"--tp must be >= 1, got {a.tp}")
    return a


def shape_recipes(args, device: torch.device) -> dict:
    """The recipe of each shape timed ('w57 tp4' -> what ``cadence serve --model w57 --tp 4`` builds on this
    device: its geometry, the attention backend 'auto' picks from, the kernel switches in effect): printed and
    recorded with the shape's figures (the variants timed are this benchmark's own, every backend)."""
    from cadence.engine.recipe import EngineSpec, resolve

    shapes = SHAPES if args.all_shapes else ((args.model, args.tp),)
    dev = "cuda:0" if device.type == "cuda" else "cpu"
    return {(name, tp): resolve(EngineSpec(model=name, tp=tp), dev) for name, tp in shapes}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    command = "cadence bench attention " + " ".join(shlex.quote(a) for a in argv)
    if args.table_from:
        if not args.table_out:
            print("error: --table-from needs --table-out", file=sys.stderr)
            return 2
        Path(args.table_out).write_text(json.dumps(table_from(args.table_from), indent=1) + "\n")
        print(f"wrote {args.table_out}")
        return 0
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    args.iters = args.iters or (20 if device.type == "cuda" else 3)
    bad, paths = [], []
    if args.sweep and device.type == "cuda":
        warm(device, args, log=lambda s: print(s, file=sys.stderr))
    for (name, tp), recipe in shape_recipes(args, device).items():
        print(recipe.describe().text(), file=sys.stderr)
        res = run_shape(name, tp, device, args, log=lambda s: print(s, file=sys.stderr), cfg=recipe.config)
        if args.ring_check:
            res["ring_check"] = ring_check(
                name, tp, device, log=lambda s: print(s, file=sys.stderr), cfg=recipe.config
            )
            bad += [f"{name} tp{tp} ring {k}" for k, r in res["ring_check"].items() if not r["ok"]]
        bad += [f"{name} tp{tp} {k}" for k in res["over_budget"]]
        sh = res["shape"]
        print_table(
            summarise(res),
            f"attention {name} tp{tp}: {sh['heads']} heads, {sh['q_tokens']} q x "
            f"{sh['kv_tokens']} kv, d {sh['head_dim']} ({res['seconds']:.0f} s)",
        )
        if not args.no_record:
            paths.append(_record_shape(args, recipe, res, device, command))
    if args.table_out and paths:
        Path(args.table_out).write_text(json.dumps(table_from(paths), indent=1) + "\n")
        print(f"wrote {args.table_out} ({git_commit()})")
    if args.check and bad:
        print("error: over budget: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


def _record_shape(args, recipe, res: dict, device: torch.device, command: str) -> str:
    """The JSON record of one shape (docs/benchmarks.md, bench "attention"), with the shape's recipe."""
    from cadence.telemetry.devices import device_kind

    best8 = max(
        (r for r in res["best"].values() if r["storage"] == "fp8"),
        default=None,
        key=lambda r: r["speedup_vs_cudnn_bf16"] or 0,
    )
    head = (
        f"best FP8 {best8['variant']} {best8['speedup_vs_cudnn_bf16'] or 0:.2f}x cuDNN bf16" if best8 else ""
    )
    sh = res["shape"]
    path = record(
        "attention",
        sh["preset"],
        sh["tp"],
        device,
        recipe.config.shape_summary(),
        res,
        out_dir=results_dir(args),
        command=command,
        headline=head,
        extra={"device_kind": device_kind(device), "recipe": recipe.describe().as_dict()},
    )
    print(f"wrote {path}")
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
