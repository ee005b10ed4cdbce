"""``cadence serve --model flashtalk``: a short live session of the tiny random FlashTalk configuration (the
flashtalk fixture's model sizes, a 4-wide Wan VAE, random CLIP and wav2vec2) through the real server, its worker
process and an aiortc client: 32x32 video at 25 fps made clip by clip (28 frames a chunk) and 48 kHz audio.
~17 s on two cores (the worker's start and warm-up are most of it)."""

from __future__ import annotations

import asyncio

import pytest
from test_families_flashtalk import HW, TINY

pytest.importorskip("soxr")
pytest.importorskip("transformers")
pytest.importorskip("aiortc")

from cadence.devtools.client import run_client  # noqa: E402
from cadence.engine.recipe import EngineSpec
from cadence.serve.config import ServeConfig  # noqa: E402
from cadence.serve.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_a_live_flashtalk_session_gets_clip_frames_and_audio():
    from cadence.media import synthetic_speech

    over = {"model": TINY, "stream": HW, "vae": {"base_dim": 4}}
    srv = ServerThread(ServeConfig(engine=EngineSpec(model="flashtalk", overrides=over), port=0)).start()
    try:
        res = asyncio.run(run_client(srv.url, 3.0, mic=synthetic_speech(2.0, sample_rate=48000).numpy()))
    finally:
        srv.stop()
    assert res.error is None and res.status_code == 201, res.error
    assert res.video_size == (HW["width"], HW["height"])
    assert len(res.video) >= 50 and 22.0 <= res.media_fps(3600) <= 28.0  # 25 fps: pts 3600 apart
    assert {r for _, _, _, r in res.audio} == {48000} and res.audio_seconds >= 2.0
    st, rep = res.status, res.report
    assert st["state"] == "streaming" and st["preset"] == "flashtalk" and st["target_fps"] == 25
    assert rep["state"] == "closed" and rep["video_frames_fresh"] >= 28  # at least one whole clip
    assert rep["av_offset_ms"] is not None and abs(rep["av_offset_ms"]) < 60
