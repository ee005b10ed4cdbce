"""Cadence as a Pipecat video service, in a real Pipecat pipeline (no browser): TTS audio frames in, the
character's frames and voice out at 24 fps, the mouth moving with the voice, idle motion while nobody
speaks, barge-in. In process (the shipped ``character`` on the CPU) and remote (a ``cadence serve`` on
loopback, the tiny preset)."""

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("pipecat", reason="the pipecat extra is not installed (pip install 'cadence[pipecat]')")
for _mod in ("fastapi", "uvicorn", "aiortc", "httpx"):
    pytest.importorskip(_mod, reason=f"the serve extra is not installed ({_mod})")

from pipecat.frames.frames import (
    EndFrame,
    InterruptionFrame,
    OutputImageRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.workers.runner import WorkerRunner

from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.eval.metrics import audio_envelope, lagged_corr, mouth_opening
from cadence.integrations.pipecat import CadenceVideoService
from cadence.serve.config import ServeConfig

pytestmark = pytest.mark.timeout(180)

FPS = 24
TTS_RATE = 24_000  # a typical TTS rate: the service resamples to 48 kHz


class Collector(FrameProcessor):
    """The end of the pipeline: every image and audio frame with its arrival time."""

    def __init__(self):
        super().__init__()
        self.video: list[tuple[float, np.ndarray]] = []
        self.audio: list[tuple[float, np.ndarray]] = []

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        now = time.monotonic()
        if isinstance(frame, OutputImageRawFrame):
            w, h = frame.size
            self.video.append((now, np.frombuffer(frame.image, np.uint8).reshape(h, w, 3)))
        elif isinstance(frame, TTSAudioRawFrame):
            assert frame.sample_rate == 48_000 and frame.num_channels == 1
            self.audio.append((now, np.frombuffer(frame.audio, np.int16).astype(np.float32) / 32767.0))
        await self.push_frame(frame, direction)


def speech_at(rate: int, seconds: float, seed: int = 7) -> np.ndarray:
    from cadence.media.audio import synthetic_speech

    return synthetic_speech(seconds, seed=seed, sample_rate=rate).numpy().astype(np.float32)


def voiced_seconds(audio: np.ndarray, rate: int) -> float:
    """Seconds of ``audio`` in 20 ms frames louder than the service's silence threshold."""
    from cadence.integrations.pipecat import SILENCE_RMS

    n = rate // 50
    x = audio[: audio.size // n * n].reshape(-1, n)
    return float((np.sqrt((x * x).mean(axis=1)) > SILENCE_RMS).sum() * 0.02)


def tts_frames(audio: np.ndarray, rate: int, piece_s: float = 0.04) -> list:
    """How a TTS service emits: started, 40 ms s16 pieces (all at once: faster than real time), stopped."""
    n = int(rate * piece_s)
    pcm = (np.clip(audio, -1, 1) * 32767).astype(np.int16)
    pieces = [
        TTSAudioRawFrame(audio=pcm[i : i + n].tobytes(), sample_rate=rate, num_channels=1)
        for i in range(0, pcm.size, n)
    ]
    return [TTSStartedFrame(), *pieces, TTSStoppedFrame()]


async def run_pipeline(service, script) -> Collector:
    """Run [service, collector]; ``script(queue)`` is awaited once the pipeline has started, then EndFrame."""
    sink = Collector()
    worker = PipelineWorker(
        Pipeline([service, sink]),
        params=PipelineParams(audio_out_sample_rate=48_000),
        cancel_on_idle_timeout=False,
    )
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(worker, frame):
        started.set()

    async def drive():
        await asyncio.wait_for(started.wait(), timeout=120)
        await script(worker.queue_frame)
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return sink


def on_video_timeline(sink: Collector) -> np.ndarray:
    """The emitted speech placed on the video's timeline (48 kHz samples from the first frame's arrival):
    both pumps pace on the session's media clock, so arrival time is media time."""
    t_v0 = sink.video[0][0]
    out = np.zeros(len(sink.video) * 2000 + 48_000, np.float32)
    for t, pcm in sink.audio:
        at = int(round((t - t_v0) * 48_000))
        if 0 <= at and at + pcm.size <= out.size:
            out[at : at + pcm.size] = pcm
    return out[: len(sink.video) * 2000]


def test_in_process_the_mouth_moves_with_the_bot_voice_at_24_fps():
    speech = speech_at(TTS_RATE, 3.0)
    svc = CadenceVideoService(
        serve_config=ServeConfig(engine=EngineSpec(model="character", fast=FastPath(threads=2)))
    )

    async def script(queue):
        await asyncio.sleep(1.5)  # nobody speaks: idle motion
        for f in tts_frames(speech, TTS_RATE):
            await queue(f)
        await asyncio.sleep(4.0)

    sink = asyncio.run(run_pipeline(svc, script))
    report = svc.report()
    times = np.array([t for t, _ in sink.video])
    span = times[-1] - times[0]
    fps = (len(times) - 1) / span
    print(
        f"in process: {len(times)} frames in {span:.2f} s = {fps:.2f} fps; speech out {svc.audio_out_s:.2f} s"
    )
    assert 23.0 <= fps <= 25.0, fps
    # the bot's speech in -> its first voiced 20 ms out of the service (the session's lead plus the wait for
    # the next chunk boundary: what the service adds before any transport)
    t_in = svc.segment_times[0]
    t_out = next(t for t, pcm in sink.audio if float(np.sqrt(np.mean(pcm * pcm))) > 0.01)
    report_lead = report.get("lead_ms")
    print(
        f"in process: speech in -> first voiced audio out {1e3 * (t_out - t_in):.0f} ms (lead {report_lead} ms)"
    )
    # (290 ms with a 222 ms lead here): never a queue of more than the lead, one chunk and some slack
    assert t_out - t_in <= (report_lead + 1000 * 4 / 24 + 200) / 1000, (t_out - t_in, report_lead)
    # idle: before any speech the frames still change (the model's motion, not one held frame); a frame
    # may repeat where the worker fell behind (a loaded 2-core machine), most do not
    t_speech = sink.audio[0][0]
    idle = np.stack([f for t, f in sink.video if t < t_speech - 0.3][-24:]).astype(np.float32)
    moved = np.abs(np.diff(idle, axis=0)).mean(axis=(1, 2, 3))
    print(f"idle: {len(idle)} frames, {(moved > 0.05).mean():.0%} differ from the one before")
    assert len(idle) >= 12 and (moved > 0.05).mean() >= 0.6, moved
    # the voice out is the voice in (resampled 24 -> 48 kHz), whole: its voiced 20 ms frames
    voiced_in = voiced_seconds(speech, TTS_RATE)
    print(f"voiced: in {voiced_in:.2f} s, out {svc.voiced_out_s:.2f} s (emitted {svc.audio_out_s:.2f} s)")
    assert svc.voiced_out_s == pytest.approx(voiced_in, abs=0.1)
    # the mouth moves with the voice (cadence.eval's metrics; the character's own ceiling is ~0.9)
    mouth = mouth_opening(np.stack([f for _, f in sink.video]))
    env = audio_envelope(on_video_timeline(sink), fps=FPS, sample_rate=48_000)
    corrs = {lag: lagged_corr(mouth, env, lag) for lag in range(-6, 7)}
    lag = max(corrs, key=corrs.get)
    corr = corrs[lag]
    print(f"in process: lip-sync correlation {corr:.2f} at a lag of {lag} frames; {corrs}")
    assert abs(lag) <= 1, corrs  # the frames and the voice leave the service together
    assert corr >= 0.5, corr
    assert report["agent"] == "pipecat" and report["agent_segments"] == 1


def test_in_process_barge_in_stops_the_voice_at_once_and_the_mouth_within_the_chunks_in_flight():
    speech = speech_at(TTS_RATE, 4.0, seed=3)
    svc = CadenceVideoService(
        serve_config=ServeConfig(engine=EngineSpec(model="character", fast=FastPath(threads=2)))
    )
    marks = {}

    async def script(queue):
        await asyncio.sleep(1.0)
        for f in tts_frames(speech, TTS_RATE):
            await queue(f)
        await asyncio.sleep(2.0)  # ~1.5 s of the 4 s are playing out
        marks["interrupt"] = time.monotonic()
        await queue(InterruptionFrame())
        await asyncio.sleep(2.0)

    sink = asyncio.run(run_pipeline(svc, script))
    t_int = marks["interrupt"]
    spoken_after = [t for t, pcm in sink.audio if t > t_int and np.sqrt(np.mean(pcm * pcm)) > 1e-3]
    last = max(spoken_after) - t_int if spoken_after else 0.0
    print(
        f"barge-in: last speech audio {last * 1e3:.0f} ms after the interruption; speech out {svc.audio_out_s:.2f} s"
    )
    assert svc.interruptions == 1
    assert last <= 0.1, last  # the voice stops at once (the planned chunks' audio is silenced)
    assert svc.voiced_out_s <= voiced_seconds(speech, TTS_RATE) - 1.0, svc.voiced_out_s  # cut short
    # the mouth: frames made before the interruption still play (the chunks in flight, <= lead + chunk);
    # after that the mouth is back to its idle level
    report = svc.report()
    settle = (report["lead_ms"] + 1e3 * 4 / FPS) / 1e3 + 0.1
    mouth_after = mouth_opening(np.stack([f for t, f in sink.video if t > t_int + settle]))
    mouth_idle = mouth_opening(np.stack([f for t, f in sink.video if t < sink.audio[0][0] - 0.3]))
    mouth_talk = mouth_opening(np.stack([f for t, f in sink.video if sink.audio[0][0] + 0.3 < t < t_int]))
    print(
        f"mouth: idle {mouth_idle.mean():.3f} talking {mouth_talk.mean():.3f} after {mouth_after.mean():.3f}"
    )
    assert mouth_talk.mean() > mouth_idle.mean()
    assert mouth_after.mean() < (mouth_idle.mean() + mouth_talk.mean()) / 2


@pytest.mark.slow  # a server, an aiortc client and a Pipecat pipeline in one test (~9 s on 2 cores)
def test_remote_through_cadence_serve():
    """The same service as a WebRTC client of a running ``cadence serve`` (tiny preset): frames at 24 fps,
    the voice back (same length), interrupt through the API."""
    from cadence.serve.server import ServerThread

    speech = speech_at(16_000, 2.0)
    with ServerThread(ServeConfig(engine=EngineSpec(model="tiny", fast=FastPath(threads=1)), port=0)) as srv:
        svc = CadenceVideoService(url=srv.url)

        async def script(queue):
            await asyncio.sleep(1.0)
            for f in tts_frames(speech, 16_000):
                await queue(f)
            await asyncio.sleep(3.5)

        sink = asyncio.run(run_pipeline(svc, script))
    rep = svc.report()
    times = np.array([t for t, _ in sink.video])
    fps = (len(times) - 1) / (times[-1] - times[0])
    print(f"remote: {fps:.2f} fps, speech out {svc.audio_out_s:.2f} s, report fps {rep and rep['fps']}")
    assert 22.0 <= fps <= 26.0, fps
    assert sink.video[0][1].shape == (svc.height, svc.width, 3)
    # Opus is lossy and adds a few frames of ramp at the edges: the voiced time within 0.25 s
    assert svc.voiced_out_s == pytest.approx(voiced_seconds(speech, 16_000), abs=0.25)
    assert rep is not None and rep["agent"] == "mirror" and rep["close_reason"] == "client"


def test_a_session_that_cannot_open_is_one_error_frame_upstream():
    """Remote mode against a port nobody listens on: the pipeline gets one ErrorFrame saying why (Pipecat
    then ends the pipeline), no hang, no traceback from the service."""
    from pipecat.frames.frames import ErrorFrame

    errors = []

    class Head(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, ErrorFrame):
                errors.append(frame.error)
            await self.push_frame(frame, direction)

    svc = CadenceVideoService(url="http://127.0.0.1:9")
    sink = Collector()
    worker = PipelineWorker(Pipeline([Head(), svc, sink]), cancel_on_idle_timeout=False)

    async def go():
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        run = asyncio.ensure_future(runner.run())
        deadline = time.monotonic() + 20
        while not errors and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await worker.cancel()
        await asyncio.wait({run}, timeout=10)

    asyncio.run(go())
    assert errors and "Cadence could not open a session" in errors[0], errors
    assert not sink.video
