"""`cadence bench linears`: the FP8 linears of one chunk at every per-rank shape, per GEMM backend (one GPU).

    cadence bench linears                          # W57 TP=1/2/4, W14 TP=1/2, W1.3 (the device plan's run)
    cadence bench linears --presets "w57:4" --sweep short
    cadence bench linears --tiny --no-record       # CPU smoke test (Triton interpreter, tiny shapes)

Per-rank shapes (rank 0's shard, as ``apply_tp`` cuts it; M = the chunk's tokens): self-attention qkv
(M x dim -> 3 dim/TP), its out (M x dim/TP -> dim), cross-attention q (dim -> dim/TP) and out, FFN fc1
(dim -> ffn/TP) and fc2 (ffn/TP -> dim), and in the audio blocks (every ``audio_every``-th) audio q, out and
the audio K/V (M = the chunk's audio tokens, 8 at W57: recomputed every pass). Identical (M, K, N) are timed
once. Sections, in this order (each checks ``--budget-s`` first and is skipped, with a note, when time is
out; the JSON is always written):

1. **GEMMs**: per shape, bf16 (``F.linear``), cuBLAS FP8 rowwise (``torch._scaled_mm``, the activation
   already quantised), cuBLAS tensorwise (scalar scales: its speed only; not Cadence's numerics), the
   separate one-launch activation quantisation alone (``kernels.quant``) and cuBLAS with it (today's
   per-call cost), and the Triton FP8 GEMM at every config of ``fp8_gemm.SWEEP`` (``--sweep short``: the
   first four). Every FP8 output is checked against cuBLAS's (max |diff| / max |cuBLAS| <= 2e-2, else the
   config is marked wrong and never chosen). Weights rotate over enough copies (> 150 MB) that no call
   finds its weight in the 50 MB L2, as in a real step.
2. **Table**: per shape cuBLAS against the best Triton config in >= 5 interleaved rounds
   (``cadence.bench.rounds``); Triton is chosen only where its worst round beats cuBLAS's best (the ratio's
   median and min-max are printed and recorded as ``rounds``), written as ``gemm-<device kind>.json``, the
   table ``FastPath.gemm="auto"`` reads (copy it to docs/perf/fp8/; ``--record`` writes it there).
3. **Chunk**: per preset and TP, the linears of one chunk (layers x passes, audio layers counted as they
   occur), CUDA-graphed: a few layers with distinct weights captured in one graph, replayed, scaled to
   the model's layers and passes; for bf16, cuBLAS FP8 without / with the separate quantisation, and the
   chosen backend per shape with the separate quantisation only where no fused producer makes it (the
   attention outputs' projections, the audio K/V, fc2 under TP). ms per chunk and average TFLOP/s, for
   the six main projections (W57 TP=4: 72.3 TFLOP) and with the audio attention.
4. **Tiles** (the fused GEMM + all-reduce, TP=2 shapes, one GPU): cuBLAS, the tile kernel's GEMM alone
   (phase 4), and its whole one-launch protocol against an emulated peer (``gemm_allreduce.EmulatedPeer``:
   flags raised beforehand, local buffers for the peer's: the protocol's own cost without NVLink), both
   protocols; "arm" (the flag fill the emulation needs) is timed alone and subtracted.
5. **Producers**: the inputs the fused producers make (norm + modulation, affine LayerNorm, GELU) at each
   preset's shapes: the plain eager op, the compiled op (Inductor) plus the separate quantisation (today),
   the one-launch Triton kernel, and the compiled fused reference (``--no-compile`` skips the Inductor ones).

Timing: CUDA events around replays of a CUDA graph of ``--inner`` calls (GPU time only, as the graphed step
pays it; ``cadence.bench.fused``'s helpers), median of ``--reps`` replays. CPU: host-timed eager calls at the
tiny preset (a smoke test: CPU numbers mean nothing). Writes <out>/linears/<date>-<kind>-<all|tiny>-tp1.json
(docs/benchmarks.md schema) and the table beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from cadence.bench.results import REPO, add_record_flags, results_dir
from cadence.errors import InputError, UsageParser

PRESETS = "w57:1,2,4;w14:1,2;w1.3:1"
ROTATE_BYTES = 150 * 2**20  # weights a timed sequence cycles through: 3x the H200's 50 MB L2
OK_REL = 2e-2  # an FP8 output within this of cuBLAS's (max |diff| / max |y|) is right
MARGIN = 0.98  # Triton is chosen only when it takes <= 98% of cuBLAS's time


def parse(argv: list[str]) -> argparse.Namespace:
    p = UsageParser(prog="cadence bench linears", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=PRESETS, help=f"'preset:tp,tp;...' (default {PRESETS})")
    p.add_argument("--tiny", action="store_true", help="the tiny preset only (CPU smoke test)")
    p.add_argument("--sweep", default="all", choices=["all", "short", "none"], help="Triton configs to time")
    p.add_argument("--inner", type=int, default=20, help="calls per captured graph")
    p.add_argument("--reps", type=int, default=15, help="timed graph replays (median)")
    p.add_argument(
        "--chunk-layers", type=int, default=3, help="distinct layers captured for the chunk figure"
    )
    p.add_argument("--budget-s", type=float, default=225.0, help="stop starting sections after this")
    p.add_argument("--no-chunk", action="store_true")
    p.add_argument("--no-tiles", action="store_true")
    p.add_argument("--no-producers", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="producers: skip the Inductor variants")
    add_record_flags(p)
    return p.parse_args(argv)


# ---- shapes ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Role:
    """One linear of a layer-pass at one rank's shard: [m, k] x [k, n]; `per_layer` calls per layer-pass
    (audio ones: the share of audio layers); `fused_input`: a fused producer makes its FP8 input."""

    name: str
    m: int
    k: int
    n: int
    per_layer: float
    fused_input: bool
    main: bool  # one of the six projections every layer has

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.m, self.k, self.n)


def roles(preset: str, tp: int) -> list[Role]:
    from cadence.config import get_preset

    cfg = get_preset(preset)
    mc, t = cfg.model, cfg.tokens_per_chunk
    d, f = mc.dim, mc.ffn_dim
    if mc.num_heads % tp or f % tp:
        raise InputError(f"{preset}: TP={tp} must divide the heads ({mc.num_heads}) and the FFN width ({f})")
    audio = sum(mc.has_audio(i) for i in range(mc.num_layers)) / mc.num_layers
    out = [
        Role("qkv", t, d, 3 * d // tp, 1, True, True),
        Role("attn_out", t, d // tp, d, 1, False, True),
        Role("cross_q", t, d, d // tp, 1, mc.cross_attn_norm, True),
        Role("cross_out", t, d // tp, d, 1, False, True),
        Role("fc1", t, d, f // tp, 1, True, True),
        Role("fc2", t, f // tp, d, 1, tp == 1, True),
    ]
    if audio:
        am = cfg.stream.latent_frames_per_chunk * mc.audio_tokens_per_frame
        out += [
            Role("audio_q", t, d, d // tp, audio, True, False),
            Role("audio_kv", am, d, 2 * d // tp, audio, False, False),
            Role("audio_out", t, d // tp, d, audio, False, False),
        ]
    return out


def plan(args) -> list[tuple[str, int]]:
    if args.tiny:
        return [("tiny", 1), ("tiny", 2)]
    out = []
    for part in (s.strip() for s in args.presets.split(";") if s.strip()):
        name, _, tps = part.partition(":")
        try:
            out += [(name.strip(), int(v)) for v in (tps or "1").split(",")]
        except ValueError:
            raise InputError(f"--presets: {part!r} is not 'preset:tp,tp' (e.g. 'w57:1,2,4')") from None
    for preset, tp in out:
        roles(preset, tp)  # an unknown preset or a TP that does not divide it: one clear error now
    if not out:
        raise InputError("--presets: no preset given")
    return out


def chunk_flop(preset: str, tp: int, main_only: bool) -> float:
    from cadence.config import get_preset

    cfg = get_preset(preset)
    per = sum(2 * r.m * r.k * r.n * r.per_layer for r in roles(preset, tp) if r.main or not main_only)
    return per * cfg.model.num_layers * cfg.stream.passes


# ---- timing ---------------------------------------------------------------------------------------------
class Clock:
    """Graph-replay timing on CUDA (``cadence.bench.fused``'s helpers), host timing on the CPU; the budget."""

    def __init__(self, device: torch.device, inner: int, reps: int, budget_s: float):
        self.device, self.cuda = device, device.type == "cuda"
        self.inner, self.reps = inner, reps
        self.t0, self.budget = time.monotonic(), budget_s
        self.skipped: list[str] = []
        self.compiled_before = False  # an Inductor compile ran in this process (the producers' section)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def enough(self, what: str, need_s: float) -> bool:
        if self.left() >= need_s:
            return True
        self.skipped.append(f"{what}: {self.left():.0f} s left of the budget")
        print(f"[bench linears] skipped {what} (budget)", file=sys.stderr, flush=True)
        return False

    def us(self, fn, inner: int | None = None) -> float:
        """Median microseconds per call of fn."""
        from cadence.bench import fused as bf

        inner = inner or self.inner
        if not self.cuda:  # the smoke test: one warm-up call, one timed (CPU numbers mean nothing)
            return bf._time_calls_us(fn, 1, 1, False)
        return bf._replay_us(bf._capture_calls(fn, inner), inner, self.reps)


def _safe(fn, *a):
    """fn(*a), or the error as a string (a config a kernel rejects is recorded, never fatal)."""
    try:
        return fn(*a)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def sweep_configs(args, cuda: bool):
    from cadence.kernels import fp8_gemm as kg

    if not cuda:  # the interpreter: the default and a split-K + descriptor config
        return {
            "all": [kg.INTERPRETER, kg.GemmConfig(16, 32, 32, 2, 2, 4, 1, tma=True)],
            "short": [kg.INTERPRETER],
        }.get(args.sweep, [])
    return {"all": list(kg.SWEEP), "short": list(kg.SWEEP[:4]), "none": []}[args.sweep]


# ---- 1. GEMMs -------------------------------------------------------------------------------------------
class Operands:
    """One shape's activation (bf16, and quantised per row) and enough weight copies (bf16 and FP8 with
    per-channel scales, a bias) that a sequence of calls never finds its weight in L2; ``next()`` rotates."""

    def __init__(self, m: int, k: int, n: int, device: torch.device):
        from cadence.quant.fp8 import quantize_rows

        g = torch.Generator(device=device).manual_seed(m * 7 + k * 3 + n)
        self.m, self.k, self.n = m, k, n
        self.x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
        self.xq, self.xs = quantize_rows(self.x)
        self.copies = max(2, min(48, math.ceil(ROTATE_BYTES / (n * k)))) if device.type == "cuda" else 2
        self.w, self.wq, self.ws = [], [], []
        for _ in range(self.copies):
            w = (torch.randn(n, k, device=device, generator=g) / math.sqrt(k)).to(torch.bfloat16)
            q, s = quantize_rows(w)
            self.w.append(w)
            self.wq.append(q)
            self.ws.append(s.t().contiguous())
        self.bias = (torch.randn(n, device=device, generator=g) * 0.1).to(torch.bfloat16)
        self.one = torch.ones((), device=device)
        self._i = 0
        self.cublas_ok = True  # set by the GEMM section: False where torch._scaled_mm refused the shape
        self._ref = None

    def next(self) -> int:
        self._i += 1
        return self._i % self.copies

    def inner(self, clock: Clock) -> int:
        return max(clock.inner, self.copies)

    # the variants: each call runs the next weight copy
    def bf16(self):
        j = self.next()
        return F.linear(self.x, self.w[j], self.bias)

    def cublas(self, j=None, tensorwise=False):
        j = self.next() if j is None else j
        sa, sb = (self.one, self.one) if tensorwise else (self.xs, self.ws[j])
        return torch._scaled_mm(self.xq, self.wq[j].t(), scale_a=sa, scale_b=sb, bias=self.bias,
                                out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip

    def today(self):
        """What FP8Linear runs today at this shape without the Triton backend: cuBLAS, or where cuBLAS
        refuses the shape (rowwise FP8 at M = 8) the dequantised float32 matmul it falls back to."""
        if self.cublas_ok:
            return self.cublas()
        j = self.next()
        y = (self.xq.float() * self.xs) @ (self.wq[j].float() * self.ws[j].t()).t()
        return (y + self.bias.float()).to(torch.bfloat16)

    def quant(self):
        from cadence.quant.fp8 import quantize_activations

        return quantize_activations(self.x)

    def triton(self, cfg, j=None):
        from cadence.kernels import fp8_gemm as kg

        j = self.next() if j is None else j
        return kg.triton_gemm(self.xq, self.wq[j], self.xs, self.ws[j], self.bias, torch.bfloat16, cfg)

    def error(self, y) -> float:
        """max |y - exact| / max |exact| against the dequantised float32 product of copy 0."""
        from cadence.kernels import fp8_gemm as kg

        if self._ref is None:  # computed once per shape (a float32 matmul: W57's largest take ~6 ms)
            self._ref = kg.reference_gemm(self.xq, self.wq[0], self.xs, self.ws[0], self.bias, torch.float32)
        ref = self._ref
        return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _time_variant(res: dict, name: str, clock: Clock, o: Operands, fn, check=None) -> None:
    """res['us'][name] = the median time (or the error text); res['err'][name] = the parity, when given."""
    if check is not None:
        e = _safe(lambda: o.error(check()))
        res["err"][name] = e
        if not isinstance(e, float):
            res["us"][name] = e
            return
    res["us"][name] = _safe(clock.us, fn, o.inner(clock))


def gemm_section(shapes: dict, clock: Clock, configs) -> tuple[dict, dict]:
    """Every variant at every shape (configs outer: each Triton config compiles once). Returns the
    per-shape results and the operands (kept for the chunk figure)."""
    ops, res = {}, {}
    for key, names in shapes.items():
        ops[key] = o = Operands(*key, clock.device)
        res[key] = r = {"m": key[0], "k": key[1], "n": key[2], "roles": names, "us": {}, "err": {}}
        r["weight_copies"] = o.copies
        _time_variant(r, "bf16", clock, o, o.bf16)
        _time_variant(r, "cublas", clock, o, o.cublas, check=lambda o=o: o.cublas(0))
        o.cublas_ok = isinstance(r["us"]["cublas"], float)
        if not o.cublas_ok:
            _time_variant(r, "dequant_fallback", clock, o, o.today)
        _time_variant(r, "cublas_tensorwise", clock, o, lambda o=o: o.cublas(tensorwise=True))
        _time_variant(r, "quant", clock, o, o.quant)
        _time_variant(r, "cublas+quant", clock, o, lambda o=o: (o.quant(), o.cublas()))
    for cfg in configs:
        name = "triton:" + cfg.text()
        if not clock.enough(name, 60 if clock.cuda else 4):  # keep a minute for the chunk figures and tiles
            break
        t0, failed = time.monotonic(), None
        for key, o in ops.items():
            r = res[key]
            if failed:
                r["us"][name] = f"skipped: {failed}"
                continue
            _time_variant(
                r, name, clock, o, lambda o=o, c=cfg: o.triton(c), check=lambda o=o, c=cfg: o.triton(c, 0)
            )
            if isinstance(r["us"][name], str):
                failed = r["us"][name]
        print(f"[bench linears] {name}: {time.monotonic() - t0:.1f} s" + (f" ({failed})" if failed else ""),
              file=sys.stderr, flush=True)  # fmt: skip
    by_text = {c.text(): c for c in configs}
    for key, r in res.items():
        _rounds(r, ops[key], clock, by_text)
        _choose(r)
    return res, ops


def _rounds(r: dict, o: Operands, clock: Clock, configs: dict, n_rounds: int = 5) -> None:
    """cuBLAS against the shape's fastest Triton config (by the sweep's medians), in interleaved rounds
    (``cadence.bench.rounds``): ``r['rounds']`` the ratio cuBLAS / Triton per round, its median, min-max and
    verdict; :func:`_choose` takes Triton only where the verdict is "faster" (its worst round beats cuBLAS's
    best)."""
    from cadence.bench.rounds import compare, interleave

    tri = [(r["us"][n], n) for n in r["us"] if n.startswith("triton:") and _ok(r, n)]
    if not tri or not _ok(r, "cublas"):
        r["rounds"] = None
        return
    name = min(tri)[1]
    cfg = configs[name[7:]]
    inner = o.inner(clock)
    variants = {
        "cublas": lambda: clock.us(o.cublas, inner),
        name: lambda: clock.us(lambda: o.triton(cfg), inner),
    }
    times = _safe(interleave, variants, n_rounds)
    ratio = compare(times, "cublas", name) if isinstance(times, dict) else None
    r["rounds"] = ratio.as_dict() if ratio is not None else None


def _ok(r: dict, name: str) -> bool:
    us, err = r["us"].get(name), r["err"].get(name)
    return isinstance(us, float) and isinstance(err, float) and err <= OK_REL


def _choose(r: dict) -> None:
    """The shape's best Triton config and the backend "auto" should take (Triton only MARGIN faster)."""
    tri = [(r["us"][n], n) for n in r["us"] if n.startswith("triton:") and _ok(r, n)]
    best = min(tri) if tri else None
    r["best_triton"] = None if best is None else {"config": best[1][7:], "us": best[0]}
    cub = r["us"]["cublas"] if _ok(r, "cublas") else None
    rounds = r.get("rounds")
    wins = rounds["verdict"] == "faster" if rounds else best[0] <= MARGIN * cub if best and cub else False
    if best is not None and (cub is None or wins):
        r["backend"], r["config"], r["chosen_us"] = "triton", best[1][7:], best[0]
    else:
        r["backend"], r["config"], r["chosen_us"] = "cublas", None, cub
    flop = 2 * r["m"] * r["k"] * r["n"]
    r["tflops"] = {n: flop / v / 1e6 for n, v in r["us"].items() if isinstance(v, float) and n != "quant"}


def gemm_table(res: dict, device: torch.device, source: str) -> dict:
    import triton

    from cadence.telemetry.devices import device_kind

    entries = []
    for r in res.values():
        us = {"cublas": r["us"].get("cublas")}
        if r["best_triton"]:
            us["triton"] = r["best_triton"]["us"]
        e = {"m": r["m"], "n": r["n"], "k": r["k"], "backend": r["backend"], "us": us}
        if r["backend"] == "triton":
            e["config"] = r["config"]
        entries.append(e)
    return {
        "kind": "fp8-gemm-table",
        "device": device_kind(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "source": source,
        "rule": f"triton where its worst of >= 5 interleaved rounds beats cuBLAS's best (no rounds: its median "
        f"at <= {MARGIN:.0%} of cuBLAS's) and its output is within {OK_REL} of the exact product",
        "entries": entries,
    }


# ---- 3. the linears of one chunk ------------------------------------------------------------------------
CHUNK_VARIANTS = ("bf16", "fp8_cublas_noquant", "fp8_cublas_quant", "fp8_auto")


def _role_fn(variant: str, role: Role, o: Operands, r: dict):
    """One call of `role` in a chunk variant: bf16; cuBLAS FP8 without / with the separate quantisation (where
    cuBLAS refuses the shape, the dequantised fallback the layer runs then: ``Operands.today``); 'fp8_auto':
    the backend chosen for the shape, quantising only where no fused producer does."""
    from cadence.kernels import fp8_gemm as kg

    if variant == "bf16":
        return o.bf16
    if variant == "fp8_cublas_noquant":
        return o.today
    if variant == "fp8_cublas_quant":
        return lambda: (o.quant(), o.today())
    cfg = kg.GemmConfig.parse(r["config"]) if r.get("backend") == "triton" else None
    gemm = (lambda: o.triton(cfg)) if cfg is not None else o.today
    return gemm if role.fused_input else (lambda: (o.quant(), gemm()))


def chunk_section(preset: str, tp: int, ops: dict, res: dict, clock: Clock, layers: int) -> dict:
    """The linears of one chunk at (preset, tp), per variant: `layers` layer-passes of the six main
    projections (and separately of the audio ones) captured in one graph, scaled to the model."""
    from cadence.config import get_preset

    cfg = get_preset(preset)
    mc = cfg.model
    rs = roles(preset, tp)
    audio_layers = sum(mc.has_audio(i) for i in range(mc.num_layers))
    out = {"preset": preset, "tp": tp, "layers_timed": layers, "passes": cfg.stream.passes,
           "tflop_main": chunk_flop(preset, tp, True) / 1e12, "tflop_all": chunk_flop(preset, tp, False) / 1e12,
           "ms": {}, "ms_main": {}, "tflops_main": {}, "tflops_all": {}}  # fmt: skip
    for v in CHUNK_VARIANTS:
        per = {}
        for group, sel in (("main", [r for r in rs if r.main]), ("audio", [r for r in rs if not r.main])):
            if not sel:
                per[group] = 0.0
                continue
            fns = [_role_fn(v, r, ops[r.key], res[r.key]) for r in sel]
            per[group] = _safe(clock.us, lambda fns=fns: [f() for f in fns], layers)
        if not isinstance(per["main"], float):
            out["ms"][v] = f"failed: {per['main']}"
            continue
        main_ms = cfg.stream.passes * mc.num_layers * per["main"] / 1e3
        out["ms_main"][v], out["tflops_main"][v] = main_ms, out["tflop_main"] / main_ms * 1e3
        if not isinstance(per["audio"], float):
            out["ms"][v] = f"audio failed: {per['audio']}"
            continue
        all_ms = main_ms + cfg.stream.passes * audio_layers * per["audio"] / 1e3
        out["ms"][v], out["tflops_all"][v] = all_ms, out["tflop_all"] / all_ms * 1e3
    return out


# ---- 4. the fused GEMM + all-reduce's parts on one GPU ---------------------------------------------------
def tiles_section(keys: list[tuple[int, int, int]], clock: Clock) -> list[dict]:
    """TP=2 row-parallel shapes: :func:`tile_row` each, while the budget lasts."""
    return [tile_row(key, clock) for key in keys if clock.enough(f"tiles {key}", 6)]


def tile_row(key: tuple[int, int, int], clock: Clock) -> dict:
    """cuBLAS, the tile kernel's GEMM alone (phase 4), its whole protocol against an emulated peer (owner,
    both: output checked equal to its GEMM's), the flag fill the emulation adds; protocol = emulated -
    arm - GEMM: the protocol's own cost on one GPU (no NVLink, no peer)."""
    from cadence.kernels import gemm_allreduce as gar

    o = Operands(*key, clock.device)
    sa = o.xs.reshape(-1)
    sbs = [s.reshape(-1) for s in o.ws]
    r = {"m": key[0], "k": key[1], "n": key[2], "us": {}, "exact": {}}
    r["us"]["cublas"] = _safe(clock.us, o.cublas, o.inner(clock))

    def phase4(j=None):
        j = o.next() if j is None else j
        return gar.gemm_only(o.xq, o.wq[j], sa, sbs[j])

    ref = _safe(phase4, 0)
    r["us"]["tile_gemm"] = _safe(clock.us, phase4, o.inner(clock))
    for proto in ("owner", "both"):
        em = _safe(gar.EmulatedPeer, key[0], key[2], clock.device, torch.bfloat16, None, proto)
        if isinstance(em, str) or isinstance(ref, str):
            r["us"][f"emulated_{proto}"] = em if isinstance(em, str) else ref
            continue
        em.arm(ref)
        y = _safe(em, o.xq, o.wq[0], sa, sbs[0])
        r["exact"][proto] = bool(torch.equal(y, ref)) if not isinstance(y, str) else y

        def call(em=em):
            j = o.next()
            em.arm()
            return em(o.xq, o.wq[j], sa, sbs[j])

        r["us"][f"emulated_{proto}"] = _safe(clock.us, call, o.inner(clock))
        r["us"]["arm"] = _safe(clock.us, em.arm)
    u = r["us"]
    for proto in ("owner", "both"):
        if all(isinstance(u.get(n), float) for n in (f"emulated_{proto}", "arm", "tile_gemm")):
            r[f"protocol_{proto}_us"] = u[f"emulated_{proto}"] - u["arm"] - u["tile_gemm"]
    return r


# ---- 5. the producers of the FP8 inputs -----------------------------------------------------------------
def _producer_fns(kind: str):
    """(plain op -> bf16, fused Triton -> (q, s), fused reference -> (q, s)) of one producer kind."""
    from cadence.kernels import quant as kq
    from cadence.model import layers as L

    if kind == "norm_modulate":
        return (
            L.norm_modulate,
            lambda x, sh, sc, eps: kq.quantize_rows_modulated_triton(x, sh, sc, eps, out_dtype=x.dtype),
            lambda x, sh, sc, eps: kq.quantize_rows_modulated_reference(x, sh, sc, eps, "layer", x.dtype),
        )
    if kind == "layer_norm":
        return (
            kq.layer_norm_reference,
            kq.quantize_rows_layer_norm_triton,
            kq.quantize_rows_layer_norm_reference,
        )
    return kq.gelu_reference, kq.gelu_quantize_rows_triton, kq.gelu_quantize_rows_reference


def _producer_inputs(kind: str, m: int, k: int, device):
    g = torch.Generator(device=device).manual_seed(m + k)
    x = (torch.randn(1, m, k, device=device, generator=g) * 2 + 0.3).to(torch.bfloat16)
    if kind == "gelu":
        return (x,)
    a = torch.randn(1, 1, k, device=device, generator=g) * 0.3
    b = torch.randn(1, 1, k, device=device, generator=g) * 0.3
    if kind == "layer_norm":
        return x, (a + 1).reshape(k), b.reshape(k), 1e-6
    return x, a, b, 1e-6


def producer_row(kind: str, m: int, k: int, clock: Clock, compiled: bool) -> dict:
    """One producer at one shape: plain, plain + separate quantisation, compiled (+ quantisation), the
    fused Triton kernel (with its parity against the fused reference) and the compiled fused reference."""
    from cadence.bench.fused import _quant_parity
    from cadence.quant.fp8 import quantize_activations

    plain, fused, ref = _producer_fns(kind)
    args = _producer_inputs(kind, m, k, clock.device)
    r = {"kind": kind, "m": m, "k": k, "us": {}}

    def q2(h):
        return quantize_activations(h.reshape(-1, h.shape[-1]))

    r["us"]["eager"] = _safe(clock.us, lambda: plain(*args))
    r["us"]["eager+quant"] = _safe(clock.us, lambda: q2(plain(*args)))
    got = _safe(fused, *args)
    if not isinstance(got, str):
        r["parity"] = _quant_parity(*got, *ref(*args))
    r["us"]["triton_fused"] = got if isinstance(got, str) else _safe(clock.us, lambda: fused(*args))
    # the first Inductor compile of a process takes its start-up (~30 s on a fresh machine), later ones less
    if compiled and clock.enough(f"compiled {kind} {m}x{k}", 15 if clock.compiled_before else 45):
        clock.compiled_before = True
        cp = torch.compile(plain, dynamic=False, fullgraph=True)
        cf = torch.compile(ref, dynamic=False, fullgraph=True)
        r["us"]["compiled"] = _safe(clock.us, lambda: cp(*args))
        r["us"]["compiled+quant"] = _safe(clock.us, lambda: q2(cp(*args)))
        r["us"]["compiled_fused"] = _safe(clock.us, lambda: cf(*args))
    return r


def producer_section(pl: list[tuple[str, int]], clock: Clock, compiled: bool) -> list[dict]:
    """Every producer shape of the plan; the Inductor variants (a compile each, seconds apiece) only at the
    first preset's TP=1 shapes (W57 in the default plan: the replicated 748 x 8192 inputs)."""
    from cadence.config import get_preset

    todo: dict[tuple, bool] = {}
    for i, (preset, tp) in enumerate(pl):
        cfg = get_preset(preset)
        t, d = cfg.tokens_per_chunk, cfg.model.dim
        first = compiled and preset == pl[0][0]
        todo.setdefault(("norm_modulate", t, d), first)
        todo.setdefault(("layer_norm", t, d), first)
        todo.setdefault(("gelu", t, cfg.model.ffn_dim // tp), first and i == 0)
    rows = []
    for (kind, m, k), comp in todo.items():
        if not clock.enough(f"producer {kind} {m}x{k}", 3):
            break
        rows.append(producer_row(kind, m, k, clock, comp))
    return rows


# ---- summary, run ---------------------------------------------------------------------------------------
def _f(v, d=1) -> str:
    return f"{v:.{d}f}" if isinstance(v, float) else "-"


def print_summary(gemms: dict, chunks: list[dict], tiles: list[dict], producers: list[dict]) -> None:
    print("\n[bench linears] per shape, us (GPU time per call; 'chosen' = what FastPath.gemm='auto' takes)")
    print(f"{'m x k -> n':>22} {'bf16':>7} {'cublas':>7} {'tensorw':>7} {'quant':>6} {'triton':>7} "
          f"{'best triton config':<28} {'chosen':>8} {'TFLOP/s':>7}  roles")  # fmt: skip
    for r in gemms.values():
        bt = r["best_triton"] or {}
        tf = r["tflops"].get("triton:" + r["config"] if r["config"] else "cublas")
        print(f"{r['m']:>6} x {r['k']:>5} -> {r['n']:>5} {_f(r['us'].get('bf16')):>7} {_f(r['us'].get('cublas')):>7} "
              f"{_f(r['us'].get('cublas_tensorwise')):>7} {_f(r['us'].get('quant')):>6} {_f(bt.get('us')):>7} "
              f"{bt.get('config', '-'):<28} {r['backend']:>8} {_f(tf, 0):>7}  {', '.join(r['roles'])}")  # fmt: skip
    print("\n[bench linears] cuBLAS / best Triton config, interleaved rounds (ratio > 1: Triton faster)")
    for r in gemms.values():
        q = r.get("rounds")
        if q:
            print(f"{r['m']:>6} x {r['k']:>5} -> {r['n']:>5}  {q['median']:.2f}x ({q['lo']:.2f}-{q['hi']:.2f}x over "
                  f"{q['rounds']} rounds): {q['verdict']}")  # fmt: skip
    print("\n[bench linears] the linears of one chunk: ms with the audio attention / ms of the six main "
          "projections / their average TFLOP/s")  # fmt: skip
    print(f"{'preset':>10} " + " ".join(f"{v:>24}" for v in CHUNK_VARIANTS))
    for c in chunks:
        cells = [
            f"{_f(c['ms'].get(v))} / {_f(c['ms_main'].get(v))} / {_f(c['tflops_main'].get(v), 0)}"
            for v in CHUNK_VARIANTS
        ]
        print(f"{c['preset'] + ' tp' + str(c['tp']):>10} " + " ".join(f"{x:>24}" for x in cells))
    if tiles:
        print("\n[bench linears] fused GEMM + all-reduce on one GPU (TP=2 shapes, us): cublas | tile GEMM | "
              "emulated owner / both | arm | protocol owner / both")  # fmt: skip
        for t in tiles:
            u = t["us"]
            print(f"{t['m']:>6} x {t['k']:>5} -> {t['n']:>5}  {_f(u.get('cublas'))} | {_f(u.get('tile_gemm'))} | "
                  f"{_f(u.get('emulated_owner'))} / {_f(u.get('emulated_both'))} | {_f(u.get('arm'))} | "
                  f"{_f(t.get('protocol_owner_us'))} / {_f(t.get('protocol_both_us'))}  exact {t['exact']}")  # fmt: skip
    if producers:
        print(
            "\n[bench linears] producers of the FP8 inputs, us: eager+quant | compiled+quant | triton fused | compiled fused"
        )
        for p in producers:
            u = p["us"]
            print(f"{p['kind']:>14} {p['m']:>5} x {p['k']:>5}  {_f(u.get('eager+quant'))} | {_f(u.get('compiled+quant'))} | "
                  f"{_f(u.get('triton_fused'))} | {_f(u.get('compiled_fused'))}  parity {p.get('parity', {}).get('bytes_differ', '-')}"
                  f"/{p.get('parity', {}).get('elements', '-')} bytes")  # fmt: skip


def collect_shapes(pl: list[tuple[str, int]]) -> dict[tuple, list[str]]:
    shapes: dict[tuple, list[str]] = {}
    for preset, tp in pl:
        for r in roles(preset, tp):
            shapes.setdefault(r.key, []).append(f"{preset}/tp{tp} {r.name}")
    return shapes


def tile_keys(pl: list[tuple[str, int]]) -> list[tuple]:
    keys: dict[tuple, None] = {}
    for preset in dict.fromkeys(p for p, _ in pl):
        for r in roles(preset, 2):
            if r.name in ("attn_out", "fc2"):
                keys[r.key] = None
    return list(keys)


def _writer(args, dev: torch.device):
    """save(results, gemms, final) -> the record's path: a partial JSON after every section (overwritten; a
    run killed by its time limit still leaves what it measured), the table as soon as the GEMMs are in, the
    docs/benchmarks.md record at the end."""
    from cadence.bench.common import git_commit, record
    from cadence.bench.recipes import recipe_fields
    from cadence.telemetry.devices import device_kind

    base = results_dir(args) / "linears"
    preset = "tiny" if args.tiny else "all"
    partial = base / f"partial-{device_kind(dev)}-{preset}.json"

    def save(results: dict, gemms: dict, final: bool, recipes: dict | None = None) -> str:
        if args.no_record:
            return ""
        base.mkdir(parents=True, exist_ok=True)
        name = f"{partial.name} (git {git_commit()})"
        if final:
            chunks = results.get("chunks", [])
            head = ", ".join(
                f"{c['preset']} tp{c['tp']} auto {_f(c['ms'].get('fp8_auto'))} ms" for c in chunks[:3]
            )
            path = record("linears", preset, 1, dev, {"plan": results["plan"]}, results, out_dir=results_dir(args),
                          command=getattr(args, "command", None), headline=head or "no chunk figure",
                          extra=recipe_fields(recipes or {}))  # fmt: skip
            name = path.name
            partial.unlink(missing_ok=True)
        else:
            partial.write_text(
                json.dumps({"partial": True, "results": results}, indent=2, default=str) + "\n"
            )
        if gemms and dev.type == "cuda":
            table = gemm_table(gemms, dev, name)
            tdir = REPO / "docs" / "perf" / "fp8" if getattr(args, "record", False) else base
            (tdir / f"gemm-{table['device']}.json").write_text(json.dumps(table, indent=2) + "\n")
        return str(path) if final else str(partial)

    return save


def plan_recipes(pl: list[tuple[str, int]], device: torch.device) -> dict:
    """The recipe of each (preset, TP) of the plan ('w57 tp4' -> what ``cadence serve --model w57 --tp 4``
    builds on this device: its geometry, gemm 'auto', the kernel switches in effect, e.g. CADENCE_FP8_QUANT):
    printed and recorded (``recipes``); the backends and configs timed are this benchmark's own."""
    from cadence.engine.recipe import EngineSpec, resolve

    dev = "cpu" if device.type != "cuda" else f"cuda:{device.index or 0}"
    return {f"{p} tp{t}": resolve(EngineSpec(model=p, tp=t), dev) for p, t in pl}


def run(args: argparse.Namespace) -> dict:
    from cadence.bench.recipes import print_recipes

    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    clock = Clock(dev, max(1, args.inner), max(3, args.reps), args.budget_s)
    pl = plan(args)
    recipes = plan_recipes(pl, dev)
    print_recipes(recipes, sys.stderr)
    shapes, configs, save = collect_shapes(pl), sweep_configs(args, clock.cuda), _writer(args, dev)
    print(f"[bench linears] {len(shapes)} shapes, {len(configs)} Triton configs on {dev}; torch {torch.__version__}",
          file=sys.stderr, flush=True)  # fmt: skip
    res: dict = {"plan": [f"{p}:{t}" for p, t in pl], "configs": [c.text() for c in configs], "chunks": [],
                 "tiles": [], "producers": [], "skipped": clock.skipped,
                 "roles": {f"{p} tp{t}": [asdict(r) for r in roles(p, t)] for p, t in pl}}  # fmt: skip
    with torch.no_grad():
        gemms, ops = gemm_section(shapes, clock, configs)
        res["gemms"] = list(gemms.values())
        save(res, gemms, False)
        for preset, tp in [] if args.no_chunk else pl:
            if clock.enough(f"chunk {preset} tp{tp}", 3):
                res["chunks"].append(chunk_section(preset, tp, ops, gemms, clock, max(1, args.chunk_layers)))
        del ops
        if clock.cuda:
            torch.cuda.empty_cache()
        save(res, gemms, False)
        res["tiles"] = [] if args.no_tiles else tiles_section(tile_keys(pl), clock)
        save(res, gemms, False)
        compiled = clock.cuda and not args.no_compile
        res["producers"] = [] if args.no_producers else producer_section(pl, clock, compiled)
    res["elapsed_s"] = time.monotonic() - clock.t0
    print_summary(gemms, res["chunks"], res["tiles"], res["producers"])
    if not args.no_record:
        res["_path"] = save(res, gemms, True, recipes)
        print(f"wrote {res['_path']}" + (" and the GEMM table beside it" if clock.cuda else ""))
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.command = "cadence bench linears " + " ".join(shlex.quote(a) for a in argv)
    if not torch.cuda.is_available():  # the smoke test runs the Triton kernels in the interpreter (set before
        os.environ.setdefault("TRITON_INTERPRET", "1")  # any kernel module is imported: Triton reads it then)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
