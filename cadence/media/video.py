"""Write generated chunks to an MP4 file: H.264 (yuv420p) video + AAC audio on one clock.

Video frame ``i`` has pts ``i / fps``; audio sample ``j`` has pts ``j / sample_rate``; both tracks
start at 0, so a writer fed chunk by chunk (4 frames, then that chunk's 8,000 samples) stays in
lip sync. Audio is sent to the AAC encoder in frames of 1024 samples (its frame size); the
remainder is held until more arrives or ``close()``.
"""

from __future__ import annotations

import logging
import os
from fractions import Fraction
from types import TracebackType

import av
import numpy as np
import torch

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.errors import InputError

log = logging.getLogger(__name__)

#: Samples per AAC frame.
AAC_FRAME = 1024


def _video_codec() -> str:
    """``libx264`` when this FFmpeg build has it, else ``mpeg4`` (with one log line)."""
    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except Exception:  # av raises UnknownCodecError (a ValueError) or FFmpegError depending on version
        log.warning("libx264 encoder not available in this FFmpeg build; writing MPEG-4 Part 2 video")
        return "mpeg4"


class Mp4Writer:
    """An MP4 file with one H.264 video track and one AAC mono audio track.

    ``with Mp4Writer(path, width, height) as w: w.write_frames(frames); w.write_audio(samples)``.
    Frames are uint8 [T, H, W, 3] RGB (torch or numpy); audio is float32 mono in [-1, 1] at
    ``sample_rate``. Calls may alternate in any order and any sizes. ``close()`` flushes both
    encoders and finalises the file; it is idempotent.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        width: int,
        height: int,
        fps: int = 24,
        sample_rate: int = AUDIO_SAMPLE_RATE,
        *,
        crf: int = 20,
        preset: str = "veryfast",
    ) -> None:
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise ValueError(f"width and height must be positive and even for yuv420p, got {width}x{height}")
        if fps <= 0 or sample_rate <= 0:
            raise ValueError(f"fps and sample_rate must be positive, got {fps}, {sample_rate}")
        self.path, self.width, self.height = str(path), width, height
        self.fps, self.sample_rate = fps, sample_rate
        self.frames_written = 0
        self.samples_written = 0
        self._pending = np.zeros(0, np.float32)
        self._closed = False
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise InputError(f"cannot write {self.path}: directory {parent} does not exist")
        self._container = av.open(self.path, mode="w", format="mp4")
        try:
            codec = _video_codec()
            self.video_codec = codec
            v = self._container.add_stream(codec, rate=Fraction(fps))
            v.width, v.height, v.pix_fmt = width, height, "yuv420p"
            v.time_base = Fraction(1, fps)
            if codec == "libx264":
                v.options = {"crf": str(crf), "preset": preset}
            else:
                v.bit_rate = max(1_000_000, int(width * height * fps * 0.2))
            a = self._container.add_stream("aac", rate=sample_rate)
            a.layout = "mono"
            a.time_base = Fraction(1, sample_rate)
            self._v, self._a = v, a
            self._container.start_encoding()  # open the file and codecs now: fail here, not mid-stream
        except OSError as e:  # av.error.PermissionError etc. subclass OSError
            self._close_quietly()
            raise InputError(f"cannot write {self.path}: {' '.join(str(e).split())}") from None
        except BaseException:
            self._close_quietly()
            raise

    # ---- writing -------------------------------------------------------------------------------
    def write_frames(self, frames: torch.Tensor | np.ndarray) -> None:
        """Encode uint8 RGB frames [T, H, W, 3] (a single [H, W, 3] frame is accepted too)."""
        self._check_open()
        arr = frames.detach().cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4 or arr.shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"frames must be [T, {self.height}, {self.width}, 3], got {tuple(arr.shape)}")
        if arr.dtype != np.uint8:
            raise ValueError(f"frames must be uint8, got {arr.dtype}")
        for img in arr:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            frame.pts = self.frames_written
            frame.time_base = Fraction(1, self.fps)
            self._container.mux(self._v.encode(frame))
            self.frames_written += 1

    def write_audio(self, samples: torch.Tensor | np.ndarray) -> None:
        """Encode float32 mono samples in [-1, 1] (values outside are clipped)."""
        self._check_open()
        arr = (
            samples.detach().cpu().float().numpy()
            if isinstance(samples, torch.Tensor)
            else np.asarray(samples, np.float32)
        )
        if arr.ndim != 1:
            raise ValueError(f"audio must be mono [samples], got shape {tuple(arr.shape)}")
        buf = np.concatenate([self._pending, np.clip(arr.astype(np.float32, copy=False), -1.0, 1.0)])
        full = buf.shape[0] // AAC_FRAME * AAC_FRAME
        for start in range(0, full, AAC_FRAME):
            self._encode_audio(buf[start : start + AAC_FRAME])
        self._pending = buf[full:].copy()

    def close(self) -> None:
        """Flush the held audio and both encoders, write the trailer. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending.size:
                self._encode_audio(self._pending)  # AAC accepts a short last frame
                self._pending = np.zeros(0, np.float32)
            self._container.mux(self._v.encode(None))
            self._container.mux(self._a.encode(None))
        finally:
            self._container.close()

    # ---- context manager -----------------------------------------------------------------------
    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # finish the file if we can, but never mask the original error
            try:
                self.close()
            except Exception:
                log.debug("error while closing %s after a failure", self.path, exc_info=True)

    # ---- helpers -------------------------------------------------------------------------------
    @property
    def seconds(self) -> float:
        """Duration of the video written so far."""
        return self.frames_written / self.fps

    def _encode_audio(self, chunk: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(chunk.reshape(1, -1)), format="fltp", layout="mono"
        )
        frame.sample_rate = self.sample_rate
        frame.pts = self.samples_written
        frame.time_base = Fraction(1, self.sample_rate)
        self._container.mux(self._a.encode(frame))
        self.samples_written += chunk.shape[0]

    def _close_quietly(self) -> None:
        self._closed = True
        try:
            self._container.close()
        except Exception:
            log.debug("error while closing %s", self.path, exc_info=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Mp4Writer for {self.path} is closed")
