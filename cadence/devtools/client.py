"""A Python WebRTC client of ``cadence serve`` (aiortc): the tests' and ``cadence bench serve``'s.

It offers what the page offers (a recvonly video transceiver and a sendrecv audio transceiver
carrying a microphone track), posts the offer (with the operator key when the server needs one),
receives the character for ``seconds`` and records every frame's arrival time and pts, then closes the
session and the connection. Every request on the session carries the token the server returned
(``Authorization: Bearer``), as the page does.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
from aiortc import RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from cadence.serve.pacing import to_s16
from cadence.serve.rtc import negotiated_codecs, rtc_configuration


class MicTrack(MediaStreamTrack):
    """A microphone stand-in: 20 ms frames of 48 kHz mono s16, paced in real time, from ``samples``
    (looped), or from ``source(n)`` (up to ``n`` samples; fewer are padded with silence: a live queue, as
    ``cadence.integrations.pipecat`` sends its TTS speech), else silence."""

    kind = "audio"

    def __init__(self, samples: np.ndarray | None = None, sample_rate: int = 48_000, source=None):
        super().__init__()
        self.samples = None if samples is None else np.asarray(samples, np.float32)
        self.source = source
        self.rate = sample_rate
        self.n = 0
        self.t0: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        size = self.rate // 50
        if self.t0 is None:
            self.t0 = time.monotonic()
        wait = self.t0 + self.n * 0.02 - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if self.source is not None:
            chunk = np.zeros(size, np.float32)
            got = self.source(size)
            chunk[: got.size] = got
        elif self.samples is None or self.samples.size == 0:
            chunk = np.zeros(size, np.float32)
        else:
            idx = (np.arange(size) + self.n * size) % self.samples.size
            chunk = self.samples[idx]
        frame = av.AudioFrame.from_ndarray(to_s16(chunk).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self.n * size
        frame.time_base = Fraction(1, self.rate)
        self.n += 1
        return frame


def frame_digest(frame: av.VideoFrame) -> int:
    """A checksum of a decoded frame's pixels (its planes without their padding): two frames differ in
    pixels when their digests differ (up to a 2^-32 collision)."""
    return zlib.crc32(np.ascontiguousarray(frame.to_ndarray()))


def frame_blank(frame: av.VideoFrame, max_std: float = 2.0) -> bool:
    """Whether a decoded frame shows nothing: its brightness one value (within the codec's noise), as a
    black frame does (what a NaN in the model decodes to, issue 39). A face never is."""
    plane = frame.to_ndarray(format="gray")
    return float(plane.std()) < max_std


@dataclass
class ClientResult:
    session_id: str = ""
    token: str = ""  # the session's token (POST /sessions' answer)
    status_code: int = 0
    error: str | None = None
    t_post: float = 0.0
    video: list[tuple[float, int]] = field(default_factory=list)  # (arrival monotonic, pts)
    video_time_base: Fraction | None = None
    video_size: tuple[int, int] | None = None
    audio: list[tuple[float, int, int, int]] = field(default_factory=list)  # (arrival, pts, samples, rate)
    status: dict = field(default_factory=dict)  # GET /sessions/{id} just before closing
    report: dict = field(default_factory=dict)  # DELETE's answer
    audio_rms: list[float] = field(default_factory=list)  # RMS (of [-1, 1]) of each received audio frame
    mic_t0: float | None = None  # when the microphone's first frame was sent (its sample 0)
    pushed_audio_at: float | None = None
    codecs: dict = field(default_factory=dict)  # what the server's answer settled on, per media kind
    # per received video frame (parallel to ``video``): whether its pixels differ from the frame before it
    video_fresh: list[bool] = field(default_factory=list)
    t_end: float | None = None  # when the client stopped watching (before it closed or left the session)

    @property
    def ttff_ms(self) -> float | None:
        return (self.video[0][0] - self.t_post) * 1e3 if self.video else None

    def _after(self, skip_s: float, edge_s: float = 1.0) -> list[tuple[float, int]]:
        """The received (arrival, pts) after the first ``skip_s`` seconds, trimmed to two well-timed ends;
        empty when there are too few frames to give a rate (under 3 in all, under 2 left, no time between).

        A frame's arrival is its send time plus a delay that is never below the path's minimum; a stall
        of the receiving process (on a 2-core machine it shares the cores with the server) only adds
        delay, and the frames behind it then arrive in a burst. A rate measured from whichever frames
        happen to be first and last is off by as much as such a stall (0.4 s in 3.5 s is 13%). So each
        end is the frame with the least arrival - pts offset (the least delayed one) among the first
        and among the last ``edge_s`` seconds (a third of the window when that is shorter); among
        equally early frames (within 1 ms) the outermost one, so a clean stream keeps its whole window.
        """
        if len(self.video) < 3:
            return []
        t_first = self.video[0][0] + skip_s
        win = [(t, pts) for t, pts in self.video if t >= t_first]
        if len(win) < 2 or win[-1][0] <= win[0][0]:
            return []
        tb = float(self.video_time_base or Fraction(1, 90000))
        edge = min(edge_s, (win[-1][0] - win[0][0]) / 3)
        offset = [t - pts * tb for t, pts in win]
        head = [i for i, (t, _) in enumerate(win) if t <= win[0][0] + edge]
        tail = [i for i, (t, _) in enumerate(win) if t >= win[-1][0] - edge]
        lo_head = min(offset[i] for i in head)
        lo_tail = min(offset[i] for i in tail)
        a = next(i for i in head if offset[i] <= lo_head + 1e-3)
        b = next(i for i in reversed(tail) if offset[i] <= lo_tail + 1e-3)
        return win[a : b + 1] if b > a and win[b][0] > win[a][0] else []

    def video_fps(self, skip_s: float = 0.5) -> float:
        """Frames per second received, after the first ``skip_s`` seconds of the stream (between the
        least delayed frames near its two ends: see ``_after``)."""
        win = self._after(skip_s)
        return (len(win) - 1) / (win[-1][0] - win[0][0]) if win else 0.0

    def media_fps(self, step: int, skip_s: float = 0.5) -> float:
        """Frame periods of stream time per wall second, after the first ``skip_s`` seconds.

        Counts the frames the received pts jump over as well as the received ones (``step`` is the
        frame period in pts ticks, 3,750 at 24 fps in 1/90000): the rate the server's media clock
        ran at, as seen by the client. It equals ``video_fps`` unless the server's pacer skipped
        frames after a stall (see ``pts_gaps``), which a test bounds separately. Measured between the
        least delayed frames near the two ends (see ``_after``), so a stall of the client is not
        read as a fast or slow server clock.
        """
        win = self._after(skip_s)
        return (win[-1][1] - win[0][1]) / step / (win[-1][0] - win[0][0]) if win else 0.0

    def fresh(self, step: int, guard_s: float = 0.1) -> tuple[int, float, list[int]]:
        """Fresh frames as a viewer sees them: ``(fresh, seconds, per_second)``.

        A frame is fresh when its pixels differ from the frame received before it and it is not blank
        (``video_fresh``; the first frame is, unless blank). They are counted in stream time, from the first frame's pts, over the ``seconds`` the
        client watched (first frame's arrival to ``t_end``, less ``guard_s`` for the frames still on their
        way): frames the server never sent (held on underrun, skipped after a stall: pts jumps) count as the
        stale seconds they are, and a burst after a stall of the receiving process counts at its own pts, not
        its arrival. ``per_second``: fresh frames in each whole second of that span. ``step``: the frame
        period in pts ticks (3,750 at 24 fps in 1/90000)."""
        if not self.video or self.t_end is None:
            return 0, 0.0, []
        seconds = self.t_end - self.video[0][0] - guard_s
        if seconds <= 0:
            return 0, 0.0, []
        p0 = self.video[0][1]
        fps = round(1 / (step * (self.video_time_base or Fraction(1, 90000))))  # frames per second, exactly
        frames = max(1, round(seconds * fps))
        per = [0] * int(seconds + 1e-6)  # whole seconds (1e-6: 4.1 - 0.1 is 3.9999...)
        n = 0
        for (_, pts), new in zip(self.video, self.video_fresh or [True] * len(self.video)):
            k = round((pts - p0) / step)
            if new and 0 <= k < frames:
                n += 1
                if k // fps < len(per):
                    per[k // fps] += 1
        return n, seconds, per

    def fresh_fps(self, step: int, guard_s: float = 0.1) -> float:
        """Fresh frames per second of the stream the client watched (see ``fresh``)."""
        n, seconds, _ = self.fresh(step, guard_s)
        return n / seconds if seconds > 0 else 0.0

    def pts_steps(self) -> list[int]:
        p = [pts for _, pts in self.video]
        return [b - a for a, b in itertools.pairwise(p)]

    def pts_gaps(self, step: int, tol: int = 1) -> tuple[list[int], int]:
        """Check the video pts against the frame period ``step`` (3,750 at 24 fps in 1/90000).

        Returns ``(bad_steps, missing)``: the pts steps that are not a whole number of frame periods
        (within ``tol`` ticks: the decoder rounds), and how many frame periods the received pts jump
        over. A jump is legitimate only when the server's pacer skipped those frames (a stalled
        sender jumps to the frame due now, counted as ``video_frames_skipped`` in the session's
        report); any other missing frame was lost on the way.
        """
        bad, missing = [], 0
        for s in self.pts_steps():
            m = max(1, round(s / step))
            if abs(s - m * step) > tol:
                bad.append(s)
            missing += m - 1
        return bad, missing

    @property
    def audio_seconds(self) -> float:
        return sum(n / r for _, _, n, r in self.audio if r)


async def read_track(track: MediaStreamTrack, res: ClientResult, first_frame: asyncio.Event) -> None:
    """Receive a track into ``res`` until it ends: each video frame's arrival, pts and whether it is fresh (its
    pixels differ from the frame before, and it is not blank: ``frame_blank``; ``first_frame`` set at the
    first), each audio frame's arrival, pts, size and RMS."""
    last = None
    while True:
        try:
            f = await track.recv()
        except MediaStreamError:
            return
        if track.kind == "video":
            res.video.append((time.monotonic(), int(f.pts)))
            digest = frame_digest(f)
            res.video_fresh.append(digest != last and not frame_blank(f))  # what the viewer sees: new, a face
            last = digest
            res.video_time_base = f.time_base
            res.video_size = (f.width, f.height)
            first_frame.set()
        else:
            res.audio.append((time.monotonic(), int(f.pts or 0), f.samples, f.sample_rate))
            pcm = f.to_ndarray().astype(np.float32) / 32768.0
            res.audio_rms.append(float(np.sqrt(np.mean(pcm * pcm))) if pcm.size else 0.0)


