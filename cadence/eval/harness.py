"""The quality harness behind ``cadence eval``: do the fast paths change the picture, on any model family?

It streams held-out clips (``cadence.eval.clips``: a reference image and speech each) through the engine
under several *configurations* (:data:`CONFIGS`: the plain reference path, FP8 linears + the ring cache,
CUDA graphs, tensor parallelism, and the ring's attention backends with per-token or per-head FP8 scales),
each clip ``R`` times with different noise seeds, measures every stream (``cadence.eval.measure``: lip-sync
offset and confidence from face landmarks, identity / colour / sharpness drift per second) and decides, per
configuration and metric, whether its difference from the reference is larger than rerunning noise.

The engine of a configuration is built through the public entry points: the command's
:class:`~cadence.engine.recipe.EngineSpec` (``--model NAME --weights ...``: any preset or family) with the
configuration's cache and fast path, ``resolve`` for the device, ``build_engine``. FP8 linears are applied
with ``cadence.quant.apply_fp8`` after the build (on the CPU too: the dequantised matmul, FP8 numerics),
and the ring with FP8 K/V comes from the stream section (the CPU runs its PyTorch reference path).

Per stream the clip's reference image is the sink, its audio drives ``ceil(frames / frames_per_chunk)``
chunks (zero-padded to whole chunks) and the first ``frames`` frames are measured. A family that is not
audio-driven (text-to-video: Self-Forcing, ...) streams the same way; its lip-sync numbers then measure only
chance (confidence near the mismatched-audio level), its drift curves are what counts.

Reruns: rerun ``r`` of every clip uses noise seed ``noise_seed + r`` in *every* configuration (paired).

Aggregation (:func:`aggregate`), per configuration and metric, from ``x[clip, rerun]`` (NaN entries, e.g.
the offset of a clip without speech, are left out): ``mean`` over all, ``per_rerun`` (one clip-mean per
rerun), ``rerun_spread = max_r - min_r`` of the per-rerun means. The range, not a standard deviation: with
the 2-3 reruns one can afford it is exactly the largest change rerunning the same configuration produced.

Verdict (:func:`compare`): a configuration differs on a metric when ``|mean_c - mean_ref| >
max(rerun_spread_ref, rerun_spread_c)`` (beyond float rounding: a delta of one clip's offset frame over 6
clips equals a spread of the same size, and is not more); ``"within rerun spread"`` when no metric differs, else ``"DIFFERS
(<metric> <delta> > spread <thr>; ...)"``. A per-head attention configuration whose ring did not run with
per-head scales here (the CPU, or a GPU without the kernel: it fell back) is reported ``"not judged"``:
its numbers are those of the fallback. :func:`attention_verdict` turns the two per-head configurations'
verdicts into the one line ``auto`` needs (``cadence.kernels.attention_backends`` leaves per-head backends
out of its ranking until an eval has judged them).

Ground truth (``ground_truth`` row): the metrics of the synthetic clips' own animation (module
``cadence.eval.clips``), the lip-sync ceiling and the drift floor; not a configuration, no verdict.

Library only: nothing is printed (``progress`` callbacks get one line per clip), nothing written.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cadence.eval.clips import EvalClip
from cadence.eval.drift import CURVES
from cadence.eval.measure import METRICS, StreamMeasure

#: The prompt every stream is generated with (the CLI's default prompt).
PROMPT = "a person talking to the camera"
REFERENCE = "reference"
GROUND_TRUTH = "ground_truth"
#: the attention backends that keep per-(layer, head) FP8 scales (``attention_backends.layout``)
PER_HEAD = ("fa3", "triton_head")

SPREAD_DEFINITION = (
    "rerun_spread = max_r(m_r) - min_r(m_r), m_r = mean over clips of rerun r "
    "(reruns differ only in the noise seed, noise_seed + r, the same in every configuration)"
)
VERDICT_RULE = (
    "a configuration differs on a metric when |mean_config - mean_reference| > "
    "max(rerun_spread_reference, rerun_spread_config); verdict 'within rerun spread' when no "
    "metric differs, else 'DIFFERS (...)' naming each metric that does; a per-head attention "
    "configuration that did not run with per-head scales is 'not judged'"
)


@dataclass(frozen=True)
class Config:
    """One engine configuration: how its engine is built from the command's spec."""

    name: str
    description: str
    cache: str = "naive"
    """Self-attention cache: 'naive' or 'ring'."""
    kv_fp8: bool = False
    """FP8 K/V in the ring."""
    fp8_linears: bool = False
    """FP8 block linears (``cadence.quant.apply_fp8``), applied after the build."""
    graphs: bool = False
    """CUDA graphs for steady-state ring steps (eager on the CPU)."""
    tp: bool = False
    """Shard the model over the whole torchrun world (needs >= 2 ranks)."""
    comm: str = "auto"
    """Row-parallel communication mode with ``tp``."""
    attention: str = "auto"
    """The ring's attention backend (``FastPath.attention``): 'triton' keeps per-token FP8 scales, 'fa3' and
    'triton_head' per-head ones; CUDA only (the CPU runs the PyTorch reference, per-token)."""

    def stream_overrides(self) -> dict:
        return {"cache": self.cache, "kv_fp8": self.kv_fp8}

    def build_settings(self) -> dict:
        """The build fields as recorded in the results."""
        out = {
            "cache": self.cache,
            "kv_fp8": self.kv_fp8,
            "fp8_linears": self.fp8_linears,
            "graphs": self.graphs,
            "tp": self.tp,
            "attention": self.attention,
        }
        return {**out, **({"comm": self.comm} if self.tp else {})}


