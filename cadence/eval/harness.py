"""The quality harness behind ``cadence eval`` (issue 7, item 5): do the fast paths change the picture?

It generates held-out synthetic clips (``cadence.train.data``) under several engine *configurations*
(:data:`CONFIGS`: the bf16 + naive-cache reference, FP8 linears + ring cache with FP8 K/V, + CUDA
graphs, + tensor parallelism with fused communication), each clip ``R`` times with different noise
seeds, measures lip sync and identity drift (``cadence.eval.metrics``) and decides, per configuration
and metric, whether its difference from the reference is larger than rerunning noise.

Per stream: the clip's reference image (its first frame) is the sink, the clip's audio drives
``ceil(frames / frames_per_chunk)`` chunks (the audio zero-padded to whole chunks), and the first
``frames`` generated frames are measured against the clip's audio and reference image inside the
clip's face box. Metrics of one stream (all from pixels and audio, see ``cadence.eval.metrics``):

* ``lipsync_corr``: the best Pearson correlation of mouth opening with the audio envelope over
  offsets within +-``MAX_OFFSET_FRAMES``; ``lipsync_offset_frames``: that offset (> 0: video lags).
* ``identity_<s>s``: mean ``frame_distance`` of the face region to the reference over the
  ``DRIFT_WINDOW_SECONDS`` before ``s`` seconds into the stream (``identity_drift``'s definition),
  for each ``s`` of ``drift_seconds`` (default 1, 10, 60: long-stream drift needs clips that long).

Both are computed incrementally per chunk (:class:`StreamMetrics`: two floats per frame are kept,
never the frames), with results identical to ``metrics.lipsync`` / ``metrics.identity_drift`` on the
whole stream (tested).

Reruns: rerun ``r`` of every clip uses the noise seed ``noise_seed + r`` in *every* configuration,
so configurations are compared on the same noise (paired), and reruns differ only in the noise seed
(same weights, clips, prompt).

Aggregation (:func:`aggregate`), per configuration and metric, from the values ``x[clip, rerun]``:

* ``mean``: the mean over all clips and reruns;
* ``per_rerun``: ``m_r = mean over clips of x[clip, r]``, one clip-mean per rerun;
* ``rerun_spread = max_r m_r - min_r m_r``: the range of the per-rerun clip-means.

Why the range of per-rerun means (and not a standard deviation): with the few reruns one can afford
(2-3) a standard deviation is a poor estimate, while the range is exactly the largest change in the
reported number that rerunning the *same* configuration produced; a configuration whose mean moves
by no more than that is indistinguishable from rerun noise at this sample size. For R = 2 it is the
plain difference of the two runs. It is deliberately lenient (the range is >= the std, and a mean
over R reruns is steadier than one rerun's): the harness flags differences that rerunning cannot
explain, it does not certify equality.

Verdict (:func:`compare`), per non-reference configuration ``c`` and metric ``m`` present in both:
``differs = |mean_c - mean_ref| > max(rerun_spread_ref, rerun_spread_c)``. The verdict is
``"within rerun spread"`` when no metric differs, else ``"DIFFERS (<metric> <delta> > spread <thr>;
...)"``. Taking the larger spread of the two keeps a noisy configuration from being flagged by the
reference's luck alone, and vice versa.

Ground truth (``ground_truth`` row): the same metrics on the clips' own frames (the rendered data,
deterministic: one "rerun", spread 0). It is the ceiling of the lip-sync metric (the mouth is drawn
from the audio), not a configuration, and gets no verdict.

Configurations that cannot run here are reported as skipped with the reason (never dropped):
tensor parallelism needs ``torchrun`` with >= 2 ranks. CUDA graphs on the CPU run the same
computation eagerly; the result says so (``"effective": "eager (no CUDA)"``).

Library only: nothing is printed (``progress`` callbacks receive one line per clip), nothing written.
The command line is ``cadence eval`` / ``cadence bench eval`` (``cadence.bench.eval``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cadence.config import AUDIO_SAMPLE_RATE, CadenceConfig
from cadence.eval.metrics import audio_envelope, frame_distance, lagged_corr, mouth_opening

#: The prompt every stream is generated with (the CLI's default prompt).
PROMPT = "a person talking to the camera"
#: Lip-sync offsets searched, +- frames (``metrics.lipsync``'s default).
MAX_OFFSET_FRAMES = 6
#: Identity at s seconds averages the frames of the last this-many seconds before s.
DRIFT_WINDOW_SECONDS = 0.5
#: Default seconds at which identity drift is measured.
DEFAULT_DRIFT_SECONDS = (1.0, 10.0, 60.0)

REFERENCE = "reference"
GROUND_TRUTH = "ground_truth"

SPREAD_DEFINITION = (
    "rerun_spread = max_r(m_r) - min_r(m_r), m_r = mean over clips of rerun r "
    "(reruns differ only in the noise seed, noise_seed + r, the same in every configuration)"
)
VERDICT_RULE = (
    "a configuration differs on a metric when |mean_config - mean_reference| > "
    "max(rerun_spread_reference, rerun_spread_config); verdict 'within rerun spread' when no "
    "metric differs, else 'DIFFERS (...)' naming each metric that does"
)


@dataclass(frozen=True)
class Config:
    """One engine configuration: how its generator is built and run."""

    name: str
    description: str
    cache: str = "naive"
    """Self-attention cache: 'naive' or 'ring' (``StreamConfig.cache``)."""
    kv_fp8: bool = False
    """FP8 K/V in the cache (``StreamConfig.kv_fp8``)."""
    fp8_linears: bool = False
    """FP8 transformer-block linears (``cadence.quant.apply_fp8``), applied after loading weights."""
    graphs: bool = False
    """Run the denoising passes through ``cadence.runtime.graphs.GraphRunner`` (CUDA graphs for
    steady-state ring steps; eager on the CPU)."""
    tp: bool = False
    """Shard the model over the whole torchrun world (``apply_tp``; needs >= 2 ranks)."""
    comm: str = "auto"
    """Row-parallel communication mode with ``tp`` ('auto' = the measured choice among the fused modes)."""
    dtype: str | None = None
    """Model dtype; None = bfloat16 on CUDA, float32 on the CPU (the reference precision there)."""

    def stream_overrides(self) -> dict:
        return {"cache": self.cache, "kv_fp8": self.kv_fp8}

    def build_settings(self) -> dict:
        """The build fields as recorded in the results."""
        return {
            "cache": self.cache,
            "kv_fp8": self.kv_fp8,
            "fp8_linears": self.fp8_linears,
            "graphs": self.graphs,
            "tp": self.tp,
            **({"comm": self.comm} if self.tp else {}),
        }


_FP8_RING = {"cache": "ring", "kv_fp8": True, "fp8_linears": True}

#: The configurations ``cadence eval`` knows, in the order they run (the reference first).
CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config(REFERENCE, "bf16 (float32 on CPU) + naive cache: the launch baseline"),
        Config("fp8_ring", "FP8 block linears + ring cache with FP8 K/V", **_FP8_RING),
        Config(
            "fp8_ring_graphs",
            "fp8_ring + CUDA graphs for steady-state steps (GraphRunner)",
            graphs=True,
            **_FP8_RING,
        ),
        Config(
            "fp8_ring_tp_fused",
            "fp8_ring + tensor parallel over the torchrun world, fused row-parallel comm",
            tp=True,
            **_FP8_RING,
        ),
        Config(
            "fp8_ring_tp_fused_graphs",
            "fp8_ring_tp_fused + CUDA graphs (the full production stack)",
            tp=True,
            graphs=True,
            **_FP8_RING,
        ),
    )
}


def metric_names(drift_seconds: Sequence[float]) -> list[str]:
    """The metric keys, in table order."""
    return ["lipsync_corr", "lipsync_offset_frames"] + [drift_key(s) for s in drift_seconds]


def drift_key(seconds: float) -> str:
    return f"identity_{seconds:g}s"


# ---- per-stream metrics -----------------------------------------------------------------------------


class StreamMetrics:
    """Lip sync and identity drift of a stream fed chunk by chunk (frames are measured and dropped).

    ``add(frames)`` takes uint8 [T, H, W, 3] (or anything ``metrics`` accepts); ``result`` gives the
    same numbers as ``metrics.lipsync`` and ``metrics.identity_drift`` on all frames at once."""

    def __init__(self, reference: np.ndarray, face_box: tuple[int, int, int, int] | None):
        self.reference, self.face_box = reference, face_box
        self._mouth: list[np.ndarray] = []
        self._dist: list[np.ndarray] = []
        self.frames = 0

    def add(self, frames) -> None:
        if len(frames) == 0:
            return
        self._mouth.append(mouth_opening(frames, self.face_box))
        self._dist.append(frame_distance(frames, self.reference, self.face_box))
        self.frames += len(self._mouth[-1])

    def result(
        self,
        audio: np.ndarray,
        drift_seconds: Sequence[float],
        fps: int,
        sample_rate: int = AUDIO_SAMPLE_RATE,
    ) -> dict[str, float]:
        """``{lipsync_corr, lipsync_offset_frames, identity_<s>s...}``; drift times past the end are left out."""
        mouth = np.concatenate(self._mouth) if self._mouth else np.zeros(0, np.float32)
        dist = np.concatenate(self._dist) if self._dist else np.zeros(0, np.float32)
        env = audio_envelope(audio, fps, sample_rate)
        # metrics.lipsync on the series: best offset, ties to the offset nearest 0
        by = {k: lagged_corr(mouth, env, k) for k in range(-MAX_OFFSET_FRAMES, MAX_OFFSET_FRAMES + 1)}
        best = max(by, key=lambda k: (round(by[k], 12), -abs(k)))
        out = {"lipsync_corr": float(by[best]), "lipsync_offset_frames": float(best)}
        # metrics.identity_drift on the per-frame distances
        for s in drift_seconds:
            end = round(s * fps)
            if end > len(dist) or end <= 0:
                continue
            start = max(0, end - max(1, round(DRIFT_WINDOW_SECONDS * fps)))
            out[drift_key(s)] = float(dist[start:end].mean())
        return out


# ---- clips ------------------------------------------------------------------------------------------


@dataclass
class EvalClip:
    """What a stream needs from one held-out clip (its frames are measured once, then dropped)."""

    seed: int
    reference: np.ndarray  # uint8 [H, W, 3], the clip's first frame
    audio: np.ndarray  # float32 [frames * sample_rate / fps]
    face_box: tuple[int, int, int, int]
    frames: int
    fps: int
    ground_truth: dict[str, float] = field(default_factory=dict)  # metrics on the clip's own frames


def prepare_clips(
    cfg: CadenceConfig,
    n: int,
    seconds: float,
    drift_seconds: Sequence[float],
    speech: str = "synthetic",
    split_seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[EvalClip]:
    """``n`` held-out test clips (``held_out_split(0, n, split_seed)``) at the preset's size and fps, with
    their ground-truth metrics (their own frames fed through :class:`StreamMetrics` chunk by chunk)."""
    from cadence.train.data import held_out_split

    if n < 1 or seconds <= 0:
        raise ValueError(f"need >= 1 clip of positive length, got {n} clips of {seconds} s")
    s = cfg.stream
    fpc = cfg.video_frames_per_chunk
    out = []
    for i, spec in enumerate(held_out_split(0, n, seed=split_seed)[1]):
        t0 = time.perf_counter()
        clip = spec.make(seconds, height=s.height, width=s.width, fps=s.fps, speech=speech)
        acc = StreamMetrics(clip.reference, clip.face_box)
        for j in range(0, clip.frames.shape[0], fpc):
            acc.add(clip.frames[j : j + fpc])
        gt = acc.result(clip.audio, drift_seconds, s.fps, clip.sample_rate)
        out.append(
            EvalClip(
                seed=spec.seed,
                reference=clip.reference.copy(),
                audio=clip.audio,
                face_box=clip.face_box,
                frames=clip.frames.shape[0],
                fps=s.fps,
                ground_truth=gt,
            )
        )
        if progress:
            progress(
                f"clip {i + 1}/{n} (seed {spec.seed}, {clip.frames.shape[0]} frames): ground truth "
                f"{_brief(gt)} ({time.perf_counter() - t0:.1f} s)"
            )
    return out


# ---- aggregation and verdicts -----------------------------------------------------------------------


def aggregate(values: Mapping[str, Sequence[Sequence[float]]]) -> dict[str, dict]:
    """Per metric, from ``values[metric][clip][rerun]``: ``{mean, rerun_spread, per_rerun}`` (module doc)."""
    out = {}
    for m, v in values.items():
        a = np.asarray(v, np.float64)
        if a.ndim != 2 or a.size == 0:
            raise ValueError(f"metric {m!r}: expected values [clips, reruns], got shape {a.shape}")
        per_rerun = a.mean(axis=0)
        out[m] = {
            "mean": float(a.mean()),
            "rerun_spread": float(per_rerun.max() - per_rerun.min()),
            "per_rerun": [float(x) for x in per_rerun],
        }
    return out


def compare(reference: Mapping[str, dict], other: Mapping[str, dict]) -> tuple[str, dict[str, dict]]:
    """(verdict, per metric ``{delta, threshold, differs}``) of ``other`` against ``reference`` (module doc)."""
    details, flagged = {}, []
    for m, ref in reference.items():
        if m not in other:
            continue
        delta = other[m]["mean"] - ref["mean"]
        thr = max(ref["rerun_spread"], other[m]["rerun_spread"])
        differs = bool(abs(delta) > thr)
        details[m] = {"delta": float(delta), "threshold": float(thr), "differs": differs}
        if differs:
            flagged.append(f"{m} {delta:+.4g} > spread {thr:.4g}")
    return ("within rerun spread" if not flagged else "DIFFERS (" + "; ".join(flagged) + ")"), details


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


def skip_reason(config: Config, cfg: CadenceConfig, world: int | None = None) -> str | None:
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


def model_dtype(config: Config, device):
    import torch

    if config.dtype:
        return getattr(torch, config.dtype)
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def build(config: Config, cfg: CadenceConfig, device, weights: str | None = None, weights_seed: int = 0):
    """(engine, notes) for ``config``: ``cadence.engine.build.build_engine`` with the configuration's fast paths
    (the model built on ``device``, random from ``weights_seed`` or loaded from ``weights``; ``apply_tp`` over
    the torchrun world and ``apply_fp8`` as the config asks). The engine decodes inline (the serial order of
    a reference run; the overlapped engine gives the same frames, tests/test_pipeline.py)."""
    import torch

    from cadence.config import PipelineConfig
    from cadence.engine.build import build_engine
    from cadence.engine.spec import FastPath

    run_cfg = cfg.with_overrides(stream=config.stream_overrides())
    if weights:
        run_cfg = run_cfg.with_overrides(model={"weights": weights})
    tp = None
    notes: dict = {}
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
    cuda = torch.device(device).type == "cuda"
    # the cache (naive / ring, FP8 K/V) is in run_cfg; FP8 linears run on the CPU too (dequantised matmul, the
    # same numerics), so they are applied here rather than through FastPath (which keeps them to CUDA)
    fast = FastPath(
        dtype=str(model_dtype(config, device)).replace("torch.", ""),
        kv_fp8=False,
        fp8_linears=False,
        graphs=config.graphs and cuda,
        comm=config.comm,
        decoder=run_cfg.vae.decoder,
        threads=0 if cuda else torch.get_num_threads(),
    )
    eng = build_engine(
        run_cfg,
        dev,
        fast,
        tp=tp,
        seed=weights_seed,
        pipeline=PipelineConfig(diffusion_devices=(dev,), decode_device="same", overlap=False),
    )
    if config.fp8_linears:
        from cadence.quant import apply_fp8

        notes["fp8_layers"] = apply_fp8(eng.gen.model)
    return eng, notes


def run_stream(
    eng, clip: EvalClip, seed: int, drift_seconds: Sequence[float], prompt: str = PROMPT
) -> dict[str, float]:
    """Generate ``clip``'s stream (its reference image, its audio, chunks covering it) with noise ``seed``
    through the engine and return its metrics (:class:`StreamMetrics`)."""
    import torch

    cfg = eng.gen.cfg
    fpc, spc = cfg.video_frames_per_chunk, cfg.audio_samples_per_chunk
    chunks = math.ceil(clip.frames / fpc)
    audio = np.zeros(chunks * spc, np.float32)
    audio[: len(clip.audio)] = clip.audio[: chunks * spc]
    image = torch.from_numpy(clip.reference).permute(2, 0, 1).float() / 127.5 - 1.0
    acc = StreamMetrics(clip.reference, clip.face_box)
    for out in eng.stream(image, prompt, torch.from_numpy(audio), chunks, seed=seed):
        acc.add(out.frames.numpy()[: clip.frames - acc.frames])
    return acc.result(clip.audio, drift_seconds, cfg.stream.fps)


def run_config(
    eng,
    config: Config,
    clips: Sequence[EvalClip],
    reruns: int,
    drift_seconds: Sequence[float],
    noise_seed: int = 0,
    prompt: str = PROMPT,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[list[float]]], dict]:
    """Every clip x rerun of one configuration: (``values[metric][clip][rerun]``, run info with
    ``effective``: how the steps actually ran)."""
    import dataclasses

    import torch

    values: dict[str, list[list[float]]] = {}
    s0 = dataclasses.replace(eng.runner.stats, eager_reasons=dict(eng.runner.stats.eager_reasons))
    t_start = time.perf_counter()
    for i, clip in enumerate(clips):
        t0 = time.perf_counter()
        per: list[dict[str, float]] = []
        for r in range(reruns):
            per.append(run_stream(eng, clip, noise_seed + r, drift_seconds, prompt=prompt))
        for m in per[0]:
            values.setdefault(m, []).append([p[m] for p in per])
        if progress:
            mean = {m: float(np.mean([p[m] for p in per])) for m in per[0]}
            progress(
                f"{config.name}: clip {i + 1}/{len(clips)} (seed {clip.seed}, {reruns} reruns): "
                f"{_brief(mean)} ({time.perf_counter() - t0:.1f} s)"
            )
    wall = time.perf_counter() - t_start
    st = eng.runner.stats
    stats = dataclasses.replace(
        st,
        captures=st.captures - s0.captures,
        replays=st.replays - s0.replays,
        eager=st.eager - s0.eager,
        capture_failures=st.capture_failures - s0.capture_failures,
        eager_reasons={
            k: v - s0.eager_reasons.get(k, 0)
            for k, v in st.eager_reasons.items()
            if v != s0.eager_reasons.get(k, 0)
        },
    )
    dev = eng.gen.model.device
    info: dict = {"wall_s": wall, "streams": len(clips) * reruns}
    if not config.graphs:
        info["effective"] = "eager"
    elif torch.device(dev).type != "cuda":
        info["effective"] = "eager (no CUDA)"
    elif stats.replays:
        info["effective"] = (
            f"CUDA graphs: {stats.replays} steps replayed, {stats.captures} captures, "
            f"{stats.eager} eager steps"
        )
    else:
        info["effective"] = f"eager (no graph replayed: {dict(stats.eager_reasons)})"
    if config.graphs:
        info["graph_stats"] = {
            "captures": stats.captures,
            "replays": stats.replays,
            "eager": stats.eager,
            "capture_failures": stats.capture_failures,
            "eager_reasons": dict(stats.eager_reasons),
        }
    if config.tp:  # which row-parallel modes actually ran (the chooser's decisions, fallbacks to NCCL)
        from cadence.parallel import fused

        info["comm_decisions"] = fused.chooser_decisions()
        info["comm_fallbacks"] = fused.fallback_warnings()
    fallbacks = {getattr(mod, "fallback_reason", None) for mod in eng.gen.model.modules()} - {None}
    if fallbacks:
        info["fp8_linears_effective"] = "dequantised matmul (FP8 numerics, no FP8 speed): " + "; ".join(
            sorted(fallbacks)
        )
    return values, info


def _brief(m: Mapping[str, float]) -> str:
    return ", ".join(f"{k.replace('lipsync_', '').replace('_frames', '')} {v:.3f}" for k, v in m.items())


def evaluate(
    cfg: CadenceConfig,
    configs: Sequence[str | Config],
    clips: Sequence[EvalClip],
    reruns: int,
    device,
    drift_seconds: Sequence[float] = DEFAULT_DRIFT_SECONDS,
    weights: str | None = None,
    weights_seed: int = 0,
    noise_seed: int = 0,
    prompt: str = PROMPT,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run ``configs`` (names or :class:`Config`; the reference is added first when missing) over
    ``clips`` with ``reruns`` noise seeds each; return the ``results`` block of the ``eval`` bench
    (docs/benchmarks.md): ``configs`` (per configuration: each metric's ``{mean, rerun_spread, per_rerun}``,
    plus for compared configurations ``delta``/``threshold``/``differs``; ``verdict``; build and run
    info; skipped ones ``{skipped, verdict}``), ``lipsync_corr_reference``, ``clips``, ``reruns`` and the
    settings."""
    if reruns < 1:
        raise ValueError(f"reruns must be >= 1, got {reruns}")
    wanted = [CONFIGS[c] if isinstance(c, str) else c for c in configs]
    if REFERENCE not in [c.name for c in wanted]:
        wanted.insert(0, CONFIGS[REFERENCE])
    else:  # the reference runs first: every verdict needs it
        wanted.sort(key=lambda c: c.name != REFERENCE)
    names = metric_names(drift_seconds)
    gt = aggregate({m: [[c.ground_truth[m]] for c in clips] for m in names if m in clips[0].ground_truth})
    out_configs: dict[str, dict] = {
        GROUND_TRUTH: {
            **gt,
            "verdict": "ceiling: the clips' own frames (not a configuration; not compared)",
            "kind": "data",
            "description": "metrics on the rendered synthetic clips themselves (deterministic: one run, spread 0)",
        }
    }
    run = dict(
        clips=clips,
        reruns=reruns,
        device=device,
        drift_seconds=drift_seconds,
        weights=weights,
        weights_seed=weights_seed,
        noise_seed=noise_seed,
        prompt=prompt,
        progress=progress,
    )
    ref_agg = None
    for config in wanted:
        out_configs[config.name], agg = _evaluate_one(config, cfg, ref_agg, **run)
        if config.name == REFERENCE:
            ref_agg = agg
    return {
        "configs": out_configs,
        "lipsync_corr_reference": ref_agg["lipsync_corr"]["mean"] if ref_agg else None,
        "lipsync_corr_ground_truth": gt["lipsync_corr"]["mean"],
        "clips": len(clips),
        "reruns": reruns,
        "metrics": names,
        "seconds": clips[0].frames / clips[0].fps,
        "frames_per_clip": clips[0].frames,
        "fps": clips[0].fps,
        "drift_seconds": list(drift_seconds),
        "drift_window_seconds": DRIFT_WINDOW_SECONDS,
        "max_offset_frames": MAX_OFFSET_FRAMES,
        "clip_seeds": [c.seed for c in clips],
        "noise_seeds": [noise_seed + r for r in range(reruns)],
        "weights": weights or f"random (seed {weights_seed})",
        "prompt": prompt,
        "rerun_spread_definition": SPREAD_DEFINITION,
        "verdict_rule": VERDICT_RULE,
    }


