"""Everything measured on one stream, fed chunk by chunk: :class:`StreamMeasure`.

Frames go through a :class:`~cadence.eval.landmarks.FaceTracker` once; what it reads feeds the mouth track
(lip sync, ``cadence.eval.sync``) and the drift meter (``cadence.eval.drift``); the frames themselves are
dropped. ``result(audio)`` gives the stream's numbers:

* ``sync_offset_frames`` (NaN when the clip has no speech or no face), ``sync_confidence``, ``sync_corr``:
  :func:`cadence.eval.sync.av_sync` of the mouth track against the audio's per-frame energy;
* ``drift_identity_geometry``, ``drift_identity_embedding``, ``drift_colour_shift``, ``drift_sharpness``:
  :func:`cadence.eval.drift.summarise` of the per-second curves (``curves``);
* ``face_fraction``: the share of frames in which a face was found.

and keeps the per-second curves and the per-frame mouth track and energy (``track``) for the report.
"""

from __future__ import annotations

import math

import numpy as np

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.eval.drift import CURVES, DriftMeter, summarise
from cadence.eval.landmarks import FaceTracker
from cadence.eval.metrics import _frames_uint8, audio_envelope
from cadence.eval.sync import MAX_OFFSET, av_sync

SYNC_METRICS = ("sync_offset_frames", "sync_confidence", "sync_corr")
DRIFT_METRICS = tuple(f"drift_{c}" for c in CURVES)
METRICS = SYNC_METRICS + DRIFT_METRICS


class StreamMeasure:
    """Lip sync and drift of one stream (module doc). ``reference``: uint8 [H, W, 3]; ``face_box``: where the
    face is when no landmarks can be had (the pixel fallback); ``tracker``: 'auto', 'landmarks' or 'pixels'."""

    def __init__(self, reference: np.ndarray, fps: float, face_box=None, tracker: str = "auto"):
        self.fps = float(fps)
        self.tracker = FaceTracker(face_box, prefer=tracker, blendshapes=False)  # jawOpen: not used here
        self.drift = DriftMeter(reference, self.tracker, fps, face_box)
        self._mouth: list[np.ndarray] = []
        self._found: list[np.ndarray] = []
        self.curves: dict = {}
        self.sync = None
        self.track: dict = {}
        self.values: dict[str, float] = {}

    @property
    def frames(self) -> int:
        return sum(len(m) for m in self._mouth)

    def add(self, frames) -> None:
        f = _frames_uint8(frames)
        if len(f) == 0:
            return
        faces = self.tracker.track(f)
        self._mouth.append(faces.mouth)
        self._found.append(faces.found)
        self.drift.add(f, faces)

    def result(self, audio: np.ndarray, sample_rate: int = AUDIO_SAMPLE_RATE) -> dict[str, float]:
        """The stream's numbers (module doc; kept as ``values``); also sets ``curves``, ``sync`` and ``track``.
        Closes the tracker."""
        self.tracker.close()
        mouth = np.concatenate(self._mouth) if self._mouth else np.zeros(0, np.float32)
        found = np.concatenate(self._found) if self._found else np.zeros(0, bool)
        energy = audio_envelope(audio, int(round(self.fps)), sample_rate)
        self.sync = av_sync(mouth, energy, MAX_OFFSET)
        self.curves = self.drift.curves()
        n = min(len(mouth), len(energy))
        self.track = {
            "mouth": [float(x) if np.isfinite(x) else math.nan for x in mouth[:n]],
            "energy": [float(x) for x in energy[:n]],
            "fps": self.fps,
            "tracker": self.tracker.tracker,
            "sync_curve": {str(k): v for k, v in self.sync.corr_by_offset.items()},
        }
        out = {
            "sync_offset_frames": math.nan
            if self.sync.offset_frames is None
            else float(self.sync.offset_frames),
            "sync_confidence": self.sync.confidence,
            "sync_corr": self.sync.corr,
            **summarise(self.curves),
            "face_fraction": float(found.mean()) if found.size else 0.0,
        }
        self.values = out
        return out

    def close(self) -> None:
        self.tracker.close()


__all__ = ["DRIFT_METRICS", "METRICS", "SYNC_METRICS", "StreamMeasure"]
