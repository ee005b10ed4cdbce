"""Quality metrics for talking-character video: lip sync and identity drift (issue 7, item 4).

All metrics read pixels and audio only (no ground truth, no learned model), so they apply equally to
generated streams and to the synthetic training clips of ``cadence.train.data``.

* ``mouth_opening``: per frame, the fraction of *dark* pixels (mouth interior) in the lower-middle
  face region. "Dark" is relative to the region's median luminance (the skin), so the measure is
  robust to skin colour: a pixel counts when its luminance is below 45% of the median (and below
  110/255). Lips, nose line and cheeks stay above that; the open mouth's interior falls well below.
* ``audio_envelope``: per video frame, the RMS of that frame's ``sample_rate / fps`` samples.
* ``lipsync``: Pearson correlation between the two at the best lag in ``+-max_offset_frames``;
  ``offset_frames > 0`` means the video *lags* the audio (the mouth moves that many frames after the
  sound), ``< 0`` that it leads.
* ``identity_drift``: distance of frames to the reference image, see ``frame_distance``.
"""

from __future__ import annotations

import numpy as np

from cadence.config import AUDIO_SAMPLE_RATE

#: Luma weights (ITU-R BT.601).
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)


def _frames_uint8(frames) -> np.ndarray:
    """uint8 [T, H, W, 3] from uint8 [T, H, W, 3] (numpy or torch) or float [T, 3, H, W] / [T, H, W, 3]
    in [-1, 1] (the engine's range; [0, 1] if nothing is negative). A single frame gets T = 1."""
    if hasattr(frames, "detach"):
        frames = frames.detach().cpu().numpy()
    a = np.asarray(frames)
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4:
        raise ValueError(f"expected frames [T, H, W, 3] or [T, 3, H, W], got shape {a.shape}")
    if a.shape[-1] != 3 and a.shape[1] == 3:
        a = a.transpose(0, 2, 3, 1)
    if a.shape[-1] != 3:
        raise ValueError(f"expected 3 colour channels, got shape {a.shape}")
    if a.dtype == np.uint8:
        return a
    a = a.astype(np.float32)
    if a.min() < 0:
        a = (a + 1.0) * 127.5
    elif a.max() <= 1.0:
        a = a * 255.0
    return np.clip(np.rint(a), 0, 255).astype(np.uint8)


def _luma(frames: np.ndarray) -> np.ndarray:
    return frames.astype(np.float32) @ _LUMA


