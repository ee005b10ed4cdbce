"""The results of ``cadence bench step``: its JSON fields and its printed table (the measuring is step.py's).

Fields beyond docs/benchmarks.md's ``step`` schema (every time is per chunk, one rank, scaled to all layers):

* ``split_mode`` 'graph' (the split of the graph-replayed step: ``step.measure_graph_split``) or 'eager' (of
  instrumented eager steps, which carry launch gaps); ``split`` that split: ``linear_ms`` (the GEMMs),
  ``quant_ms`` (FP8 activation quantisation), ``attention_ms``, ``cache_ms`` (ring writes, RoPE at write),
  ``comm_ms`` (the collectives as run: on an emulated rank their stand-ins), ``linear_comm_ms`` (modes whose
  GEMM and collective are one call), ``elementwise_ms`` (everything else: norms, modulation, gates,
  residuals, GELU, the sampler), ``total_ms`` (the instrumented step they add up to); ``split_eager`` and
  ``split_graph`` both; the top-level ``linear_ms`` / ``attention_ms`` / ``cache_upkeep_ms`` / ``comm_ms`` /
  ``quant_ms`` / ``elementwise_ms`` (= ``other_ms``) are ``split``'s.
* ``floors`` (``cadence.bench.floors``: per part, and their sum ``step``) and ``vs_floor`` (floor /
  measured per part; comm against the estimate where the rank is emulated).
* Under TP: ``collectives`` (per chunk: kind, label, shape, dtype, bytes, algorithm, count, estimated us
  each and ms in all), ``comm_estimate_ms`` and ``comm_estimate`` (the link fits and their source:
  ``cadence.parallel.emulate``), ``compute_ms`` (the step less the time its collectives took in it:
  per-rank compute), ``step_estimate_ms`` (``compute_ms + comm_estimate_ms``: no overlap); an emulated
  rank adds ``standin_ms`` (its stand-ins alone, graph-replayed).
"""

from __future__ import annotations

import json
import logging

from cadence.bench.common import CEILING, median, p99, print_table

PARTS = ("linear", "quant", "attention", "cache", "elementwise", "comm")
REGIONS = ("attention", "cache", "linear", "quant", "allreduce", "linear_comm")


#: The switches of the step's own reference paths (cadence.runtime.chunk / compile), recorded with every run
STEP_SWITCHES = (
    "CADENCE_TIMESTEP_CACHE",
    "CADENCE_AUDIO_KV",
    "CADENCE_COMPILE_PAIRS",
    "CADENCE_COMPILE_ROPE",
    "CADENCE_QK_NORM_IN_WRITE",
)


def step_env() -> dict:
    """The step switches as set in this run's environment (None: unset, the default)."""
    import os

    return {k: os.environ.get(k) for k in STEP_SWITCHES}


def split_regions(splits: list[dict[str, float]]) -> dict[str, float]:
    """The median per region of instrumented steps' region totals."""
    return {k: median([s.get(k, 0.0) for s in splits]) for k in REGIONS}


PART_NAMES = {
    "linear": "linears (GEMMs)",
    "quant": "FP8 quantisation",
    "attention": "attention",
    "cache": "cache writes",
    "elementwise": "elementwise + rest",
    "comm": "comm",
}


def split_of(region: dict, total_ms: float, scale: float) -> dict:
    """Region times (one step of some layers) -> the per-chunk split of the module docstring."""
    parts = {
        "linear_ms": region.get("linear", 0.0),
        "quant_ms": region.get("quant", 0.0),
        "attention_ms": region.get("attention", 0.0),
        "cache_ms": region.get("cache", 0.0),
        "comm_ms": region.get("allreduce", 0.0),
        "linear_comm_ms": region.get("linear_comm", 0.0),
    }
    named = sum(parts.values())
    out = {k: v * scale for k, v in parts.items()}
    out["elementwise_ms"] = max(total_ms - named, 0.0) * scale
    out["total_ms"] = total_ms * scale
    return out


