"""The held-out clips ``cadence eval`` streams: a reference image and speech each, at the model's size and fps.

Two kinds, both made here, nothing downloaded:

* **Synthetic faces** (``cadence.train.data``): ``held_out_split(0, n, split_seed)``'s test clips, faces,
  colours and voices never trained on. Their own animation (the mouth drawn from the audio's loudness) is
  the **ground truth**: measured like a generated stream, it is the ceiling of the lip-sync numbers and the
  floor of the drift curves. It is rendered at the model's size, or scaled down to 256 pixels on the long
  side for a larger model (the face is drawn resolution-independently), and the reference image is the same
  face's first frame at the model's size.
* **Images** (``--images``): ``astronaut`` (scikit-image's ``data.astronaut()``, the NASA photograph of
  Eileen Collins, public domain per scikit-image; needs ``scikit-image``, in the ``eval`` extra) or any image
  file, scaled to cover the model's frame and centre-cropped; no ground truth.

Speech (``speech``): 'synthetic' (``cadence.media.audio.synthetic_speech``, seeded per clip) or 'espeak'
(espeak-ng sentences, voice, pitch and speed drawn per clip); both peak-normalised to 0.5, at 48 kHz.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from cadence.config import AUDIO_SAMPLE_RATE, CadenceConfig
from cadence.errors import InputError

#: Longest side the ground-truth animation of a synthetic face is rendered at.
GROUND_TRUTH_SIDE = 256


@dataclass
class EvalClip:
    """What a stream needs from one held-out clip."""

    name: str
    seed: int
    reference: np.ndarray  # uint8 [H, W, 3] at the model's size
    audio: np.ndarray  # float32 [frames * sample_rate / fps]
    face_box: tuple[int, int, int, int] | None  # at the model's size (None: unknown)
    frames: int
    fps: int
    sample_rate: int = AUDIO_SAMPLE_RATE
    ground_truth: dict = field(default_factory=dict)  # metrics of the clip's own animation (synthetic faces)
    ground_truth_track: dict = field(default_factory=dict)
    ground_truth_curves: dict = field(default_factory=dict)


def _scaled(height: int, width: int, side: int) -> tuple[int, int]:
    k = min(1.0, side / max(height, width))
    return max(16, round(height * k)), max(16, round(width * k))


def face_box_at(params, height: int, width: int) -> tuple[int, int, int, int]:
    """The face ellipse's box of ``params`` drawn at ``height`` x ``width`` (``make_clip``'s rule)."""
    s = min(height, width)
    cx, cy = width / 2, height * params.center_y
    fw, fh = params.face_w * s, params.face_h * s
    return (int(np.floor(cx - fw)), int(np.floor(cy - fh)), int(np.ceil(cx + fw)), int(np.ceil(cy + fh)))


def synthetic_clip(
    seed: int,
    cfg: CadenceConfig,
    seconds: float,
    speech: str = "synthetic",
    ground_truth: bool = True,
    tracker: str = "auto",
) -> EvalClip:
    """Test-split face ``seed`` at ``cfg``'s size and fps, with its ground truth measured (module doc)."""
    from cadence.eval.measure import StreamMeasure
    from cadence.media.face import render_face
    from cadence.train.data import make_clip

    H, W, fps = cfg.stream.height, cfg.stream.width, cfg.stream.fps
    h, w = _scaled(H, W, GROUND_TRUTH_SIDE) if ground_truth else (16, 16)  # 16 px: the audio alone
    clip = make_clip(seed, seconds, height=h, width=w, fps=fps, speech=speech, split="test")
    if (h, w) == (H, W):
        ref = clip.frames[0].copy()
    else:
        ref = render_face(clip.params, H, W, float(clip.mouth_open[0]), False)
    out = EvalClip(
        name=f"face {seed}",
        seed=seed,
        reference=ref,
        audio=clip.audio,
        face_box=face_box_at(clip.params, H, W),
        frames=clip.frames.shape[0],
        fps=fps,
        sample_rate=clip.sample_rate,
    )
    if ground_truth:
        m = StreamMeasure(clip.frames[0], fps, clip.face_box, tracker)
        fpc = cfg.video_frames_per_chunk
        for j in range(0, clip.frames.shape[0], fpc):
            m.add(clip.frames[j : j + fpc])
        out.ground_truth = m.result(clip.audio, clip.sample_rate)
        out.ground_truth_track, out.ground_truth_curves = m.track, m.curves
    return out


