"""Deterministic synthetic talking-face clips: the training data of the default character (issue 7).

``make_clip(seed, seconds)`` draws a stylised face (shape, skin/hair/eye/backdrop colours, eye
placement, hair style and mouth size all come from ``seed``) that blinks (eyes shut for ~3 frames
every 2-5 s), moves a little (a smooth head translation of a few pixels) and opens its mouth with
the loudness of the clip's speech. No files are read; the same seed gives the same bytes.

Mouth ground truth: per video frame, the RMS of that frame's audio samples (2,000 at 48 kHz /
24 fps), smoothed with a symmetric [1, 2, 1] / 4 kernel (no lag), divided by the clip's 95th
percentile and clipped to [0, 1]. The mouth is drawn as a dark ellipse (its interior) inside a
lip ellipse; the interior's height is ``opening * max_open`` pixels, so its *area* is linear in the
opening. Closed (opening 0), only a thin lip line is drawn. ``cadence.eval.metrics.mouth_opening``
measures it back from pixels.

Held-out split: ``held_out_split`` hands out train seeds in ``[0, 2**30)`` and test seeds in
``[2**30, 2**31)`` (speech is seeded from the clip seed, so voices differ too), and
``split='train'`` / ``'test'`` draw hair and backdrop hue (and espeak pitch) from disjoint ranges,
so no test face shares a hair or backdrop colour family with any train face.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.media.face import HAIR_STYLES, HUE_RANGES, FaceParams, backdrop, face_params, render_face

__all__ = [
    "HAIR_STYLES",
    "HUE_RANGES",
    "PITCH_RANGES",
    "TEST_SEED_BASE",
    "Clip",
    "ClipSpec",
    "FaceParams",
    "backdrop",
    "espeak_speech",
    "face_params",
    "held_out_split",
    "make_clip",
    "mouth_open_from_audio",
    "render_face",
]

#: Seed ranges of the held-out split: train seeds are below ``TEST_SEED_BASE``, test seeds at or above.
TEST_SEED_BASE = 2**30

#: espeak-ng pitch (0..99) ranges per split.
PITCH_RANGES = {"train": (25, 55), "test": (60, 85), "any": (25, 85)}

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Please call me back when you get this message, I will be home after seven.",
    "A small boat drifted slowly across the quiet lake in the morning light.",
    "Numbers like one, two, three and four are easy to say out loud.",
    "We walked to the market, bought some bread, and talked about the weather.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "Every moment of the day, the city hums with voices, engines and music.",
)


@dataclass
class Clip:
    """One generated clip. ``frames[0]`` is the reference image."""

    frames: np.ndarray  # uint8 [T, H, W, 3]
    audio: np.ndarray  # float32 [T * sample_rate / fps], in [-1, 1]
    mouth_open: np.ndarray  # float32 [T], ground-truth opening in [0, 1]
    face_box: tuple[int, int, int, int]  # (x0, y0, x1, y1) of the face ellipse in frame 0, pixels
    blink: np.ndarray  # bool [T], eyes shut
    head_offset: np.ndarray  # float32 [T, 2], (dx, dy) head translation in pixels
    params: FaceParams
    fps: int
    sample_rate: int
    seed: int

    @property
    def reference(self) -> np.ndarray:
        """The reference image (uint8 [H, W, 3]): the first frame."""
        return self.frames[0]


@dataclass(frozen=True)
class ClipSpec:
    """A clip to generate: its seed and the split whose parameter ranges it draws from."""

    seed: int
    split: str

    def make(self, seconds: float, **kw) -> Clip:
        return make_clip(self.seed, seconds, split=self.split, **kw)


def held_out_split(n_train: int, n_test: int, seed: int = 0) -> tuple[list[ClipSpec], list[ClipSpec]]:
    """``n_train`` train and ``n_test`` test clip specs whose faces and voices never coincide.

    Train seeds are drawn (distinct) from ``[0, 2**30)``, test seeds from ``[2**30, 2**31)``;
    train specs use ``split='train'`` and test specs ``split='test'``, whose hair/backdrop hue
    (and espeak pitch) ranges are disjoint (``HUE_RANGES``, ``PITCH_RANGES``).
    """
    if n_train < 0 or n_test < 0:
        raise ValueError(f"counts must be >= 0, got {n_train}, {n_test}")
    rng = np.random.default_rng(seed)
    train = rng.choice(TEST_SEED_BASE, size=n_train, replace=False)
    test = TEST_SEED_BASE + rng.choice(TEST_SEED_BASE, size=n_test, replace=False)
    return ([ClipSpec(int(s), "train") for s in train], [ClipSpec(int(s), "test") for s in test])


def make_clip(
    seed: int,
    seconds: float,
    height: int = 128,
    width: int = 128,
    fps: int = 24,
    sample_rate: int = AUDIO_SAMPLE_RATE,
    speech: str = "synthetic",
    text: str | None = None,
    split: str = "any",
) -> Clip:
    """Generate clip ``seed``: ``round(seconds * fps)`` frames and their speech (see the module doc).

    ``speech='synthetic'`` uses ``cadence.media.audio.synthetic_speech`` (seeded from ``seed``);
    ``'espeak'`` speaks ``text`` (default: sentences picked by ``seed``) with espeak-ng at a pitch and
    speed drawn from ``seed`` and resamples it to ``sample_rate`` with PyAV; it raises
    ``RuntimeError`` when espeak-ng is not installed. Audio shorter than the clip is padded with
    silence; longer is cut.
    """
    if seconds <= 0 or height <= 0 or width <= 0 or fps <= 0:
        raise ValueError(
            f"seconds, height, width and fps must be positive, got {seconds}, {height}, {width}, {fps}"
        )
    if sample_rate % fps:
        raise ValueError(f"sample_rate ({sample_rate}) must be a multiple of fps ({fps})")
    spf = sample_rate // fps
    n_frames = max(1, round(seconds * fps))
    n_samples = n_frames * spf
    audio = _speech(seed, n_samples, sample_rate, speech, text, split)
    mouth = mouth_open_from_audio(audio, spf)
    params = face_params(seed, split)
    rng = np.random.default_rng([seed, 2])
    blink = _blinks(rng, n_frames, fps)
    offset = _head_motion(rng, n_frames, fps, params.motion_amp * min(height, width))
    frames = np.empty((n_frames, height, width, 3), np.uint8)
    bg = backdrop(params, height, width)
    for t in range(n_frames):
        frames[t] = render_face(params, height, width, mouth[t], bool(blink[t]), offset[t], bg)
    s = min(height, width)
    cx, cy = width / 2, height * params.center_y
    fw, fh = params.face_w * s, params.face_h * s
    box = (int(np.floor(cx - fw)), int(np.floor(cy - fh)), int(np.ceil(cx + fw)), int(np.ceil(cy + fh)))
    return Clip(
        frames=frames,
        audio=audio,
        mouth_open=mouth,
        face_box=box,
        blink=blink,
        head_offset=offset,
        params=params,
        fps=fps,
        sample_rate=sample_rate,
        seed=seed,
    )


def mouth_open_from_audio(audio: np.ndarray, samples_per_frame: int) -> np.ndarray:
    """Ground-truth opening per frame: frame RMS, [1, 2, 1]/4-smoothed, / 95th percentile, clipped to [0, 1]."""
    n = audio.shape[0] // samples_per_frame
    rms = np.sqrt(np.mean(audio[: n * samples_per_frame].astype(np.float64).reshape(n, -1) ** 2, axis=1))
    padded = np.concatenate([rms[:1], rms, rms[-1:]])
    smooth = 0.25 * padded[:-2] + 0.5 * padded[1:-1] + 0.25 * padded[2:]
    top = np.percentile(smooth, 95) if n else 0.0
    if top <= 0:
        return np.zeros(n, np.float32)
    return np.clip(smooth / top, 0.0, 1.0).astype(np.float32)


# ---- helpers --------------------------------------------------------------------------------------


def _blinks(rng: np.random.Generator, n: int, fps: int) -> np.ndarray:
    """Eyes shut for 3 frames (2-4) at intervals of 2-5 s; the first blink after 0.5-3 s (frame 0 open)."""
    out = np.zeros(n, bool)
    t = rng.uniform(0.5, 3.0) * fps
    while int(t) < n:
        length = int(rng.integers(2, 5))
        out[int(t) : int(t) + length] = True
        t += rng.uniform(2.0, 5.0) * fps
    out[0] = False
    return out


def _head_motion(rng: np.random.Generator, n: int, fps: int, amp_px: float) -> np.ndarray:
    """Smooth (dx, dy) in pixels: a sum of three slow sinusoids per axis (0.05-0.4 Hz), 0 at frame 0."""
    t = np.arange(n) / fps
    out = np.zeros((n, 2))
    for axis, scale in ((0, 1.0), (1, 0.6)):
        for _ in range(3):
            f, ph, a = rng.uniform(0.05, 0.4), rng.uniform(0, 2 * np.pi), rng.uniform(0.3, 1.0)
            out[:, axis] += a * (np.sin(2 * np.pi * f * t + ph) - np.sin(ph))
        peak = np.abs(out[:, axis]).max()
        if peak > 0:
            out[:, axis] *= scale * amp_px / peak
    return out.astype(np.float32)


def _speech(
    seed: int, n_samples: int, sample_rate: int, speech: str, text: str | None, split: str
) -> np.ndarray:
    if speech == "synthetic":
        from cadence.media.audio import synthetic_speech

        a = synthetic_speech(n_samples / sample_rate, sample_rate=sample_rate, seed=seed).numpy()
    elif speech == "espeak":
        a = espeak_speech(seed, n_samples / sample_rate, sample_rate, text, split)
    else:
        raise ValueError(f"speech must be 'synthetic' or 'espeak', got {speech!r}")
    # both sources peak-normalise to 0.5 here, so clips of either kind have the same level
    a = np.asarray(a, np.float32)
    peak = float(np.abs(a).max()) if a.size else 0.0
    if peak > 0:
        a = a * np.float32(0.5 / peak)
    out = np.zeros(n_samples, np.float32)
    out[: min(n_samples, a.shape[0])] = a[:n_samples]
    return out


def espeak_speech(
    seed: int,
    seconds: float,
    sample_rate: int = AUDIO_SAMPLE_RATE,
    text: str | None = None,
    split: str = "any",
) -> np.ndarray:
    """``text`` (default: sentences picked by ``seed`` until ``seconds`` are filled) spoken by espeak-ng.

    Voice (en-us / en-gb / en-gb-scotland), pitch (``PITCH_RANGES[split]``) and speed (140-185
    wpm) come from ``seed``. Resampled to mono float32 at ``sample_rate`` with PyAV
    (``cadence.media.audio.load_audio``), peak-normalised to 0.5.
    """
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError(
            "speech='espeak' needs espeak-ng on PATH (apt-get install espeak-ng); "
            "use speech='synthetic' otherwise"
        )
    from cadence.media.audio import load_audio

    rng = np.random.default_rng([seed, 3])
    voice = ("en-us", "en-gb", "en-gb-scotland")[int(rng.integers(3))]
    pitch = int(rng.integers(*PITCH_RANGES[split]))
    speed = int(rng.integers(140, 186))
    if text is None:  # ~2.6 words/s at 160 wpm: enough sentences to cover the clip
        words, parts = 0, []
        while words < seconds * 3.2 + 5:
            parts.append(_SENTENCES[int(rng.integers(len(_SENTENCES)))])
            words += len(parts[-1].split())
        text = " ".join(parts)
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        r = subprocess.run(
            [exe, "-v", voice, "-p", str(pitch), "-s", str(speed), "-w", str(wav), text],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0 or not wav.exists():
            raise RuntimeError(f"espeak-ng failed (rc {r.returncode}): {' '.join(r.stderr.split())[:200]}")
        a = load_audio(wav, sample_rate).numpy()
    peak = float(np.abs(a).max()) if a.size else 0.0
    if peak > 0:
        a = a * (0.5 / peak)
    return a.astype(np.float32)


__all__ = [
    "HAIR_STYLES",
    "HUE_RANGES",
    "TEST_SEED_BASE",
    "Clip",
    "ClipSpec",
    "FaceParams",
    "espeak_speech",
    "face_params",
    "held_out_split",
    "make_clip",
    "mouth_open_from_audio",
    "render_face",
]
