"""WebRTC terminated on the group's own node (``cadence serve --ray ... --fleet-media group``, issue 19).

Without Ray: the fleet option and its flags, the metric relay (the actor records, the front end applies),
and the front end's session bookkeeping against a stand-in group actor (open, status, the group's death,
the claim given back).

The real thing (slow tier): a Ray head on loopback with one ``character`` group on the CPU behind a front end
in ``group`` media mode, and an aiortc client. The client gets >= 23.5 fps of video and its audio; the proof
that the media never crossed the front end: the answer's ICE candidate is a UDP socket of the group actor's
process (not the front end's), the front end's own tracks sent no frame and no worker reply with frames
reached it, while the actor's session counts every frame it sent. The API works as on one machine (status,
/prompt, /audio, /metrics, draining). Then the group's actor is killed mid-session: the session ends with one
clear error, the claim goes back, Ray restarts the actor, and a new session streams from the new one.
"""

import argparse
import asyncio
import collections
import os
import pickle
import signal
import time
import types

import numpy as np
import pytest
from fleet_support import FakeRemote, needs_ray, wait_for

from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.errors import ConfigError
from cadence.fleet.config import FleetConfig, add_fleet_flags, fleet_from_args
from cadence.fleet.messages import (
    MediaAnswer,
    MediaClose,
    MediaClosed,
    MediaSettings,
    MediaSpeak,
    MediaUpdate,
    MetricEvent,
    MetricsRecorder,
    OpenMedia,
    apply_metric_events,
)

# ---- no Ray -----------------------------------------------------------------------------------------------


def test_fleet_media_option_and_flags():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=1)
    add_fleet_flags(p)
    f = fleet_from_args(p.parse_args(["--ray", "auto"]))
    assert f.media == "frontend" and f.media_ice == "node"  # the default: today's media path
    f = fleet_from_args(
        p.parse_args(["--ray", "auto", "--fleet-media", "group", "--fleet-media-address", "auto"])
    )
    assert f.media == "group" and f.media_ice == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--ray", "auto", "--fleet-media", "browser"])
    for bad in ({"media": "browser"}, {"media_ice": ""}, {"media_ice": "10.0.0.1,"}):
        with pytest.raises(ConfigError):
            FleetConfig(**bad)


def test_metric_events_recorded_in_the_actor_apply_to_the_front_ends_metrics():
    pytest.importorskip("prometheus_client")
    from cadence.telemetry.metrics import ServeMetrics

    rec, m = MetricsRecorder(), ServeMetrics()
    rec.chunk_latency.observe(100.0)
    rec.chunk_latency.observe(120.0)
    rec.underruns_total.labels("video").inc()
    rec.fps.labels("sid-1").set(23.0)
    rec.fps.labels("sid-1").set(24.0)  # a gauge: only its last value travels
    rec.set_worker_memory(3, {"rss_mb": 100.0, "cuda_mb": None})
    events = rec.drain()
    assert rec.drain() == [] and len(events) == 5
    events = pickle.loads(pickle.dumps(events))  # (they cross Ray as they are)
    assert apply_metric_events(m, events, session_open=True) == 5
    text = m.render(sessions=True).decode()
    assert "cadence_chunk_latency_ms_count 2.0" in text
    assert 'cadence_underruns_total{kind="video"} 1.0' in text
    assert 'cadence_session_fps{session="sid-1"} 24.0' in text
    assert 'cadence_worker_memory_bytes{group="3",kind="rss"}' in text
    # a closed session's late update brings none of its series back; an unknown series is not touched
    m.remove_session("sid-1")
    rec.fps.labels("sid-1").set(5.0)
    rec.ttff_hist.observe(200.0)
    events = rec.drain() + [MetricEvent("bad_requests", (), "inc", 1.0)]
    assert apply_metric_events(m, events, session_open=False) == 1
    text = m.render(sessions=True).decode()
    assert 'session="sid-1"' not in text and "cadence_ttff_ms_count 1.0" in text
    assert "cadence_bad_requests_total{" not in text  # (a series the actor may not touch)


