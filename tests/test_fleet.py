"""The fleet (issue 19): the registry's rules and the capacity model without Ray, then a real two-node Ray
cluster on this machine (``ray start --head`` + ``ray start --address``, loopback only) running two
``character`` groups on the CPU behind one front end.

The real test, in order: two sessions stream to aiortc clients through the front end, one per group (one
group per node); the actor of one group is killed (SIGKILL) mid-session -> that session ends with one clear
error, Ray restarts the actor and the registry counts the restart, while the other session keeps >= 23.5 fps
in every window (an expected failure, with its figures, below 4 cores: see ``MIN_CORES_TWO_SESSIONS``);
draining both groups admits nobody (503) while the busy one's session streams to its end; a restarted
front end finds the same groups (nothing rebuilt); the second node stops -> its group leaves the registry.
"""

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
import types

import pytest
from fleet_support import FakeRemote, needs_ray, wait_for

from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.errors import ConfigError
from cadence.fleet.capacity import CapacityModel, gpus_needed, simulate
from cadence.fleet.config import FleetConfig, fleet_placement
from cadence.fleet.state import FleetState

# ---- the registry's rules (no Ray) -------------------------------------------------------------------


def _ping(inc="a", node="n1", ready=True, **kw):
    return {"incarnation": inc, "node_id": node, "pid": 1, "ready": ready, "info": {"preset": "x"}, **kw}


def test_state_admission_is_one_claim_per_group_and_fleet_wide():
    s = FleetState(lease_s=10.0, max_duration_s=50.0)
    s.observe("g0", 0, _ping("a", "n1"), 0.0)
    s.observe("g1", 1, _ping("b", "n2", ready=False), 0.0)
    assert s.groups["g1"].state == "starting" and s.groups["g0"].state == "up"
    assert s.claim("fe1", "c1", 1.0) == "g0"
    assert s.claim("fe2", "c2", 1.0) is None  # g1 is not ready: the fleet is full
    assert s.retry_after(11.0) == 40  # g0's session ends at its max duration (50 s after 1.0)
    s.observe("g1", 1, _ping("b", "n2"), 2.0)
    assert s.claim("fe2", "c2", 2.0) == "g1"
    assert not s.release("fe1", "g1", "c1")  # not fe1's claim
    assert s.release("fe1", "g0", "c1") and s.groups["g0"].free
    snap = s.snapshot(3.0)
    assert snap["free"] == 1 and snap["sessions"] == 1 and [g["name"] for g in snap["groups"]] == ["g0", "g1"]


def test_state_restart_node_loss_lease_and_drain():
    s = FleetState(lease_s=5.0)
    s.observe("g0", 0, _ping("a", "n1"), 0.0)
    s.observe("g1", 1, _ping("b", "n2"), 0.0)
    assert s.claim("fe1", "c1", 0.0) == "g0"
    s.observe("g0", 0, None, 1.0)  # a check failed: no session is admitted there; the claim stays
    assert s.groups["g0"].state == "restarting" and s.groups["g0"].claim == ("fe1", "c1")
    s.observe("g0", 0, _ping("a", "n1"), 1.5)  # only slow: the same incarnation, still held
    assert s.groups["g0"].claim == ("fe1", "c1") and not s.groups["g0"].free and s.groups["g0"].restarts == 0
    s.observe("g0", 0, None, 1.6)  # the actor died: a new incarnation holds no claim
    s.observe("g0", 0, _ping("a2", "n1", ready=False), 2.0)  # a new incarnation answers: one restart
    assert s.groups["g0"].restarts == 1 and s.groups["g0"].state == "starting"
    s.observe("g0", 0, _ping("a2", "n1"), 3.0)
    assert s.groups["g0"].restarts == 1 and s.groups["g0"].free
    # node n2 leaves: g1 leaves the registry; an answer from a node the cluster no longer lists is ignored
    assert s.nodes({"n1"}) == ["g1"] and "g1" not in s.groups
    s.observe("g1", 1, _ping("b", "n2"), 4.0, alive_nodes={"n1"})
    assert "g1" not in s.groups and s.snapshot(4.0)["lost"] == ["g1"]
    # it comes back on another node (a new incarnation): in again, its restart counted
    s.observe("g1", 1, _ping("b2", "n3"), 5.0, alive_nodes={"n1", "n3"})
    assert s.groups["g1"].node_id == "n3"
    # drain: no new session there; survives the group leaving and coming back
    assert s.drain("g1") and not s.drain("nope")
    assert s.claim("fe1", "c2", 6.0) == "g0" and s.claim("fe1", "c3", 6.0) is None
    # a front end not heard from for lease_s loses its claims (returned for closing)
    s.heartbeat("fe1", {"g0": ("c2", "sid-2")}, 7.0)
    assert s.groups["g0"].claim_sid == "sid-2"
    assert s.expire(11.0) == [] and s.expire(12.5) == [("g0", "sid-2")] and s.groups["g0"].free
    # after a registry restart, a heartbeat gives the claims back
    s2 = FleetState()
    s2.observe("g0", 0, _ping("a2", "n1", restarted=True), 0.0)
    assert s2.groups["g0"].restarts == 1
    s2.heartbeat("fe9", {"g0": ("c9", "sid-9")}, 0.0)
    assert s2.groups["g0"].claim == ("fe9", "c9") and s2.claim("fe8", "x", 0.0) is None


