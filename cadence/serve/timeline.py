"""A long session, window by window: whether a stream holds up for as long as the conversation lasts.

A session's report gives whole-session figures (fps mean, chunk latency p50/p99, underruns); those
hide a stream that starts well and degrades (memory that grows chunk after chunk, a cache or RoPE
position that drifts, latency that creeps up until the deadline is missed ten minutes in). The
``Timeline`` cuts the session into fixed windows (one minute by default, ``ServeConfig.timeline_window_s``)
and keeps, per window: fresh video frames per second, chunks done, chunk latency p50 and max, video
underruns, deadline misses, and the worker process's memory at the window's last chunk (host RSS and,
on CUDA, the bytes allocated on its device).

Pure Python (no asyncio, no torch): the session calls ``chunk`` on every chunk and ``tick`` from its
watchdog (every 0.25 s) with its cumulative counters, and ``rows`` for its report. Windows start at
the first chunk; a window closes at the first call on or after its end (so it lasts the window plus
at most a quarter second: ``seconds`` is what it really lasted, and its rates are over that), the next
one ends on the grid again, and the windows always add up to the session's totals. Bounded: the
oldest windows are dropped past ``max_windows`` (a 4-hour session at one-minute windows).
"""

from __future__ import annotations

import statistics

COUNTERS = ("video_fresh", "chunks_done", "underruns_video", "deadline_misses")
MIN_RATED_S = 1.0  # a (partial) window shorter than this gets no fps: a frame or two over a few ms is no rate


class Timeline:
    def __init__(self, window_s: float = 60.0, max_windows: int = 240):
        if window_s <= 0:
            raise ValueError(f"timeline window must be positive, got {window_s} s")
        self.window_s = float(window_s)
        self.max_windows = int(max_windows)
        self.t0: float | None = None
        self.windows: list[dict] = []
        self.dropped = 0
        self._start: dict[str, int] = {}
        self._t_start = self._t_end = 0.0
        self._latency: list[float] = []
        self.memory_last: dict[str, float] = {}  # MB by name, as of the last chunk that reported it
        self.memory_first: dict[str, float] = {}
        self.memory_max: dict[str, float] = {}

    def tick(self, now: float, counts: dict[str, int]) -> None:
        """Close the windows that ended by ``now`` with the session's cumulative ``COUNTERS`` as they are
        (the session calls this a few times a second, so a window closes on time even while no chunk
        comes back, and a stall is counted in the window it happened in)."""
        if self.t0 is None or now < self._t_end:
            return
        self._close(now, counts)  # the window is [its start, now): its counts are exactly that interval's
        while self._t_end <= now:  # the next ends on the grid (no drift); a long gap is one longer window
            self._t_end += self.window_s

    def chunk(
        self, now: float, latency_ms: float, counts: dict[str, int], memory: dict | None = None
    ) -> None:
        """One chunk came back at ``now`` (monotonic seconds), ``latency_ms`` after its plan. ``counts``: the
        session's cumulative ``COUNTERS`` just before it; ``memory``: the worker's figures with it (MB, or
        None). The first chunk starts the timeline."""
        if self.t0 is None:
            self.t0 = self._t_start = now
            self._t_end = now + self.window_s
            self._start = {k: int(counts.get(k, 0)) for k in COUNTERS}
        self.tick(now, counts)
        self._latency.append(float(latency_ms))
        for k, v in (memory or {}).items():
            if v is None:
                continue
            self.memory_last[k] = v
            self.memory_first.setdefault(k, v)
            self.memory_max[k] = max(self.memory_max.get(k, v), v)

    def _row(self, t_end: float, counts: dict[str, int], partial: bool) -> dict:
        secs = t_end - self._t_start
        d = {k: int(counts.get(k, 0)) - self._start.get(k, 0) for k in COUNTERS}
        lat = self._latency
        row = {
            "t_s": round(self._t_start - self.t0, 3),
            "seconds": round(secs, 3),
            "fps": round(d["video_fresh"] / secs, 2) if secs >= MIN_RATED_S else None,
            "chunks": d["chunks_done"],
            "chunk_latency_ms_p50": round(statistics.median(lat), 1) if lat else None,
            "chunk_latency_ms_max": round(max(lat), 1) if lat else None,
            "underruns_video": d["underruns_video"],
            "deadline_misses": d["deadline_misses"],
            "video_fresh": d["video_fresh"],
        }
        row.update({f"worker_{k}": round(v, 1) for k, v in self.memory_last.items()})
        if partial:
            row["partial"] = True
        return row

    def _close(self, t_end: float, counts: dict[str, int]) -> None:
        self.windows.append(self._row(t_end, counts, partial=False))
        if len(self.windows) > self.max_windows:
            self.windows.pop(0)
            self.dropped += 1
        self._start = {k: int(counts.get(k, 0)) for k in COUNTERS}
        self._t_start = t_end
        self._latency = []

    def rows(self, now: float, counts: dict[str, int]) -> list[dict]:
        """The closed windows, then the one still open (``partial``: up to ``now``) when it has begun."""
        if self.t0 is None:
            return []
        out = list(self.windows)
        if now > self._t_start:
            out.append(self._row(now, counts, partial=True))
        return out

    def memory_growth(self) -> dict[str, float]:
        """Per memory figure: the last value minus the first (MB), over the session so far."""
        return {k: round(v - self.memory_first[k], 1) for k, v in self.memory_last.items()}