def test_front_end_session_bookkeeping_against_a_stand_in_group():
    """The front end's ``GroupMediaSession``: the offer goes to the group with the session's settings, the
    status is the group's, requests are forwarded in order, the group's report comes back at DELETE; and a
    group that dies ends its session with one error and gives the claim back."""
    pytest.importorskip("aiortc")
    from cadence.engine.messages import Died
    from cadence.fleet.remote import GroupMediaSession

    calls: list = []
    settings = MediaSettings(ice="127.0.0.1")

    def open_media(req):
        assert isinstance(req, OpenMedia) and req.settings is settings and req.agent == "mirror"
        if req.sdp == "bad":
            return MediaAnswer(req.sid, error_type="ValueError", error="bad offer", closed=None)
        status = {"state": "connecting", "fps": 0.0, "errors": [], "agent_queued_s": 0.0, "chunks": {}}
        return MediaAnswer(req.sid, sdp="v=0 answer", status=status, pid=4242)

    def media_request(sid, req):
        if isinstance(req, MediaClose):
            return MediaClosed(
                sid, {"state": "closed", "close_reason": req.reason, "errors": [], "timeline": [1]}
            )
        return None

    released, closed = [], []
    source = types.SimpleNamespace(media_settings=settings, release=lambda g, sid: released.append(sid))
    group = types.SimpleNamespace(
        name="cadence-group-0",
        index=0,
        source=source,
        handle=types.SimpleNamespace(
            open_media=FakeRemote(open_media, calls), media_request=FakeRemote(media_request, calls)
        ),
    )

    class Metrics:
        def __getattr__(self, name):
            raise AssertionError(f"no metric expected here ({name})")

    server = types.SimpleNamespace(
        background=set(), metrics=Metrics(), source=source, session_closed=lambda s, r: closed.append(r)
    )
    engine_cfg = types.SimpleNamespace(name="character")
    agent = types.SimpleNamespace(name="mirror")

    async def run():
        s = GroupMediaSession(server, "sid-1", group, agent, engine_cfg, "a prompt", 0)
        answer = await s.start(None, "v=0 offer", "offer")
        assert (answer.sdp, answer.type, s.media_pid, s.state) == ("v=0 answer", "answer", 4242, "connecting")
        s.on_worker_message(MediaUpdate("sid-1", {"state": "streaming", "fps": 24.0, "errors": []}, []))
        st = s.status()
        assert st["state"] == "streaming" and st["fps"] == 24.0 and st["session_id"] == "sid-1"
        s.agent.speak(np.ones(4800, np.float32))
        assert s.agent.queued_samples == 4800
        await asyncio.sleep(0)
        assert [type(c[1][1]).__name__ for c in calls if c[0] == "media_request"] == ["MediaSpeak"]
        assert isinstance(calls[-1][1][1], MediaSpeak) and calls[-1][1][1].samples.size == 4800
        report = await s.close("client")
        assert (
            report["close_reason"] == "client" and report["timeline"] == [1] and report["state"] == "closed"
        )
        assert released == ["sid-1"] and closed == [report]

        # the group dies mid-session: one error, closed for the client, the claim back, the group not asked
        s2 = GroupMediaSession(server, "sid-2", group, agent, engine_cfg, "a prompt", 0)
        await s2.start(None, "v=0 offer", "offer")
        n = len(calls)
        s2.on_worker_message(Died("worker group cadence-group-0 failed (ActorDiedError: x); Ray restarts it"))
        s2.on_worker_message(Died("again"))
        await s2.close("client")
        st = s2.status()
        assert st["state"] == "closed" and st["close_reason"] == "worker_error", st
        assert st["errors"] == [
            "worker: worker group cadence-group-0 failed (ActorDiedError: x); Ray restarts it"
        ]
        assert released == ["sid-1", "sid-2"] and len(calls) == n  # nothing more asked of a dead group

        # a refused offer raises what the manager maps to a 400
        s3 = GroupMediaSession(server, "sid-3", group, agent, engine_cfg, "a prompt", 0)
        with pytest.raises(ValueError, match="bad offer"):
            await s3.start(None, "bad", "offer")

    asyncio.run(run())


# ---- the real thing: a Ray head on loopback, one group, WebRTC on the group's node --------------------------

KEY = "fleet-media-test-operator-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def group_media_fleet():
    """A Ray head (1 CPU) with one character group, a front end with ``media='group'`` (in this process)."""
    needs_ray()

    from cadence.fleet.cluster import LocalCluster
    from cadence.serve.config import ServeConfig
    from cadence.serve.server import ServerThread

    t0 = time.monotonic()
    cluster = LocalCluster(num_cpus=1)
    srv = None
    try:
        cluster.start()
        # (loopback candidates, as the single-machine server offers on loopback; the default, 'node', would
        # offer the node's cluster address, which Ray takes from the machine's interface here)
        fleet = FleetConfig(address=cluster.address, groups=1, media="group", media_ice="127.0.0.1")
        cfg = ServeConfig(
            engine=EngineSpec(fast=FastPath(threads=1)),
            port=0,
            api_key=KEY,
            timeline_window_s=2.0,
            deployment=fleet,
        )
        srv = ServerThread(cfg).start(timeout=240)
        print(f"\nfleet media: cluster + front end + group up in {time.monotonic() - t0:.1f} s")
        yield srv
    finally:
        if srv is not None:
            srv.stop()
        cluster.shutdown()