def test_fleet_config_checks():
    assert FleetConfig(placement="cuda:0+cuda:1").bundle() == {"CPU": 1.0, "GPU": 2.0}
    assert FleetConfig().bundle() == {"CPU": 1.0}
    assert str(fleet_placement("cuda", 2)) == "cuda:0+cuda:1" and str(fleet_placement("cpu", 1)) == "cpu"
    for bad in (
        {"placement": "cuda:0+cpu"},
        {"groups": -1},
        {"lease_s": 0.5, "heartbeat_s": 0.5},
        {"address": ""},
    ):
        with pytest.raises(ConfigError):
            FleetConfig(**bad)


# ---- the front end's group source against a fake registry (no Ray) -------------------------------------


def test_front_end_admission_claims_fleet_wide_and_gives_back_what_it_did_not_use():
    from cadence.engine.messages import Died
    from cadence.fleet.frontend import FleetGroups
    from cadence.serve.config import ServeConfig

    state = FleetState()
    calls: list = []

    def heartbeat(fe, claims):
        state.heartbeat(fe, claims, 0.0)
        return state.snapshot(0.0)

    def claim(fe, cid):
        return {"group": state.claim(fe, cid, 0.0), "retry_after": state.retry_after(0.0)}

    def release(fe, name, cid):
        return state.release(fe, name, cid)

    info = {
        "preset": "character",
        "device": "cpu",
        "tp": 1,
        "build_ms": 1.0,
        "threads": 1,
        "fast_path": {},
        "notes": [],
        "warmup": {"steady_chunk_ms": 50.0, "interval_ms": 50.0},
        "preopen_ms": 1.0,
        "frame_transport": "pipe",
        "frames_per_chunk": 4,
        "audio_samples_per_chunk": 8000,
    }
    for i in (0, 1):
        state.observe(f"cadence-group-{i}", i, {**_ping(f"inc{i}", "n1"), "info": info}, 0.0)

    async def run():
        src = FleetGroups(ServeConfig(deployment=FleetConfig(address="unused")))
        src.registry = types.SimpleNamespace(
            heartbeat=FakeRemote(heartbeat, calls),
            claim=FakeRemote(claim, calls),
            release=FakeRemote(release, calls),
        )
        src._route = lambda g, msg: None

        class Hang:  # a group actor whose poll never answers (no replies), until the test fails it
            pending: list = []

            def remote(self, *args):
                f = asyncio.get_running_loop().create_future()
                Hang.pending.append(f)
                return f

        src._actor = lambda name: types.SimpleNamespace(poll=Hang(), send=Hang())
        await src.sync()
        assert [g.name for g in src.groups] == ["cadence-group-0", "cadence-group-1"]
        assert all(g.free for g in src.groups) and src.groups[0].transport_s == 0.015
        assert src.acquire() is None  # outside an admission: nothing (the fleet claims first)
        # a request that is refused after its claim (429, a bad image) gives the group back
        async with src.admission():
            pass
        assert state.groups["cadence-group-0"].free and calls[-1][0] == "release"
        # a request that takes it: bound to the session, reported in the heartbeat, released at its end
        async with src.admission():
            g = src.acquire()
            g.session_id = "sid-1"
        assert g.name == "cadence-group-0" and not state.groups[g.name].free and g._poll is not None
        await src.sync()
        assert state.groups[g.name].claim_sid == "sid-1" and not g.free
        async with src.admission():  # the next request gets the other group
            g2 = src.acquire()
            g2.session_id = "sid-2"
        assert g2.name == "cadence-group-1"
        async with src.admission():  # the fleet is full: no claim, 503 upstream
            assert src.acquire() is None
        # the group dies: not ready (its closing session never talks to the restarted actor) until released
        g._dispatch(Died("gone"))
        state.observe(g.name, 0, {**_ping("inc0-b", "n1"), "info": info}, 1.0)  # Ray restarted it
        await src.sync()
        assert not g.ready.is_set() and g.state == "up"
        src.release(g, "sid-1")
        await src.sync()
        assert g.ready.is_set() and g.free and state.groups[g.name].restarts == 1
        # a fast restart: the heartbeat brings the restarted actor before the failed poll reports the death;
        # the death is the old incarnation's (the one the poll talked to), so the new one serves after release
        await asyncio.sleep(
            0.01
        )  # g2's poll running (started at its acquire), on the incarnation it had then
        assert any(not f.done() for f in Hang.pending)
        old = g2.incarnation
        state.observe(g2.name, 1, {**_ping("inc1-b", "n1"), "info": info}, 2.0)
        await src.sync()
        assert g2.incarnation != old
        for f in Hang.pending:  # g2's poll (the only one still waiting): its actor is gone
            if not f.done():
                f.set_exception(RuntimeError("The actor is unavailable"))
        await asyncio.sleep(0.01)
        assert not g2.ready.is_set() and g2.state == "restarting" and g2.died_incarnation == old
        src.release(g2, "sid-2")
        await src.sync()  # (the next heartbeat: the registry says the restarted actor is up)
        assert state.groups["cadence-group-1"].free and g2.ready.is_set() and g2.free

    asyncio.run(run())
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()  # no Ray started by the fake


