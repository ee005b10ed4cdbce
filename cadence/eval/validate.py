"""The lip-sync measure checked where the answer is known: ``cadence eval --measure-check``.

Three checks, on two kinds of faces whose mouth follows the audio by construction:

* **synthetic faces** (``cadence.train.data`` test clips at ``size`` x ``size``): the mouth interior is drawn
  from the audio's loudness, frame by frame;
* **the shipped character** (``--model character``, its trained weights): streams the engine generates from a
  held-out face and its speech (its mouth follows the audio as well as the model learned to).

1. **Known shifts**: the clip's frames are tracked once; its audio delayed by ``k`` frames (``k`` in -5..5,
   ``sync.delay_audio``) must give ``offset_frames == k`` (the sign convention of ``cadence.eval.sync``). For
   the character the shift is on top of whatever offset its own streams have (``base``: the offset measured
   on the unshifted audio, expected 0): recovered means ``offset == base + k``.
2. **Confidence separates**: matched audio (k = 0) against mismatched audio (the next clip's speech) and
   silence; both distributions are reported (min, quartiles, max, all values).
3. **Runtime**: frames per second of the landmark tracker alone and of the whole per-stream measure (tracker
   + sync + drift) on this machine at ``size`` x ``size``: per wall-clock second (what this machine did, with
   whatever else ran on it: the 1-minute load average before and after is recorded) and per CPU second of
   this process, all its threads (what a machine with one free core does, whatever the load).

Library only; ``cadence.bench.eval`` prints and records.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import numpy as np

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.eval.landmarks import FaceTracker
from cadence.eval.metrics import audio_envelope
from cadence.eval.sync import av_sync, delay_audio

SHIFTS = tuple(range(-5, 6))


def distribution(xs) -> dict:
    """min, quartiles, max and the values (rounded to 4 places) of ``xs``."""
    a = np.asarray(xs, np.float64)
    if a.size == 0:
        return {"n": 0}
    q = np.percentile(a, [0, 25, 50, 75, 100])
    return {
        "n": int(a.size),
        "min": float(q[0]),
        "q25": float(q[1]),
        "median": float(q[2]),
        "q75": float(q[3]),
        "max": float(q[4]),
        "values": [round(float(x), 4) for x in a],
    }


def check_tracks(tracks: list[tuple[str, np.ndarray, np.ndarray]], fps: int, relative: bool = False) -> dict:
    """Known shifts and confidence over ``tracks`` [(name, mouth track, audio)]: the dict of checks 1 and 2.
    ``relative``: a shift is recovered when the offset moves by exactly k from the unshifted one."""
    spf = AUDIO_SAMPLE_RATE // fps
    misses, matched, mismatched, silence, bases = [], [], [], [], []
    for i, (name, mouth, audio) in enumerate(tracks):
        base = av_sync(mouth, audio_envelope(audio, fps)).offset_frames
        bases.append(base)
        for k in SHIFTS:
            r = av_sync(mouth, audio_envelope(delay_audio(audio, k * spf), fps))
            want = (base + k) if (relative and base is not None) else k
            if r.offset_frames != want:
                misses.append(
                    {"clip": name, "k": k, "offset": r.offset_frames, "confidence": round(r.confidence, 4)}
                )
            if k == 0:
                matched.append(r.confidence)
        other = tracks[(i + 1) % len(tracks)][2]
        mismatched.append(av_sync(mouth, audio_envelope(other, fps)).confidence)
        silence.append(av_sync(mouth, audio_envelope(np.zeros_like(audio), fps)).confidence)
    total = len(tracks) * len(SHIFTS)
    return {
        "clips": len(tracks),
        "shifts": list(SHIFTS),
        "recovered": total - len(misses),
        "of": total,
        "misses": misses,
        "base_offsets": bases,
        "confidence_matched": distribution(matched),
        "confidence_mismatched": distribution(mismatched),
        "confidence_silence": distribution(silence),
        "separated": bool(matched and min(matched) > max(mismatched + silence)),
    }


def synthetic(n: int, seconds: float, size: int, split_seed: int = 0, progress=None) -> tuple[dict, dict]:
    """Checks 1-2 on ``n`` synthetic test faces, and check 3's timings: (checks, runtime)."""
    from cadence.eval.drift import DriftMeter
    from cadence.train.data import held_out_split

    tracks, t_track, t_drift, frames, cpu_track, cpu_drift = [], 0.0, 0.0, 0, 0.0, 0.0
    load0 = os.getloadavg()
    for i, spec in enumerate(held_out_split(0, n, seed=split_seed)[1]):
        clip = spec.make(seconds, height=size, width=size)
        tr = FaceTracker(clip.face_box, blendshapes=False)  # as StreamMeasure runs it
        try:
            c0, t0 = time.process_time(), time.perf_counter()
            faces = tr.track(clip.frames)
            c1, t1 = time.process_time(), time.perf_counter()
            meter = DriftMeter(clip.reference, tr, clip.fps, clip.face_box)
            c2, t2 = time.process_time(), time.perf_counter()
            meter.add(clip.frames, faces)
            t_drift += time.perf_counter() - t2
            cpu_drift += time.process_time() - c2
            cpu_track += c1 - c0
        finally:
            tr.close()
        t_track += t1 - t0
        frames += len(clip.frames)
        tracks.append((f"face {spec.seed}", faces.mouth, clip.audio))
        if progress:
            progress(
                f"synthetic clip {i + 1}/{n}: {len(clip.frames)} frames tracked at {len(clip.frames) / (t1 - t0):.1f} fps"
            )
    checks = check_tracks(tracks, 24)
    checks["tracker"] = tr.tracker
    runtime = {
        "size": f"{size}x{size}",
        "frames": frames,
        "tracker_fps": frames / t_track if t_track else math.nan,
        "measure_fps": frames / (t_track + t_drift) if t_track else math.nan,
        "tracker_fps_per_cpu_second": frames / cpu_track if cpu_track else math.nan,
        "measure_fps_per_cpu_second": frames / (cpu_track + cpu_drift) if cpu_track else math.nan,
        "load_average_1min": [load0[0], os.getloadavg()[0]],
        "tracker": tr.tracker,
    }
    return checks, runtime


