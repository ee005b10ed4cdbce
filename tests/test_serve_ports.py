"""The seams of ``cadence.serve.ports``, held against the classes that implement them (no Ray, no worker).

Each Protocol's members (attributes, properties, methods) are read from the Protocol itself, so a member added
there is checked here at once. An implementation must have every attribute (on a constructed instance) and
every method, async where the Protocol's is async and sync where it is sync, with the Protocol's parameters in
its order (an implementation may add parameters only with defaults). A type checker would say the same of
annotated code; this holds it without one (none is in the test extra). Beside the shapes, what the seams
decide: which session class a source gives, and that the manager builds a session with it.
"""

import asyncio
import inspect
import re
import types
import typing

import pytest

for _mod in ("fastapi", "aiortc", "prometheus_client"):
    pytest.importorskip(_mod, reason=f"the serve extra is not installed ({_mod})")

from fastapi import Request

from cadence.engine.recipe import EngineSpec
from cadence.fleet.config import FleetConfig
from cadence.fleet.frontend import FleetGroups, RayGroup
from cadence.fleet.media import GroupView, MediaHost
from cadence.fleet.messages import MediaSettings
from cadence.fleet.remote import GroupMediaSession, RemoteAgent
from cadence.serve import ports
from cadence.serve.agent import Agent
from cadence.serve.agents import make_agent
from cadence.serve.config import LOCAL, Local, ServeConfig
from cadence.serve.manager import SessionManager
from cadence.serve.schemas import SessionCreated
from cadence.serve.session import LiveSession
from cadence.serve.workers import LocalGroups, WorkerGroup

pytestmark = pytest.mark.timeout(60)


def _members(proto) -> dict[str, tuple[str, object]]:
    """name -> (kind, the Protocol's function or None): 'attr', 'property', 'method' or 'async'."""
    out: dict[str, tuple[str, object]] = {}
    for cls in reversed(proto.__mro__):
        if not getattr(cls, "_is_protocol", False) or cls is typing.Protocol:
            continue
        for name in cls.__dict__.get("__annotations__", {}):
            out[name] = ("attr", None)
        for name, v in vars(cls).items():
            if name.startswith("_") and name != "__call__":
                continue
            if isinstance(v, property):
                out[name] = ("property", None)
            elif inspect.isfunction(v):
                out[name] = ("async" if inspect.iscoroutinefunction(v) else "method", v)
    return out


def _params(fn) -> list[inspect.Parameter]:
    ps = list(inspect.signature(fn).parameters.values())
    return ps[1:] if ps and ps[0].name == "self" else ps


def _mismatches(proto, impl, instance) -> list[str]:
    bad = []
    for name, (kind, fn) in _members(proto).items():
        if kind in ("attr", "property"):
            if not hasattr(instance, name):
                bad.append(f"{name}: missing")
            continue
        got = getattr(impl, name, None)
        if got is None or not callable(got):
            bad.append(f"{name}(): missing")
            continue
        if (kind == "async") != inspect.iscoroutinefunction(got):
            bad.append(f"{name}(): {'not ' if kind == 'async' else ''}async")
        want, have = _params(fn), _params(got)
        names = [p.name for p in have[: len(want)]]
        if names != [p.name for p in want]:
            bad.append(f"{name}(): parameters {names}, the Protocol's {[p.name for p in want]}")
        extra = [p.name for p in have[len(want) :] if p.default is p.empty and p.kind <= p.KEYWORD_ONLY]
        if extra:
            bad.append(f"{name}(): required parameters the Protocol does not pass: {extra}")
    return bad


def test_the_checker_finds_what_is_missing_or_wrong():
    class Half:  # a SessionGroup without restart, send sync but with another parameter name
        index, session_id, transport_s, latency_profile, ready, info = 0, None, 0.0, None, None, None

        def send(self, message) -> None: ...

    assert set(_members(ports.SessionGroup)) == {
        "index",
        "session_id",
        "transport_s",
        "latency_profile",
        "ready",
        "info",
        "send",
        "restart",
    }
    assert sorted(_mismatches(ports.SessionGroup, Half, Half())) == [
        "restart(): missing",
        "send(): parameters ['message'], the Protocol's ['msg']",
    ]

    class AsyncSend(Half):
        async def send(self, msg) -> None: ...

        async def restart(self, hard) -> None: ...

    assert sorted(_mismatches(ports.SessionGroup, AsyncSend, AsyncSend())) == [
        "restart(): required parameters the Protocol does not pass: ['hard']",
        "send(): async",
    ]


@pytest.fixture(scope="module")
def sides():
    """One constructed object of every implementation (nothing started: no process, no Ray)."""
    cfg = ServeConfig(engine=EngineSpec(model="tiny"))
    fleet_cfg = ServeConfig(
        engine=EngineSpec(model="tiny"), deployment=FleetConfig(address="unused", media="group")
    )
    loop = asyncio.new_event_loop()
    mgr = SessionManager(cfg)
    wg = mgr.groups[0]
    fleet = FleetGroups(fleet_cfg)
    ray_group = RayGroup(fleet, "cadence-group-0", 0)
    host = MediaHost(wg, wg.spec.recipe.config, loop, lambda msg: None)
    try:
        yield types.SimpleNamespace(
            cfg=cfg,
            mgr=mgr,
            wg=wg,
            fleet=fleet,
            ray_group=ray_group,
            view=GroupView(wg, loop),
            host=host,
            live=LiveSession(mgr, "s0", wg, make_agent("mirror"), mgr.engine_cfg, "p", 0),
            remote=GroupMediaSession(mgr, "s1", ray_group, make_agent("mirror"), mgr.engine_cfg, "p", 0),
        )
    finally:
        host._updates.cancel()
        host.loop.call_soon_threadsafe(host.loop.stop)
        host.thread.join(5)
        loop.close()