def load_image(name: str, height: int, width: int) -> np.ndarray:
    """``astronaut`` (scikit-image) or an image file, scaled to cover ``height`` x ``width`` and centre-cropped
    (uint8 [H, W, 3]). One ``InputError`` for what cannot be had."""
    if name == "astronaut":
        try:
            from skimage import data
        except ImportError:
            raise InputError("--images astronaut needs scikit-image (pip install 'cadence[eval]')") from None
        img = Image.fromarray(data.astronaut()).convert("RGB")
    else:
        p = Path(name)
        if not p.is_file():
            raise InputError(f"--images: no such image file {name} (or 'astronaut')")
        try:
            with Image.open(p) as im:
                img = im.convert("RGB")
        except (OSError, ValueError) as e:
            raise InputError(f"--images: cannot read {name}: {e}") from None
    k = max(width / img.width, height / img.height)
    size = (max(width, round(img.width * k)), max(height, round(img.height * k)))
    img = img.resize(size, Image.Resampling.LANCZOS)
    x0, y0 = (size[0] - width) // 2, (size[1] - height) // 2
    return np.asarray(img.crop((x0, y0, x0 + width, y0 + height)), np.uint8).copy()


def image_clip(
    name: str, seed: int, cfg: CadenceConfig, seconds: float, speech: str = "synthetic"
) -> EvalClip:
    """Image ``name`` (``load_image``) speaking the voice of test clip ``seed``."""
    from cadence.train.data import make_clip

    H, W, fps = cfg.stream.height, cfg.stream.width, cfg.stream.fps
    audio = make_clip(seed, seconds, height=16, width=16, fps=fps, speech=speech, split="test").audio
    return EvalClip(
        name=Path(name).name if name != "astronaut" else name,
        seed=seed,
        reference=load_image(name, H, W),
        audio=audio,
        face_box=None,
        frames=len(audio) * fps // AUDIO_SAMPLE_RATE,
        fps=fps,
    )


def prepare_clips(
    cfg: CadenceConfig,
    n: int,
    seconds: float,
    speech: str = "synthetic",
    split_seed: int = 0,
    images: Sequence[str] = (),
    ground_truth: bool = True,
    tracker: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> list[EvalClip]:
    """``n`` synthetic held-out faces then one clip per image (module doc), ``seconds`` long each."""
    from cadence.train.data import held_out_split

    if n < 0 or seconds <= 0 or n + len(images) < 1:
        raise ValueError(
            f"need >= 1 clip of positive length, got {n} clips + {len(images)} images of {seconds} s"
        )
    specs = held_out_split(0, n + len(images), seed=split_seed)[1]
    out = []
    for i, spec in enumerate(specs):
        t0 = time.perf_counter()
        if i < n:
            c = synthetic_clip(spec.seed, cfg, seconds, speech, ground_truth, tracker)
        else:
            c = image_clip(images[i - n], spec.seed, cfg, seconds, speech)
        out.append(c)
        if progress:
            gt = c.ground_truth
            what = (
                f"ground truth offset {gt['sync_offset_frames']:g}, confidence {gt['sync_confidence']:.3f}"
                if gt
                else "no ground truth"
            )
            progress(
                f"clip {i + 1}/{len(specs)} ({c.name}, {c.frames} frames): {what} ({time.perf_counter() - t0:.1f} s)"
            )
    return out


__all__ = [
    "GROUND_TRUTH_SIDE",
    "EvalClip",
    "face_box_at",
    "image_clip",
    "load_image",
    "prepare_clips",
    "synthetic_clip",
]