def character(n: int, seconds: float, device, split_seed: int = 0, progress: Callable | None = None) -> dict:
    """Checks 1-2 on ``n`` streams of the shipped character (trained weights; held-out faces and voices)."""
    import torch

    from cadence.config import PipelineConfig
    from cadence.engine.build import build_engine
    from cadence.engine.recipe import EngineSpec, resolve
    from cadence.eval.clips import prepare_clips
    from cadence.eval.harness import run_stream

    spec = EngineSpec(model="character", warmup=False)
    cfg = spec.config()
    clips = prepare_clips(cfg, n, seconds, split_seed=split_seed, ground_truth=False)
    dev = str(device)
    eng = build_engine(
        resolve(spec, dev),
        device=dev,
        pipeline=PipelineConfig(diffusion_devices=(dev,), decode_device="same", overlap=False),
    )
    tracks = []
    try:
        for i, clip in enumerate(clips):
            t0 = time.perf_counter()
            m = run_stream(eng, clip, seed=0)
            tracks.append((clip.name, np.asarray(m.track["mouth"], np.float64), clip.audio))
            if progress:
                progress(
                    f"character stream {i + 1}/{n} ({clip.name}): offset {m.values['sync_offset_frames']:g}, "
                    f"confidence {m.values['sync_confidence']:.3f} ({time.perf_counter() - t0:.1f} s)"
                )
    finally:
        eng.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = check_tracks(tracks, cfg.stream.fps, relative=True)
    out["weights"] = cfg.model.weights
    return out


__all__ = ["SHIFTS", "character", "check_tracks", "distribution", "synthetic"]
