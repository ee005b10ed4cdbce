"""``cadence serve --model flashhead-lite --weights DIR``: a short live session of the tiny released-layout fixture
(tests/fixtures/flashhead/SoulX-FlashHead-tiny, 64 x 64) through the real server, its worker process and an aiortc
client, driven by the ``say`` agent (speech pushed over POST /sessions/{id}/audio), then by ``mirror`` (the
microphone spoken back): video at the family's 25 fps
made clip by clip (24 new frames a chunk), 48 kHz audio, in sync, the speech timed to its first speaking frame.
~15-25 s on two cores (the worker's start and warm-up are most of it): slow tier."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("soxr")
pytest.importorskip("transformers")
pytest.importorskip("aiortc")

from cadence.devtools.client import run_client  # noqa: E402
from cadence.engine.recipe import EngineSpec  # noqa: E402
from cadence.serve.config import ServeConfig  # noqa: E402
from cadence.serve.server import ServerThread  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
TINY_DIR = Path(__file__).parent / "fixtures" / "flashhead" / "SoulX-FlashHead-tiny"


def test_a_live_flashhead_session_speaks_what_the_agent_says():
    from cadence.media import synthetic_speech
    from cadence.serve.agent import wav_bytes

    over = {"model": {"weights": str(TINY_DIR)}, "stream": {"height": 64, "width": 64}}
    spec = EngineSpec(model="flashhead-lite", overrides=over)
    srv = ServerThread(ServeConfig(engine=spec, port=0)).start()
    try:
        speech = wav_bytes(synthetic_speech(1.5).numpy())
        res = asyncio.run(run_client(srv.url, 4.0, agent="say", speak_wav=speech, speak_after_s=0.3))
        mic = synthetic_speech(2.0, sample_rate=48000).numpy()  # the mirror agent: the microphone spoken back
        echo = asyncio.run(run_client(srv.url, 3.0, mic=mic))
    finally:
        srv.stop()
    assert echo.error is None and echo.report["agent"] == "mirror" and echo.report["video_frames_fresh"] >= 24
    assert res.error is None and res.status_code == 201, res.error
    assert res.video_size == (64, 64)
    assert len(res.video) >= 75 and 22.0 <= res.media_fps(3600) <= 28.0  # 25 fps: pts 3600 apart
    assert {r for _, _, _, r in res.audio} == {48000} and res.audio_seconds >= 3.0
    st, rep = res.status, res.report
    assert st["preset"] == "flashhead-lite" and st["target_fps"] == 25
    assert rep["state"] == "closed" and rep["video_frames_fresh"] >= 24  # at least one whole clip
    assert rep["av_offset_ms"] is not None and abs(rep["av_offset_ms"]) < 60
    assert rep["agent_audio_to_frame_ms"], rep  # the pushed speech reached a speaking frame, timed


def test_pipecat_drives_flashhead_lite_at_its_25_fps():
    """Pipecat's ``CadenceVideoService`` in process (its own session manager and worker) on the tiny Lite
    fixture: TTS frames in (faster than real time, 24 kHz), the character's frames out at the family's 25 fps
    and the voice back whole."""
    pytest.importorskip("pipecat", reason="the pipecat extra is not installed")
    import numpy as np
    from test_pipecat import TTS_RATE, run_pipeline, speech_at, tts_frames, voiced_seconds

    from cadence.integrations.pipecat import CadenceVideoService

    speech = speech_at(TTS_RATE, 2.0)
    over = {"model": {"weights": str(TINY_DIR)}, "stream": {"height": 64, "width": 64}}
    svc = CadenceVideoService(
        serve_config=ServeConfig(engine=EngineSpec(model="flashhead-lite", overrides=over))
    )

    async def script(queue):
        await asyncio.sleep(1.0)
        for f in tts_frames(speech, TTS_RATE):
            await queue(f)
        await asyncio.sleep(3.0)

    sink = asyncio.run(run_pipeline(svc, script))
    times = np.array([t for t, _ in sink.video])
    fps = (len(times) - 1) / (times[-1] - times[0])
    assert 24.0 <= fps <= 26.0, fps
    assert sink.video[0][1].shape == (64, 64, 3)
    assert svc.voiced_out_s == pytest.approx(voiced_seconds(speech, TTS_RATE), abs=0.1)
    rep = svc.report()
    assert rep["agent"] == "pipecat" and rep["agent_segments"] == 1 and rep["agent_audio_to_frame_ms"], rep


@pytest.mark.parametrize("cut_in", [True, False])
def test_speech_cuts_in_at_the_first_replaceable_frame(cut_in):
    """The speech cut-in through the real server and worker (``ServeConfig.cut_in``; the pure arithmetic and the
    scheduler on a fake worker are in tests/test_serve_cut_in.py): speech pushed while silent clips are queued
    plays lead + up to a few frames after it arrives (the clip started at the first replaceable frame), on the
    grid lead + up to one clip (0.96 s) later, at the next clip boundary."""
    from cadence.media import synthetic_speech
    from cadence.serve.agent import wav_bytes

    over = {"model": {"weights": str(TINY_DIR)}, "stream": {"height": 64, "width": 64}}
    spec = EngineSpec(model="flashhead-lite", overrides=over)
    srv = ServerThread(ServeConfig(engine=spec, port=0, cut_in=cut_in)).start()
    try:
        speech = wav_bytes(synthetic_speech(0.5).numpy())
        res = asyncio.run(run_client(srv.url, 3.5, agent="say", speak_wav=speech, speak_after_s=1.3))
    finally:
        srv.stop()
    assert res.error is None, res.error
    rep = res.report
    (ms,) = rep["agent_audio_to_frame_ms"]
    assert rep["chunks"]["cut_ins"] == int(cut_in) and rep["underruns"]["audio"] == 0
    if (
        cut_in
    ):  # the first replaceable frame: one clip's latency as the lead covers it, + the look and a frame
        assert ms < rep["lead_ms"] + 150, rep
    else:  # the next clip boundary: lead .. lead + 960 ms
        assert ms > rep["lead_ms"] - 40, rep