def _graph_speedup(graph, eager_ms: float, graph_ms: float | None) -> float | None:
    """eager / graphed: the median of the interleaved rounds' ratios where they ran, else of the two medians."""
    if graph_ms is None:
        return None
    rounds = graph.get("rounds") if graph else None
    return rounds["median"] if rounds else eager_ms / graph_ms


def _step_fields(st, m: dict) -> dict:
    times, graph, scale = m["times"], m["graph"], st.scale
    eager_ms = median(times)
    graph_ms = median(graph["times"]) if graph is not None and graph["used"] else None
    step_ms = graph_ms if graph_ms is not None else eager_ms
    step_times = graph["times"] if graph_ms is not None else times
    return {
        "step_ms": step_ms * scale,
        "step_p99_ms": p99(step_times) * scale,
        "step_mode": "graph" if graph_ms is not None else "eager",
        "step_eager_ms": eager_ms * scale,
        "step_eager_p99_ms": p99(times) * scale,
        "step_graph_ms": graph_ms * scale if graph_ms is not None else None,
        "step_graph_p99_ms": p99(graph["times"]) * scale if graph_ms is not None else None,
        "graph_speedup": _graph_speedup(graph, eager_ms, graph_ms),
        "raw_step_ms_unscaled": times,
        "raw_graph_step_ms_unscaled": graph["times"] if graph is not None else None,
    }


def _split_fields(args, st, m: dict) -> dict:
    eager = split_of(m["region"], median(m["totals"]) if m["totals"] else 0.0, st.scale)
    gs = m.get("graph_split")
    graph = split_of(gs["region"], gs["total_ms"], st.scale) if gs and gs.get("used") else None
    split = graph or eager
    return {
        "split_mode": "graph" if graph else "eager",
        "split": split,
        "split_eager": eager,
        "split_graph": graph,
        "graph_split": None if gs is None else {k: v for k, v in gs.items() if k != "region"},
        "attention_ms": split["attention_ms"],
        "cache_upkeep_ms": split["cache_ms"],
        "linear_ms": split["linear_ms"],
        "quant_ms": split["quant_ms"],
        "comm_ms": split["comm_ms"],
        "linear_comm_ms": split["linear_comm_ms"],
        "elementwise_ms": split["elementwise_ms"],
        "other_ms": split["elementwise_ms"],
        "instrumented_step_ms": split["total_ms"],
    }


def _tp_fields(args, st, m: dict, out: dict) -> dict:
    """Collectives, the comm estimate, the per-rank compute (TP > 1; TP=1: compute = step)."""
    if m.get("log") is None:
        return {
            "collectives": [],
            "comm_estimate_ms": 0.0,
            "compute_ms": out["step_ms"],
            "step_estimate_ms": None,
        }
    from cadence.parallel.emulate import comm_estimate, time_standins

    summary = m["log"].summary(st.scale)
    est = comm_estimate(summary, args.tp)
    res = {"collectives": est.pop("collectives"), "comm_estimate_ms": est["total_ms"], "comm_estimate": est}
    standin = None
    if st.emulated:
        try:
            standin = time_standins(summary, st.device)
        except RuntimeError as e:  # a capture problem: the in-step split still has the stand-ins' time
            logging.getLogger("cadence.bench.step").warning("stand-ins alone not timed: %s", e)
    in_step = out["split"]["comm_ms"] if out["split_mode"] == "graph" or standin is None else standin
    res.update(standin_ms=standin, comm_in_step_ms=in_step)
    res["compute_ms"] = max(out["step_ms"] - in_step, 0.0)
    res["step_estimate_ms"] = res["compute_ms"] + est["total_ms"]
    return res


