"""Audio samples a model may be given: finite and within [-1, 1] (NumPy only: the web process uses it).

A NaN or an infinity in the driving audio does not stay in the audio: the audio encoder spreads it over every
feature, the diffusion step over every latent, and the decoder turns the result into black frames (a float
NaN cast to uint8 is 0). ``np.clip`` keeps NaN as it is, so clipping is not cleaning. Every way audio reaches
a session therefore goes through one of two doors:

* :func:`require_finite`: refuse (``NonFiniteAudio``, an ``InputError`` naming how many samples of how
  many are not finite), where a request can be answered: an upload, a TTS reply, a file;
* :func:`clean`: replace them with silence and say how many, where nothing can be refused (a live
  microphone track; the last guard before a chunk's audio goes to the worker).
"""

from __future__ import annotations

import numpy as np

from cadence.errors import InputError


class NonFiniteAudio(InputError):
    """Audio with NaN or infinite samples (refused: it would blank the video)."""


def nonfinite_count(samples: np.ndarray) -> int:
    """How many samples are NaN or +-infinity."""
    a = np.asarray(samples)
    if a.dtype.kind not in "fc":  # integer PCM is always finite
        return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def require_finite(samples: np.ndarray, what: str = "audio") -> np.ndarray:
    """``samples`` as float32 within [-1, 1], or ``NonFiniteAudio`` when any sample is NaN or infinite."""
    a = np.asarray(samples, dtype=np.float32)
    bad = nonfinite_count(a)
    if bad:
        raise NonFiniteAudio(
            f"{what} has {bad} non-finite samples (NaN or infinity) of {a.size}: every sample must be a "
            "finite number (PCM in [-1, 1])"
        )
    return np.clip(a, -1.0, 1.0)


def clean(samples: np.ndarray) -> tuple[np.ndarray, int]:
    """``(samples within [-1, 1] with every NaN or infinity replaced by 0, how many were)``; the array is
    returned as it is (no copy) when it was clean already and within range."""
    a = np.asarray(samples, dtype=np.float32)
    bad = nonfinite_count(a)
    if bad:
        a = np.where(np.isfinite(a), a, np.float32(0.0))
    if a.size and (a.max() > 1.0 or a.min() < -1.0):
        a = np.clip(a, -1.0, 1.0)
    return a, bad