async def run_client(
    url: str,
    seconds: float,
    *,
    agent: str = "mirror",
    http=None,
    mic: np.ndarray | None = None,
    speak_wav: bytes | None = None,
    speak_after_s: float = 0.5,
    speak_every_s: float = 0.0,
    speak_jitter_s: float = 0.0,
    image: bytes | None = None,
    connect_timeout: float = 30.0,
    close: bool = True,
    video_codec: str | None = None,
    api_key: str | None = None,
    created: dict | None = None,
) -> ClientResult:
    """One session against ``url`` for ``seconds`` after its first frame. ``speak_wav`` is pushed
    ``speak_after_s`` after the first frame, and again every ``speak_every_s`` seconds (> 0) while the
    session runs (each push is one agent segment: one speech -> frame latency sample), plus a uniform
    random 0..``speak_jitter_s`` (seeded) so the pushes land at different phases of the chunk clock
    (with a period that is a multiple of the chunk length every sample would see the same phase).
    ``video_codec`` ('VP8' or 'H264'): offer only that video codec (``setCodecPreferences``), as a
    browser that prefers it would; default: aiortc's order (VP8 first). ``api_key``: the server's operator
    key, sent with the POST that creates the session. ``created``: a dict that gets the session's
    ``session_id`` and ``token`` as soon as the server answers (for a caller watching the session
    meanwhile: a test, ``cadence bench serve``'s progress lines)."""
    import httpx

    res = ClientResult()
    own_http = http is None
    http = http or httpx.AsyncClient(timeout=60.0)
    pc = RTCPeerConnection(rtc_configuration())
    readers: list[asyncio.Task] = []
    first_frame = asyncio.Event()

    @pc.on("track")
    def on_track(track):
        readers.append(asyncio.ensure_future(read_track(track, res, first_frame)))

    mic_track = MicTrack(mic)
    try:
        video = pc.addTransceiver("video", direction="recvonly")
        if video_codec is not None:
            caps = [
                c
                for c in RTCRtpReceiver.getCapabilities("video").codecs
                if c.mimeType.lower() in (f"video/{video_codec.lower()}", "video/rtx")
            ]
            if not any(c.mimeType.lower() != "video/rtx" for c in caps):
                raise ValueError(f"this aiortc cannot receive {video_codec!r} video")
            video.setCodecPreferences(caps)
        pc.addTransceiver(mic_track, direction="sendrecv")
        await pc.setLocalDescription(await pc.createOffer())
        res.t_post = time.monotonic()
        key = {"authorization": f"Bearer {api_key}"} if api_key else {}
        if image is not None:
            r = await http.post(
                f"{url}/sessions",
                data={"sdp": pc.localDescription.sdp, "type": "offer", "agent": agent},
                files={"image": ("face.png", image)},
                headers=key,
            )
        else:
            r = await http.post(
                f"{url}/sessions",
                json={"sdp": pc.localDescription.sdp, "type": "offer", "agent": agent},
                headers=key,
            )
        res.status_code = r.status_code
        if r.status_code != 201:
            res.error = (
                r.json().get("error", r.text)
                if r.headers.get("content-type", "").startswith("application/json")
                else r.text
            )
            return res
        body = r.json()
        res.session_id, res.token = body["session_id"], body["token"]
        auth = {"authorization": f"Bearer {res.token}"}
        if created is not None:
            created.update(session_id=res.session_id, token=res.token)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type=body["type"]))
        res.codecs = negotiated_codecs(body["sdp"])
        try:
            await asyncio.wait_for(first_frame.wait(), timeout=connect_timeout)
        except TimeoutError:
            res.error = f"no video within {connect_timeout:.0f} s (connection {pc.connectionState})"
            return res
        t_end = time.monotonic() + seconds
        if speak_wav is not None:
            import random

            rng = random.Random(0)
            await asyncio.sleep(speak_after_s)
            while res.error is None:
                res.pushed_audio_at = time.monotonic()
                r = await http.post(
                    f"{url}/sessions/{res.session_id}/audio",
                    content=speak_wav,
                    headers={"content-type": "audio/wav", **auth},
                )
                if r.status_code != 200:
                    res.error = f"POST audio: {r.status_code} {r.text}"
                if speak_every_s <= 0 or time.monotonic() + speak_every_s > t_end - 0.5:
                    break
                await asyncio.sleep(
                    max(
                        0.0,
                        res.pushed_audio_at
                        + speak_every_s
                        + rng.uniform(0.0, speak_jitter_s)
                        - time.monotonic(),
                    )
                )
        await asyncio.sleep(max(0.0, t_end - time.monotonic()))
        res.t_end = time.monotonic()
        r = await http.get(f"{url}/sessions/{res.session_id}", headers=auth)
        res.status = r.json()
        if close:
            r = await http.delete(f"{url}/sessions/{res.session_id}", headers=auth)
            res.report = r.json()
        return res
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    finally:
        res.mic_t0 = mic_track.t0
        mic_track.stop()
        await pc.close()
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        if own_http:
            await http.aclose()
