"""Drift over a long stream: identity, colour and sharpness of the face, per second: :class:`DriftMeter`.

Long sessions are where the complaints about streamed talking faces concentrate: the face slowly stops
looking like the reference, its colours wander, its detail washes out ("sharpness at half by 70 s"). Each of
these is measured per frame inside the face region, averaged per second into a curve, and summarised by one
number a verdict can compare (:data:`CURVES`, :func:`summarise`).

Per frame (the face region is the landmarks' bounding box, ``cadence.eval.landmarks``; with the pixel
fallback, the face box given, else the whole frame):

* ``identity_geometry``: the rigid landmarks (eyes, brows, nose, forehead: ``landmarks.RIGID``, none of
  which moves with speech) aligned to the reference image's by the best similarity transform (Procrustes:
  translation, rotation, scale), then the RMS distance of the points, in units of the reference's eye-corner
  distance. Head motion is aligned away; a face whose proportions change is not. NaN without landmarks.
* ``identity_embedding``: ``1 - cosine`` between the face region's appearance embedding and the reference's.
  The embedding is hand-made, not learned (no face-recognition model with weights and a licence that fits is
  on the registry): the region resized to 32x32, its luminance gradients binned into 8 orientations over a
  4x4 grid of cells (a HOG descriptor, each cell normalised) next to an 8x8 contrast-normalised luminance
  thumbnail; invariant to brightness and contrast, sensitive to the face's layout and detail.
* ``colour_shift``: the distance, in 8-bit RGB units, between the face region's per-channel mean and that
  mean over the stream's first ``baseline_seconds`` (the colour the stream started with).
* ``sharpness``: the variance of the luminance Laplacian in the face region, as a ratio to its mean over the
  first ``baseline_seconds`` (1 = as sharp as at the start; 0.5 = half).

Per second: the mean over that second's frames with a face (NaN when none). One number per curve
(:func:`summarise`): its mean over the last ``tail`` seconds (20% of the stream, 1 to 5 s): where the stream
ended up. Identity curves start near their floor (mouth and blinks move the embedding a little, the geometry
hardly), so a rise is drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from cadence.eval.landmarks import FaceTracker, FrameFaces

#: The curves, in report order, and whether larger is worse.
CURVES = ("identity_geometry", "identity_embedding", "colour_shift", "sharpness")
WORSE_IF_HIGHER = {
    "identity_geometry": True,
    "identity_embedding": True,
    "colour_shift": True,
    "sharpness": False,
}
BASELINE_SECONDS = 2.0
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)
_EMBED = 32  # embedding crop side
_CELLS = 4  # HOG grid
_BINS = 8  # orientations


def face_embedding(region: np.ndarray) -> np.ndarray:
    """The appearance embedding of a face region (uint8 [h, w, 3]): L2-normalised float32 [4*4*8 + 64]."""
    if region.size == 0:
        return np.zeros(_CELLS * _CELLS * _BINS + 64, np.float32)
    img = Image.fromarray(np.ascontiguousarray(region)).resize((_EMBED, _EMBED), Image.Resampling.BILINEAR)
    y = np.asarray(img, np.float32) @ _LUMA
    gy, gx = np.gradient(y)
    mag = np.hypot(gx, gy)
    ang = np.mod(np.arctan2(gy, gx), np.pi)  # unsigned orientation
    b = np.minimum((ang / np.pi * _BINS).astype(int), _BINS - 1)
    c = _EMBED // _CELLS
    hog = np.zeros((_CELLS, _CELLS, _BINS), np.float32)
    cy, cx = np.divmod(np.arange(_EMBED * _EMBED), _EMBED)
    np.add.at(hog, (cy // c, cx // c, b.reshape(-1)), mag.reshape(-1))
    hog /= np.linalg.norm(hog, axis=2, keepdims=True) + 1e-6
    thumb = y.reshape(8, _EMBED // 8, 8, _EMBED // 8).mean(axis=(1, 3)).reshape(-1)
    thumb = (thumb - thumb.mean()) / (thumb.std() + 1e-6) / 8.0
    v = np.concatenate([hog.reshape(-1) / _CELLS, thumb])
    return (v / (np.linalg.norm(v) + 1e-12)).astype(np.float32)


def laplacian_variance(region: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian of the region's luminance (0 for a region under 3x3)."""
    if region.shape[0] < 3 or region.shape[1] < 3:
        return 0.0
    y = region.astype(np.float32) @ _LUMA
    lap = y[:-2, 1:-1] + y[2:, 1:-1] + y[1:-1, :-2] + y[1:-1, 2:] - 4.0 * y[1:-1, 1:-1]
    return float(lap.var())


def procrustes_rms(points: np.ndarray, reference: np.ndarray) -> float:
    """RMS distance of ``points`` [N, 2] to ``reference`` [N, 2] after the best similarity transform of
    ``points`` onto ``reference``, over the reference's eye-corner-like scale (its RMS radius is used by the
    caller's unit choice: this returns pixels of the reference)."""
    a = points - points.mean(axis=0)
    b = reference - reference.mean(axis=0)
    na = np.sqrt((a * a).sum())
    if na < 1e-9:
        return math.nan
    u, s, vt = np.linalg.svd(a.T @ b)
    d = np.sign(np.linalg.det(u @ vt))
    s_ = s.copy()
    s_[-1] *= d
    r = u @ np.diag([1.0, d]) @ vt
    scale = s_.sum() / (na * na)
    aligned = scale * a @ r
    return float(np.sqrt(((aligned - b) ** 2).sum(axis=1).mean()))