def _fleet(srv) -> dict:
    import httpx

    return httpx.get(f"{srv.url}/fleet", headers=AUTH, timeout=10).json()


def _udp_owner(port: int, pids: list[int]) -> list[int]:
    """Which of ``pids`` holds the UDP socket bound to ``port`` (from /proc: the socket's inode, then each
    process's open files)."""
    inodes = set()
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    out.append(pid)
                    break
            except OSError:
                pass
    return out


def _speech(seconds: float = 1.0) -> bytes:
    """A voiced test signal as a WAV file (no torch in this process: it is the front end)."""
    from cadence.serve.agent import wav_bytes

    t = np.arange(int(48000 * seconds)) / 48000
    return wav_bytes(
        (0.3 * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_group_media_streams_from_the_group_actor_not_the_front_end(group_media_fleet, monkeypatch):
    import httpx

    from cadence.devtools.testing import BackgroundClient, offer_sdp
    from cadence.fleet.frontend import RayGroup
    from cadence.fleet.remote import GroupMediaSession
    from cadence.serve import rtc

    srv = group_media_fleet
    f = _fleet(srv)
    (g,) = f["groups"]
    assert g["state"] == "up" and g["pid"] != os.getpid(), f

    # what this process (the front end) does with media: counted
    seen: collections.Counter = collections.Counter()
    for cls, name in ((rtc.VideoOut, "next_frame"), (rtc.AudioOut, "next_samples")):
        orig = getattr(cls, name)

        async def counted(self, _orig=orig, _key=cls.__name__):
            seen[_key] += 1
            return await _orig(self)

        monkeypatch.setattr(cls, name, counted)
    dispatch = RayGroup._dispatch

    def dispatch_counted(self, msg, *args):
        seen[type(msg).__name__] += 1
        return dispatch(self, msg, *args)

    monkeypatch.setattr(RayGroup, "_dispatch", dispatch_counted)
    answers = []
    start = GroupMediaSession.start

    async def start_kept(self, *a):
        ans = await start(self, *a)
        answers.append(ans.sdp)
        return ans

    monkeypatch.setattr(GroupMediaSession, "start", start_kept)

    created: dict = {}
    seconds = 6.0
    c = BackgroundClient(
        srv.url,
        seconds,
        api_key=KEY,
        connect_timeout=60.0,
        speak_wav=_speech(),
        speak_after_s=1.0,
        created=created,
    )

    def streaming():
        sid, token = created.get("session_id"), created.get("token")
        if not sid:
            return None
        st = httpx.get(
            f"{srv.url}/sessions/{sid}", headers={"authorization": f"Bearer {token}"}, timeout=10
        ).json()
        return st if st["state"] == "streaming" and st["fps"] > 0 else None

    st = wait_for(streaming, 60, "the session streaming")
    sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}
    assert st["group"] == 0 and st["preset"] == "character" and st["errors"] == [], st

    # the answer's ICE candidates are UDP sockets of the group actor's process, not of this one
    (sdp,) = answers
    cands = [ln.split() for ln in sdp.splitlines() if ln.startswith("a=candidate:")]
    udp = [(c[4], int(c[5])) for c in cands if c[2].lower() == "udp"]
    assert udp and all(ip == "127.0.0.1" for ip, _ in udp), cands
    for _, port in udp:
        assert _udp_owner(port, [g["pid"], os.getpid()]) == [g["pid"]], (port, g["pid"], os.getpid())

    # the API on a session whose media is on the group: /prompt (the group's chunk index), /metrics
    r = httpx.post(
        f"{srv.url}/sessions/{sid}/prompt", json={"prompt": "a calm face"}, headers=auth, timeout=10
    )
    assert r.status_code == 200 and isinstance(r.json()["from_chunk"], int) and r.json()["from_chunk"] > 0, (
        r.text
    )

    def series():
        text = httpx.get(f"{srv.url}/metrics", headers=AUTH, timeout=10).text
        return text if f'cadence_session_fps{{session="{sid}"}}' in text else None

    metrics = wait_for(series, 5, "the session's series on /metrics")
    assert (
        "cadence_chunk_latency_ms_count 0.0" not in metrics
        and 'cadence_worker_memory_bytes{group="0"' in metrics
    )
    # draining works as in the other mode: the live session goes on, a new one is refused
    assert (
        httpx.post(f"{srv.url}/fleet/groups/{g['name']}/drain", headers=AUTH, timeout=10).status_code == 200
    )
    r = httpx.post(
        f"{srv.url}/sessions", json={"sdp": offer_sdp(), "type": "offer"}, headers=AUTH, timeout=30
    )
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert (
        httpx.delete(f"{srv.url}/fleet/groups/{g['name']}/drain", headers=AUTH, timeout=10).status_code == 200
    )

    res = c.join(timeout=seconds + 60)
    assert res.error is None, res.error
    fps, audio = res.video_fps(), res.audio_seconds
    print(
        f"\ngroup media: client {fps:.2f} fps video, {audio:.1f} s audio; the group's session sent "
        f"{res.report['video_frames_sent']} video / {res.report['audio_frames_sent']} audio frames; this "
        f"process: {dict(seen)}"
    )
    assert fps >= 23.5, (fps, res.media_fps(3750))
    assert audio >= seconds - 1.0, audio
    rep = res.report
    assert rep["state"] == "closed" and rep["close_reason"] == "client" and rep["errors"] == [], rep
    assert rep["video_frames_sent"] >= 24 * (seconds - 1) and rep["audio_frames_sent"] >= 50 * (
        seconds - 1
    ), rep
    assert rep["timeline"] and rep["worker_chunks"] and rep["agent_audio_to_frame_ms"], rep
    # the media did not cross the front end: its tracks sent nothing, no chunk of frames reached it
    assert seen["VideoOut"] == 0 and seen["AudioOut"] == 0 and seen["ChunkDone"] == 0, seen
    assert seen["MediaUpdate"] >= seconds and seen["MediaClosed"] <= 1, seen
    wait_for(lambda: _fleet(srv)["free"] == 1, 10, "the group free again")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_group_media_session_ends_with_one_error_when_its_group_dies(group_media_fleet):
    import httpx

    from cadence.devtools.testing import BackgroundClient

    srv = group_media_fleet
    (g,) = wait_for(lambda: [x for x in _fleet(srv)["groups"] if x["free"]], 60, "the group up and free")
    restarts = g["restarts"]
    created: dict = {}
    c = BackgroundClient(srv.url, 10.0, api_key=KEY, connect_timeout=60.0, created=created)

    def streaming():
        ss = httpx.get(f"{srv.url}/sessions", headers=AUTH, timeout=10).json()["sessions"]
        return ss if ss and ss[0]["state"] == "streaming" and ss[0]["fps"] > 0 else None

    wait_for(streaming, 60, "the session streaming")
    time.sleep(1.0)
    t_kill = time.monotonic()
    os.kill(g["pid"], signal.SIGKILL)  # the group actor: it terminates the session's WebRTC
    sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}

    def ended():
        st = httpx.get(f"{srv.url}/sessions/{sid}", headers=auth, timeout=10).json()
        return st if st["state"] == "closed" else None

    st = wait_for(ended, 15, "the session closed after its group died")
    t_end = time.monotonic() - t_kill
    assert st["close_reason"] == "worker_error", st
    assert len(st["errors"]) == 1 and st["errors"][0].startswith(
        f"worker: worker group {g['name']} failed ("
    ), st["errors"]
    assert st["errors"][0].endswith("Ray restarts it"), st["errors"]
    # the claim is back in the registry, and Ray restarts the actor: a fresh group, up again
    wait_for(lambda: _fleet(srv)["groups"][0]["claim"] is None, 10, "the claim released")

    def back():
        x = _fleet(srv)["groups"][0]
        return x if x["restarts"] == restarts + 1 and x["state"] == "up" else None

    g2 = wait_for(back, 120, "the group restarted")
    t_back = time.monotonic() - t_kill
    assert g2["pid"] != g["pid"] and g2["incarnation"] != g["incarnation"], g2
    res = c.join(timeout=60)  # (its client saw the stream stop; its DELETE finds the session closed)
    assert res.status.get("close_reason") == "worker_error", res.status
    # the restarted actor terminates WebRTC again
    again = BackgroundClient(srv.url, 3.0, api_key=KEY, connect_timeout=60.0).join(timeout=90)
    assert again.error is None and again.video_fps() > 0 and again.report["close_reason"] == "client", (
        again.error
    )
    print(f"\ngroup died: session closed {t_end:.1f} s after the kill, group back {t_back:.1f} s after it")
