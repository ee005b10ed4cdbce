"""What a front end and a group actor say to each other when the group's node terminates WebRTC
(``cadence serve --ray ... --fleet-media group``): dataclasses, passed through Ray calls as they are.

Torch-free, Ray-free, aiortc-free: the front end, the actor and the tests import it.

    front end -> actor   open_media(OpenMedia) -> MediaAnswer
                         media_request(sid, MediaSpeak | MediaInterrupt | MediaPrompt | MediaTouch | MediaClose)
    actor -> front end   (in ``poll``'s answer, beside the worker's own Died)
                         MediaUpdate (every UPDATE_S: the session's status and the metric events since the last)
                         MediaClosed (the session ended on the group: its report)

The worker's requests and replies (``cadence.engine.messages``) stay on the group's node in this mode: the
session's scheduler, playout buffer, tracks and agent run in the actor (``cadence.fleet.media``), so frames
and the audio the character says never reach the front end.

Metrics: the session's code in the actor reports to a :class:`MetricsRecorder` (the ``ServeMetrics``
interface, recording instead of exporting); its events travel with the updates and the front end applies them
to its own ``ServeMetrics`` (:func:`apply_metric_events`), so ``/metrics`` on the front end shows the
session as it would on one machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: How often the actor sends a live session's status (and its metric events) to the front end.
UPDATE_S = 0.5

# ---- front end -> actor ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaSettings:
    """The front end's serving settings a session in the actor needs (it reads them as ``cfg``: the names are
    ``ServeConfig``'s), plus where its ICE agent offers candidates."""

    sync_marker_every: int = 0
    max_in_flight: int = 2
    timeline_window_s: float = 60.0
    max_duration_s: float = 600.0
    idle_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    lead_ms: float = 100.0
    lead_auto: bool = True
    lead_margin: float = 0.15
    cut_in: bool = True
    agent_endpoint: object | None = None
    """The ``talk`` agent's endpoint (``cadence.serve.converse.AgentEndpoint``; its key is read from the
    group node's environment, ``CADENCE_AGENT_API_KEY``)."""
    ice: str = "node"
    """The host addresses the group's ICE agent offers: 'node' (the group node's Ray address), 'auto'
    (aioice's own discovery: every interface but loopback) or a comma-separated list."""

    @classmethod
    def from_serve(cls, cfg, ice: str) -> MediaSettings:
        from cadence.serve.config import agent_endpoint

        return cls(
            sync_marker_every=cfg.sync_marker_every,
            max_in_flight=cfg.max_in_flight,
            timeline_window_s=cfg.timeline_window_s,
            max_duration_s=cfg.max_duration_s,
            idle_timeout_s=cfg.idle_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            lead_ms=cfg.lead_ms,
            lead_auto=cfg.lead_auto,
            lead_margin=cfg.lead_margin,
            cut_in=cfg.cut_in,
            agent_endpoint=agent_endpoint(cfg),
            ice=ice,
        )


@dataclass(frozen=True)
class OpenMedia:
    """Open session ``sid`` on the group and answer the browser's SDP offer there. ``age_s``: how long ago
    the front end received the request (the session's clock starts then: time to first frame counts it)."""

    sid: str
    image: np.ndarray | None
    prompt: str
    seed: int
    agent: str
    sdp: str
    sdp_type: str
    settings: MediaSettings
    age_s: float = 0.0


@dataclass(frozen=True)
class MediaSpeak:
    """Speech for the character (48 kHz mono float32; ``/say``, ``/audio``); ``age_s``: how long ago the
    front end had it (the agent's audio -> frame latency starts then)."""

    samples: np.ndarray
    age_s: float = 0.0
    new_segment: bool = True


@dataclass(frozen=True)
class MediaInterrupt:
    """Stop speaking (``/interrupt``)."""


@dataclass(frozen=True)
class MediaPrompt:
    """A new prompt from the next chunk on (``/prompt``); the answer is that chunk's index."""

    prompt: str


@dataclass(frozen=True)
class MediaTouch:
    """The client is still there (an API request on the session): the idle timeout starts again."""


@dataclass(frozen=True)
class MediaClose:
    """Close the session (the client's DELETE, the front end's shutdown, a lost front end); the answer is
    its :class:`MediaClosed`."""

    reason: str