def _floor_fields(args, st, out: dict) -> dict:
    from cadence.bench.floors import comm_bus_bytes, floors_ms, rank_flops

    bus = comm_bus_bytes(out["collectives"], args.tp) if out["collectives"] else 0.0
    floors = floors_ms(st.full, args.tp, bool(st.fast.sequence_parallel), st.fp8, st.kv_fp8, bus)
    split = out["split"]
    measured = {p: split[f"{p}_ms"] for p in PARTS}
    if st.emulated:
        measured["comm"] = out["comm_estimate_ms"]
    fl = rank_flops(st.full, args.tp)
    floor_ms = (
        fl["linear"] / (CEILING["fp8_gemm"] * 1e12) + fl["attention"] / (CEILING["fp8_attn"] * 1e12)
    ) * 1e3
    floor_bf16 = (
        fl["linear"] / (CEILING["bf16_gemm"] * 1e12) + fl["attention"] / (CEILING["bf16_attn"] * 1e12)
    ) * 1e3
    s = out["step_ms"]
    return {
        "floors": floors,
        "vs_floor": {p: (floors[p] / measured[p] if measured[p] > 0 else None) for p in PARTS},
        "comm_bus_bytes": bus,
        "tflop_per_rank": (fl["linear"] + fl["attention"]) / 1e12,
        "tflop_linear_per_rank": fl["linear"] / 1e12,
        "tflop_attention_per_rank": fl["attention"] / 1e12,
        "tflops_per_gpu": (fl["linear"] + fl["attention"]) / (s * 1e-3) / 1e12,
        "floor_ms": floor_ms,
        "floor_bf16_ms": floor_bf16,
        "efficiency": floor_ms / s,
        "efficiency_vs_bf16_floor": floor_bf16 / s,
    }


def results(args, st, model, m: dict, graphs_why, built: str, fp8_layers: int, compile_report) -> dict:
    """Every field of the JSON's ``results`` (docs/benchmarks.md's step schema plus the module docstring's)."""
    import torch

    from cadence.bench.floors import chunk_flops

    graph = m["graph"]
    out = _step_fields(st, m)
    out["graphs"] = {
        "requested": st.graphs_asked,
        "tried": graph is not None,
        "used": out["step_graph_ms"] is not None,
        "reason": graphs_why if graph is None else (None if graph["used"] else graph["last"]),
        **({k: v for k, v in graph.items() if k != "times"} if graph is not None else {}),
    }
    out["compile"] = compile_info(compile_report) if st.fast.compile else None
    out["profile"] = m.get("profile")
    out.update(_split_fields(args, st, m))
    out.update(_tp_fields(args, st, m, out))
    out.update(_floor_fields(args, st, out))
    fl = chunk_flops(st.full)
    out["tflop_per_chunk"] = fl["total"] / 1e12  # the whole chunk, all ranks
    out["tflop_linear"], out["tflop_attention"] = fl["linear"] / 1e12, fl["attention"] / 1e12
    dev = st.device
    out.update(
        cache=st.cache,
        kv_fp8=st.kv_fp8,
        cache_mem_gib=m["cache_bytes"] * st.scale / 2**30,
        fp8=st.fp8,
        fused=bool(st.group is not None and st.fast.comm != "nccl"),
        sequence_parallel=bool(st.fast.sequence_parallel),
        emulated=st.emulated,
        emulated_rank=st.group.rank if st.emulated else None,
        dtype=str(st.dtype).replace("torch.", ""),
        peak_mem_gib=(torch.cuda.max_memory_allocated(dev) / 2**30) if dev.type == "cuda" else None,
        layers_run=st.layers,
        layers_full=st.full.model.num_layers,
        scaled=st.scale != 1.0,
        scale_factor=st.scale,
        host_sync_in_step=m["host_sync"],
        iters=st.iters,
        warmup=st.warmup,
        step_env=step_env(),
    )
    if st.fp8:
        from cadence.quant import fp8 as fp8_mod

        out["fp8_layers"] = fp8_layers
        out["fp8_counts"] = fp8_mod.fp8_report(model)
        if st.fused_quant is not None:
            out["fused_quant"] = {"describe": st.fused_quant.describe(), "status": st.fused_quant.status()}
        out["fp8_quant"] = {
            "backend": fp8_mod.quant_backend(),
            "triton_failed": fp8_mod._quant_failed,
            "reference_path_reasons": sorted(fp8_mod._quant_logged),
        }
    if st.group is not None:
        import os

        from cadence.parallel import fused

        out["tp_env"] = {
            k: os.environ.get(k) for k in ("CADENCE_TP_BIAS", "CADENCE_TP_QK_PAIR", "CADENCE_TP_SMALL_COMM")
        }
        out.update(
            comm=st.fast.comm,
            comm_decisions=fused.chooser_decisions(),
            comm_fallbacks=fused.fallback_warnings(),
            symm_cache=fused.symm_cache_info(),
            tp_built=built,
        )
    return out