_FP8_RING = {"cache": "ring", "kv_fp8": True, "fp8_linears": True}
_RING = {"cache": "ring", "kv_fp8": True}

#: The configurations ``cadence eval`` knows, in the order they run (the reference first).
CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config(REFERENCE, "bf16 (float32 on CPU) + naive cache: the plain reference path"),
        Config("fp8_ring", "FP8 block linears + ring cache with FP8 K/V", **_FP8_RING),
        Config("fp8_ring_graphs", "fp8_ring + CUDA graphs for steady-state steps", graphs=True, **_FP8_RING),
        Config("fp8_ring_tp_fused", "fp8_ring + tensor parallel, fused row-parallel comm", tp=True, **_FP8_RING),
        Config(
            "fp8_ring_tp_fused_graphs", "fp8_ring_tp_fused + CUDA graphs", tp=True, graphs=True, **_FP8_RING
        ),
        Config("ring_token", "ring cache, FP8 K/V with per-token scales (triton): what auto runs", attention="triton", **_RING),
        Config("ring_fa3", "ring cache, FP8 K/V with per-head scales read by FlashAttention-3", attention="fa3", **_RING),
        Config(
            "ring_triton_head", "ring cache, FP8 K/V with per-head scales (Cadence's Triton kernel)",
            attention="triton_head", **_RING,
        ),
    )
}  # fmt: skip
#: The per-head judgement of issue 37: the reference, the per-token ring auto runs now, the per-head rings.
ATTENTION_CONFIGS = ("reference", "ring_token", "ring_fa3", "ring_triton_head")


def metric_names() -> list[str]:
    """The metric keys, in table order."""
    return list(METRICS)


# ---- aggregation and verdicts -----------------------------------------------------------------------