def mouth_region(
    height: int, width: int, face_box: tuple[int, int, int, int] | None = None
) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1) of the lower-middle face region where the mouth is looked for.

    With ``face_box`` (x0, y0, x1, y1 of the face): the middle 56% of its width and the band from
    60% to 92% of its height (the face's centre is at 50%). Without: the same for a centred face of
    half-size 0.27 x 0.37 of the shorter side at 52% of the height (the layout of the built-in and
    synthetic faces), widened a little to allow for head motion.
    """
    if face_box is None:
        s = min(height, width)
        cx, cy = width / 2, height * 0.52
        return (
            int(cy + 0.07 * s),
            int(np.ceil(cy + 0.28 * s)),
            int(cx - 0.14 * s),
            int(np.ceil(cx + 0.14 * s)),
        )
    x0, y0, x1, y1 = face_box
    fw, fh = x1 - x0, y1 - y0
    ry0, ry1 = int(y0 + 0.60 * fh), int(np.ceil(y0 + 0.92 * fh))
    rx0, rx1 = int(x0 + 0.22 * fw), int(np.ceil(x0 + 0.78 * fw))
    return (max(ry0, 0), min(ry1, height), max(rx0, 0), min(rx1, width))


def mouth_opening(frames, face_box: tuple[int, int, int, int] | None = None) -> np.ndarray:
    """Mouth opening per frame (float32 [T]), measured from pixels only.

    The fraction of pixels of ``mouth_region`` that are dark relative to the region's median
    luminance (see the module doc). Proportional to the visible mouth-interior area; 0 when closed.
    """
    f = _frames_uint8(frames)
    y0, y1, x0, x1 = mouth_region(f.shape[1], f.shape[2], face_box)
    lum = _luma(f[:, y0:y1, x0:x1])
    flat = lum.reshape(lum.shape[0], -1)
    med = np.median(flat, axis=1, keepdims=True)
    thr = np.minimum(0.45 * med, 110.0)
    return (flat < thr).mean(axis=1).astype(np.float32)


def audio_envelope(audio, fps: int = 24, sample_rate: int = AUDIO_SAMPLE_RATE) -> np.ndarray:
    """Per-frame RMS (float32 [T], T = samples // (sample_rate / fps)) of mono ``audio``."""
    if hasattr(audio, "detach"):
        audio = audio.detach().cpu().numpy()
    a = np.asarray(audio, np.float64).reshape(-1)
    if sample_rate % fps:
        raise ValueError(f"sample_rate ({sample_rate}) must be a multiple of fps ({fps})")
    spf = sample_rate // fps
    n = a.shape[0] // spf
    return np.sqrt(np.mean(a[: n * spf].reshape(n, spf) ** 2, axis=1)).astype(np.float32)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x = x.astype(np.float64) - x.mean()
    y = y.astype(np.float64) - y.mean()
    den = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / den) if den > 0 else 0.0


def lagged_corr(video_signal: np.ndarray, audio_signal: np.ndarray, lag: int) -> float:
    """Pearson correlation of ``video_signal[t + lag]`` with ``audio_signal[t]`` over their overlap."""
    n = min(len(video_signal), len(audio_signal))
    v, a = np.asarray(video_signal[:n]), np.asarray(audio_signal[:n])
    if lag >= 0:
        v, a = v[lag:], a[: n - lag]
    else:
        v, a = v[: n + lag], a[-lag:]
    return _pearson(v, a) if len(v) >= 3 else 0.0


def lipsync(
    frames,
    audio,
    max_offset_frames: int = 6,
    fps: int = 24,
    sample_rate: int = AUDIO_SAMPLE_RATE,
    face_box: tuple[int, int, int, int] | None = None,
) -> dict:
    """Lip sync of ``frames`` to ``audio``: ``{corr, offset_frames, corr_at_zero, corr_by_offset}``.

    ``corr`` is the largest Pearson correlation between ``mouth_opening(frames)`` and
    ``audio_envelope(audio)`` over offsets in ``[-max_offset_frames, max_offset_frames]``;
    ``offset_frames`` is that offset: positive = the video lags the audio by that many frames
    (mouth at frame t + k matches the sound of frame t), negative = the video leads.
    ``corr_at_zero`` is the correlation at offset 0; ``corr_by_offset`` maps every offset to its value.
    Ties go to the offset nearest 0.
    """
    m = mouth_opening(frames, face_box)
    e = audio_envelope(audio, fps, sample_rate)
    by = {k: lagged_corr(m, e, k) for k in range(-max_offset_frames, max_offset_frames + 1)}
    best = max(by, key=lambda k: (round(by[k], 12), -abs(k)))
    return {"corr": by[best], "offset_frames": best, "corr_at_zero": by[0], "corr_by_offset": by}


def frame_distance(
    frames, reference, face_box: tuple[int, int, int, int] | None = None, grid: int = 16
) -> np.ndarray:
    """Per-frame distance (float32 [T], 0 = identical, 1 = black vs white) to ``reference``.

    What it measures: the mean absolute difference, in [0, 1] RGB, between the frame and the
    reference after both are cropped to ``face_box`` (whole frame if None) and area-averaged to a
    ``grid`` x ``grid`` image. The averaging keeps colours and layout (skin, hair, backdrop, where
    the face is) and washes out small details, so blinks and the mouth moving add little while a
    changed face, a colour shift or a displaced head add a lot.
    """
    f = _frames_uint8(frames)
    r = _frames_uint8(reference)[0]
    if r.shape != f.shape[1:]:
        raise ValueError(f"reference {r.shape} does not match frames {f.shape[1:]}")
    if face_box is not None:
        x0, y0, x1, y1 = face_box
        x0, y0 = max(x0, 0), max(y0, 0)
        f, r = f[:, y0:y1, x0:x1], r[y0:y1, x0:x1]
    return np.abs(_pool(f, grid) - _pool(r[None], grid)).mean(axis=(1, 2, 3)).astype(np.float32)


def _pool(f: np.ndarray, grid: int) -> np.ndarray:
    """Area-average uint8 [T, H, W, 3] to float [T, grid, grid, 3] in [0, 1] (uneven cells allowed)."""
    _t, h, w, _ = f.shape
    ys = np.linspace(0, h, min(grid, h) + 1).astype(int)
    xs = np.linspace(0, w, min(grid, w) + 1).astype(int)
    x = f.astype(np.float32) / 255.0
    rows = np.add.reduceat(x, ys[:-1], axis=1) / np.diff(ys)[None, :, None, None]
    return np.add.reduceat(rows, xs[:-1], axis=2) / np.diff(xs)[None, None, :, None]


def identity_drift(
    frames,
    reference,
    at_seconds=(1, 10, 60),
    fps: int = 24,
    face_box: tuple[int, int, int, int] | None = None,
    window_seconds: float = 0.5,
) -> dict:
    """``{s: distance}``: ``frame_distance`` to ``reference`` around ``s`` seconds into the stream.

    The value at ``s`` is the mean ``frame_distance`` over the frames in ``[s - window, s)`` seconds
    (the last ``window_seconds`` before that moment), which averages out mouth and blink states.
    Times past the end of ``frames`` are left out of the result.
    """
    f = _frames_uint8(frames)
    out = {}
    for s in at_seconds:
        end = round(s * fps)
        if end > f.shape[0] or end <= 0:
            continue
        start = max(0, end - max(1, round(window_seconds * fps)))
        out[s] = float(frame_distance(f[start:end], reference, face_box).mean())
    return out


__all__ = [
    "audio_envelope",
    "frame_distance",
    "identity_drift",
    "lagged_corr",
    "lipsync",
    "mouth_opening",
    "mouth_region",
]
