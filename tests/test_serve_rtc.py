"""End to end over real WebRTC on loopback: a Python aiortc client against ``cadence serve`` (tiny
preset, one CPU worker process), then a full shutdown that must leave nothing running.

Loopback ICE: aioice drops 127.0.0.1 from its host candidates; the server (and so this test, in the
same process) swaps aioice's address discovery for ["127.0.0.1"] (``cadence.serve.rtc.
use_ice_host_addresses``), with ``RTCConfiguration(iceServers=[])`` on both sides: no STUN, no other
interface, nothing leaves the machine.
"""

import asyncio
import multiprocessing
import threading
import time

import pytest

for _mod in ("fastapi", "uvicorn", "aiortc", "prometheus_client", "httpx", "multipart"):
    pytest.importorskip(_mod, reason=f"the serve extra is not installed ({_mod})")

from cadence.devtools.client import run_client
from cadence.devtools.testing import on_server_loop
from cadence.serve.config import ServeConfig
from cadence.serve.server import ServerThread

pytestmark = pytest.mark.timeout(180)


def _cadence_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("cadence-"))


def test_aiortc_client_gets_24fps_video_and_48khz_audio_then_nothing_leaks():
    import aioice.ice

    original = aioice.ice.get_host_addresses
    threads_before = set(threading.enumerate())
    srv = ServerThread(ServeConfig(port=0)).start()
    try:
        pids = [g.pid for g in srv.manager.groups]
        assert all(pids)
        from cadence.media import synthetic_speech

        # the microphone sends speech: the 'mirror' agent lip-syncs it (resampled to 48 kHz mono)
        res = asyncio.run(run_client(srv.url, 2.6, mic=synthetic_speech(2.0, sample_rate=48000).numpy()))
        assert res.error is None, res.error
        assert res.status_code == 201
        # >= 2 s of video at ~24 fps (not aiortc's stock 30), pts spaced 3750 in 1/90000
        # every pts step is a whole number of frame periods (the decoder rounds by <= 1 tick); a jump
        # of several periods only where the server's pacer skipped frames after a stalled sender (on a
        # loaded 2-core machine the event loop can stall for ~0.5 s) or held them (a held frame is not
        # sent: the receiver keeps showing the last one): no frame lost in between
        bad, missing = res.pts_gaps(3750)
        span = res.video[-1][0] - res.video[0][0]
        assert span >= 2.0 and len(res.video) + missing >= 48
        assert 22.0 <= res.media_fps(3750) <= 26.0, (res.media_fps(3750), res.video_fps())
        assert res.video_time_base == pytest.approx(1 / 90000)
        assert bad == [], sorted(set(res.pts_steps()))
        # (<=: the pacer may also skip after the client's last frame, before the session closes)
        held = res.report["underruns"]["video"]
        assert missing <= res.report["video_frames_skipped"] + held, (missing, res.report)
        assert res.report["video_frames_skipped"] <= 24, res.report  # at most a second skipped in 2.6 s
        assert len(res.video) <= res.report["video_frames_fresh"] and all(res.video_fresh), res.report
        total = res.video[-1][1] - res.video[0][1]
        assert abs(total - 3750 * (len(res.video) - 1 + missing)) <= 2
        assert res.video_size == (128, 128)
        # audio: 48 kHz, as long as the video
        assert {r for _, _, _, r in res.audio} == {48000}
        assert res.audio_seconds >= 2.0
        # the server's view of the same session
        st = res.status
        assert st["state"] == "streaming" and st["preset"] == "character" and st["target_fps"] == 24
        assert st["ttff_ms"] is not None and st["ttff_ms"] < 5000
        assert st["agent"] == "mirror" and st["mic_frames"] > 50 and st["agent_segments"] >= 1
        # the microphone that 'mirror' mouths: its own measure (speech given to the character is another)
        assert st["mic_to_frame_ms_p50"] is not None and 0 < st["mic_to_frame_ms_p50"] < 1000
        assert st["agent_audio_to_frame_ms_p50"] is None
        rep = res.report
        assert rep["state"] == "closed" and rep["close_reason"] == "client"
        assert rep["worker_preopened"] is True  # default face and prompt: the worker had it opened ahead
        # >= 2 s of generated video sent, or skipped by the pacer after a stall (bounded above)
        assert (
            rep["video_frames_fresh"] + rep["video_frames_skipped"] >= 48 and rep["av_offset_ms"] is not None
        )
        assert abs(rep["av_offset_ms"]) < 60
        # session teardown: its tasks are gone, the group is free again, the worker is the same process
        names = on_server_loop(srv, _task_names)
        assert not [n for n in names if n.startswith("cadence-" + res.session_id[:8])], names
        assert srv.manager.sessions == {} and all(g.free for g in srv.manager.groups)
        assert [g.pid for g in srv.manager.groups] == pids
        import httpx

        metrics = httpx.get(srv.url + "/metrics").text
        assert 'cadence_sessions_total{reason="client"} 1.0' in metrics
        assert "cadence_chunk_latency_ms_bucket" in metrics
    finally:
        srv.stop()
    # server shutdown: worker processes joined, pipe threads joined, aioice restored
    assert multiprocessing.active_children() == []
    deadline = time.monotonic() + 10
    while _cadence_threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cadence_threads() == []
    leftover = [t for t in set(threading.enumerate()) - threads_before if t.is_alive() and not t.daemon]
    assert leftover == []
    assert aioice.ice.get_host_addresses is original


async def _task_names():
    return [t.get_name() for t in asyncio.all_tasks() if not t.done()]
