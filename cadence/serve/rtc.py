"""WebRTC adapters (aiortc): the two outgoing tracks, the microphone reader, the loopback ICE switch.

The tracks only pace and stamp: frame/audio *selection* is ``AVBuffer``'s, timing is
``pacing.next_video_frame`` / ``next_audio_frame`` on the session's shared :class:`MediaClock`.
Whichever track the sender asks first starts the clock, so both start together. A track receives what
it reads (a :class:`MediaFeed`), not the session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from cadence.serve.pacing import (
    VIDEO_CLOCK_RATE,
    AVBuffer,
    MediaTiming,
    next_audio_frame,
    next_video_frame,
    to_s16,
)


class MediaClock:
    """The session's media clock: ``t0`` (host monotonic seconds) is set once, by the first track."""

    def __init__(self, now: Callable[[], float] = time.monotonic):
        self.now = now
        self.t0: float | None = None
        self.started = asyncio.Event()

    def start(self) -> float:
        if self.t0 is None:
            self.t0 = self.now()
            self.started.set()
        return self.t0


@dataclass
class MediaFeed:
    """What the two outgoing tracks read and whom they tell: the chunk store, the shared clock and its
    arithmetic, the event that says the first chunk is here (the clock waits for it, at most
    ``clock_start_timeout_s``), and the hooks each sent frame is reported to
    (``on_video_frame(k, fresh, skipped, now)``, ``on_audio_frame(n, complete, skipped, now)``)."""

    buffer: AVBuffer
    clock: MediaClock
    timing: MediaTiming
    first_chunk: asyncio.Event
    clock_start_timeout_s: float
    on_video_frame: Callable[[int, bool, int, float], None]
    on_audio_frame: Callable[[int, bool, int, float], None]


class _PacedTrack(MediaStreamTrack):
    def __init__(self, feed: MediaFeed):
        super().__init__()
        self.feed = feed
        self.next_index = 0

    async def _t0(self) -> float:
        """The media clock's start; the first caller waits (bounded by ``clock_start_timeout_s``) for the
        session's first chunk, so the clock never starts behind a slow first chunk."""
        feed = self.feed
        clock = feed.clock
        if clock.t0 is None:
            if not feed.first_chunk.is_set() and feed.clock_start_timeout_s > 0:
                w = asyncio.ensure_future(feed.first_chunk.wait())
                try:  # asyncio.wait, not wait_for: a cancellation always gets through (see session.py)
                    await asyncio.wait({w}, timeout=feed.clock_start_timeout_s)
                finally:
                    w.cancel()
            if self.readyState != "live":
                raise MediaStreamError
        return clock.start()

    async def _wait(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)
        if self.readyState != "live":
            raise MediaStreamError


class VideoOut(_PacedTrack):
    """Video at the model's fps, pts = k * 90000 / fps in 1/90000 (3750 at 24 fps).

    Over WebRTC (``recv``) only fresh frames are sent: a frame held on underrun (the last one again) is not
    encoded and sent a second time, its pts is skipped, and the receiver keeps showing the frame it has,
    which is what a held frame looks like anyway. So every frame a browser decodes is a new one: its decoded
    frame rate is the fresh frame rate, and no encoder spends CPU re-encoding a picture the viewer already
    sees (a video codec re-encoding a repeated picture refines it, so a repeat would not even decode to the
    same pixels: a receiver could not tell it from a fresh frame, docs/perf/soak/NOTES.md). Underruns are
    counted as before (``on_video_frame`` sees every paced frame). An in-process reader (``next_frame``)
    still gets one frame per frame period, held ones included."""

    kind = "video"
    last_fresh = False  # whether the frame ``next_frame`` returned last was fresh (generated, not held)

    async def next_frame(self) -> tuple[int, np.ndarray]:
        """The next frame when it is due: ``(k, uint8 [H, W, 3])``, held or fresh (``last_fresh`` says
        which). ``recv`` wraps it for WebRTC; an in-process reader (``cadence.integrations.pipecat``) takes
        the array as it is."""
        if self.readyState != "live":
            raise MediaStreamError
        feed, clock, timing = self.feed, self.feed.clock, self.feed.timing
        t0 = await self._t0()
        k, wait, skipped = next_video_frame(self.next_index, clock.now(), t0, timing)
        await self._wait(wait)
        frame, fresh = feed.buffer.video_frame(k)
        self.next_index = k + 1
        self.last_fresh = fresh
        feed.on_video_frame(k, fresh, skipped, clock.now())
        return k, frame

    async def recv(self) -> av.VideoFrame:
        k, frame = await self.next_frame()
        while not self.last_fresh:  # held: the receiver shows the last frame it has; wait for a fresh one
            k, frame = await self.next_frame()
        out = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        out.pts = self.feed.timing.video_pts(k)
        out.time_base = Fraction(1, VIDEO_CLOCK_RATE)
        return out


