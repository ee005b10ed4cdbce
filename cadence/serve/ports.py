"""The seams between the server and what it runs on, declared: ``typing.Protocol`` classes that the local
side (``cadence.serve``) and the Ray side (``cadence.fleet``) implement. Nothing here runs; it says who may
rely on what, and ``tests/test_serve_ports.py`` holds every implementation below against its Protocol (the
table is read from this docstring).

    SessionGroup  a worker group as the session on it sees it (send, restart, ready, the warm-up's info)
                  -> serve.workers.WorkerGroup, fleet.frontend.RayGroup, fleet.media.GroupView
    GroupPort     a worker group as the session manager lists, admits and restarts it
                  -> serve.workers.WorkerGroup, fleet.frontend.RayGroup
    GroupSource   where the manager's groups come from: start/stop, admission, acquire/release, the
                  Retry-After hint and which session class a new session on a group is (session_factory)
                  -> serve.workers.LocalGroups, fleet.frontend.FleetGroups
    SessionHost   what a session reports to: settings, metrics, background tasks, the group given back,
                  the closed session's report
                  -> serve.manager.SessionManager, fleet.media.MediaHost
    SessionPort   a session as the manager and the routes use it
                  -> serve.session.LiveSession, fleet.remote.GroupMediaSession
    SessionAgent  a session's agent as the routes use it (speak, interrupt, what is queued)
                  -> serve.agent.Agent, fleet.remote.RemoteAgent
    SessionSettings  the serving settings a session reads
                  -> serve.config.ServeConfig, fleet.messages.MediaSettings
    Deployment    what ``ServeConfig.deployment`` holds: where the groups run, their source, its extra routes
                  -> serve.config.Local, fleet.config.FleetConfig

(``SessionFactory``: a session class, called with what a new session needs; ``WorkerSpeed``: how a new
session plans with its group's worker.)

The two sides meet only here: the manager takes a ``GroupSource`` and builds each session with the
source's ``session_factory``; a ``LiveSession`` talks to a ``SessionHost`` and its ``SessionGroup``, never to
the class behind them (a fleet's ``GroupMediaSession`` also uses its ``RayGroup``: the fleet's own class).
``cadence.serve`` never imports ``cadence.fleet`` (the layers, ``tests/test_layers.py``): ``ServeConfig.deployment``
is typed by :class:`Deployment`, which ``Local`` and ``FleetConfig`` implement (``serve.config.DEPLOYMENTS``).

Torch-free, FastAPI-free, and it imports no module of ``cadence.serve`` (``cadence.serve.config`` imports it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import numpy as np

    from cadence.engine.messages import WorkerInfo
    from cadence.serve.pacing import LatencyProfile

#: A worker reply for the manager: ``route(group, msg)`` on the event loop (``msg``: a dataclass of
#: ``cadence.engine.messages``, or on a fleet a ``cadence.fleet.messages`` update of a remote session).
Route = Callable[[Any, object], None]
#: Routes a server adds beside its own: ``add(app, access)`` with the FastAPI app and its
#: ``cadence.serve.guard.Access`` (the operator key's check).
ExtraRoutes = Callable[[Any, Any], None]


class WorkerSpeed(NamedTuple):
    """How a new session plans with its group's worker, in seconds (``serve.session.worker_speed``)."""

    lead: float
    """How long before a chunk is due it is handed to the worker."""
    latency: float
    """One chunk, plan -> frames back, as the web side sees it."""
    interval: float
    """The sustained time per chunk."""


class SessionSettings(Protocol):
    """The serving settings a session reads (``ServeConfig``'s names; ``cadence.fleet.messages.MediaSettings``
    carries the same to a group actor)."""

    @property
    def sync_marker_every(self) -> int: ...
    @property
    def max_in_flight(self) -> int: ...
    @property
    def timeline_window_s(self) -> float: ...
    @property
    def max_duration_s(self) -> float: ...
    @property
    def idle_timeout_s(self) -> float: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def lead_ms(self) -> float: ...
    @property
    def lead_auto(self) -> bool: ...
    @property
    def lead_margin(self) -> float: ...
    @property
    def cut_in(self) -> bool: ...


class SessionGroup(Protocol):
    """A worker group as the session holding it sees it."""

    index: int
    session_id: str | None
    """The session holding the group (None: free)."""
    transport_s: float
    """What the path between the worker and the session adds to a chunk's latency (a fleet's Ray hop)."""
    latency_profile: LatencyProfile
    """The chunk latencies of the group's recent sessions (a new session's lead is sized from their tail)."""

    @property
    def ready(self) -> asyncio.Event: ...
    @property
    def info(self) -> WorkerInfo | None:
        """What the worker reported when it was ready (its warm-up's figures among them)."""

    def send(self, msg) -> None:
        """Queue a request for the worker (never blocks the loop)."""

    async def restart(self) -> None:
        """Replace a worker that would not release its session."""