def _evaluate_one(
    config: Config,
    cfg: CadenceConfig,
    ref_agg: dict | None,
    *,
    clips,
    reruns: int,
    device,
    drift_seconds,
    weights,
    weights_seed: int,
    noise_seed: int,
    prompt: str,
    progress,
) -> tuple[dict, dict | None]:
    """One configuration of :func:`evaluate`: built, run over the clips, aggregated and compared with the
    reference's aggregate ``ref_agg`` (None: this is the reference). Returns (its entry, its aggregate; None
    when skipped)."""
    import gc

    import torch

    why = skip_reason(config, cfg)
    entry: dict = {"description": config.description, "build": config.build_settings()}
    if why is not None:
        if progress:
            progress(f"{config.name}: skipped: {why}")
        return {**entry, "skipped": why, "verdict": f"skipped: {why}"}, None
    eng, notes = build(config, cfg, device, weights=weights, weights_seed=weights_seed)
    entry["build"]["dtype"] = str(eng.gen.model.dtype).replace("torch.", "")
    entry["build"]["device"] = str(eng.gen.model.device)
    entry["build"].update(notes)
    entry["recipe"] = eng.recipe.describe().as_dict()  # what this configuration built (cadence.engine.recipe)
    values, info = run_config(eng, config, clips, reruns, drift_seconds, noise_seed, prompt, progress)
    eng.close()
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    agg = aggregate(values)
    if config.name == REFERENCE:
        verdict = "reference"
    else:
        verdict, details = compare(ref_agg, agg)
        for m, d in details.items():
            agg[m].update(d)
    if progress:
        progress(f"{config.name}: {verdict}")
    return {**agg, "verdict": verdict, **entry, **info}, agg


__all__ = [
    "CONFIGS",
    "DEFAULT_DRIFT_SECONDS",
    "GROUND_TRUTH",
    "REFERENCE",
    "Config",
    "EvalClip",
    "StreamMetrics",
    "aggregate",
    "build",
    "compare",
    "evaluate",
    "metric_names",
    "prepare_clips",
    "run_config",
    "run_stream",
    "skip_reason",
]