class AudioOut(_PacedTrack):
    """20 ms frames of 48 kHz mono s16, pts = n * 960 in 1/48000; silence on underrun."""

    kind = "audio"

    async def next_samples(self) -> tuple[int, np.ndarray]:
        """The next 20 ms when it is due: ``(n, float32 [960])`` (see ``VideoOut.next_frame``)."""
        if self.readyState != "live":
            raise MediaStreamError
        feed, clock, timing = self.feed, self.feed.clock, self.feed.timing
        t0 = await self._t0()
        n, wait, skipped = next_audio_frame(self.next_index, clock.now(), t0, timing)
        await self._wait(wait)
        samples, complete = feed.buffer.audio_frame(n)
        self.next_index = n + 1
        feed.on_audio_frame(n, complete, skipped, clock.now())
        return n, samples

    async def recv(self) -> av.AudioFrame:
        n, samples = await self.next_samples()
        timing = self.feed.timing
        pcm = to_s16(samples)
        out = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        out.sample_rate = timing.sample_rate
        out.pts = timing.audio_pts(n)
        out.time_base = Fraction(1, timing.sample_rate)
        return out


async def consume_microphone(
    track: MediaStreamTrack,
    on_samples: Callable[[np.ndarray], None],
    on_error: Callable[[str], None],
    sample_rate: int = 48_000,
) -> None:
    """Read the browser's audio track: any rate/layout/format -> float32 mono ``sample_rate``."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    errors = 0
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if not isinstance(frame, av.AudioFrame):
            on_error(f"expected audio frames on the audio track, got {type(frame).__name__}")
            return
        try:
            for out in resampler.resample(frame):
                on_samples(out.to_ndarray().reshape(-1).astype(np.float32, copy=False))
        except (ValueError, av.error.FFmpegError) as e:  # a format the resampler refuses: count, go on
            errors += 1
            if errors == 1 or errors % 100 == 0:
                on_error(f"could not resample microphone audio ({errors} frames): {e}")


# ---- loopback ICE ----------------------------------------------------------------------------------

_ORIGINAL_HOST_ADDRESSES = None


def use_ice_host_addresses(addresses: Sequence[str] | None) -> None:
    """Make aioice gather host candidates on exactly ``addresses`` (None: its own discovery).

    aioice 0.x has no option for this and its discovery (``aioice.ice.get_host_addresses``) drops
    127.0.0.1, so a loopback-only server or test would offer no usable candidate. We replace that
    module-level function (the one place aioice looks addresses up); process-wide, reversible.
    With ``["127.0.0.1"]`` every candidate and every packet stays on the loopback interface.
    """
    import aioice.ice

    global _ORIGINAL_HOST_ADDRESSES
    if _ORIGINAL_HOST_ADDRESSES is None:
        _ORIGINAL_HOST_ADDRESSES = aioice.ice.get_host_addresses
    if addresses is None:
        aioice.ice.get_host_addresses = _ORIGINAL_HOST_ADDRESSES
        return
    fixed = list(addresses)

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [a for a in fixed if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]

    aioice.ice.get_host_addresses = get_host_addresses


def rtc_configuration():
    """No STUN/TURN servers: host candidates only (loopback or LAN); nothing contacts the internet."""
    from aiortc import RTCConfiguration

    return RTCConfiguration(iceServers=[])


__all__ = [
    "AudioOut",
    "MediaClock",
    "MediaFeed",
    "MediaTiming",
    "VideoOut",
    "consume_microphone",
    "rtc_configuration",
    "use_ice_host_addresses",
]


#: The video codecs the server can send (aiortc's encoders: libvpx VP8, libx264 H.264); the offer's
#: order decides (a client prefers one with ``RTCRtpTransceiver.setCodecPreferences``).
VIDEO_CODECS = ("VP8", "H264")


def negotiated_codecs(sdp: str) -> dict[str, str]:
    """The codec each media section of an SDP answer settled on: the first payload type on its ``m=``
    line, named by its ``a=rtpmap`` (e.g. ``{"video": "H264", "audio": "opus"}``). Pure text parsing."""
    out: dict[str, str] = {}
    kind, first, names = None, None, {}

    def flush():
        if kind is not None and first is not None and first in names and kind not in out:
            out[kind] = names[first]

    for line in sdp.splitlines():
        line = line.strip()
        if line.startswith("m="):
            flush()
            parts = line[2:].split()
            kind, first, names = parts[0], (parts[3] if len(parts) > 3 else None), {}
        elif line.startswith("a=rtpmap:") and kind is not None:
            pt, _, enc = line[len("a=rtpmap:") :].partition(" ")
            names[pt] = enc.split("/")[0]
    flush()
    return out
