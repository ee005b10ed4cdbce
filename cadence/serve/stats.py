"""What one live session measures: per-chunk worker times, frames sent, fresh fps, latencies, A/V offset.

Plain bookkeeping (no asyncio, no aiortc): the session calls ``chunk`` for every chunk that comes back,
``video_frame`` / ``audio_frame`` for every frame its tracks send, ``plan`` for every chunk it plans; the
watchdog calls ``update_metrics`` a few times a second; ``status`` / ``report`` make the JSON the API
serves. The window-by-window view of a long stream is :class:`cadence.serve.timeline.Timeline`.

Per chunk the report keeps the worker's own figures (``worker_chunks``: diffusion, decode, the worker's busy
time from request to frames, and the web side's latency from plan to frames), so the overlap of decode
with the next chunk's diffusion is visible chunk by chunk: with it the worker's time per chunk falls from
diffusion + decode toward max(diffusion, decode).
"""

from __future__ import annotations

import collections
import statistics
import time

from cadence.engine.messages import ChunkTimings
from cadence.serve.timeline import Timeline

#: Chunks whose worker figures the report keeps (at 4 frames per chunk, 1,000 chunks = 2.8 min).
KEEP_CHUNKS = 1000

#: The page says "reduced" (the status's ``degraded``) when the session sent fewer than ``REDUCED_SHARE`` of
#: real time's fresh frames over the last ``REDUCED_WINDOW_S``: below 21.6 of 24 fps over 3 s, i.e. more than
#: two whole chunks held in that window (one late chunk, 4 of 72 frames, is a hiccup, not a server that cannot
#: keep up). The first ``STARTUP_ALLOWANCE_S`` after the first frame are never counted, while a session's first
#: chunks share the machine with its connection being set up (docs/perf/soak/NOTES.md): the flag can first
#: show 1 s after that (3 s after the first frame), from the frames of that second on. A machine too slow for
#: real time shows it from then on, for as long as it lasts.
REDUCED_WINDOW_S = 3.0
REDUCED_SHARE = 0.9
STARTUP_ALLOWANCE_S = 2.0


def _p50(xs) -> float | None:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else None


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