def _documented() -> set[tuple[str, str]]:
    """(Protocol, implementation) as the table of ``cadence.serve.ports``' docstring gives them."""
    out, proto = set(), None
    for line in ports.__doc__.splitlines():
        head = re.match(r"^    ([A-Z]\w+)\s", line)
        if head:
            proto = head.group(1)
        impls = re.match(r"^\s+-> (.+)$", line)
        if impls:
            out |= {(proto, name.strip()) for name in impls.group(1).split(",")}
    return out


def test_every_implementation_has_its_protocols_members(sides):
    s = sides
    cases = [
        (ports.SessionGroup, WorkerGroup, s.wg),
        (ports.SessionGroup, RayGroup, s.ray_group),
        (ports.SessionGroup, GroupView, s.view),
        (ports.GroupPort, WorkerGroup, s.wg),
        (ports.GroupPort, RayGroup, s.ray_group),
        (ports.GroupSource, LocalGroups, s.mgr.source),
        (ports.GroupSource, FleetGroups, s.fleet),
        (ports.SessionHost, SessionManager, s.mgr),
        (ports.SessionHost, MediaHost, s.host),
        (ports.SessionPort, LiveSession, s.live),
        (ports.SessionPort, GroupMediaSession, s.remote),
        (ports.SessionAgent, Agent, s.live.agent),
        (ports.SessionAgent, RemoteAgent, s.remote.agent),
        (ports.SessionSettings, ServeConfig, s.cfg),
        (ports.SessionSettings, MediaSettings, MediaSettings()),
        (ports.Deployment, FleetConfig, FleetConfig(address="unused")),
        (ports.Deployment, Local, LOCAL),
    ]
    tested = {
        (p.__name__, f"{impl.__module__.removeprefix('cadence.')}.{impl.__name__}") for p, impl, _ in cases
    }
    assert tested == _documented()  # the docstring's table is what is checked here, row for row
    bad = {
        f"{impl.__name__} as {proto.__name__}": m
        for proto, impl, obj in cases
        if (m := _mismatches(proto, impl, obj))
    }
    assert not bad, bad
    # a session class is a SessionFactory: called with the Protocol's parameters, in its order
    want = [p.name for p in _params(ports.SessionFactory.__call__)]
    for cls in (LiveSession, GroupMediaSession):
        assert [p.name for p in inspect.signature(cls).parameters.values()] == want, cls


def test_each_source_says_which_session_class_a_group_gets_and_the_manager_builds_that(sides):
    s = sides
    assert s.mgr.source.session_factory(s.wg) is LiveSession
    assert s.fleet.session_factory(s.ray_group) is GroupMediaSession  # --fleet-media group
    frontend = FleetGroups(
        ServeConfig(engine=EngineSpec(model="tiny"), deployment=FleetConfig(address="unused"))
    )
    assert frontend.session_factory(RayGroup(frontend, "g", 0)) is LiveSession  # frames through Ray
    # the manager builds a new session with its source's class, whatever that is
    built = []

    class Stub:
        def __init__(self, server, sid, group, agent, engine_cfg, prompt, seed):
            built.append((server, group, prompt, seed))
            self.sid, self.state, self.t_created = sid, "starting", 0.0

        async def start(self, image, sdp, sdp_type):
            return types.SimpleNamespace(sdp="v=0 answer", type="answer")

    source = LocalGroups([s.wg], Stub)
    mgr = SessionManager(s.cfg, source)
    assert mgr.source is source and mgr.groups is source.groups
    s.wg.ready.set()  # (free: ready and holding no session; no process behind it)
    try:
        sdp = "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=fingerprint:sha-256 00\r\n"
        created = asyncio.run(
            mgr.create(
                sdp=sdp,
                sdp_type="offer",
                image_bytes=None,
                prompt="hi",
                agent="mirror",
                seed=7,
                t_request=1.0,
            )
        )
    finally:
        s.wg.ready.clear()
        s.wg.session_id = None
    assert built == [(mgr, s.wg, "hi", 7)] and (created.sdp, created.type) == ("v=0 answer", "answer")
    assert mgr.sessions[created.session_id].t_created == 1.0
    # the answer's JSON: the documented fields, in the documented order
    assert (
        list(created.as_json()) == list(SessionCreated.model_fields) and created.as_json()["preset"] == "tiny"
    )


def test_the_app_is_built_with_the_source_and_the_routes_it_is_given(sides):
    """``create_app(cfg, source=, routes=)``: the manager serves on that source, and each extra route set is
    added with the server's ``Access`` (the operator key's check), ahead of the server's own routes."""
    from fastapi.testclient import TestClient

    from cadence.serve.app import create_app
    from cadence.serve.guard import bearer

    source = LocalGroups([sides.wg], LiveSession)
    given = []

    def extra(app, access):
        given.append(access)

        @app.get("/extra")
        async def extra_route(request: Request):
            access.require_operator(bearer(request), "the extra route")
            return {"ok": True}

    key = "k" * 40
    app = create_app(ServeConfig(engine=EngineSpec(model="tiny"), api_key=key), source=source, routes=[extra])
    mgr = app.state.manager
    assert mgr.source is source and given == [mgr.access]
    assert next(iter(app.openapi()["paths"])) == "/extra"
    client = TestClient(app)  # (no lifespan: nothing starts)
    assert client.get("/extra").status_code == 401
    assert client.get("/extra", headers={"authorization": f"Bearer {key}"}).json() == {"ok": True}
    # and without routes given, a server without a fleet has none beyond its own
    assert (
        "/extra"
        not in create_app(ServeConfig(engine=EngineSpec(model="tiny")), source=source).openapi()["paths"]
    )
