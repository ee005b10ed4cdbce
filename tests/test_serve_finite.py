"""Every input that reaches the model is finite (issue 39, probe 1), one test per way audio gets in, and the
frames the viewer gets are counted by what they show.

The probe: a float32 WAV with NaN and infinity posted to ``/sessions/{id}/audio`` was taken (200), and the page
showed ~2 s of black video while the fps cell, the report and ``/metrics`` said every frame was fresh:
``np.clip`` keeps a NaN, the model turns it into NaN latents, and a NaN decodes to black.

* an upload (``/audio``), a file (``cadence generate --audio``): refused, naming how many samples;
* a TTS reply (the ``talk`` agent's endpoint): the turn fails with that one line, nothing is said;
* the microphone track (a live track cannot be refused): silenced, one log line, counted in the status;
* Pipecat's TTS frames: 16-bit PCM (always finite); its speech goes through ``Agent.speak``, which refuses;
* whatever still gets past them (a bug): the scheduler silences it before the worker, counted, one line;
* a blank frame from the engine (one colour: what a NaN decodes to) is replaced by the last good one and is
  not fresh: the status, the fps, the report and ``/metrics`` say so.
"""

import asyncio
import logging

import numpy as np
import pytest

from cadence.devtools.testing import float_wav
from cadence.errors import InputError
from cadence.media.pcm import NonFiniteAudio, clean, require_finite

SR = 48_000