class SessionStats:
    def __init__(
        self, fps: int, frames_per_chunk: int, timeline_window_s: float, metrics, sid: str, t_created: float
    ):
        self.fps_target, self.frames_per_chunk = fps, frames_per_chunk
        self.metrics, self.sid = metrics, sid
        self.t_created = t_created
        self.chunks_planned = 0
        self.chunks_done = 0
        self.deadline_misses = 0
        self.chunk_latency_ms: collections.deque[float] = collections.deque(maxlen=2000)
        self.diffusion_ms: collections.deque[float] = collections.deque(maxlen=2000)
        self.decode_ms: collections.deque[float] = collections.deque(maxlen=2000)
        self.worker_chunks: collections.deque[dict] = collections.deque(maxlen=KEEP_CHUNKS)
        self.ttff_ms: float | None = None
        self.first_frame_wall: float | None = None
        self.video_frames_sent = 0
        self.video_frames_skipped = 0
        self.audio_frames_sent = 0
        self.audio_frames_skipped = 0
        self._fresh_times: collections.deque[float] = collections.deque(maxlen=fps * 10)
        self._first_fresh = 0.0
        self._video_lag: collections.deque[float] = collections.deque(maxlen=240)
        self._audio_lag: collections.deque[float] = collections.deque(maxlen=500)
        self._pending_marks: list[tuple[int, float, str]] = []  # (video frame, t_agent, kind)
        self.agent_latency_ms: list[float] = []  # speech given to the character -> its first frame sent
        self.mic_latency_ms: list[float] = []  # the user's voiced onset (mirror) -> its first frame sent
        self.mic_frames = 0
        self.mic_nonfinite = 0  # microphone samples that were NaN or infinite (replaced by silence)
        self.audio_nonfinite = 0  # chunk audio samples cleaned just before the worker (0 unless a bug)
        self.errors: list[str] = []
        self.timeline = Timeline(timeline_window_s)

    # ---- events ---------------------------------------------------------------------------------
    def mark_speech(self, frame: int, t_agent: float, kind: str = "speech") -> None:
        """An agent segment starts at video frame ``frame`` (its first audio was had at ``t_agent``; ``kind``:
        "speech" or "mic", ``cadence.serve.agent.SegmentMark``)."""
        self._pending_marks.append((frame, t_agent, kind))

    def chunk(
        self,
        now: float,
        index: int,
        latency_ms: float,
        tm: ChunkTimings,
        late: bool,
        counts: dict,
        budget_ms: float | None = None,
    ) -> None:
        """Chunk ``index`` came back at ``now``, ``latency_ms`` after its plan; ``late``: after it was due;
        ``counts``: the session's cumulative counters just before it (the timeline's windows); ``budget_ms``:
        how long before it was due it was planned (None: before the media clock started)."""
        self.chunks_done += 1
        self.chunk_latency_ms.append(latency_ms)
        self.diffusion_ms.append(tm.diffusion_ms)
        self.decode_ms.append(tm.decode_ms)
        self.worker_chunks.append(
            {
                "i": index,
                "diffusion_ms": _r(tm.diffusion_ms),
                "decode_ms": _r(tm.decode_ms),
                "work_ms": _r(tm.work_ms),
                "latency_ms": _r(latency_ms),
                "budget_ms": _r(budget_ms),  # plan -> due: late when latency_ms exceeds it
                # where the rest of the latency went: plan -> the worker began it (the web side's writer
                # thread, the pipe, a worker still busy with the chunk before), and frames ready -> back on
                # the event loop (the pipe, the reader thread, the loop); one system-wide monotonic clock
                "to_worker_ms": _r((tm.t_recv - tm.t_plan) * 1e3) if tm.t_recv and tm.t_plan else None,
                "back_ms": _r((now - tm.t_done) * 1e3) if tm.t_done else None,
                "step": tm.step,
            }
        )
        m = self.metrics
        m.chunk_latency.observe(latency_ms)
        if late:
            self.deadline_misses += 1
            m.deadline_misses_total.inc()
        self.timeline.chunk(now, latency_ms, counts, tm.memory or None)

    def video_frame(
        self, k: int, fresh: bool, skipped: int, now: float, lag: float | None, marks: bool = True
    ) -> bool:
        """A video frame was sent; returns True when it is the session's first fresh frame. ``marks`` False: it
        is not the frame its media instant was planned with (a clip queued before a cut-in that is late), so no
        agent segment starts on it."""
        self.video_frames_sent += 1
        self.video_frames_skipped += skipped
        if lag is not None:
            self._video_lag.append(lag)
        if not fresh:
            self.metrics.underruns_total.labels("video").inc()
            return False
        self._fresh_times.append(now)
        first = self.ttff_ms is None
        if first:
            self._first_fresh = now
            self.ttff_ms = (now - self.t_created) * 1e3
            self.first_frame_wall = time.time()
            self.metrics.ttff_hist.observe(self.ttff_ms)
        while marks and self._pending_marks and self._pending_marks[0][0] <= k:
            _, t_agent, kind = self._pending_marks.pop(0)
            ms = (now - t_agent) * 1e3
            if kind == "mic":
                self.mic_latency_ms.append(ms)
                del self.mic_latency_ms[:-1000]
            else:
                self.agent_latency_ms.append(ms)
                del self.agent_latency_ms[:-1000]
                self.metrics.agent_latency_hist.observe(ms)
        return first

    def audio_frame(self, complete: bool, skipped: int, lag: float | None) -> None:
        self.audio_frames_sent += 1
        self.audio_frames_skipped += skipped
        if lag is not None:
            self._audio_lag.append(lag)
        if not complete and self.ttff_ms is not None:
            self.metrics.underruns_total.labels("audio").inc()

    # ---- figures --------------------------------------------------------------------------------
    def fps(self, now: float | None = None) -> float:
        """Fresh frames (new on screen: ``AVBuffer.video_frame``) sent per second over the last 2 s (or since
        the first one)."""
        if not self._fresh_times:
            return 0.0
        now = time.monotonic() if now is None else now
        window = 2.0
        n = sum(1 for t in self._fresh_times if t >= now - window)
        span = min(window, now - self._first_fresh)
        return n / max(span, 1.0 / self.fps_target)

    def reduced(self, now: float) -> bool:
        """Whether the stream is below real time, as the page says it (see ``REDUCED_SHARE``)."""
        rate = self.fresh_rate(now, REDUCED_WINDOW_S, after_s=STARTUP_ALLOWANCE_S)
        return rate is not None and rate < REDUCED_SHARE * self.fps_target

    def fresh_rate(self, now: float, window: float, after_s: float = 0.0, min_s: float = 1.0) -> float | None:
        """Fresh frames sent per second over the last ``window`` seconds, leaving out the first ``after_s``
        seconds after the first fresh frame; None until that leaves at least ``min_s`` seconds to count."""
        if self.ttff_ms is None:
            return None
        start = max(now - window, self._first_fresh + after_s)
        if now - start < min_s:
            return None
        n = sum(1 for t in self._fresh_times if start < t <= now)
        return n / (now - start)

    def av_offset_ms(self) -> float | None:
        v, a = _p50(self._video_lag), _p50(self._audio_lag)
        return None if v is None or a is None else (v - a) * 1e3

    def worker_figures(self) -> dict:
        """Medians over the kept chunks: the stages, the worker's busy time per chunk, and what it would be
        serial (diffusion + decode) or perfectly overlapped (the slower stage)."""
        rows = list(self.worker_chunks)
        if not rows:
            return {}
        d = [r["diffusion_ms"] or 0.0 for r in rows]
        e = [r["decode_ms"] or 0.0 for r in rows]
        return {
            "work_ms_p50": _r(_p50(r["work_ms"] for r in rows)),
            "serial_ms_p50": _r(_p50(a + b for a, b in zip(d, e))),
            "overlapped_ms_p50": _r(_p50(max(a, b) for a, b in zip(d, e))),
        }

    def status_fields(self, now: float, closed: bool) -> dict:
        return {
            "fps": round(self.fps(now), 2) if not closed else 0.0,
            "target_fps": self.fps_target,
            "frames_per_chunk": self.frames_per_chunk,
            "ttff_ms": _r(self.ttff_ms),
            "chunk_latency_ms_p50": _r(_p50(self.chunk_latency_ms)),
            "chunk_latency_ms_last": _r(self.chunk_latency_ms[-1] if self.chunk_latency_ms else None),
            "diffusion_ms_p50": _r(_p50(self.diffusion_ms)),
            "decode_ms_p50": _r(_p50(self.decode_ms)),
            "agent_audio_to_frame_ms_p50": _r(_p50(self.agent_latency_ms)),
            "agent_audio_to_frame_ms_last": _r(self.agent_latency_ms[-1] if self.agent_latency_ms else None),
            "mic_to_frame_ms_p50": _r(_p50(self.mic_latency_ms)),
            "mic_to_frame_ms_last": _r(self.mic_latency_ms[-1] if self.mic_latency_ms else None),
            "av_offset_ms": _r(self.av_offset_ms()),
            "video_frames_sent": self.video_frames_sent,
            "audio_frames_sent": self.audio_frames_sent,
            "deadline_misses": self.deadline_misses,
            "mic_frames": self.mic_frames,
            "mic_nonfinite_samples": self.mic_nonfinite,
            "worker_memory_mb": {k: _r(v) for k, v in self.timeline.memory_last.items()},
            "errors": self.errors[-5:],
        }

    def report_fields(self, t_end: float, t0: float | None, video_fresh: int, counts: dict) -> dict:
        lat = sorted(self.chunk_latency_ms)
        tl = self.timeline
        return {
            "fps_mean": round(video_fresh / max(1e-9, t_end - (t0 or self.t_created)), 2) if t0 else 0.0,
            "chunk_latency_ms_p99": _r(
                lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))] if lat else None
            ),
            # the p50/p99 (and diffusion/decode p50) cover the last this-many chunks (a bounded window:
            # 2,000 chunks = 5.6 min at 4 frames per chunk); the timeline has every window of the session
            "chunk_latency_samples": len(lat),
            "agent_audio_to_frame_ms": [round(x, 1) for x in self.agent_latency_ms[-100:]],
            "mic_to_frame_ms": [round(x, 1) for x in self.mic_latency_ms[-100:]],
            "audio_nonfinite_samples": self.audio_nonfinite,
            "video_frames_skipped": self.video_frames_skipped,
            "audio_frames_skipped": self.audio_frames_skipped,
            "worker": self.worker_figures(),
            "worker_chunks": list(self.worker_chunks),
            "worker_memory_first_mb": {k: _r(v) for k, v in tl.memory_first.items()},
            "worker_memory_max_mb": {k: _r(v) for k, v in tl.memory_max.items()},
            "worker_memory_growth_mb": tl.memory_growth(),
            "timeline_window_s": tl.window_s,
            "timeline": tl.rows(t_end, counts),
            "errors": self.errors[-20:],
        }