# ---- actor -> front end ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricEvent:
    """One call on a ``ServeMetrics`` series: ``getattr(metrics, name)[.labels(*labels)].<op>(value)``; op
    'call': ``getattr(metrics, name)(*value)`` (``set_worker_memory``)."""

    name: str
    labels: tuple = ()
    op: str = "set"
    value: object = None


@dataclass(frozen=True)
class MediaAnswer:
    """The SDP answer (``sdp``, ``type``), the session's first status and the process that terminates its
    WebRTC (``pid``); or, when the session could not start, ``error_type`` / ``error`` (the exception's
    class name and text, raised again by the front end) and the closed session (``closed``)."""

    sid: str
    sdp: str = ""
    type: str = "answer"
    status: dict = field(default_factory=dict)
    pid: int = 0
    error_type: str | None = None
    error: str = ""
    closed: MediaClosed | None = None


@dataclass(frozen=True)
class MediaUpdate:
    sid: str
    status: dict
    events: list[MetricEvent] = field(default_factory=list)


@dataclass(frozen=True)
class MediaClosed:
    sid: str
    report: dict
    events: list[MetricEvent] = field(default_factory=list)


# ---- metrics, recorded in the actor and applied on the front end -------------------------------------------

#: The ServeMetrics series a session may touch, with the operations it may apply (what the front end
#: accepts from an actor: nothing else is called on its metrics).
METRIC_OPS = {
    "fps": "set",
    "ttff": "set",
    "av_offset": "set",
    "agent_latency": "set",
    "video_underruns": "set",
    "audio_underruns": "set",
    "deadline_misses": "set",
    "in_flight": "set",
    "buffer_ms": "set",
    "chunk_latency": "observe",
    "agent_latency_hist": "observe",
    "ttff_hist": "observe",
    "underruns_total": "inc",
    "deadline_misses_total": "inc",
    "set_worker_memory": "call",
}
#: The per-session gauges (label: the session id): applied only while the front end's session is open.
SESSION_GAUGES = frozenset(k for k, op in METRIC_OPS.items() if op == "set")


class _Series:
    def __init__(self, rec: MetricsRecorder, name: str, labels: tuple = ()):
        self.rec, self.name, self.labels_ = rec, name, labels

    def labels(self, *labels) -> _Series:
        return _Series(self.rec, self.name, tuple(str(x) for x in labels))

    def set(self, value) -> None:
        self.rec._set[(self.name, self.labels_)] = float(value)  # (only the last value of a gauge matters)

    def observe(self, value) -> None:
        self.rec._events.append(MetricEvent(self.name, self.labels_, "observe", float(value)))

    def inc(self, value=1.0) -> None:
        self.rec._events.append(MetricEvent(self.name, self.labels_, "inc", float(value)))


class MetricsRecorder:
    """``ServeMetrics``' interface for the sessions in a group actor: every call is kept as a
    :class:`MetricEvent` until ``drain`` hands them over (gauges: only the last value of each)."""

    def __init__(self) -> None:
        self._events: list[MetricEvent] = []
        self._set: dict[tuple, float] = {}

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in METRIC_OPS or METRIC_OPS[name] == "call":
            raise AttributeError(name)
        return _Series(self, name)

    def set_worker_memory(self, group: int, mem: dict) -> None:
        self._events.append(MetricEvent("set_worker_memory", (), "call", (int(group), dict(mem))))

    def remove_session(self, sid: str) -> None:
        """(The front end removes a closed session's series.)"""

    def drain(self) -> list[MetricEvent]:
        out = self._events + [MetricEvent(n, lab, "set", v) for (n, lab), v in self._set.items()]
        self._events, self._set = [], {}
        return out


def apply_metric_events(metrics, events: list[MetricEvent], session_open: bool) -> int:
    """Apply an actor's events to the front end's ``ServeMetrics``; the per-session gauges only while the
    session is open (a late update must not bring back a closed session's series). Returns how many."""
    n = 0
    for e in events:
        if METRIC_OPS.get(e.name) != e.op or (e.name in SESSION_GAUGES and not session_open):
            continue
        if e.op == "call":
            metrics.set_worker_memory(*e.value)
        else:
            series = getattr(metrics, e.name)
            if e.labels:
                series = series.labels(*e.labels)
            getattr(series, e.op)(e.value)
        n += 1
    return n