def poisoned(seconds: float = 2.0) -> np.ndarray:
    """The issue's probe: speech-like audio with a stretch of NaN and a few infinities."""
    n = int(seconds * SR)
    x = (0.3 * np.sin(np.arange(n) * 0.05)).astype(np.float32)
    x[n // 4 : n // 4 + min(6000, n // 4)] = np.nan
    x[n // 2 : n // 2 + 3] = np.inf
    x[n // 2 + 10] = -np.inf
    return x


def test_the_two_doors():
    x = poisoned()
    with pytest.raises(NonFiniteAudio, match="6004 non-finite samples"):
        require_finite(x, "audio")
    assert np.array_equal(require_finite(np.array([2.0, -3.0, 0.5])), np.array([1.0, -1.0, 0.5], np.float32))
    y, bad = clean(x)
    assert bad == 6004 and np.isfinite(y).all() and y.dtype == np.float32 and np.abs(y).max() <= 1.0
    ok = np.zeros(4, np.float32)
    assert clean(ok)[0] is ok and clean(ok)[1] == 0  # clean audio: no copy
    assert isinstance(NonFiniteAudio("x"), InputError)  # (one error line at the CLI, a 4xx at the API)


def test_an_upload_with_nan_or_infinity_is_a_400_naming_it(tmp_path):
    pytest.importorskip("av")
    from cadence.media.audio import load_audio
    from cadence.serve.agent import decode_audio_bytes
    from cadence.serve.guard import ApiError
    from cadence.serve.uploads import decode_speech

    data = float_wav(poisoned())
    with pytest.raises(NonFiniteAudio, match="non-finite"):
        decode_audio_bytes(data)
    with pytest.raises(ApiError) as e:
        asyncio.run(decode_speech(data, 10 << 20))
    assert e.value.status == 400 and "6004 non-finite samples (NaN or infinity)" in e.value.message
    # resampled first (a 16 kHz float WAV): the NaNs spread, still refused
    with pytest.raises(ApiError, match="non-finite"):
        asyncio.run(decode_speech(float_wav(poisoned(), 16_000), 10 << 20))
    # the same file for `cadence generate --audio`: one clear error, not black video
    f = tmp_path / "nan.wav"
    f.write_bytes(data)
    with pytest.raises(NonFiniteAudio, match="non-finite"):
        load_audio(f)
    # finite float audio over full scale is taken, clipped
    loud = decode_audio_bytes(float_wav(np.full(SR, 3.0, np.float32)))
    assert np.isfinite(loud).all() and loud.max() == 1.0


def test_a_tts_reply_with_nan_fails_the_turn_with_one_line_and_says_nothing(caplog):
    for mod in ("fastapi", "uvicorn", "httpx", "av"):
        pytest.importorskip(mod)
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import Response

    from cadence.devtools.testing import AppThread
    from cadence.serve.agent import Turn
    from cadence.serve.converse import AgentEndpoint, AgentEndpointError, TalkAgent

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        return {"choices": [{"message": {"role": "assistant", "content": "Hello."}}]}

    @app.post("/v1/audio/speech")
    async def tts():
        return Response(float_wav(poisoned(1.0)), media_type="audio/wav")

    with AppThread(app) as url:
        ep = AgentEndpoint(url + "/v1", tts_model="tts-1")

        async def speak():
            async with httpx.AsyncClient() as client:
                return await ep.speech(client, "hello")

        with pytest.raises(AgentEndpointError, match="text-to-speech: audio has .* non-finite samples"):
            asyncio.run(speak())
        agent = TalkAgent(ep)
        turn = Turn(0, 1.0)

        async def answer():
            agent._client = None
            await agent._answer(turn, np.zeros(SR, np.float32))

        with caplog.at_level(logging.WARNING, logger="cadence.serve"):
            asyncio.run(answer())
    assert turn.error is not None and "non-finite" in turn.error, turn
    assert agent.queued_samples == 0 and agent.segments == 0  # nothing said
    assert [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()], caplog.records


def _session():
    from cadence.engine.recipe import EngineSpec
    from cadence.serve.agents import make_agent
    from cadence.serve.config import ServeConfig
    from cadence.serve.manager import SessionManager
    from cadence.serve.session import LiveSession

    mgr = SessionManager(ServeConfig(engine=EngineSpec(model="tiny"), groups=("cpu",)))
    return LiveSession(mgr, "s0123456789", mgr.groups[0], make_agent("mirror"), mgr.engine_cfg, "p", 0)


def test_the_microphone_is_cleaned_with_one_log_line_and_counted(caplog):
    for mod in ("fastapi", "aiortc", "prometheus_client"):
        pytest.importorskip(mod)

    async def main():
        sess = _session()
        with caplog.at_level(logging.WARNING, logger="cadence.serve"):
            for _ in range(3):
                sess._on_mic(poisoned(0.02 * 10))  # 200 ms of microphone, NaN and infinities in it
        return sess

    sess = asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "microphone" in r.getMessage()]
    assert len(lines) == 1 and "non-finite samples" in lines[0], lines
    assert sess.stats.mic_nonfinite == 3 * int(np.count_nonzero(~np.isfinite(poisoned(0.2))))
    taken, _ = sess.agent.take(sess.timing.samples_per_chunk)
    assert np.isfinite(taken).all() and np.abs(taken).max() > 0  # the voice is still there, the NaN silenced
    assert sess.status()["mic_nonfinite_samples"] == sess.stats.mic_nonfinite


def test_pipecat_tts_frames_are_finite_and_its_speech_refuses_nan():
    pytest.importorskip("pipecat")
    from cadence.integrations.pipecat import SpeechAgent, _Resampler

    extremes = np.array([-32768, 32767, 0, -1, 1] * 4000, np.int16).tobytes()
    for rate in (16_000, 24_000, 48_000):
        out = _Resampler()(extremes, rate, 1)
        assert out.size and np.isfinite(out).all()
    agent = SpeechAgent()
    with pytest.raises(NonFiniteAudio):
        agent.speak(poisoned(0.5))
    assert agent.queued_samples == 0 and agent.segments == 0


def test_the_scheduler_never_sends_non_finite_audio_to_the_worker(caplog):
    for mod in ("fastapi", "aiortc", "prometheus_client"):
        pytest.importorskip(mod)
    from cadence.engine.messages import ChunkRequest

    async def main():
        sess = _session()
        sess.agent.take = lambda n: (poisoned(n / SR), [])  # a bug that bypasses every door
        sent = []
        sess.scheduler.send = sent.append
        sess._spawn(sess.scheduler.run(), "scheduler")  # two chunks planned before the clock starts
        await asyncio.sleep(0.1)
        await sess._stop_tasks(1.0)
        return sess, [m for m in sent if isinstance(m, ChunkRequest)]

    with caplog.at_level(logging.WARNING, logger="cadence.serve"):
        sess, sent = asyncio.run(main())
    assert len(sent) == 2 and all(np.isfinite(m.audio).all() for m in sent)
    assert all(np.isfinite(a).all() for a in sess.buffer.audio.values())
    assert sess.stats.audio_nonfinite > 0
    assert len([r for r in caplog.records if "reached the scheduler" in r.getMessage()]) == 1


def test_a_blank_chunk_from_the_engine_is_held_and_not_fresh_in_status_fps_and_metrics():
    """Probe 1 seen where it shows: the engine's chunk 1 came back black (a NaN decodes to 0). The viewer gets
    chunk 0's last frame held over it (it is not sent again over WebRTC), and the figures count 4 fresh frames,
    not 8."""
    for mod in ("fastapi", "aiortc", "prometheus_client"):
        pytest.importorskip(mod)
    from cadence.serve.rtc import VideoOut

    async def main():
        sess = _session()
        t = sess.timing
        h, w = sess.buffer.height, sess.buffer.width
        good = np.random.default_rng(0).integers(0, 255, (t.frames_per_chunk, h, w, 3), dtype=np.uint8)
        sess.buffer.put_video(0, good)
        sess.buffer.put_video(1, np.zeros_like(good))  # black: what the engine makes of NaN
        sess.first_chunk.set()
        sess.video = VideoOut(sess.feed)
        sess.clock.now = lambda: 0.0  # every frame due now (no waiting)
        sess.clock.start()
        got = [await sess.video.next_frame() for _ in range(2 * t.frames_per_chunk)]
        sess.update_metrics()
        return sess, good, got

    sess, good, got = asyncio.run(main())
    f = sess.timing.frames_per_chunk
    for k, frame in got[f:]:
        assert np.array_equal(frame, good[-1]), k  # the last good frame, never black
    st = sess.status()
    assert st["video_frames_fresh"] == f and st["video_frames_blank"] == f, st
    assert st["underruns"]["video"] == 0  # it came back in time: blank, not late
    assert sess.stats.video_frames_sent == 2 * f and len(sess.stats._fresh_times) == f  # fps counts 4 of 8
    text = sess.server.metrics.render().decode()
    assert f'cadence_underruns_total{{kind="video"}} {float(f)}' in text, text
