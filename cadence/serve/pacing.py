"""Pacing and the media clock, as pure functions and plain data (no asyncio, no aiortc).

One media clock drives both tracks. It starts once, at ``t0`` (the first time either WebRTC track
asks for media), and every presentation time is derived from it:

* video frame ``k`` is due at ``t0 + k / fps`` and stamped ``pts = k * 90000 / fps`` in 1/90000
  (3,750 at 24 fps; aiortc's stock video clock would pace and stamp at 30 fps);
* audio frame ``n`` (20 ms = 960 samples) is due at ``t0 + n * 960 / 48000`` and stamped
  ``pts = n * 960`` in 1/48000 (Opus counts samples anyway: we never leave gaps, we send silence);
* chunk ``c`` (F frames and F x 48000 / fps samples: 4 frames / 8,000 samples / 166.7 ms at the
  tiny presets, W14 and W57; 12 / 24,000 / 500 ms at W1.3) is due at ``t0 + c * F / fps``; the
  scheduler plans it (hands its audio window to the worker) ``lead`` seconds earlier.

Because both tracks read the same ``t0`` and the same chunk store, a frame and the audio of the
same media instant are always taken from the same chunk: the streams cannot drift apart, whatever
the network or the model does. Underrun policy (``AVBuffer``): when a chunk has not arrived by
the time its media is due, video holds the last frame and audio sends silence; both are counted.
A chunk that arrives late is used only for what is still in the future (the clock never stops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

VIDEO_CLOCK_RATE = 90_000  # RTP video clock; pts of video frames are in 1/90000 s
AUDIO_FRAME_SECONDS = 0.020  # 20 ms audio frames, as WebRTC (Opus) sends them


@dataclass(frozen=True)
class MediaTiming:
    """The media clock's arithmetic for one stream geometry (``from_config``: tiny, W14, W57: 24 fps and
    4 frames per chunk; W1.3: 24 fps and 12 frames per chunk)."""

    fps: int = 24
    frames_per_chunk: int = 4
    sample_rate: int = 48_000

    def __post_init__(self) -> None:
        if VIDEO_CLOCK_RATE % self.fps:
            raise ValueError(f"fps {self.fps} does not divide the 90 kHz video clock")
        if (self.frames_per_chunk * self.sample_rate) % self.fps:
            raise ValueError(f"{self.frames_per_chunk} frames at {self.fps} fps is not a whole number of samples "
                             f"at {self.sample_rate} Hz")

    @classmethod
    def from_config(cls, cfg) -> MediaTiming:
        from cadence.config import AUDIO_SAMPLE_RATE

        return cls(fps=cfg.stream.fps, frames_per_chunk=cfg.video_frames_per_chunk, sample_rate=AUDIO_SAMPLE_RATE)

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def samples_per_chunk(self) -> int:
        return self.frames_per_chunk * self.sample_rate // self.fps

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per video frame (2,000 at 48 kHz / 24 fps)."""
        return self.sample_rate // self.fps

    @property
    def audio_frame_samples(self) -> int:
        return int(round(AUDIO_FRAME_SECONDS * self.sample_rate))

    @property
    def video_pts_step(self) -> int:
        return VIDEO_CLOCK_RATE // self.fps

    @property
    def chunk_seconds(self) -> float:
        return self.frames_per_chunk / self.fps

    # ---- due times (seconds on the host clock) and stamps ----------------------------------------
    def video_due(self, t0: float, k: int) -> float:
        return t0 + k / self.fps

    def audio_due(self, t0: float, n: int) -> float:
        return t0 + n * self.audio_frame_samples / self.sample_rate

    def chunk_due(self, t0: float, c: int) -> float:
        return t0 + c * self.chunk_seconds

    def plan_time(self, t0: float, c: int, lead: float) -> float:
        """When the scheduler should hand chunk ``c`` to the worker: ``lead`` before it is due."""
        return self.chunk_due(t0, c) - lead

    def video_pts(self, k: int) -> int:
        return k * self.video_pts_step

    def audio_pts(self, n: int) -> int:
        return n * self.audio_frame_samples

    def frame_chunk(self, k: int) -> tuple[int, int]:
        """(chunk, frame within the chunk) of video frame ``k``."""
        return divmod(k, self.frames_per_chunk)

    def frame_of_sample(self, sample: int) -> int:
        """The video frame on screen while media sample ``sample`` plays."""
        return sample // self.samples_per_frame