def _region(frame: np.ndarray, box) -> np.ndarray:
    x0, y0, x1, y1 = (int(v) for v in box)
    return frame[max(y0, 0) : max(y1, 0), max(x0, 0) : max(x1, 0)]


@dataclass
class _Ref:
    embedding: np.ndarray
    rigid: np.ndarray | None  # [N, 2] or None (no landmarks)
    eye: float


class DriftMeter:
    """Per-frame drift features of a stream, fed chunk by chunk, turned into per-second curves.

    ``reference``: the reference image (uint8 [H, W, 3]); ``tracker``: the stream's :class:`FaceTracker`
    (its reference faces are read here, once); ``fps``: frames per second of the stream."""

    def __init__(self, reference: np.ndarray, tracker: FaceTracker, fps: float, face_box=None):
        self.fps, self.face_box = float(fps), face_box
        ref = np.asarray(reference, np.uint8)
        faces = tracker.track(ref[None])
        box = faces.box[0] if faces.found[0] else self._fallback_box(ref)
        rigid = faces.rigid[0] if faces.found[0] and np.isfinite(faces.rigid[0]).all() else None
        eye = float(faces.eye_distance[0]) if rigid is not None else math.nan
        self.ref = _Ref(face_embedding(_region(ref, box)), rigid, eye)
        self.reference_found = bool(faces.found[0])
        self._rows: list[np.ndarray] = []  # per frame: geometry, embedding, r, g, b means, sharpness

    def _fallback_box(self, frame: np.ndarray):
        return self.face_box if self.face_box is not None else (0, 0, frame.shape[1], frame.shape[0])

    def add(self, frames: np.ndarray, faces: FrameFaces) -> None:
        """Frames (uint8 [T, H, W, 3]) and what the tracker read from them."""
        out = np.full((len(frames), 6), np.nan, np.float64)
        for i, f in enumerate(frames):
            box = faces.box[i] if faces.found[i] and faces.box[i][0] >= 0 else self._fallback_box(f)
            reg = _region(f, box)
            if reg.size == 0:
                continue
            if self.ref.rigid is not None and np.isfinite(faces.rigid[i]).all():
                out[i, 0] = procrustes_rms(faces.rigid[i].astype(np.float64), self.ref.rigid) / self.ref.eye
            out[i, 1] = 1.0 - float(face_embedding(reg) @ self.ref.embedding)
            out[i, 2:5] = reg.reshape(-1, 3).mean(axis=0)
            out[i, 5] = laplacian_variance(reg)
        self._rows.append(out)

    @property
    def frames(self) -> int:
        return sum(len(r) for r in self._rows)

    def curves(self, baseline_seconds: float = BASELINE_SECONDS) -> dict[str, list[float]]:
        """Per-second curves (``CURVES``; seconds are whole: a last partial second counts if it has half a
        second of frames), plus ``colour_mean_rgb`` (per second, the face region's mean per channel)."""
        rows = np.concatenate(self._rows) if self._rows else np.zeros((0, 6))
        fps = self.fps
        n_sec = int(len(rows) // fps + (1 if (len(rows) % fps) >= fps / 2 else 0))
        per = np.full((n_sec, 6), np.nan)
        for s in range(n_sec):
            chunk = rows[int(round(s * fps)) : int(round((s + 1) * fps))]
            ok = np.isfinite(chunk)
            cnt = ok.sum(axis=0)
            per[s] = np.where(cnt > 0, np.where(ok, chunk, 0).sum(axis=0) / np.maximum(cnt, 1), np.nan)
        nb = max(1, min(n_sec, int(round(baseline_seconds))))
        base_rgb = np.nanmean(per[:nb, 2:5], axis=0) if n_sec else np.full(3, np.nan)
        base_sharp = np.nanmean(per[:nb, 5]) if n_sec else np.nan
        colour = np.sqrt(((per[:, 2:5] - base_rgb) ** 2).sum(axis=1))
        sharp = per[:, 5] / base_sharp if base_sharp and np.isfinite(base_sharp) else np.full(n_sec, np.nan)
        return {
            "identity_geometry": _list(per[:, 0]),
            "identity_embedding": _list(per[:, 1]),
            "colour_shift": _list(colour),
            "sharpness": _list(sharp),
            "colour_mean_rgb": [_list(r) for r in per[:, 2:5]],
        }


def _list(a) -> list[float]:
    return [float(x) if np.isfinite(x) else math.nan for x in np.asarray(a, np.float64)]


def tail_seconds(n_seconds: int) -> int:
    """How many final seconds the summary averages: 20% of the stream, at least 1, at most 5."""
    return max(1, min(5, int(round(0.2 * n_seconds))))


def summarise(curves: dict[str, list[float]]) -> dict[str, float]:
    """One number per curve: its mean over the last :func:`tail_seconds` seconds (NaN-aware; NaN when the
    curve has no value there). Keys: ``drift_<curve>``."""
    out = {}
    for name in CURVES:
        c = np.asarray(curves.get(name, []), np.float64)
        if c.size == 0:
            continue
        tail = c[-tail_seconds(len(c)) :]
        ok = np.isfinite(tail)
        out[f"drift_{name}"] = float(tail[ok].mean()) if ok.any() else math.nan
    return out


__all__ = [
    "BASELINE_SECONDS",
    "CURVES",
    "WORSE_IF_HIGHER",
    "DriftMeter",
    "face_embedding",
    "laplacian_variance",
    "procrustes_rms",
    "summarise",
    "tail_seconds",
]