# ---- the capacity model -----------------------------------------------------------------------------------


def _erlang_c(c: int, a: float) -> float:
    """M/M/c: the probability that an arrival waits (c servers, a erlangs offered)."""
    top = a**c / math.factorial(c) * c / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top)


def test_a_groups_info_read_back_by_the_front_end_leaves_out_what_the_web_side_adds():
    """A group reports ``info_dict()`` (its WorkerInfo's fields plus ``share`` and ``mps``, which the web side
    adds); the fleet front end reads it back with ``WorkerInfo.of``. Building it with ``WorkerInfo(**info)``
    failed every fleet server's start once ``mps`` was added ("unexpected keyword argument 'mps'")."""
    import dataclasses

    from cadence.engine.messages import WorkerInfo

    info = WorkerInfo("tiny", "cpu", 1, 1.0, 1, {}, [], None, 0.0, "pipe", 4, 8000)
    d = {**dataclasses.asdict(info), "share": {"placement": "cpu"}, "mps": False}
    with pytest.raises(TypeError):
        WorkerInfo(**d)
    assert WorkerInfo.of(d) == info


def test_capacity_simulation_against_erlang_c_and_its_monotonicity():
    # M/M/c with c=2, arrival 1/s, mean session 1 s (load 1 erlang): P(wait) = Erlang C = 1/3, mean wait
    # = C / (c*mu - lambda) = 1/3 s. The simulation (exponential lengths, no failures) must agree.
    m = CapacityModel(
        arrival_per_s=1.0, session_mean_s=1.0, session_dist="exp", groups_per_node=1, gpus_per_group=1
    )
    r = simulate(m, groups=2, sessions=60_000, seed=1)
    assert abs(r["p_wait"] - 1 / 3) < 0.02, r
    assert abs(r["mean_wait_s"] - 1 / 3) < 0.03, r
    # more groups never wait longer; failures only add waiting
    a = simulate(m, groups=3, sessions=20_000, seed=2)["p99_wait_s"]
    b = simulate(m, groups=4, sessions=20_000, seed=2)["p99_wait_s"]
    assert b <= a
    mf = CapacityModel(**{**m.__dict__, "group_mtbf_s": 20.0, "restart_s": 30.0})
    assert simulate(mf, groups=3, sessions=20_000, seed=2)["p99_wait_s"] >= a
    # the search against M/M/c: P(wait > t) = C(c, a) exp(-(c mu - lambda) t); the fewest c with P(wait > 1 s)
    # <= 1% is 37 at 24 erlangs (0.2/s x 120 s); the simulation's p99 may land a group either side
    lam, mean = 0.2, 120.0
    c = next(c for c in range(25, 60) if _erlang_c(c, lam * mean) * math.exp(-(c / mean - lam)) <= 0.01)
    assert c == 37
    exp1 = CapacityModel(arrival_per_s=lam, session_mean_s=mean, session_dist="exp", groups_per_node=1)
    assert abs(gpus_needed(exp1, sessions=20_000, seed=3)["groups"] - c) <= 2
    # the answer: the fewest GPUs with p99 admission wait <= target, whole nodes
    m8 = CapacityModel(
        arrival_per_s=0.2, session_mean_s=120.0, groups_per_node=8, gpus_per_group=1, target_p99_wait_s=1.0
    )
    out = gpus_needed(m8, sessions=20_000, seed=3)
    assert out["gpus"] == out["groups"] * 1 and out["groups"] % 8 == 0 and out["p99_wait_s"] <= 1.0
    below = simulate(m8, groups=out["groups"] - 8, sessions=20_000, seed=3)
    assert below["p99_wait_s"] > 1.0  # one node fewer misses the target
    assert out["groups"] >= 0.2 * 120.0  # at least the offered load (24 erlangs)