def next_video_frame(k: int, now: float, t0: float, timing: MediaTiming, max_lag_frames: int = 2) -> tuple[int, float, int]:
    """The video pacer: which frame to send next and how long to wait for it.

    ``k`` is the next frame in order. If its due time is ahead, wait for it. If the sender fell
    behind by more than ``max_lag_frames`` frames (a stalled event loop or encoder), jump to the
    frame due now instead of bursting old frames: video then stays on the media clock, and the
    skipped frames are returned as a count. Returns ``(frame, wait_seconds, skipped)``.
    """
    due = timing.video_due(t0, k)
    if now <= due:
        return k, due - now, 0
    current = int(math.floor((now - t0) * timing.fps + 1e-9))
    if current - k > max_lag_frames:
        return current, 0.0, current - k
    return k, 0.0, 0


def next_audio_frame(n: int, now: float, t0: float, timing: MediaTiming, max_lag_frames: int = 5) -> tuple[int, float, int]:
    """The audio pacer, as ``next_video_frame`` for 20 ms frames (more slack: Opus frames are cheap)."""
    due = timing.audio_due(t0, n)
    if now <= due:
        return n, due - now, 0
    per = timing.audio_frame_samples / timing.sample_rate
    current = int(math.floor((now - t0) / per + 1e-9))
    if current - n > max_lag_frames:
        return current, 0.0, current - n
    return n, 0.0, 0


def next_plan(c: int, now: float, t0: float | None, timing: MediaTiming, lead: float, in_flight: int,
              max_in_flight: int = 2, prestart_chunks: int = 2) -> tuple[bool, float | None]:
    """The chunk scheduler: may chunk ``c`` be planned now? Returns ``(go, wait_seconds)``.

    Before the clock starts, the first ``prestart_chunks`` chunks are planned at once (they are
    ready when the tracks start); after it starts, chunk ``c`` is planned ``lead`` before it is due.
    Never more than ``max_in_flight`` chunks at the worker. ``wait`` None = wait for an event
    (the clock starting, or a chunk coming back).
    """
    if in_flight >= max_in_flight:
        return False, None
    if t0 is None:
        return (True, 0.0) if c < prestart_chunks else (False, None)
    at = timing.plan_time(t0, c, lead)
    if now >= at:
        return True, 0.0
    return False, at - now


SYNC_TONE_HZ = 1000.0  # the sync marker's audio: a 1 kHz tone burst ...
SYNC_TONE_SECONDS = 0.040  # ... 40 ms long, at amplitude 0.5
SYNC_TONE_AMPLITUDE = 0.5


