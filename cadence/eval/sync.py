"""Audio-video offset and confidence of one clip, SyncNet-style, from a mouth track and the audio: :func:`av_sync`.

SyncNet (Chung & Zisserman, 2016) embeds short windows of mouth crops and of audio, and over a range of
offsets takes, per offset, the mean distance between the two embeddings across the clip; the offset is the
one with the smallest distance and the *confidence* is ``median - minimum`` of those distances: how much the
best offset stands out from the others. This module does the same with two scalar signals instead of learned
embeddings, both per video frame:

* the **mouth track**: the opening per frame (``cadence.eval.landmarks``: inner-lip gap over eye-corner
  distance, or the pixel fallback), NaN where no face was found;
* the **speech energy**: the RMS of each frame's ``sample_rate / fps`` audio samples
  (``metrics.audio_envelope``).

Per sliding window of ``window`` frames (hop ``window // 2``) and per offset ``k`` in ``[-max_offset,
max_offset]``, the Pearson correlation of the window's mouth frames ``t`` with the energy at ``t + k``; the
curve ``c(k)`` is the mean over the windows. ``offset_frames`` is the ``k`` that maximises ``c`` and
``confidence = c(best) - median_k c(k)`` (SyncNet's statistic with correlation in place of distance).

Sign: ``offset_frames = k > 0`` means **the audio is late by k frames** (the mouth moves k frames before its
sound): audio delayed by k frames against a synchronised picture gives k. (``metrics.lipsync`` uses the
opposite sign, "video lags", for its ``offset_frames``.)

Windows without speech are left out: a window whose energy peaks below :data:`SILENCE_RMS` (-50 dBFS) or
whose energy does not vary (std below 1% of its mean) carries no timing. A clip with no speech window, or no
face in most of a window's frames, gets ``offset_frames`` None and confidence 0. Short face drop-outs are
interpolated over (at most half a window's frames).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Offsets searched, +- frames (SyncNet's default search is +-15 at 25 fps; talking-head drift is smaller).
MAX_OFFSET = 6
#: Window length in frames (about 2 s at 24 fps) and the least a window may shrink to on a short clip.
WINDOW = 48
MIN_WINDOW = 16
#: Speech gate: a window whose per-frame RMS never reaches this (-50 dBFS for audio in [-1, 1]) is silence.
SILENCE_RMS = 10 ** (-50 / 20)


@dataclass(frozen=True)
class SyncResult:
    """One clip's sync: ``offset_frames`` (None: no speech or no face), ``confidence``, the correlation at
    the best offset, ``corr_by_offset`` (the curve c(k)), and how many windows and frames it came from."""

    offset_frames: int | None
    confidence: float
    corr: float
    corr_by_offset: dict[int, float]
    windows: int
    frames: int
    face_fraction: float

    def as_dict(self) -> dict:
        return {
            "offset_frames": self.offset_frames,
            "confidence": self.confidence,
            "corr": self.corr,
            "corr_by_offset": {str(k): v for k, v in self.corr_by_offset.items()},
            "windows": self.windows,
            "frames": self.frames,
            "face_fraction": self.face_fraction,
        }


def _fill_gaps(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x with NaN runs linearly interpolated, mask of the frames that were NaN)."""
    x = np.asarray(x, np.float64)
    bad = ~np.isfinite(x)
    if bad.all() or not bad.any():
        return np.where(bad, 0.0, x), bad
    idx = np.arange(len(x))
    return np.interp(idx, idx[~bad], x[~bad]), bad


def _corr_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of ``a`` [W] with each row of ``b`` [K, W] (0 where either is constant)."""
    a = a - a.mean()
    b = b - b.mean(axis=1, keepdims=True)
    den = np.sqrt((a * a).sum() * (b * b).sum(axis=1))
    num = b @ a
    return np.where(den > 1e-12, num / np.where(den > 1e-12, den, 1.0), 0.0)


def window_starts(n: int, max_offset: int, window: int) -> tuple[list[int], int]:
    """(start frames of the windows, window length) for ``n`` frames: every window's frames ``t`` and ``t + k``
    for all offsets lie inside the clip; a clip too short for one full window gets one shorter window."""
    w = min(window, n - 2 * max_offset)
    if w < MIN_WINDOW:
        return [], w
    last = n - max_offset - w
    starts = list(range(max_offset, last + 1, max(1, w // 2)))
    if starts[-1] != last:
        starts.append(last)
    return starts, w


def av_sync(
    mouth: np.ndarray,
    energy: np.ndarray,
    max_offset: int = MAX_OFFSET,
    window: int = WINDOW,
) -> SyncResult:
    """Offset and confidence of a mouth track [T] against a per-frame speech energy [T'] (module doc)."""
    n = min(len(mouth), len(energy))
    m, missing = _fill_gaps(np.asarray(mouth[:n]))
    e = np.asarray(energy[:n], np.float64)
    face = float(1.0 - missing.mean()) if n else 0.0
    starts, w = window_starts(n, max_offset, window)
    offsets = np.arange(-max_offset, max_offset + 1)
    rows = []
    for s in starts:
        ew = e[s : s + w]
        if ew.max() < SILENCE_RMS or ew.std() < 0.01 * max(ew.mean(), 1e-12):
            continue  # silence: no timing to read
        if missing[s : s + w].mean() > 0.5:
            continue  # mostly no face
        shifted = np.stack([e[s + k : s + k + w] for k in offsets])
        rows.append(_corr_rows(m[s : s + w], shifted))
    if not rows:
        zero = {int(k): 0.0 for k in offsets}
        return SyncResult(None, 0.0, 0.0, zero, 0, n, face)
    curve = np.mean(rows, axis=0)
    # ties go to the offset nearest 0
    best = int(max(range(len(offsets)), key=lambda i: (round(float(curve[i]), 12), -abs(int(offsets[i])))))
    conf = float(curve[best] - np.median(curve))
    by = {int(k): float(c) for k, c in zip(offsets, curve)}
    return SyncResult(int(offsets[best]), conf, float(curve[best]), by, len(rows), n, face)


def delay_audio(audio: np.ndarray, samples: int) -> np.ndarray:
    """``audio`` delayed by ``samples`` (> 0: later, silence in front; < 0: earlier, silence at the end), same
    length: the known shifts of the validation."""
    a = np.asarray(audio)
    out = np.zeros_like(a)
    if samples >= 0:
        out[samples:] = a[: len(a) - samples]
    else:
        out[: len(a) + samples] = a[-samples:]
    return out


__all__ = ["MAX_OFFSET", "SILENCE_RMS", "WINDOW", "SyncResult", "av_sync", "delay_audio", "window_starts"]