# ---- the real thing: a two-node Ray cluster on this machine ------------------------------------------------

KEY = "fleet-test-operator-key-0123456789"
#: Below this many cores the fps check is an expected failure (with its figures): two character sessions on
#: 2 cores run at 13.4 to 22.9 fps on the single-machine server already (docs/fleet.md, "Measured").
MIN_CORES_TWO_SESSIONS = 4
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_nodes_two_groups_kill_a_group_drain_restart_front_end_lose_a_node():
    needs_ray()
    import httpx
    import ray

    from cadence.devtools.testing import BackgroundClient, offer_sdp
    from cadence.fleet.cluster import LocalCluster
    from cadence.serve.config import ServeConfig
    from cadence.serve.server import ServerThread

    t0 = time.monotonic()
    cluster = LocalCluster(num_cpus=1)
    srv = None
    try:
        cluster.start()
        node_b = cluster.add_node(num_cpus=1)
        t_cluster = time.monotonic() - t0
        fleet = FleetConfig(address=cluster.address, groups=2, lease_s=10.0)
        cfg = ServeConfig(
            engine=EngineSpec(fast=FastPath(threads=1)),
            port=0,
            api_key=KEY,
            timeline_window_s=2.0,
            deployment=fleet,
        )
        srv = ServerThread(cfg).start(timeout=240)
        t_up = time.monotonic() - t0

        def fleet_state():
            return httpx.get(f"{srv.url}/fleet", headers=AUTH, timeout=10).json()

        f = fleet_state()
        groups = {g["name"]: g for g in f["groups"]}
        assert sorted(groups) == ["cadence-group-0", "cadence-group-1"], f
        assert all(g["state"] == "up" for g in groups.values()), f
        assert len({g["node_id"] for g in groups.values()}) == 2, f  # one group per node (1 CPU each)
        head_id = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
        victim = next(n for n, g in groups.items() if g["node_id"] == head_id)
        other = next(n for n in groups if n != victim)
        incarnations = {n: g["incarnation"] for n, g in groups.items()}

        # two sessions through the front end (one per group); both stream
        seconds = 32.0
        a = BackgroundClient(srv.url, seconds, api_key=KEY, connect_timeout=60.0)
        time.sleep(1.5)
        b = BackgroundClient(srv.url, seconds, api_key=KEY, connect_timeout=60.0)

        def streaming():
            ss = httpx.get(f"{srv.url}/sessions", headers=AUTH, timeout=10).json()["sessions"]
            return (
                ss if len(ss) == 2 and all(s["state"] == "streaming" and s["fps"] > 0 for s in ss) else None
            )

        sessions = wait_for(streaming, 60, "two streaming sessions")
        by_group = {f"cadence-group-{s['group']}": s["session_id"] for s in sessions}
        assert sorted(by_group) == sorted(groups), sessions
        assert fleet_state()["sessions"] == 2 and fleet_state()["free"] == 0
        # the fleet is full: one more session is refused, 503 + Retry-After (fleet-wide)
        r = httpx.post(
            f"{srv.url}/sessions", json={"sdp": offer_sdp(), "type": "offer"}, headers=AUTH, timeout=30
        )
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text

        # kill the victim group's actor mid-session
        time.sleep(4.0)
        t_kill = time.monotonic()
        os.kill(groups[victim]["pid"], signal.SIGKILL)

        def restarted():
            g = {x["name"]: x for x in fleet_state()["groups"]}.get(victim)
            return g if g and g["restarts"] >= 1 and g["state"] == "up" else None

        g_after = wait_for(restarted, 120, "the killed group back up after one restart")
        t_restart = time.monotonic() - t_kill
        assert g_after["restarts"] == 1 and g_after["incarnation"] != incarnations[victim], g_after

        # drain both groups: the busy one keeps its live session (it streams to its end, below), the free
        # one takes no new session: the fleet admits nobody
        for name in (other, victim):
            r = httpx.post(f"{srv.url}/fleet/groups/{name}/drain", headers=AUTH, timeout=10)
            assert r.status_code == 200 and r.json()["draining"] is True, r.text
        assert httpx.post(f"{srv.url}/fleet/groups/nope/drain", headers=AUTH, timeout=10).status_code == 404
        r = httpx.post(
            f"{srv.url}/sessions", json={"sdp": offer_sdp(), "type": "offer"}, headers=AUTH, timeout=30
        )
        assert r.status_code == 503, r.text

        res = {}
        for c in (a, b):
            out = c.join(timeout=seconds + 90)
            res[out.session_id] = out
        dead, alive = res[by_group[victim]], res[by_group[other]]
        # the victim's client: one clear error, the session closed for it
        st = dead.status
        assert st["state"] == "closed" and st["close_reason"] == "worker_error", st
        assert len(st["errors"]) == 1 and f"worker group {victim} failed" in st["errors"][0], st["errors"]
        # the other session never fell below 23.5 fps: every full 2-s window (the server's count of frames
        # sent) and the client's received rate over the whole stream, through the kill and the restart
        assert alive.error is None, alive.error
        report = alive.report
        assert report["state"] == "closed" and report["close_reason"] == "client" and not report["errors"]
        windows = [w for w in report["timeline"] if not w.get("partial")]
        fps_windows = [w["fps"] for w in windows]
        f = fleet_state()  # the drained group that finished its session is not free; undrained, both are
        assert f["free"] == 0 and all(g["draining"] for g in f["groups"]), f
        for name in (other, victim):
            assert (
                httpx.delete(f"{srv.url}/fleet/groups/{name}/drain", headers=AUTH, timeout=10).status_code
                == 200
            )
        wait_for(lambda: fleet_state()["free"] == 2, 10, "both groups free after undrain")
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert "cadence_fleet_restarts 1.0" in metrics and 'cadence_fleet_groups{state="up"} 2.0' in metrics

        # a front end that restarts finds the same groups: nothing rebuilt, nothing restarted
        srv.stop()
        srv = ServerThread(cfg).start(timeout=120)
        f = fleet_state()
        assert {g["name"]: g["incarnation"] for g in f["groups"]} == {
            victim: g_after["incarnation"],
            other: incarnations[other],
        }, f
        assert f["restarts"] == 1 and f["free"] == 2

        # the second node leaves: its group leaves the registry (and the front end's groups)
        t_stop = time.monotonic()
        node_b.stop()

        def dropped():
            s = fleet_state()
            return s if [g["name"] for g in s["groups"]] == [victim] and s["lost"] == [other] else None

        f = wait_for(dropped, 60, "the stopped node's group to leave the registry")
        t_drop = time.monotonic() - t_stop
        h = httpx.get(f"{srv.url}/healthz", timeout=10).json()
        assert h["groups"] == 1 and h["free"] == 1, h

        # the operator's command line reads and drains the same registry
        def cli(*argv):
            out = subprocess.run(
                [sys.executable, "-m", "cadence", "fleet", *argv, "--ray", cluster.address],
                capture_output=True,
                text=True,
                timeout=120,
                env=cluster.env,
            )
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stdout

        assert "draining" in cli("drain", victim) and fleet_state()["groups"][0]["draining"] is True
        assert fleet_state()["free"] == 0  # (one call of the CLI: each is a Ray driver, ~15 s here)
        print(
            f"\nfleet: cluster {t_cluster:.1f} s, front end + 2 groups up {t_up:.1f} s, killed group back "
            f"{t_restart:.1f} s, node loss -> registry {t_drop:.1f} s; the other session: fps per 2-s window "
            f"{fps_windows}, client {alive.video_fps():.2f} fps"
        )
        # (last, so that every check above has run when the machine is too small for this one)
        assert len(windows) >= 12, fps_windows
        cores = os.cpu_count() or 1
        if min(fps_windows) < 23.5 and cores < MIN_CORES_TWO_SESSIONS:
            pytest.xfail(
                f"the other session fell to {min(fps_windows)} fps on this {cores}-core machine: two "
                f"character sessions need more than {cores} cores (the single-machine server, no Ray, "
                "measured 13.4 to 22.9 fps with two sessions here: docs/fleet.md); strict from "
                f"{MIN_CORES_TWO_SESSIONS} cores"
            )
        assert min(fps_windows) >= 23.5, fps_windows
        assert alive.video_fps() >= 23.5, (alive.video_fps(), alive.media_fps(3750))
    finally:
        if srv is not None:
            srv.stop()
        cluster.shutdown()
