"""One live session: peer connection, agent, media buffer and clock, the chunk scheduler, stats.

Life cycle: ``starting`` (worker opening the session, SDP answered) -> ``connecting`` (waiting for
ICE/DTLS) -> ``streaming`` -> ``closing`` -> ``closed``. The chunk scheduler is an asyncio task that
only moves small messages: it takes one chunk's audio window from the agent and sends it to the
group's worker process ``lead`` before the chunk is due (``pacing.next_plan``); frames come back on
the worker's reader thread and are handed to this session on the event loop (``on_chunk``). The
geometry is the engine config's: F frames and 48000 x F / fps samples per chunk (4 / 8,000 at the
tiny presets, 12 / 24,000 at W1.3).

The media clock starts when a track first asks for media *and* the first chunk is here (bounded by
``clock_start_timeout_s``): a session whose first chunk takes longer than the WebRTC connection
(W1.3: one ~400 ms chunk) starts on a full chunk instead of beginning behind, with underruns.

Agent latency (first audio -> first speaking frame). Speech is taken from the agent at plan time, so
it goes into the earliest chunk not yet planned, at its start when nothing was queued: it waits for
the next plan (0..one chunk period), then ``lead`` until that chunk is due, where its first frame
plays. ``lead`` cannot be below one chunk's work (plan -> frames back) or every chunk would be late,
so the latency is at least one chunk's work and on average lead + half a chunk period: at W1.3
(12-frame, 500 ms chunks, ~400 ms of work on an H200) >= ~0.45 s and ~0.7 s on average; the
<= 250 ms target is out of reach at 12 frames per chunk whatever the scheduling (at the tiny presets'
166.7 ms chunks it is met). ``lead`` follows the worker's measured chunk time (``SessionManager.lead_ms``),
so it is no longer than needed; with it one chunk is at the worker at a time in steady state, and
the next plan (the one that takes new speech) happens after it is done, not a chunk earlier.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time

import numpy as np

from cadence.serve.agent import Agent
from cadence.serve.pacing import AVBuffer, MediaTiming, next_plan
from cadence.serve.rtc import (
    AudioOut,
    MediaClock,
    VideoOut,
    consume_microphone,
    negotiated_codecs,
    rtc_configuration,
)
from cadence.serve.timeline import Timeline

log = logging.getLogger("cadence.serve")


async def _wait_events(timeout: float, *events: asyncio.Event) -> None:
    """Return when one of ``events`` is set or after ``timeout`` seconds.

    Not ``asyncio.wait_for(event.wait(), timeout)``: on Python 3.11, ``wait_for`` swallows a
    cancellation that arrives while the awaited event has just been set (its inner task finished,
    its done-callback not yet run: a window of about two loop iterations) and returns normally, so
    the cancelled task runs on. A chunk arriving (``_wake.set()``) just as a session closes hit that
    window and left the scheduler running forever. ``asyncio.wait`` always lets the
    CancelledError through.
    """
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _p50(xs) -> float | None:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else None


class LiveSession:
    def __init__(self, server, sid: str, group, agent: Agent, engine_cfg, prompt: str, seed: int):
        self.server, self.sid, self.group, self.agent = server, sid, group, agent
        self.cfg = server.cfg
        self.engine_cfg = engine_cfg
        self.prompt, self.seed = prompt, seed
        self.timing = MediaTiming.from_config(engine_cfg)
        self.lead_s = server.lead_ms(group) / 1e3 if hasattr(server, "lead_ms") else self.cfg.lead_ms / 1e3
        self.first_chunk = asyncio.Event()  # set when the first chunk's frames are here (the clock may start)
        self.clock_start_timeout_s = max(2.0, 4 * self.timing.chunk_seconds)
        self.buffer = AVBuffer(self.timing, engine_cfg.stream.height, engine_cfg.stream.width,
                               sync_marker_every=self.cfg.sync_marker_every)
        self.clock = MediaClock()
        self.state = "starting"
        self.close_reason: str | None = None
        self.t_created = time.monotonic()
        self.wall_created = time.time()
        self.t_closed: float | None = None
        self.last_activity = self.t_created
        self.pc = None
        self.video: VideoOut | None = None
        self.audio: AudioOut | None = None
        self.tasks: set[asyncio.Task] = set()
        self._opened: asyncio.Future | None = None
        self._closed_ack: asyncio.Future | None = None
        self._wake = asyncio.Event()
        self._close_task: asyncio.Task | None = None
        self.final_report: dict | None = None
        # stats
        self.in_flight = 0
        self.plans: dict[int, tuple[float, np.ndarray, list]] = {}
        self.chunks_planned = 0
        self.chunks_done = 0
        self.chunks_skipped = 0
        self.deadline_misses = 0
        self.chunk_latency_ms: collections.deque[float] = collections.deque(maxlen=2000)
        self.diffusion_ms: collections.deque[float] = collections.deque(maxlen=2000)
        self.decode_ms: collections.deque[float] = collections.deque(maxlen=2000)
        self.ttff_ms: float | None = None
        self.first_frame_wall: float | None = None
        self.video_frames_sent = 0
        self.video_frames_skipped = 0
        self.audio_frames_sent = 0
        self.audio_frames_skipped = 0
        self._fresh_times: collections.deque[float] = collections.deque(maxlen=self.timing.fps * 10)
        self._first_fresh = 0.0
        self._video_lag: collections.deque[float] = collections.deque(maxlen=240)
        self._audio_lag: collections.deque[float] = collections.deque(maxlen=500)
        self._pending_marks: list[tuple[int, float]] = []  # (video frame, t_agent)
        self.agent_latency_ms: list[float] = []
        self.mic_frames = 0
        self.errors: list[str] = []
        self.worker_open_ms: float | None = None
        self.worker_preopened = False  # the worker had this session opened ahead (default face and prompt)
        self.timeline = Timeline(self.cfg.timeline_window_s)
        self.codecs: dict[str, str] = {}  # what the answer settled on: {"video": "VP8" | "H264", "audio": "opus"}

    # ---- start ----------------------------------------------------------------------------------
    async def start(self, image: np.ndarray | None, offer_sdp: str, offer_type: str):
        """Open the session in the worker and answer the offer (concurrently). Returns the answer."""
        from aiortc import RTCPeerConnection, RTCSessionDescription

        loop = asyncio.get_running_loop()
        self._opened = loop.create_future()
        self.group.send(("open", self.sid, image, self.prompt, self.seed))
        pc = self.pc = RTCPeerConnection(rtc_configuration())

        @pc.on("track")
        def on_track(track):
            if track.kind == "audio":
                self._spawn(consume_microphone(track, self._on_mic, self._on_media_error), "mic")

        @pc.on("connectionstatechange")
        async def on_state():
            st = pc.connectionState
            self.touch()
            if st == "connected" and self.state in ("starting", "connecting"):
                self.state = "streaming"
            elif st in ("failed", "closed") and self.state not in ("closing", "closed"):
                self.close_soon(f"peer_{st}")

        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type=offer_type))
        kinds = {t.kind for t in pc.getTransceivers()}
        if "video" not in kinds:
            raise ValueError("the offer has no video section (the character is sent as video)")
        self.video = VideoOut(self)
        pc.addTrack(self.video)
        if "audio" in kinds:
            self.audio = AudioOut(self)
            pc.addTrack(self.audio)
        answer = await pc.createAnswer()
        await pc.setLocalDescription(answer)  # gathers host candidates (loopback: one, instantly)
        self.codecs = negotiated_codecs(pc.localDescription.sdp)
        done, _ = await asyncio.wait({self._opened}, timeout=60.0)
        if not done:
            raise RuntimeError("the worker did not open the session within 60 s")
        self.worker_open_ms = self._opened.result()  # raises the worker's error, or a close's
        if self.state in ("closing", "closed"):
            raise RuntimeError(f"the session was closed while starting ({self.close_reason})")
        if self.state == "starting":
            self.state = "connecting"
        self._spawn(self._schedule(), "scheduler")
        self._spawn(self._watchdog(), "watchdog")
        return pc.localDescription

    def _spawn(self, coro, name: str) -> asyncio.Task | None:
        if self.state in ("closing", "closed"):  # nothing new once the teardown has collected the tasks
            coro.close()
            return None
        t = asyncio.create_task(coro, name=f"cadence-{self.sid[:8]}-{name}")
        self.tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        self.tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            e = t.exception()
            log.error("session %s: task %s failed: %r", self.sid, t.get_name(), e)
            self.errors.append(f"{t.get_name()}: {type(e).__name__}: {e}")
            self.close_soon("internal_error")

    # ---- worker messages (on the event loop) ---------------------------------------------------------
    def on_worker_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "opened":
            if self._opened is not None and not self._opened.done():
                self.worker_preopened = bool(msg[3]) if len(msg) > 3 else False
                self._opened.set_result(msg[2])
        elif kind == "chunk":
            self.on_chunk(msg[2], msg[3], msg[4])
        elif kind == "closed":
            if self._closed_ack is not None and not self._closed_ack.done():
                self._closed_ack.set_result(True)
        elif kind in ("error", "died"):
            text = f"worker: {msg[2]}"
            self.errors.append(text)
            log.error("session %s: %s", self.sid, text)
            if self._opened is not None and not self._opened.done():
                self._opened.set_exception(RuntimeError(text))
            if kind == "died" and self._closed_ack is not None and not self._closed_ack.done():
                self._closed_ack.set_result(False)
            self.close_soon("worker_error")

    def on_chunk(self, c: int, frames: np.ndarray, timings: dict) -> None:
        now = time.monotonic()
        plan = self.plans.pop(c, None)
        if plan is None:
            return
        self.in_flight -= 1
        t_plan, window, marks = plan
        before = self._counts()
        self.chunks_done += 1
        lat = (now - t_plan) * 1e3
        self.chunk_latency_ms.append(lat)
        self.diffusion_ms.append(timings.get("diffusion_ms", 0.0))
        self.decode_ms.append(timings.get("decode_ms", 0.0))
        m = self.server.metrics
        m.chunk_latency.observe(lat)
        t0 = self.clock.t0
        if t0 is not None and now > self.timing.chunk_due(t0, c):
            self.deadline_misses += 1
            m.deadline_misses_total.inc()
        self.buffer.put_chunk(c, frames, window)
        self.first_chunk.set()
        mem = timings.get("memory") or {}  # the worker's memory (MB) with this chunk: rss_mb, cuda_mb on CUDA
        if mem:
            m.set_worker_memory(self.group.index, mem)
        self.timeline.chunk(now, lat, before, mem)
        for mark in marks:
            self._pending_marks.append((c * self.timing.frames_per_chunk + self.timing.frame_of_sample(mark.offset),
                                        mark.t_agent))
        self._wake.set()

    # ---- track callbacks -------------------------------------------------------------------------
    def on_video_frame(self, k: int, fresh: bool, skipped: int, now: float) -> None:
        self.video_frames_sent += 1
        self.video_frames_skipped += skipped
        if self.clock.t0 is not None:
            self._video_lag.append(now - self.timing.video_due(self.clock.t0, k))
        if not fresh:
            self.server.metrics.underruns_total.labels("video").inc()
            return
        self._fresh_times.append(now)
        if self.ttff_ms is None:
            self._first_fresh = now
            self.ttff_ms = (now - self.t_created) * 1e3
            self.first_frame_wall = time.time()
            self.server.metrics.ttff_hist.observe(self.ttff_ms)
            if self.state in ("starting", "connecting"):
                self.state = "streaming"
        while self._pending_marks and self._pending_marks[0][0] <= k:
            _, t_agent = self._pending_marks.pop(0)
            ms = (now - t_agent) * 1e3
            self.agent_latency_ms.append(ms)
            self.server.metrics.agent_latency_hist.observe(ms)

    def on_audio_frame(self, n: int, complete: bool, skipped: int, now: float) -> None:
        self.audio_frames_sent += 1
        self.audio_frames_skipped += skipped
        if self.clock.t0 is not None:
            self._audio_lag.append(now - self.timing.audio_due(self.clock.t0, n))
        if not complete and self.ttff_ms is not None:
            self.server.metrics.underruns_total.labels("audio").inc()

    def _on_mic(self, samples: np.ndarray) -> None:
        self.mic_frames += 1
        self.touch()
        self.agent.push_mic(samples)

    def _on_media_error(self, text: str) -> None:
        self.errors.append(text)
        log.warning("session %s: %s", self.sid, text)

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # ---- the scheduler and the watchdog ---------------------------------------------------------------
    async def _schedule(self) -> None:
        timing, spc = self.timing, self.timing.samples_per_chunk
        lead = self.lead_s
        c = 0
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            t0 = self.clock.t0
            if t0 is not None and now > timing.chunk_due(t0, c + 1):  # fell behind: skip what is already past
                skip_to = int((now - t0) / timing.chunk_seconds) + 1
                self.chunks_skipped += skip_to - c
                c = skip_to
            go, wait = next_plan(c, now, t0, timing, lead, self.in_flight, self.cfg.max_in_flight)
            if go:
                window, marks = self.agent.take(spc)
                self.plans[c] = (now, window, marks)
                self.in_flight += 1
                self.chunks_planned += 1
                self.group.send(("chunk", self.sid, c, window, now))
                c += 1
                continue
            self._wake.clear()
            if t0 is None:
                await _wait_events(1.0, self._wake, self.clock.started)
            else:
                await _wait_events(wait if wait is not None else 1.0, self._wake)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            cfg = self.cfg  # read each time: the limits may be changed on a live session
            now = time.monotonic()
            if now - self.t_created > cfg.max_duration_s:
                self.close_soon("max_duration")
            elif now - self.last_activity > cfg.idle_timeout_s:
                self.close_soon("idle")
            elif self.pc is not None and self.pc.connectionState != "connected" and self.ttff_ms is None \
                    and now - self.t_created > cfg.connect_timeout_s:
                self.close_soon("connect_timeout")
            self.timeline.tick(now, self._counts())
            self.update_metrics()

    # ---- status, metrics, report ------------------------------------------------------------------
    def fps(self, now: float | None = None) -> float:
        """Generated frames sent per second over the last 2 s (or since the first one)."""
        if not self._fresh_times:
            return 0.0
        now = time.monotonic() if now is None else now
        window = 2.0
        n = sum(1 for t in self._fresh_times if t >= now - window)
        span = min(window, now - self._first_fresh)
        return n / max(span, 1.0 / self.timing.fps)

    def av_offset_ms(self) -> float | None:
        v, a = _p50(self._video_lag), _p50(self._audio_lag)
        return None if v is None or a is None else (v - a) * 1e3

    def buffer_ms(self) -> float:
        """Playout headroom: generated video not yet sent (ms of media from the next frame due to the
        end of the newest chunk that is back). Falls toward 0 before an underrun; ~lead when healthy."""
        if not self.buffer.chunks or self.video is None:
            return 0.0
        frames = (max(self.buffer.chunks) + 1) * self.timing.frames_per_chunk - self.video.next_index
        return max(0.0, frames * 1e3 / self.timing.fps)

    def _counts(self) -> dict:
        """The cumulative counters the timeline cuts into windows."""
        return {"video_fresh": self.buffer.video_fresh, "chunks_done": self.chunks_done,
                "underruns_video": self.buffer.video_underruns, "deadline_misses": self.deadline_misses}

    def update_metrics(self) -> None:
        m, s = self.server.metrics, self.sid
        m.fps.labels(s).set(self.fps())
        m.video_underruns.labels(s).set(self.buffer.video_underruns)
        m.audio_underruns.labels(s).set(self.buffer.audio_underruns)
        m.deadline_misses.labels(s).set(self.deadline_misses)
        m.in_flight.labels(s).set(self.in_flight)
        m.buffer_ms.labels(s).set(self.buffer_ms())
        if self.ttff_ms is not None:
            m.ttff.labels(s).set(self.ttff_ms)
        off = self.av_offset_ms()
        if off is not None:
            m.av_offset.labels(s).set(off)
        if self.agent_latency_ms:
            m.agent_latency.labels(s).set(self.agent_latency_ms[-1])

    def status(self) -> dict:
        now = time.monotonic()
        end = self.t_closed or now
        return {
            "session_id": self.sid, "state": self.state, "agent": self.agent.name, "preset": self.engine_cfg.name,
            "group": self.group.index, "close_reason": self.close_reason,
            "age_s": round(end - self.t_created, 3),
            "fps": round(self.fps(now), 2) if self.state != "closed" else 0.0,
            "target_fps": self.timing.fps,
            "frames_per_chunk": self.timing.frames_per_chunk, "lead_ms": _r(self.lead_s * 1e3),
            "ttff_ms": _r(self.ttff_ms),
            "chunk_latency_ms_p50": _r(_p50(self.chunk_latency_ms)),
            "chunk_latency_ms_last": _r(self.chunk_latency_ms[-1] if self.chunk_latency_ms else None),
            "diffusion_ms_p50": _r(_p50(self.diffusion_ms)), "decode_ms_p50": _r(_p50(self.decode_ms)),
            "agent_audio_to_frame_ms_p50": _r(_p50(self.agent_latency_ms)),
            "agent_audio_to_frame_ms_last": _r(self.agent_latency_ms[-1] if self.agent_latency_ms else None),
            "av_offset_ms": _r(self.av_offset_ms()),
            "video_frames_sent": self.video_frames_sent, "video_frames_fresh": self.buffer.video_fresh,
            "audio_frames_sent": self.audio_frames_sent,
            "underruns": {"video": self.buffer.video_underruns, "audio": self.buffer.audio_underruns},
            "deadline_misses": self.deadline_misses,
            "chunks": {"planned": self.chunks_planned, "done": self.chunks_done, "skipped": self.chunks_skipped,
                       "late_dropped": self.buffer.late_chunks, "in_flight": self.in_flight},
            "buffer_ms": _r(self.buffer_ms()) if self.state != "closed" else 0.0,
            "agent_queued_s": round(self.agent.queued_samples / self.timing.sample_rate, 3),
            "agent_segments": self.agent.segments,
            "mic_frames": self.mic_frames,
            "connection": self.pc.connectionState if self.pc is not None else None,
            "video_codec": self.codecs.get("video"), "audio_codec": self.codecs.get("audio"),
            "worker_memory_mb": {k: _r(v) for k, v in self.timeline.memory_last.items()},
            "errors": self.errors[-5:],
        }

    def report(self) -> dict:
        st = self.status()
        lat = sorted(self.chunk_latency_ms)
        st.update({
            "report": True,
            "started_at": self.wall_created,
            "duration_s": round((self.t_closed or time.monotonic()) - self.t_created, 3),
            "fps_mean": round(self.buffer.video_fresh / max(1e-9, (self.t_closed or time.monotonic())
                                                              - (self.clock.t0 or self.t_created)), 2)
            if self.clock.t0 else 0.0,
            "chunk_latency_ms_p99": _r(lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))] if lat else None),
            # the p50/p99 (and diffusion/decode p50) cover the last this-many chunks (a bounded window:
            # 2,000 chunks = 5.6 min at 4 frames per chunk); the timeline has every window of the session
            "chunk_latency_samples": len(lat),
            "agent_audio_to_frame_ms": [round(x, 1) for x in self.agent_latency_ms[-100:]],
            "video_frames_skipped": self.video_frames_skipped, "audio_frames_skipped": self.audio_frames_skipped,
            "worker_open_ms": _r(self.worker_open_ms), "worker_preopened": self.worker_preopened,
            "worker_memory_first_mb": {k: _r(v) for k, v in self.timeline.memory_first.items()},
            "worker_memory_max_mb": {k: _r(v) for k, v in self.timeline.memory_max.items()},
            "worker_memory_growth_mb": self.timeline.memory_growth(),
            "timeline_window_s": self.timeline.window_s,
            "timeline": self.timeline.rows(self.t_closed or time.monotonic(), self._counts()),
            "errors": self.errors[-20:],
        })
        return st

    # ---- close ---------------------------------------------------------------------------------
    # Every wait in the teardown is bounded, so a close always ends: tasks 5 s, the peer connection
    # 10 s, the worker's release 10 s (then the worker is restarted). What has not stopped in time is
    # logged and handed to the server (``background``), whose shutdown waits for it, bounded too.
    TASKS_TIMEOUT_S = 5.0
    PC_CLOSE_TIMEOUT_S = 10.0

    def close_soon(self, reason: str) -> None:
        """Start closing from a callback (not awaited); the server keeps the task to await at shutdown."""
        self._begin_close(reason)

    def _begin_close(self, reason: str) -> asyncio.Task:
        if self._close_task is None:
            self.state = "closing"
            self.close_reason = reason
            t = self._close_task = asyncio.get_running_loop().create_task(
                self._teardown(), name=f"cadence-{self.sid[:8]}-close")
            self.server.background.add(t)
            t.add_done_callback(self.server.background.discard)
        return self._close_task

    async def close(self, reason: str) -> dict:
        """Stop everything this session started; release its group; store the report. Idempotent.

        The teardown runs as its own task (the first close's reason wins); callers wait for it
        shielded, so a caller that is cancelled (a client hanging up on DELETE, uvicorn cancelling
        requests at shutdown) cannot stop it half-way, which would leave the session 'closing' for
        ever and every later close (the server's shutdown) waiting on it."""
        await asyncio.shield(self._begin_close(reason))
        return self.final_report or {}

    async def _teardown(self) -> None:
        try:
            if self._opened is not None and not self._opened.done():  # still starting: stop waiting
                self._opened.set_exception(RuntimeError(f"the session was closed while starting ({self.close_reason})"))
                self._opened.exception()  # retrieved: no "never retrieved" warning if start() is gone
            await self._stop_tasks(self.TASKS_TIMEOUT_S)
            for tr in (self.video, self.audio):
                if tr is not None:
                    tr.stop()
            await self._close_pc(self.PC_CLOSE_TIMEOUT_S)
            self.agent.close()
        except Exception as e:  # keep tearing down: the group must be released and the report stored
            log.exception("session %s: error while closing", self.sid)
            self.errors.append(f"close: {type(e).__name__}: {e}")
        finally:
            self.t_closed = time.monotonic()
            try:
                await self.server.release_group(self)
            except Exception as e:
                log.exception("session %s: releasing its worker group", self.sid)
                self.errors.append(f"release: {type(e).__name__}: {e}")
            finally:
                self.state = "closed"
                self.final_report = self.report()
                self.server.session_closed(self, self.final_report)

    async def _stop_tasks(self, timeout: float) -> None:
        """Cancel this session's tasks and wait for them (``asyncio.wait``: never ``gather`` or
        ``wait_for``, which wait as long as a cancelled coroutine takes to stop), cancelling again
        every 0.1 s: one cancel is not always enough (a coroutine may swallow a CancelledError, as
        Python 3.11's ``asyncio.wait_for`` does in a narrow window). Leftovers go to the server."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        me = asyncio.current_task()
        pending = {t for t in self.tasks if t is not me}
        while pending:
            for t in pending:
                t.cancel()
            left = deadline - loop.time()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(0.1, left))
        if pending:
            log.warning("session %s: %d task(s) still running %.0f s after cancel: %s", self.sid, len(pending),
                        timeout, sorted(t.get_name() for t in pending))
            for t in pending:
                self.server.background.add(t)
                t.add_done_callback(self.server.background.discard)

    async def _close_pc(self, timeout: float) -> None:
        if self.pc is None:
            return
        closing = asyncio.ensure_future(self.pc.close())
        done, _ = await asyncio.wait({closing}, timeout=timeout)
        if not done:
            log.warning("session %s: peer connection still closing after %.0f s", self.sid, timeout)
            self.server.background.add(closing)
            closing.add_done_callback(self.server.background.discard)
        elif not closing.cancelled() and closing.exception() is not None:
            log.warning("session %s: closing the peer connection: %r", self.sid, closing.exception())


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)