def apply_sync_marker(frames: np.ndarray, audio: np.ndarray, timing: MediaTiming,
                      tone_seconds: float = SYNC_TONE_SECONDS, tone_hz: float = SYNC_TONE_HZ,
                      amplitude: float = SYNC_TONE_AMPLITUDE) -> tuple[np.ndarray, np.ndarray]:
    """An A/V sync marker on one chunk, at the media layer (after the model): its first video frame
    becomes solid white and its first ``tone_seconds`` of audio a ``tone_hz`` tone burst. Both start at
    the chunk's first media instant (frame 0 and sample 0 of the chunk), so a receiver that sees the
    flash and hears the tone onset at different times measures its own A/V offset. Returns copies."""
    frames = np.array(frames, dtype=np.uint8, copy=True)
    audio = np.array(audio, dtype=np.float32, copy=True)
    frames[0] = 255
    n = min(audio.shape[0], round(tone_seconds * timing.sample_rate))
    t = np.arange(n, dtype=np.float64) / timing.sample_rate
    audio[:n] = (amplitude * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
    return frames, audio


@dataclass
class _Chunk:
    frames: np.ndarray  # uint8 [F, H, W, 3]
    audio: np.ndarray  # float32 [samples_per_chunk]


@dataclass
class AVBuffer:
    """Generated chunks keyed by index; video and audio frames read out by media index with the
    underrun policy (hold the last frame / silence), counted. Plain data: the tracks call it."""

    timing: MediaTiming
    height: int
    width: int
    keep_chunks: int = 6
    sync_marker_every: int = 0  # > 0: every K-th chunk (0, K, 2K, ...) carries the A/V sync marker
    chunks: dict[int, _Chunk] = field(default_factory=dict)
    video_underruns: int = 0  # video frames held (their chunk had not arrived)
    audio_underruns: int = 0  # 20 ms audio frames (partly) replaced by silence
    video_fresh: int = 0  # video frames sent from a generated chunk
    late_chunks: int = 0  # chunks that arrived after their first frame was due (put with due info)
    _last: np.ndarray | None = None
    _min_needed: int = 0

    def put_chunk(self, c: int, frames: np.ndarray, audio: np.ndarray) -> None:
        if c < self._min_needed:  # entirely in the past: nothing of it can still be played
            self.late_chunks += 1
            return
        f = self.timing.frames_per_chunk
        if frames.shape[0] != f or audio.shape[0] != self.timing.samples_per_chunk:
            raise ValueError(f"chunk {c}: expected {f} frames and {self.timing.samples_per_chunk} samples, got "
                             f"{frames.shape[0]} and {audio.shape[0]}")
        if self.sync_marker_every > 0 and c % self.sync_marker_every == 0:
            frames, audio = apply_sync_marker(frames, audio, self.timing)
        self.chunks[c] = _Chunk(frames, audio.astype(np.float32, copy=False))

    def has_chunk(self, c: int) -> bool:
        return c in self.chunks

    def blank(self) -> np.ndarray:
        return np.zeros((self.height, self.width, 3), np.uint8)

    def video_frame(self, k: int) -> tuple[np.ndarray, bool]:
        """Frame ``k`` (uint8 [H, W, 3]) and whether it is fresh (False: the last frame, held)."""
        c, i = self.timing.frame_chunk(k)
        ch = self.chunks.get(c)
        self._advance(c)
        if ch is None:
            self.video_underruns += 1
            return (self._last if self._last is not None else self.blank()), False
        self._last = ch.frames[i]
        self.video_fresh += 1
        return self._last, True

    def audio_frame(self, n: int) -> tuple[np.ndarray, bool]:
        """Audio frame ``n`` (float32 [960]) and whether it is complete (False: silence filled in)."""
        t = self.timing
        size = t.audio_frame_samples
        start = n * size
        out = np.zeros(size, np.float32)
        complete = True
        pos = start
        while pos < start + size:
            c, off = divmod(pos, t.samples_per_chunk)
            take = min(start + size - pos, t.samples_per_chunk - off)
            ch = self.chunks.get(c)
            if ch is None:
                complete = False
            else:
                out[pos - start:pos - start + take] = ch.audio[off:off + take]
            pos += take
        if not complete:
            self.audio_underruns += 1
        self._audio_chunk = start // t.samples_per_chunk
        self._gc()
        return out, complete

    def _advance(self, c: int) -> None:
        self._video_chunk = c
        self._gc()

    def _gc(self) -> None:
        # a track that never started (a video-only client) does not hold chunks back
        marks = [m for m in (getattr(self, "_video_chunk", None), getattr(self, "_audio_chunk", None)) if m is not None]
        self._min_needed = min(marks) if marks else 0
        for old in [k for k in self.chunks if k < self._min_needed]:
            del self.chunks[old]
        if len(self.chunks) > self.keep_chunks:  # a runaway producer: keep the oldest needed ones
            for old in sorted(self.chunks)[self.keep_chunks:]:
                del self.chunks[old]


def to_s16(samples: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 for the Opus encoder."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype(np.int16)