class GroupPort(SessionGroup, Protocol):
    """A worker group as the session manager lists (``/config``, ``/healthz``), admits and restarts it."""

    on_message: Callable[[object], None] | None
    """Called on the event loop with every reply of the worker (a dead one: ``Died``)."""
    start_error: str | None
    restarts: int

    @property
    def device(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def free(self) -> bool:
        """Ready, and holding no session."""

    def info_dict(self) -> dict:
        """The worker's ready info as ``/config`` shows it."""

    def start(self) -> None: ...
    async def stop(self) -> None: ...


class SessionAgent(Protocol):
    """A session's agent as the routes use it (``/say``, ``/audio``, ``/interrupt``)."""

    name: str

    def speak(self, samples: np.ndarray, t_agent: float | None = None, new_segment: bool = True) -> None: ...
    def interrupt(self) -> None: ...
    @property
    def queued_samples(self) -> int: ...


class SessionHost(Protocol):
    """What a session reports to: the manager on one machine or a front end, a group actor's ``MediaHost``."""

    background: set[asyncio.Task]
    """Tasks the host awaits at shutdown (closes, and what did not stop in time)."""

    @property
    def cfg(self) -> SessionSettings: ...
    @property
    def metrics(self) -> Any:
        """``cadence.telemetry.metrics.ServeMetrics``' interface (a group actor records it instead)."""

    def release(self, group: SessionGroup, sid: str) -> None:
        """Session ``sid`` is done with ``group`` (its worker has let the session go, or was restarted)."""

    def session_closed(self, sess: SessionPort, report: dict) -> None:
        """``sess`` is closed; ``report`` is its final report."""


class SdpAnswer(Protocol):
    sdp: str
    type: str


class SessionPort(Protocol):
    """A session as the manager and the routes use it."""

    sid: str
    state: str
    """'starting' -> 'connecting' -> 'streaming' -> 'closing' -> 'closed'."""
    close_reason: str | None
    t_created: float
    group: Any
    agent: SessionAgent

    async def start(self, image: np.ndarray | None, offer_sdp: str, offer_type: str) -> SdpAnswer:
        """Open the session on its worker and answer the browser's offer."""

    def on_worker_message(self, msg) -> None: ...
    def touch(self) -> None:
        """The client is there (its idle timeout starts again)."""

    async def set_prompt(self, prompt: str) -> int:
        """The new prompt from the next chunk planned on; that chunk's index."""

    def status(self) -> dict:
        """The JSON ``GET /sessions/{id}`` answers."""

    def report(self) -> dict:
        """The JSON report (kept after the close)."""

    def update_metrics(self) -> None: ...
    def close_soon(self, reason: str) -> None: ...
    async def close(self, reason: str) -> dict:
        """Close (idempotent, cancellation-proof); the report."""


class SessionFactory(Protocol):
    """A session class: ``LiveSession`` (frames to this process) or a fleet's ``GroupMediaSession``."""

    def __call__(
        self, server: SessionHost, sid: str, group: Any, agent: Any, engine_cfg: Any, prompt: str, seed: int
    ) -> SessionPort: ...


class GroupSource(Protocol):
    """Where the session manager's groups come from, and how a session gets one."""

    @property
    def groups(self) -> Sequence[GroupPort]:
        """The groups (a fleet's list is kept up to date in place)."""

    @property
    def recipe(self) -> Any:
        """What its groups build (a ``cadence.engine.recipe.EngineRecipe``): the sessions' geometry is its config."""

    async def start(self, route: Route, metrics: Any, timeout_s: float) -> None:
        """Start (or join) the groups, send every reply to ``route``, export to ``metrics``; return when
        they are ready (RuntimeError when none can be)."""

    async def stop(self) -> None: ...
    def admission(self) -> AbstractAsyncContextManager[None]:
        """An async context around the manager's (synchronous) ``reserve``: a fleet claims a group there."""

    def acquire(self) -> GroupPort | None:
        """A free group for the request being admitted (None: 503)."""

    def release(self, group: GroupPort, sid: str) -> None:
        """Session ``sid`` (or an unused claim) no longer holds ``group``."""

    def retry_after(self) -> int | None:
        """Seconds until a group is likely free (None: the manager estimates it from its own sessions)."""

    def session_factory(self, group: GroupPort) -> SessionFactory:
        """The session class for a new session on ``group``."""


class Deployment(Protocol):
    """What ``ServeConfig.deployment`` holds: where the worker groups run (``cadence serve --deploy local|ray``),
    their source, and the routes it adds."""

    name: str
    """Its name in ``cadence.serve.config.DEPLOYMENTS``."""

    def placements(self, device: str, tp: int, max_sessions: int | None, decode_gpu: int | None) -> tuple:
        """The groups' ``cadence.engine.placement.Placement`` for ``cadence serve --device --tp --max-sessions``."""

    def group_source(self, cfg: Any) -> GroupSource:
        """The group source of a server serving ``cfg`` (a ``cadence.serve.config.ServeConfig``)."""

    def routes(self, source: GroupSource) -> list[ExtraRoutes]:
        """Its operator routes on a server whose groups come from ``source`` (a fleet's ``/fleet``)."""
