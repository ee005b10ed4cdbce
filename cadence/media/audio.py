"""Driving audio: decode any file PyAV reads to mono float32 at the media clock (48 kHz).

Also ``fit_audio`` (pad/trim a track to a whole number of chunks) and ``synthetic_speech``
(a deterministic speech-like signal for runs without ``--audio``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.errors import InputError
from cadence.media.pcm import require_finite


def load_audio(
    path: str | os.PathLike, sample_rate: int = AUDIO_SAMPLE_RATE, max_samples: int | None = None
) -> torch.Tensor:
    """Decode the first audio stream of ``path`` to float32 mono [samples] in [-1, 1] at ``sample_rate``.

    Any container/codec FFmpeg reads (wav, flac, mp3, ogg, m4a, a video's soundtrack), any rate,
    channel count or sample format; channels are down-mixed and the rate converted by
    ``av.AudioResampler(format='flt', layout='mono', rate=sample_rate)``, flushed at the end.
    With ``max_samples``, decoding stops once that many samples are in hand (the result is
    truncated to it), so a long file costs only what is used.

    Raises ``InputError`` (one line) for a missing file, a file with no decodable audio stream,
    one that decodes to no samples, or one with NaN or infinite samples (``NonFiniteAudio``).
    """
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    if max_samples is not None and max_samples <= 0:
        raise ValueError(f"max_samples must be positive, got {max_samples}")
    p = Path(path)
    if not p.exists():
        raise InputError(f"audio file not found: {p}")
    if not p.is_file():
        raise InputError(f"audio path is not a file: {p}")
    if p.stat().st_size == 0:
        raise InputError(f"audio file is empty (0 bytes): {p}")
    import av  # lazily: the engine and training import this module on machines without PyAV

    pieces: list[np.ndarray] = []
    have = 0
    try:
        with av.open(str(p), mode="r") as container:
            if not container.streams.audio:
                raise InputError(f"no audio stream in {p}")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().reshape(-1))
                    have += pieces[-1].shape[0]
                if max_samples is not None and have >= max_samples:
                    break
            else:
                for out in resampler.resample(None):  # flush what the resampler holds back
                    pieces.append(out.to_ndarray().reshape(-1))
    except InputError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise InputError(f"could not decode audio from {p}: {_one_line(e)}") from None
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if max_samples is not None:
        samples = samples[:max_samples]
    if samples.size == 0:
        raise InputError(f"audio file contains no samples: {p}")
    samples = require_finite(samples, f"audio file {p}")  # (np.clip keeps a NaN: it would blank the video)
    return torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))


def fit_audio(audio: torch.Tensor, samples: int) -> torch.Tensor:
    """``audio`` (1-D) padded with trailing zeros or truncated to exactly ``samples``."""
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    if audio.dim() != 1:
        raise ValueError(f"expected mono audio [samples], got shape {tuple(audio.shape)}")
    n = audio.shape[0]
    if n >= samples:
        return audio[:samples].clone()
    return torch.cat([audio, audio.new_zeros(samples - n)])


def synthetic_speech(
    seconds: float = 2.0, sample_rate: int = AUDIO_SAMPLE_RATE, seed: int = 0
) -> torch.Tensor:
    """A deterministic speech-like float32 mono signal: voiced 'syllables' with pauses.

    Each syllable is a gliding pitch (95-180 Hz) with harmonics shaped by two vowel-like formants,
    a short noisy onset (a consonant) and a raised-cosine envelope; pauses of 60-250 ms separate
    them, as in conversational speech (~4 syllables per second). Peak amplitude 0.5.
    """
    if seconds <= 0 or sample_rate <= 0:
        raise ValueError(f"seconds and sample_rate must be positive, got {seconds}, {sample_rate}")
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    out = np.zeros(n, np.float64)
    vowels = [(730, 1090), (270, 2290), (530, 1840), (300, 870), (640, 1190)]  # (F1, F2) of a, i, e, u, o
    t0 = int(0.05 * sample_rate)
    while t0 < n:
        length = min(int(rng.uniform(0.12, 0.28) * sample_rate), n - t0)
        if length < int(0.03 * sample_rate):
            break
        t = np.arange(length) / sample_rate
        f_start, f_end = rng.uniform(110, 180), rng.uniform(95, 150)
        f0 = f_start + (f_end - f_start) * t / t[-1] if length > 1 else np.full(1, f_start)
        phase = 2 * np.pi * np.cumsum(f0) / sample_rate
        f1, f2 = vowels[rng.integers(len(vowels))]
        sig = np.zeros(length)
        for k in range(1, 30):
            hk = k * f0
            if hk[0] > sample_rate / 2 - 1000:
                break
            amp = np.exp(-(((hk - f1) / 120.0) ** 2)) + 0.6 * np.exp(-(((hk - f2) / 180.0) ** 2)) + 0.15 / k
            sig += amp * np.sin(k * phase)
        onset = min(int(0.03 * sample_rate), length)
        sig[:onset] += 0.3 * rng.standard_normal(onset) * np.linspace(1, 0, onset)
        # clamp: sin(pi * 1.0) is a tiny negative number in floating point, and a fractional power
        # of a negative number is NaN
        env = np.clip(np.sin(np.pi * np.arange(length) / max(length - 1, 1)), 0.0, None) ** 0.6
        out[t0 : t0 + length] += sig * env * rng.uniform(0.6, 1.0)
        t0 += length + int(rng.uniform(0.06, 0.25) * sample_rate)
    peak = np.abs(out).max()
    if peak > 0:
        out *= 0.5 / peak
    return torch.from_numpy(out.astype(np.float32))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


__all__ = ["load_audio", "fit_audio", "synthetic_speech"]
