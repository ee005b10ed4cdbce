"""Prometheus metrics of the live server (``/metrics``), on a registry of its own per app.

Per session (label ``session``; the series are removed when the session closes, so the label
set stays bounded): fps, time to first frame, A/V offset, speech -> frame latency, video and
audio underruns, deadline misses, and the queue: chunks in flight at the worker and the playout
headroom (generated video not yet sent, ms). Server-wide: a chunk latency histogram (plan -> frames back in
the web process), sessions by close reason, admissions refused, active sessions, totals of
underruns and deadline misses (they survive the session's series). Per worker group (label
``group``): the worker process's memory with its last chunk (host RSS, GPU allocation). A ``--ray`` front
end also shows the whole fleet as its registry sees it (``cadence_fleet_*``: groups by state, sessions,
free groups, restarts per group and in all); every front end shows the same fleet figures.

The per-session series live on a registry of their own (``session_registry``): their labels are the
session ids, which are operator information (with a session id and nothing else a client can do
nothing, but the list of who is connected is not for everyone), so ``render(sessions=False)`` (what
``/metrics`` answers without the operator key) leaves them out and keeps every aggregate.

``prometheus_client`` is imported here only: the engine and the benchmarks never need it.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_MS_BUCKETS = (5, 10, 20, 35, 50, 75, 100, 125, 150, 166.7, 200, 250, 333, 500, 750, 1000, 2000, 5000)


class ServeMetrics:
    def __init__(self) -> None:
        self.session_registry = CollectorRegistry(auto_describe=True)
        self.registry = CollectorRegistry(auto_describe=True)  # everything else: aggregates
        self._session_series(self.session_registry)
        self._aggregates(self.registry)
        self._fleet_series(self.registry)
        self.bad_requests = Counter(
            "cadence_bad_requests", "Requests answered with a 4xx error", ("status",), registry=self.registry
        )

    def _session_series(self, r: CollectorRegistry) -> None:
        """The per-session gauges (label ``session``)."""
        s = ("session",)
        self.fps = Gauge(
            "cadence_session_fps",
            "Fresh video frames (generated and not blank: what the viewer gets) delivered per second "
            "(last 2 s)",
            s,
            registry=r,
        )
        self.ttff = Gauge(
            "cadence_session_ttff_ms",
            "Session start (request received) -> first generated frame sent",
            s,
            registry=r,
        )
        self.av_offset = Gauge(
            "cadence_session_av_offset_ms",
            "Media time of the last video frame sent minus that of the audio sent (pacing skew)",
            s,
            registry=r,
        )
        self.agent_latency = Gauge(
            "cadence_session_agent_audio_to_frame_ms",
            "Speech given to the character (upload, say, TTS) -> its first frame sent (last segment; the "
            "microphone that mirror mouths is not in it)",
            s,
            registry=r,
        )
        self.video_underruns = Gauge(
            "cadence_session_video_underruns", "Video frames held (chunk late)", s, registry=r
        )
        self.audio_underruns = Gauge(
            "cadence_session_audio_underruns", "20 ms audio frames with silence filled in", s, registry=r
        )
        self.deadline_misses = Gauge(
            "cadence_session_deadline_misses", "Chunks back after their first frame was due", s, registry=r
        )
        self.in_flight = Gauge(
            "cadence_session_chunks_in_flight",
            "Chunks planned and not back from the worker yet",
            s,
            registry=r,
        )
        self.buffer_ms = Gauge(
            "cadence_session_buffer_ms",
            "Playout headroom: generated video not yet sent, in ms of media (falls toward 0 "
            "before an underrun)",
            s,
            registry=r,
        )

    def _aggregates(self, r: CollectorRegistry) -> None:
        """The server-wide histograms, gauges and counters."""
        self.chunk_latency = Histogram(
            "cadence_chunk_latency_ms",
            "Chunk plan -> frames back in the web process",
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.agent_latency_hist = Histogram(
            "cadence_agent_audio_to_frame_ms",
            "Speech given to the character (upload, say, TTS) -> its first frame sent",
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.ttff_hist = Histogram(
            "cadence_ttff_ms", "Session start -> first generated frame sent", buckets=_MS_BUCKETS, registry=r
        )
        self.active = Gauge("cadence_sessions_active", "Sessions open now", registry=r)
        self.groups = Gauge("cadence_groups", "Worker groups (GPU groups) configured", registry=r)
        self.sessions = Counter("cadence_sessions", "Sessions closed, by reason", ("reason",), registry=r)
        self.refused = Counter(
            "cadence_admissions_refused", "Session requests refused: no free group", registry=r
        )
        self.underruns_total = Counter(
            "cadence_underruns",
            "Underruns: video frames held (their chunk late, or the generated frame blank: replaced by the "
            "last good one) + audio frames silenced",
            ("kind",),
            registry=r,
        )
        self.deadline_misses_total = Counter(
            "cadence_deadline_misses", "Chunks back after their first frame was due", registry=r
        )
        self.worker_memory = Gauge(
            "cadence_worker_memory_bytes",
            "A worker group's rank-0 process memory with its last chunk: host RSS "
            "('rss') and torch's allocation on its GPU ('cuda')",
            ("group", "kind"),
            registry=r,
        )

    def _fleet_series(self, r: CollectorRegistry) -> None:
        """The fleet's gauges (``cadence serve --ray``)."""
        self.fleet_groups = Gauge(
            "cadence_fleet_groups",
            "Fleet worker groups in the registry, by state (starting, up, draining, restarting, failed)",
            ("state",),
            registry=r,
        )
        self.fleet_sessions = Gauge(
            "cadence_fleet_sessions", "Sessions open on the fleet (every front end's)", registry=r
        )
        self.fleet_free = Gauge(
            "cadence_fleet_free_groups", "Fleet groups free for a new session", registry=r
        )
        self.fleet_restarts = Gauge(
            "cadence_fleet_group_restarts", "Restarts of a fleet group's actor (Ray)", ("group",), registry=r
        )
        self.fleet_restarts_total = Gauge(
            "cadence_fleet_restarts", "Restarts of the fleet's group actors, in all", registry=r
        )

    _per_session = (
        "fps",
        "ttff",
        "av_offset",
        "agent_latency",
        "video_underruns",
        "audio_underruns",
        "deadline_misses",
        "in_flight",
        "buffer_ms",
    )

    def remove_session(self, sid: str) -> None:
        for name in self._per_session:
            try:
                getattr(self, name).remove(sid)
            except KeyError:
                pass

    def set_worker_memory(self, group: int, mem: dict) -> None:
        """``mem``: MB by name as the worker reports it (``rss_mb``, ``cuda_mb``; None = not known)."""
        for name, mb in mem.items():
            if mb is not None:
                self.worker_memory.labels(str(group), name.removesuffix("_mb")).set(mb * 2**20)

    def render(self, sessions: bool = False) -> bytes:
        """The Prometheus text exposition: the aggregates, and the per-session series when ``sessions``."""
        out = generate_latest(self.registry)
        return out + generate_latest(self.session_registry) if sessions else out
