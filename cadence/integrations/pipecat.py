"""Cadence as a Pipecat video service: the bot's TTS audio in, the character's video and voice out, in sync.

Put :class:`CadenceVideoService` after the TTS service and before the output transport, as Pipecat's
other avatar services (Simli, Tavus, HeyGen) go::

    pipeline = Pipeline([transport.input(), vad, stt, llm, tts, CadenceVideoService(), transport.output()])

It takes the ``TTSAudioRawFrame`` s the TTS makes (any sample rate), hands them to a Cadence session as
the character's speech, and emits, paced on the session's media clock at the model's fps (24), the
character's frames (``OutputImageRawFrame``, RGB) and the same speech, delayed by exactly what the
video is delayed by (``TTSAudioRawFrame`` at 48 kHz mono): the transport receives them together, so
the mouth moves with the voice. While nobody speaks, frames keep coming (the model's idle motion: it
is never a held frame); no audio is emitted then, so Pipecat's "bot speaking" state stays right.

Interruptions: on an ``InterruptionFrame`` (the user barged in) the queued speech is dropped and the
speech already planned into chunks not yet played is silenced, so the character is back to listening
within the chunks in flight (one chunk plus the worker's latency). The frame goes on downstream.

Two ways to run the engine:

* **In process** (default; ``serve_config=ServeConfig(...)``): the service starts Cadence's session
  manager in this process (its worker groups are child processes, as in ``cadence serve``; the same
  engine, warm-up and scheduler) and reads the session's paced tracks directly: no WebRTC hop, no
  extra encode.
* **Remote** (``url="http://host:8000"``): the service is a WebRTC client of a running
  ``cadence serve`` through its documented HTTP API (version :data:`API_VERSION`, checked at start on
  ``/config``): it opens a session with the ``mirror`` agent, sends the TTS audio as the microphone
  track (paced in real time), receives the character's video and audio tracks, and calls
  ``POST /sessions/{id}/interrupt`` on barge-in. Costs: one video encode/decode per frame and a WebRTC
  jitter buffer (tens of ms) more than in process.

Pipecat is an optional extra: ``pip install 'cadence[pipecat]'``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from fractions import Fraction

import numpy as np

try:
    from pipecat.frames.frames import (
        CancelFrame,
        EndFrame,
        Frame,
        InterruptionFrame,
        OutputImageRawFrame,
        StartFrame,
        TTSAudioRawFrame,
        TTSStartedFrame,
    )
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
except ModuleNotFoundError as e:  # pragma: no cover - the extra is missing
    raise ModuleNotFoundError(
        f"cadence.integrations.pipecat needs Pipecat ({e.name} is missing): pip install 'cadence[pipecat]'"
    ) from e

from cadence.serve.agent import SAMPLE_RATE, Agent, SampleQueue

log = logging.getLogger("cadence.pipecat")

#: The ``cadence serve`` API version the remote mode speaks (``/config``'s ``api_version``).
API_VERSION = 1
#: A received 20 ms audio frame quieter than this (RMS of [-1, 1]) is not speech (not emitted).
SILENCE_RMS = 1e-4
#: Quiet inside an utterance shorter than this is emitted (the pauses between words); longer quiet is not
#: speech: nothing is emitted, so Pipecat's "bot speaking" state ends.
PAUSE_S = 0.4


class SpeechAgent(Agent):
    """The session's agent in process: its speech is what the Pipecat pipeline's TTS said (``speak``)."""

    name = "pipecat"


class _Resampler:
    """Any-rate s16 PCM (mono or interleaved) -> 48 kHz mono float32, through PyAV (FFmpeg's swresample)."""

    def __init__(self):
        self._r = None
        self._key = None

    def __call__(self, pcm: bytes, rate: int, channels: int) -> np.ndarray:
        import av

        if self._key != (rate, channels):
            self._r = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            self._key = (rate, channels)
        a = np.frombuffer(pcm, np.int16)
        if a.size == 0:
            return np.zeros(0, np.float32)
        layout = "mono" if channels == 1 else "stereo"
        f = av.AudioFrame.from_ndarray(a.reshape(1, -1), format="s16", layout=layout)
        f.sample_rate = rate
        out = [o.to_ndarray().reshape(-1) for o in self._r.resample(f)]
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def _s16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class CadenceVideoService(FrameProcessor):
    """The character's video (and its voice, in sync) from the bot's TTS audio; see the module doc.

    Args:
        serve_config: in-process mode: the engine to run (``cadence.serve.config.ServeConfig``; default:
            the shipped ``character`` preset on the CPU, one worker group).
        session_manager: in-process mode, shared: a started ``cadence.serve.manager.SessionManager`` (warm
            workers kept across conversations: an app serving many calls starts one at startup); the
            service opens its session there and leaves the manager running.
        url: remote mode: a running ``cadence serve`` (``http://127.0.0.1:8000``) instead.
        image: the reference face (image file bytes); None: the preset's default face.
        prompt: the text prompt; None: the server's default.
        seed: the session's noise seed.
        api_key: remote mode: the server's operator key, if it has one.
        sync_with_audio: mark every frame ``sync_with_audio`` (Pipecat's output transport then shows it
            only once the audio before it has been sent: frames and voice leave the transport together,
            whatever its audio buffering). Use with ``TransportParams(video_out_is_live=False)``, whose
            video task sends the latest frame at ``video_out_framerate``. False: frames go to the
            transport's live video queue as they come (``video_out_is_live=True``).
    """

    def __init__(
        self,
        *,
        serve_config=None,
        session_manager=None,
        url: str | None = None,
        image: bytes | None = None,
        prompt: str | None = None,
        seed: int = 0,
        api_key: str | None = None,
        sync_with_audio: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if sum(x is not None for x in (serve_config, session_manager, url)) > 1:
            raise ValueError("give one of serve_config, session_manager (in process) or url (remote)")
        self._backend = (
            _Remote(url, image, prompt, seed, api_key)
            if url is not None
            else _Local(serve_config, image, prompt, seed, session_manager)
        )
        self.sync_with_audio = sync_with_audio
        self._resample = _Resampler()
        self._new_segment = True
        self._cut = False
        self._tasks: list[asyncio.Task] = []
        self.frames_out = 0  # video frames emitted
        self.audio_out_s = 0.0  # seconds of audio emitted (speech and the pauses inside it)
        self.voiced_out_s = 0.0  # of which voiced (RMS > SILENCE_RMS)
        self.interruptions = 0
        self.segment_times: list[float] = []  # when each utterance's first TTS audio arrived (monotonic)
        # when each stretch of speech's first voiced 20 ms left the service (monotonic)
        self.voice_out_times: list[float] = []

    @property
    def width(self) -> int | None:
        return self._backend.width

    @property
    def height(self) -> int | None:
        return self._backend.height

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            # the session first (the worker is warm and the session open when the pipeline has started),
            # then the StartFrame downstream, then the pumps (a processor drops frames before its start)
            try:
                await self._backend.start()
            except Exception as e:  # no engine, no session (a full server, a refused offer): one clear error
                await self.push_frame(frame, direction)
                await self.push_error(
                    f"Cadence could not open a session: {type(e).__name__}: {e}",
                    exception=e,
                    force_treat_as_permanent=True,
                )
                return
            await self.push_frame(frame, direction)
            self._tasks = [
                self.create_task(self._pump_video(), "cadence-video"),
                self.create_task(self._pump_audio(), "cadence-audio"),
            ]
            return
        if isinstance(frame, (EndFrame, CancelFrame)):
            await self._stop()
            await self.push_frame(frame, direction)
            return
        if isinstance(frame, TTSAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
            samples = self._resample(frame.audio, frame.sample_rate, frame.num_channels)
            if self._new_segment:
                self.segment_times.append(time.monotonic())
            self._backend.speak(samples, self._new_segment)
            self._new_segment = False
            return  # the character's own audio (in sync with its frames) goes out instead
        if isinstance(frame, TTSStartedFrame):
            self._new_segment = True
        elif isinstance(frame, InterruptionFrame):
            self.interruptions += 1
            self._new_segment = self._cut = True
            await self._backend.interrupt()
        await self.push_frame(frame, direction)

    async def _stop(self) -> None:
        for t in self._tasks:
            await self.cancel_task(t)
        self._tasks = []
        await self._backend.stop()

    async def cleanup(self):
        await super().cleanup()
        await self._stop()

    async def _pump_video(self) -> None:
        while True:
            rgb = await self._backend.next_video()
            if rgb is None:
                return
            h, w = rgb.shape[:2]
            out = OutputImageRawFrame(image=rgb.tobytes(), size=(w, h), format="RGB")
            out.sync_with_audio = self.sync_with_audio
            await self.push_frame(out)
            self.frames_out += 1

    async def _pump_audio(self) -> None:
        quiet_for = float("inf")  # seconds since the last voiced frame
        while True:
            pcm = await self._backend.next_audio()  # 20 ms, 48 kHz mono float32
            if pcm is None:
                return
            voiced = float(np.sqrt(np.mean(pcm * pcm))) > SILENCE_RMS
            if self._cut:  # interrupted: no trailing pause
                self._cut, quiet_for = False, float("inf")
            if voiced and quiet_for > PAUSE_S:
                self.voice_out_times.append(time.monotonic())
            quiet_for = 0.0 if voiced else quiet_for + pcm.size / SAMPLE_RATE
            if quiet_for <= PAUSE_S:  # speech, and the pauses inside it (not the silence between turns)
                await self.push_frame(
                    TTSAudioRawFrame(audio=_s16(pcm), sample_rate=SAMPLE_RATE, num_channels=1)
                )
                self.audio_out_s += pcm.size / SAMPLE_RATE
                if voiced:
                    self.voiced_out_s += pcm.size / SAMPLE_RATE

    def report(self) -> dict | None:
        """The Cadence session's report (in process: the live one; remote: after the stop)."""
        return self._backend.report()


# ---- in process ----------------------------------------------------------------------------------------


class _Local:
    def __init__(self, cfg, image: bytes | None, prompt: str | None, seed: int, manager=None):
        from cadence.serve.config import DEFAULT_PROMPT, ServeConfig

        self.cfg = manager.cfg if manager is not None else (cfg or ServeConfig())
        self.image, self.prompt, self.seed = image, prompt or DEFAULT_PROMPT, seed
        self.mgr = manager
        self.own_mgr = manager is None
        self.sess = None
        self.agent = SpeechAgent()
        self.width = self.height = None
        self._final: dict | None = None

    async def start(self) -> None:
        from cadence.serve.manager import SessionManager

        if self.own_mgr:
            self.mgr = SessionManager(self.cfg)
            await self.mgr.start()
        image = await self.mgr.decode_image(self.image) if self.image is not None else None
        self.sess = await self.mgr.create_local(self.agent, image, self.prompt, self.seed)
        e = self.mgr.engine_cfg
        self.width, self.height = e.stream.width, e.stream.height
        log.info("cadence: in-process session %s (%s, %dx%d)", self.sess.sid, e.name, self.width, self.height)

    def speak(self, samples: np.ndarray, new_segment: bool) -> None:
        self.agent.speak(samples, new_segment=new_segment)
        if self.sess is not None:
            self.sess.touch()

    async def interrupt(self) -> None:
        self.agent.interrupt()

    async def next_video(self) -> np.ndarray | None:
        from aiortc.mediastreams import MediaStreamError

        try:
            _, frame = await self.sess.video.next_frame()
        except MediaStreamError:
            return None
        self.sess.touch()
        return frame

    async def next_audio(self) -> np.ndarray | None:
        from aiortc.mediastreams import MediaStreamError

        try:
            _, samples = await self.sess.audio.next_samples()
        except MediaStreamError:
            return None
        return samples

    async def stop(self) -> None:
        if self.sess is not None:
            self._final = await self.sess.close("pipeline_end")
            self.sess = None
        if self.mgr is not None and self.own_mgr:
            await self.mgr.stop()
            self.mgr = None

    def report(self) -> dict | None:
        return self.sess.report() if self.sess is not None else self._final


# ---- remote: a WebRTC client of cadence serve -------------------------------------------------------------


class _Remote:
    def __init__(self, url: str, image: bytes | None, prompt: str | None, seed: int, api_key: str | None):
        self.url = url.rstrip("/")
        self.image, self.prompt, self.seed, self.api_key = image, prompt, seed, api_key
        self.width = self.height = None
        self.http = None
        self.pc = None
        self.sid = self.token = None
        self.mic = None
        self.speech = SampleQueue(60.0)  # the TTS speech, sent as the microphone in real time
        self._video: asyncio.Queue = asyncio.Queue(maxsize=48)
        self._audio: asyncio.Queue = asyncio.Queue(maxsize=200)
        self._readers: list[asyncio.Task] = []
        self._final: dict | None = None

    def _auth(self) -> dict:
        return {"authorization": f"Bearer {self.token}"}

    async def start(self) -> None:
        import httpx
        from aiortc import RTCPeerConnection, RTCSessionDescription

        from cadence.serve.rtc import rtc_configuration

        self.http = httpx.AsyncClient(timeout=60.0)
        r = await self.http.get(f"{self.url}/config")
        r.raise_for_status()
        conf = r.json()
        if conf.get("api_version") != API_VERSION:
            raise RuntimeError(
                f"{self.url} speaks cadence API version {conf.get('api_version')!r}; this client speaks "
                f"{API_VERSION} (upgrade the older side)"
            )
        self.width, self.height = conf["width"], conf["height"]
        pc = self.pc = RTCPeerConnection(rtc_configuration())
        from cadence.devtools.client import MicTrack

        self.mic = MicTrack(source=lambda n: self.speech.take(n)[0])

        @pc.on("track")
        def on_track(track):
            self._readers.append(asyncio.ensure_future(self._read(track)))

        pc.addTransceiver("video", direction="recvonly")
        pc.addTransceiver(self.mic, direction="sendrecv")
        await pc.setLocalDescription(await pc.createOffer())
        fields = {"sdp": pc.localDescription.sdp, "type": "offer", "agent": "mirror", "seed": str(self.seed)}
        if self.prompt:
            fields["prompt"] = self.prompt
        key = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.image is not None:
            files = {"image": ("face.png", self.image)}
            r = await self.http.post(f"{self.url}/sessions", data=fields, files=files, headers=key)
        else:
            fields["seed"] = self.seed
            r = await self.http.post(f"{self.url}/sessions", json=fields, headers=key)
        if r.status_code != 201:
            raise RuntimeError(f"cadence serve refused the session: {r.status_code} {r.text[:300]}")
        body = r.json()
        self.sid, self.token = body["session_id"], body["token"]
        await pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type=body["type"]))
        log.info("cadence: remote session %s at %s", self.sid, self.url)

    async def _read(self, track) -> None:
        import av
        from aiortc.mediastreams import MediaStreamError

        res = (
            av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            if track.kind == "audio"
            else None
        )
        while True:
            try:
                f = await track.recv()
            except MediaStreamError:
                await (self._video if track.kind == "video" else self._audio).put(None)
                return
            if track.kind == "video":
                await self._video.put(f.to_ndarray(format="rgb24"))
            else:
                for o in res.resample(f):
                    await self._audio.put(o.to_ndarray().reshape(-1).astype(np.float32))

    def speak(self, samples: np.ndarray, new_segment: bool) -> None:
        self.speech.push(samples)

    async def interrupt(self) -> None:
        self.speech.drop()
        if self.sid is not None:
            try:
                await self.http.post(f"{self.url}/sessions/{self.sid}/interrupt", headers=self._auth())
            except Exception as e:  # the stream goes on; the next speech plays
                log.warning("cadence: interrupt failed: %r", e)

    async def next_video(self) -> np.ndarray | None:
        return await self._video.get()

    async def next_audio(self) -> np.ndarray | None:
        return await self._audio.get()

    async def stop(self) -> None:
        if self.sid is not None and self.http is not None:
            try:
                r = await self.http.delete(f"{self.url}/sessions/{self.sid}", headers=self._auth())
                self._final = r.json() if r.status_code == 200 else None
            except Exception as e:
                log.warning("cadence: closing the remote session: %r", e)
            self.sid = None
        if self.mic is not None:
            self.mic.stop()
        if self.pc is not None:
            await self.pc.close()
            self.pc = None
        for t in self._readers:
            t.cancel()
        self._readers = []
        if self.http is not None:
            await self.http.aclose()
            self.http = None

    def report(self) -> dict | None:
        return self._final


# ---- Pipecat's SmallWebRTC transport: video timestamps -----------------------------------------------------


def use_wall_clock_video_timestamps() -> None:
    """Stamp the frames Pipecat's SmallWebRTC transport sends with their send time (90 kHz), process-wide.

    That transport's video track takes aiortc's ``VideoStreamTrack.next_timestamp``: 3000 ticks (1/30 s)
    per frame and a sleep to hold 30 fps, whatever the frame rate. At 24 fps its timestamps fall behind
    real time by a fifth (8 s of RTP time per 10 s), while its audio track is stamped by the wall clock,
    so a browser cannot line the two up (measured here: the voice 7 frames, ~290 ms, behind the mouth).
    Stamped with the send time, both streams share one clock and the browser's A/V sync holds. Idempotent.
    """
    from pipecat.transports.smallwebrtc import transport as t

    cls = t.RawVideoTrack
    if getattr(cls, "_cadence_wall_clock", False):
        return

    async def next_timestamp(self):
        now = time.monotonic()
        if getattr(self, "_cadence_t0", None) is None:
            self._cadence_t0 = now
        return int((now - self._cadence_t0) * 90_000), Fraction(1, 90_000)

    cls.next_timestamp = next_timestamp
    cls._cadence_wall_clock = True