def compile_info(report) -> dict:
    """JSON for the compile report (after the run: its per-op status says what really compiled)."""
    info: dict = {"applied": True}
    for attr in ("enabled", "reason", "blocks", "norms", "backend"):
        if hasattr(report, attr):
            info[attr] = getattr(report, attr)
    for meth in ("describe", "status"):
        fn = getattr(report, meth, None)
        if callable(fn):
            try:
                info[meth] = fn()
            except Exception as e:  # noqa: BLE001  (a report that cannot describe itself: say so, keep going)
                info[meth] = f"{type(e).__name__}: {e}"
    if report is not None and len(info) == 1:
        info["report"] = repr(report)
    try:
        json.dumps(info)
    except (TypeError, ValueError):
        info = {"applied": True, "report": repr(report)}
    return info


def _rounds_text(q: dict | None) -> str:
    return f", {q['lo']:.2f}-{q['hi']:.2f} over {q['rounds']} interleaved rounds" if q else ""


def _ms(v) -> str:
    return f"{v:9.2f} ms" if v is not None else "      n/a"


def split_rows(r: dict, emulated: bool) -> list[tuple[str, str]]:
    """One row per part: measured, floor, floor / measured, share of the step."""
    split, floors, s = r["split"], r["floors"], r["step_ms"]
    rows = [
        (f"split ({r['split_mode']})", f"{'measured':>12} {'floor':>10} {'floor/meas':>11} {'of step':>8}")
    ]
    for p in PARTS:
        meas = split[f"{p}_ms"]
        extra = ""
        if p == "comm" and emulated:
            extra = f"   (stand-ins; estimate {r['comm_estimate_ms']:.2f} ms: floor/est {r['vs_floor']['comm'] or 0:.0%})"
        ratio = floors[p] / meas if meas > 0 else float("nan")
        rows.append(
            (f"  {PART_NAMES[p]}", f"{meas:9.2f} ms {floors[p]:7.2f} ms {ratio:10.0%} {meas / s:8.1%}{extra}")
        )
    if split["linear_comm_ms"]:
        rows.append(("  GEMM + comm (fused)", f"{split['linear_comm_ms']:9.2f} ms"))
    rows.append(
        ("  instrumented total", f"{split['total_ms']:9.2f} ms   floor (all parts) {floors['step']:.2f} ms")
    )
    return rows


def collective_rows(r: dict) -> list[tuple[str, str]]:
    rows = []
    for c in r["collectives"]:
        shape = "x".join(str(x) for x in c["shape"])
        rows.append(
            (
                f"  {c['kind']} {c['label']}",
                f"[{shape}] {c['dtype']} {c['nbytes'] / 1e6:7.2f} MB x {c['count']:g} {c['algo']}: "
                f"{c['est_us']:6.1f} us each, {c['est_ms']:6.2f} ms",
            )
        )
    return rows