def _num(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def aggregate(values: Mapping[str, Sequence[Sequence[float]]]) -> dict[str, dict]:
    """Per metric, from ``values[metric][clip][rerun]``: ``{mean, rerun_spread, per_rerun}`` (module doc; NaN
    entries left out, None where nothing is left)."""
    out = {}
    for m, v in values.items():
        a = np.asarray(v, np.float64)
        if a.ndim != 2 or a.size == 0:
            raise ValueError(f"metric {m!r}: expected values [clips, reruns], got shape {a.shape}")
        ok = np.isfinite(a)
        cnt = ok.sum(axis=0)
        per_rerun = np.where(cnt > 0, np.where(ok, a, 0.0).sum(axis=0) / np.maximum(cnt, 1), np.nan)
        fin = per_rerun[np.isfinite(per_rerun)]
        out[m] = {
            "mean": _num(a[ok].mean()) if ok.any() else None,
            "rerun_spread": _num(fin.max() - fin.min()) if fin.size else None,
            "per_rerun": [_num(x) for x in per_rerun],
        }
    return out


def compare(reference: Mapping[str, dict], other: Mapping[str, dict]) -> tuple[str, dict[str, dict]]:
    """(verdict, per metric ``{delta, threshold, differs}``) of ``other`` against ``reference`` (module doc)."""
    details, flagged = {}, []
    for m, ref in reference.items():
        o = other.get(m)
        if o is None or ref["mean"] is None or o["mean"] is None:
            continue
        delta = o["mean"] - ref["mean"]
        thr = max(ref["rerun_spread"] or 0.0, o["rerun_spread"] or 0.0)
        differs = bool(abs(delta) > thr + 1e-9 * max(1.0, abs(thr)))  # equal up to rounding is not more
        details[m] = {"delta": float(delta), "threshold": float(thr), "differs": differs}
        if differs:
            flagged.append(f"{m} {delta:+.4g} > spread {thr:.4g}")
    return ("within rerun spread" if not flagged else "DIFFERS (" + "; ".join(flagged) + ")"), details


def attention_verdict(passes: Sequence[Mapping[str, dict]]) -> dict:
    """What the per-head configurations' verdicts (over every pass: the short clips, the long streams) let
    ``auto`` do: ``{"decision": "rank by speed" | "keep opt-in" | "not judged", "why": ...}``."""
    seen, why, judged = [], [], True
    for configs in passes:
        for name in ("ring_fa3", "ring_triton_head"):
            c = configs.get(name)
            if c is None:
                continue
            seen.append(name)
            v = c.get("verdict", "")
            if v.startswith("not judged") or v.startswith("skipped"):
                judged = False
                why.append(f"{name}: {v}")
            elif v != "within rerun spread":
                why.append(f"{name}: {v}")
    if not seen:
        return {
            "decision": "not judged",
            "why": "no per-head configuration ran (--configs ring_fa3,ring_triton_head)",
        }
    if not judged:
        return {"decision": "not judged", "why": "; ".join(why)}
    if why:
        return {"decision": "keep opt-in", "why": "; ".join(why)}
    return {
        "decision": "rank by speed",
        "why": "every per-head configuration is within the rerun spread of the reference on every metric",
    }


# ---- running configurations -------------------------------------------------------------------------


def world_size() -> int:
    """The torch.distributed world size (initialised group, else torchrun's WORLD_SIZE, else 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def skip_reason(config: Config, cfg, world: int | None = None) -> str | None:
    """Why ``config`` cannot run in this process (None: it can)."""
    if config.tp:
        import torch.distributed as dist

        world = world_size() if world is None else world
        if world < 2:
            return (
                f"tensor parallelism needs torchrun with >= 2 ranks (this process has world size {world}): "
                "torchrun --nproc_per_node 2 -m cadence eval ..."
            )
        if not (dist.is_available() and dist.is_initialized()):
            return "tensor parallelism needs an initialised process group (cadence.parallel.init_tp)"
        from cadence.parallel.tp import check_tp_size

        try:
            check_tp_size(cfg.model, world)
        except ValueError as e:
            return str(e)
    return None


def spec_for(config: Config, spec, device):
    """The command's :class:`EngineSpec` with ``config``'s cache and fast path (no warm-up: streams are
    measured from their first frame either way)."""
    import torch

    from cadence.engine.spec import FastPath

    cuda = torch.device(device).type == "cuda"
    over = {k: dict(v) for k, v in spec.overrides.items()}
    over["stream"] = dict(over.get("stream", {}), **config.stream_overrides())
    # the cache and FP8 K/V come through the stream section, FP8 linears from outside (both run on the CPU
    # too, with FP8 numerics); FastPath keeps its CUDA-only switches to what CUDA alone can do
    fast = FastPath(
        dtype="bfloat16" if cuda else "float32",
        kv_fp8=False,
        fp8_linears=False,
        graphs=config.graphs and cuda,
        comm=config.comm,
        attention=config.attention,
        decoder=spec.fast.decoder,
        threads=0 if cuda else torch.get_num_threads(),
    )
    return dataclasses.replace(
        spec, overrides=over, fast=fast, warmup=False, tp=world_size() if config.tp else 1
    )


def build(config: Config, spec, device):
    """(engine, notes) for ``config``: ``resolve(spec_for(...))`` then ``build_engine`` on ``device`` (tensor
    parallel over the torchrun world when the config asks), then ``apply_fp8`` when it asks for FP8 linears.
    The engine decodes inline (the serial order of a reference run)."""
    import torch

    from cadence.config import PipelineConfig
    from cadence.engine.build import build_engine
    from cadence.engine.recipe import resolve

    notes: dict = {}
    tp = None
    if config.tp:
        import torch.distributed as dist

        from cadence.parallel.mesh import TPInfo

        tp = TPInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=dist.get_rank(),
            device=torch.device(device),
            backend=dist.get_backend(),
            group=dist.group.WORLD,
        )
        notes["tp_world"] = dist.get_world_size()
    dev = str(device)
    recipe = resolve(spec_for(config, spec, device), dev)
    eng = build_engine(
        recipe,
        device=dev,
        tp=tp,
        pipeline=PipelineConfig(diffusion_devices=(dev,), decode_device="same", overlap=False),
    )
    if config.fp8_linears:
        from cadence.quant import apply_fp8

        notes["fp8_layers"] = apply_fp8(eng.gen.model)
    return eng, notes


def effective_attention(eng) -> dict:
    """What read the ring in the engine's last stream: the plan's backend and scales (naive cache: none)."""
    plan = getattr(getattr(getattr(eng, "session", None), "cache", None), "plan", None)
    if plan is None:
        return {"backend": "naive cache (PyTorch attention)", "scales": "none"}
    return {"backend": plan.backend, "scales": plan.scales, "storage": plan.storage, "why": plan.why}


def run_stream(eng, clip: EvalClip, seed: int, prompt: str = PROMPT, tracker: str = "auto") -> StreamMeasure:
    """Stream ``clip`` (its reference image, its audio, chunks covering it) with noise ``seed`` and measure
    it; returns the :class:`StreamMeasure` after ``result`` (its ``values``: the stream's numbers)."""
    import torch

    cfg = eng.gen.cfg
    fpc, spc = cfg.video_frames_per_chunk, cfg.audio_samples_per_chunk
    chunks = math.ceil(clip.frames / fpc)
    audio = np.zeros(chunks * spc, np.float32)
    audio[: len(clip.audio)] = clip.audio[: chunks * spc]
    image = torch.from_numpy(np.array(clip.reference)).permute(2, 0, 1).float() / 127.5 - 1.0
    m = StreamMeasure(clip.reference, clip.fps, clip.face_box, tracker)
    try:
        for out in eng.stream(image, prompt, torch.from_numpy(audio), chunks, seed=seed):
            m.add(out.frames.numpy()[: clip.frames - m.frames])
        m.result(clip.audio, clip.sample_rate)
    finally:
        m.close()
    return m


def _mean_curves(curves: Sequence[dict]) -> dict[str, list[float]]:
    """Per curve, the per-second mean over streams (NaN-aware; the shortest stream's length)."""
    out = {}
    for name in CURVES:
        rows = [c[name] for c in curves if c.get(name)]
        if not rows:
            continue
        n = min(len(r) for r in rows)
        a = np.asarray([r[:n] for r in rows], np.float64)
        ok = np.isfinite(a)
        mean = np.where(
            ok.any(axis=0), np.where(ok, a, 0).sum(axis=0) / np.maximum(ok.sum(axis=0), 1), np.nan
        )
        out[name] = [_num(x) for x in mean]
    return out


def mean_sync_curve(tracks: Sequence[dict]) -> dict[str, float]:
    """The mean over streams of their sync curves c(k) (``track['sync_curve']``)."""
    curves = [t["sync_curve"] for t in tracks if t.get("sync_curve")]
    if not curves:
        return {}
    return {k: float(np.mean([c[k] for c in curves])) for k in curves[0]}


def run_config(
    eng,
    config: Config,
    clips: Sequence[EvalClip],
    reruns: int,
    noise_seed: int = 0,
    prompt: str = PROMPT,
    tracker: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[list[float]]], dict]:
    """Every clip x rerun of one configuration: (``values[metric][clip][rerun]``, run info: ``effective``
    (how the steps ran), ``attention_effective``, mean ``curves``, the first stream's ``track``)."""
    values: dict[str, list[list[float]]] = {}
    s0 = dataclasses.replace(eng.runner.stats, eager_reasons=dict(eng.runner.stats.eager_reasons))
    t_start = time.perf_counter()
    curves, tracks, trackers = [], [], set()
    for i, clip in enumerate(clips):
        t0 = time.perf_counter()
        per = []
        for r in range(reruns):
            m = run_stream(eng, clip, noise_seed + r, prompt, tracker)
            per.append(m.values)
            curves.append(m.curves)
            trackers.add(m.track["tracker"])
            tracks.append(
                {**m.track, "clip": clip.name, "noise_seed": noise_seed + r} if not tracks else m.track
            )
        for k in per[0]:
            values.setdefault(k, []).append([p[k] for p in per])
        if progress:
            progress(
                f"{config.name}: clip {i + 1}/{len(clips)} ({clip.name}, {reruns} reruns): {_brief(per)} ({time.perf_counter() - t0:.1f} s)"
            )
    info: dict = {"wall_s": time.perf_counter() - t_start, "streams": len(clips) * reruns}
    info.update(_run_effective(eng, config, s0))
    info["attention_effective"] = effective_attention(eng)
    info["tracker"] = sorted(trackers)
    info["curves"] = _mean_curves(curves)
    info["sync_curve"] = mean_sync_curve(tracks)
    info["track"] = tracks[0] if tracks else None
    return values, info


def _run_effective(eng, config: Config, s0) -> dict:
    """How the steps ran: eager, or CUDA graphs with their counts; TP comm decisions; FP8 linear fallbacks."""
    import torch

    st = eng.runner.stats
    replays, captures, eager = st.replays - s0.replays, st.captures - s0.captures, st.eager - s0.eager
    reasons = {
        k: v - s0.eager_reasons.get(k, 0)
        for k, v in st.eager_reasons.items()
        if v != s0.eager_reasons.get(k, 0)
    }
    info: dict = {}
    if not config.graphs:
        info["effective"] = "eager"
    elif torch.device(eng.gen.model.device).type != "cuda":
        info["effective"] = "eager (no CUDA)"
    elif replays:
        info["effective"] = f"CUDA graphs: {replays} steps replayed, {captures} captures, {eager} eager steps"
    else:
        info["effective"] = f"eager (no graph replayed: {reasons})"
    if config.graphs:
        info["graph_stats"] = {
            "captures": captures,
            "replays": replays,
            "eager": eager,
            "eager_reasons": reasons,
        }
    if config.tp:
        from cadence.parallel import fused

        info["comm_decisions"] = fused.chooser_decisions()
        info["comm_fallbacks"] = fused.fallback_warnings()
    fallbacks = {getattr(mod, "fallback_reason", None) for mod in eng.gen.model.modules()} - {None}
    if fallbacks:
        info["fp8_linears_effective"] = "dequantised matmul (FP8 numerics, no FP8 speed): " + "; ".join(
            sorted(fallbacks)
        )
    return info


def _brief(per: Sequence[Mapping[str, float]]) -> str:
    def mean(k):
        xs = [p[k] for p in per if math.isfinite(p[k])]
        return float(np.mean(xs)) if xs else math.nan

    return (
        f"offset {mean('sync_offset_frames'):.2f}, confidence {mean('sync_confidence'):.3f}, "
        f"embedding drift {mean('drift_identity_embedding'):.3f}, sharpness {mean('drift_sharpness'):.2f}"
    )


def evaluate(
    spec,
    configs: Sequence[str | Config],
    clips: Sequence[EvalClip],
    reruns: int,
    device,
    noise_seed: int = 0,
    prompt: str = PROMPT,
    tracker: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run ``configs`` (names or :class:`Config`; the reference is added first when missing) over ``clips``
    with ``reruns`` noise seeds each, engines built from ``spec`` (an ``EngineSpec``); return the results block:
    ``configs`` (per configuration: each metric's aggregate and, compared, ``delta``/``threshold``/``differs``;
    ``verdict``; build and run info; ``curves``; ``track``), the ground truth, and the settings."""
    if reruns < 1:
        raise ValueError(f"reruns must be >= 1, got {reruns}")
    wanted = [CONFIGS[c] if isinstance(c, str) else c for c in configs]
    if REFERENCE not in [c.name for c in wanted]:
        wanted.insert(0, CONFIGS[REFERENCE])
    wanted.sort(key=lambda c: c.name != REFERENCE)  # the reference first: every verdict needs it
    out_configs: dict[str, dict] = {}
    gt_clips = [c for c in clips if c.ground_truth]
    if gt_clips:
        gt = aggregate({m: [[c.ground_truth[m]] for c in gt_clips] for m in METRICS})
        out_configs[GROUND_TRUTH] = {
            **gt,
            "verdict": "ceiling: the synthetic clips' own animation (not a configuration; not compared)",
            "kind": "data",
            "clips": len(gt_clips),
            "curves": _mean_curves([c.ground_truth_curves for c in gt_clips]),
            "sync_curve": mean_sync_curve([c.ground_truth_track for c in gt_clips]),
            "track": {**gt_clips[0].ground_truth_track, "clip": gt_clips[0].name},
        }
    ref_agg = None
    run = dict(
        clips=clips, reruns=reruns, device=device, noise_seed=noise_seed, prompt=prompt, tracker=tracker
    )
    for config in wanted:
        out_configs[config.name], agg = _evaluate_one(config, spec, ref_agg, progress=progress, **run)
        if config.name == REFERENCE:
            ref_agg = agg
    return {
        "configs": out_configs,
        "clips": len(clips),
        "clip_names": [c.name for c in clips],
        "reruns": reruns,
        "metrics": metric_names(),
        "seconds": clips[0].frames / clips[0].fps,
        "frames_per_clip": clips[0].frames,
        "fps": clips[0].fps,
        "noise_seeds": [noise_seed + r for r in range(reruns)],
        "prompt": prompt,
        "rerun_spread_definition": SPREAD_DEFINITION,
        "verdict_rule": VERDICT_RULE,
    }


def _evaluate_one(
    config: Config, spec, ref_agg, *, clips, reruns, device, noise_seed, prompt, tracker, progress
):
    """One configuration of :func:`evaluate`: built, run, aggregated and compared with the reference's
    aggregate ``ref_agg`` (None: this is the reference). Returns (its entry, its aggregate; None when skipped)."""
    import gc

    import torch

    cfg = spec.config()
    why = skip_reason(config, cfg)
    entry: dict = {"description": config.description, "build": config.build_settings()}
    if why is not None:
        if progress:
            progress(f"{config.name}: skipped: {why}")
        return {**entry, "skipped": why, "verdict": f"skipped: {why}"}, None
    eng, notes = build(config, spec, device)
    try:
        entry["build"].update(
            dtype=str(eng.gen.model.dtype).replace("torch.", ""), device=str(eng.gen.model.device), **notes
        )
        entry["recipe"] = eng.recipe.describe().as_dict()
        values, info = run_config(eng, config, clips, reruns, noise_seed, prompt, tracker, progress)
    finally:
        eng.close()
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    agg = aggregate({m: values[m] for m in METRICS})
    face = aggregate({"face_fraction": values["face_fraction"]})["face_fraction"]
    if config.name == REFERENCE:
        verdict = "reference"
    else:
        verdict, details = compare(ref_agg, agg)
        for m, d in details.items():
            agg[m].update(d)
        eff = info["attention_effective"]
        if config.attention in PER_HEAD and eff.get("scales") != "head":
            verdict = (
                f"not judged: {config.attention} did not run here (the ring ran {eff['backend']} with "
                f"{eff['scales']} scales; per-head backends need a CUDA GPU with the kernel); its numbers "
                f"would read: {verdict}"
            )
    if progress:
        progress(f"{config.name}: {verdict}")
    return {**agg, "face_fraction": face, "verdict": verdict, **entry, **info}, agg


__all__ = [
    "ATTENTION_CONFIGS",
    "CONFIGS",
    "GROUND_TRUTH",
    "PER_HEAD",
    "REFERENCE",
    "Config",
    "aggregate",
    "attention_verdict",
    "build",
    "compare",
    "effective_attention",
    "evaluate",
    "metric_names",
    "run_config",
    "run_stream",
    "skip_reason",
    "spec_for",
]