def tp_rows(r: dict, emulated: bool) -> list[tuple[str, str]]:
    """The rows of a TP run: per-rank compute, the comm estimate, its alternatives and the link figures used."""
    est = r["comm_estimate"]
    rows = [
        (
            "compute per rank",
            _ms(r["compute_ms"]) + f"   (step less {r['comm_in_step_ms']:.2f} ms of collectives in it)",
        ),
        (
            "comm estimate",
            _ms(r["comm_estimate_ms"]) + f"   ({len(r['collectives'])} kinds; link figures below)",
        ),
        ("step estimate", _ms(r["step_estimate_ms"]) + "   (compute + comm estimate, no overlap)"),
        (
            "  RS/AG over symm-mem",
            _ms(est["total_ms_symm_halves"])
            + "   (each reduce-scatter / all-gather as half a two-shot: a model)",
        ),
        (
            "  cheapest per size",
            _ms(est.get("total_ms_cheapest"))
            + "   (every all-reduce in the algorithm the table prices lowest)",
        ),
        (
            "  FP8 all-gather half",
            _ms(est.get("total_ms_fp8_gather"))
            + "   (all-reduces > 1 MB with an e4m3 all-gather half: a model)",
        ),
    ]
    f8 = est.get("total_ms_fp8")
    if f8:  # cadence.parallel.emulate.fp8_reduce_parts: all-reduces > 1 MB as two_shot_fp8, per variant
        rows.append(
            (
                "  FP8 two-shot",
                f"as built {f8['as_built']:.2f} / symm {f8['symm']:.2f} / symm fused {f8['symm_fused']:.2f} / "
                f"quant in epilogue {f8['symm_epilogue']:.2f} ms   (all-reduces > 1 MB; models but 'as built')",
            )
        )
    for a, f in est.get("links_used", {}).items():
        lo, hi = f["measured_bytes"]
        ext = f"; extrapolated for {', '.join(f['extrapolated_for'])}" if f["extrapolated_for"] else ""
        rows.append(
            (
                f"  link figure {a}",
                f"{f['fixed_us']:.1f} us + {f['us_per_mb']:.2f} us/bus MB (measured {lo / 1e6:.1f}-{hi / 1e6:.1f} "
                f"MB at 2 GPUs{ext})",
            )
        )
    rows.append(("  link source", est["source"][:100] + "..."))
    if emulated:
        rows.append(("stand-ins alone", _ms(r["standin_ms"]) + "   (graph-replayed)"))
    return rows


def print_report(args, st, r: dict) -> None:
    s, scale = r["step_ms"], st.scale
    g = r["graphs"]
    rows = [
        (
            "step (median)",
            f"{s:9.2f} ms  [{r['step_mode']}]"
            + (f"   (scaled x{scale:.2f} from {st.layers} layers)" if scale != 1 else ""),
        ),
        ("step p99", f"{r['step_p99_ms']:9.2f} ms"),
        (
            "eager / graphed",
            f"{r['step_eager_ms']:9.2f} ms / "
            + (
                f"{r['step_graph_ms']:.2f} ms  (x{r['graph_speedup']:.2f}{_rounds_text(g.get('rounds'))})"
                if r["step_graph_ms"] is not None
                else f"n/a ({g['reason']})"
            ),
        ),
    ]
    if st.fp8:
        rows.append(
            (
                "FP8 linears",
                "{fp8_linears}: {ran_fp8} ran FP8, {fell_back} fell back ({mixed} mixed), {unused} unused".format(
                    **r["fp8_counts"]
                ),
            )
        )
    rows += split_rows(r, st.emulated)
    if st.group is not None:
        rows += tp_rows(r, st.emulated)
    rows += [
        ("TFLOP / rank / chunk", f"{r['tflop_per_rank']:9.2f}  ({r['tflops_per_gpu']:.0f} TFLOP/s)"),
        (
            "floor (FP8) / bf16",
            f"{r['floor_ms']:9.2f} ms / {r['floor_bf16_ms']:.2f} ms  efficiency {r['efficiency']:.1%}",
        ),
        ("peak memory", f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] else "n/a (CPU)"),
        ("host sync in step", str(r["host_sync_in_step"])),
    ]
    who = ""
    if st.group is not None:
        who = (
            f" tp{args.tp}"
            + (f" (emulated rank {st.group.rank})" if st.emulated else "")
            + f" comm={st.fast.comm}"
        )
        who += " sequence-parallel" if st.fast.sequence_parallel else ""
    print_table(
        rows,
        f"bench step: {st.full.name}{who or ' tp1'} cache={st.cache}{' fp8 K/V' if st.kv_fp8 else ''} "
        f"{r['dtype']}{' fp8 linears' if st.fp8 else ''}",
    )
    if r["collectives"]:
        print_table(collective_rows(r), "collectives per chunk (estimated from measured link figures):")
    if r.get("profile") is not None:
        from cadence.bench.step_profile import rows as profile_rows

        print_table(
            profile_rows(r["profile"]), "every kernel of the step, by part (ms per chunk, all layers):"
        )
    for shape, d in r.get("comm_decisions", {}).items():
        print(f"  comm {shape}: {d['mode']} ({d['why']})")
