"""One live session: its life cycle (start, worker replies, close), built from the scheduler, the stats
and the two tracks.

Life cycle: ``starting`` (worker opening the session, SDP answered) -> ``connecting`` (waiting for
ICE/DTLS) -> ``streaming`` -> ``closing`` -> ``closed``. The pieces, each in its own file:
:class:`~cadence.serve.scheduler.ChunkScheduler` plans chunks on the media clock and sends requests to
the group's worker; :class:`~cadence.serve.stats.SessionStats` counts and times everything and makes the
status and the report; the tracks (``cadence.serve.rtc``) read a :class:`~cadence.serve.rtc.MediaFeed`
(buffer, clock, hooks), not the session. The geometry is the engine config's: F frames and
48000 x F / fps samples per chunk (4 / 8,000 at the tiny presets, 12 / 24,000 at W1.3).

The media clock starts when a track first asks for media *and* the first chunk is here (bounded by
``clock_start_timeout_s``): a session whose first chunk takes longer than the WebRTC connection (one
W1.3 chunk can) starts on a full chunk instead of beginning behind, with underruns.

A worker slower than real time (a slow CPU, a loaded machine): the scheduler asks it only for the
chunks it can return before they are due; the others play their audio over the last frame. The status
and the report say so (``degraded``, ``chunks.audio_only``, the fresh fps), and the page shows it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from cadence.engine.messages import (
    ChunkDone,
    ChunkTimings,
    Closed,
    CloseSession,
    Died,
    Error,
    Opened,
    OpenSession,
    SwitchPrompt,
)
from cadence.media.pcm import clean
from cadence.serve.agent import Agent
from cadence.serve.pacing import AVBuffer, ChunkPlanner, CutIn, MediaTiming, steal_slowdown
from cadence.serve.ports import SessionGroup, SessionHost, SessionSettings, WorkerSpeed
from cadence.serve.rtc import (
    AudioOut,
    MediaClock,
    MediaFeed,
    VideoOut,
    consume_microphone,
    negotiated_codecs,
    rtc_configuration,
)
from cadence.serve.scheduler import ChunkScheduler
from cadence.serve.stats import SessionStats

log = logging.getLogger("cadence.serve")

#: A connected client that sends nothing at all for this long is gone (closed as ``peer_gone``): every
#: client sends RTCP reports for the video it receives about once a second (aiortc 0.5-1.5 s, Chrome ~1 s),
#: so 8 s is many missed reports. Without it a client that vanishes without a word (its process or network
#: died) held its slot until ICE consent failed: 32-34 s measured (docs/perf/soak/NOTES.md).
PEER_SILENCE_S = 8.0


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


def worker_speed(cfg: SessionSettings, chunk_seconds: float, group: SessionGroup) -> WorkerSpeed:
    """How a new session on ``group`` plans (seconds): the lead (``cfg.lead_ms``, raised with ``lead_auto``
    to the worker's measured chunk latency x (1 + ``lead_margin``) + 20 ms, and to the tail of the group's
    recent sessions), the latency of one chunk (plan -> frames back) and the sustained time per chunk, as the
    worker's warm-up measured them (``lead_ms`` and one chunk period when it measured nothing). The lower the
    lead, the sooner speech reaches the screen; it cannot go below one chunk's work (the session's planner
    raises it further if chunks come back slower).

    A CPU group's lead has headroom: it covers the latency its chunks would have while the hypervisor takes
    ``STEAL_HEADROOM`` of every vCPU (``steal_slowdown``: 2.04x at two threads), capped at three chunk periods
    (beyond that a worker is below real time, which no lead covers): on a shared VM the chunks of a few
    seconds of steal came back late, and every session that missed 23.5 fresh fps ran in such a stretch
    (docs/perf/soak/NOTES.md, finding 7). The price is latency (speech -> frame ~ lead + half a chunk)."""
    info = group.info
    warm = (info.warmup if info is not None else None) or {}
    latency = warm.get("steady_chunk_ms")
    interval = warm.get("interval_ms")
    slow = (
        steal_slowdown(info.threads or 1) if info is not None and str(info.device).startswith("cpu") else 1.0
    )
    lead = cfg.lead_ms / 1e3
    if latency:
        # the web side's view: + the pipe and the event loop (+ a fleet group's Ray hop: transport_s)
        latency = latency / 1e3 + 0.01 + group.transport_s
        if cfg.lead_auto:
            lead = max(lead, min(latency * slow, 3 * chunk_seconds) * (1 + cfg.lead_margin) + 0.02)
    else:
        latency = min(cfg.lead_ms / 1e3, chunk_seconds)
    # the tail of the group's recent sessions (``cadence.serve.pacing.LatencyProfile``): a few-second session
    # is too short to meet the rare slow chunks that make it lose frames (docs/perf/soak/NOTES.md)
    tail = group.latency_profile.lead() if cfg.lead_auto else None
    if tail is not None:
        lead = max(lead, min(group.latency_profile.lead(slow), 3 * chunk_seconds + 0.02), tail)
    return WorkerSpeed(lead, latency, interval / 1e3 if interval else min(latency, chunk_seconds))


def cut_in_of(cfg: SessionSettings, group: SessionGroup) -> CutIn | None:
    """The speech cut-in a session on ``group`` uses (``cadence.serve.pacing.cut_in_point``): what the group's
    engine can do (``WorkerInfo.cut_in``: the clip streams), unless switched off (``cut_in`` False); None: the
    chunk grid only."""
    info = group.info
    got = getattr(info, "cut_in", None) if info is not None else None
    if not got or not getattr(cfg, "cut_in", True):
        return None
    return CutIn(int(got[0]), int(got[1]))


class ClosesInBackground:
    """The close protocol of a server's sessions (this module's ``LiveSession``, and a fleet session whose media
    runs on its group: ``cadence.fleet.remote.GroupMediaSession``): the first close starts ``_teardown`` as a
    task of its own (the first reason wins; a cancelled caller does not stop it) that the host keeps in
    ``background`` to await at shutdown; every teardown ends in ``_finish_close`` (the group given back, the
    report stored). Needs ``sid``, ``server`` (a :class:`~cadence.serve.ports.SessionHost`), ``state``,
    ``close_reason``, ``errors``, ``report()``, ``_close_task`` (None until the first close) and
    ``async _teardown()``."""

    def close_soon(self, reason: str) -> None:
        """Start closing from a callback (not awaited); the server keeps the task to await at shutdown."""
        self._begin_close(reason)

    def _begin_close(self, reason: str) -> asyncio.Task:
        if self._close_task is None:
            self.state = "closing"
            self.close_reason = reason
            t = self._close_task = asyncio.get_running_loop().create_task(
                self._teardown(), name=f"cadence-{self.sid[:8]}-close"
            )
            self.server.background.add(t)
            t.add_done_callback(self.server.background.discard)
        return self._close_task

    async def close(self, reason: str) -> dict:
        """Close the session, release its group, store and return the report. Idempotent: the teardown runs
        as its own task (the first close's reason wins); callers wait for it shielded, so a cancelled caller
        (a client that drops the DELETE, requests at shutdown) cannot stop it half-way, which would leave the
        session 'closing' for ever and every later close (the server's shutdown) waiting on it."""
        await asyncio.shield(self._begin_close(reason))
        return self.final_report or {}

    async def _finish_close(self, release, what: str) -> None:
        """The end of every teardown: the group given back (``await release()``; a failure is logged and
        kept as an error), then closed, the report stored and handed to the host, whatever happened."""
        self.t_closed = time.monotonic()
        try:
            await release()
        except Exception as e:
            log.exception("session %s: releasing its %s", self.sid, what)
            self.errors.append(f"release: {type(e).__name__}: {e}")
        finally:
            self.state = "closed"
            self.final_report = self.report()
            self.server.session_closed(self, self.final_report)


class LiveSession(ClosesInBackground):
    """One session whose media runs in this process (the :class:`~cadence.serve.ports.SessionPort` the manager
    and the routes use), on a :class:`~cadence.serve.ports.SessionGroup`, reporting to ``server`` (a
    :class:`~cadence.serve.ports.SessionHost`: the session manager, or a group actor's ``MediaHost``)."""

    def __init__(
        self,
        server: SessionHost,
        sid: str,
        group: SessionGroup,
        agent: Agent,
        engine_cfg,
        prompt: str,
        seed: int,
    ):
        self.server, self.sid, self.group, self.agent = server, sid, group, agent
        self.cfg = server.cfg
        self.engine_cfg = engine_cfg
        self.prompt, self.seed = prompt, seed
        self.timing = MediaTiming.from_config(engine_cfg)
        lead, latency, interval = worker_speed(self.cfg, engine_cfg.chunk_seconds, group)
        self.first_chunk = asyncio.Event()  # set when the first chunk's frames are here (the clock may start)
        self.clock_start_timeout_s = max(2.0, 4 * self.timing.chunk_seconds)
        self.buffer = AVBuffer(
            self.timing,
            engine_cfg.stream.height,
            engine_cfg.stream.width,
            sync_marker_every=self.cfg.sync_marker_every,
        )
        self.clock = MediaClock()
        self.state = "starting"
        self.close_reason: str | None = None
        self.t_created = time.monotonic()
        self.wall_created = time.time()
        self.t_closed: float | None = None
        self.last_activity = self.t_created
        self.stats = SessionStats(
            self.timing.fps,
            self.timing.frames_per_chunk,
            self.cfg.timeline_window_s,
            server.metrics,
            sid,
            self.t_created,
        )
        self.planner = ChunkPlanner(
            self.timing, lead=lead, latency=latency, interval=interval, max_in_flight=self.cfg.max_in_flight
        )
        pieces = (self.planner, agent, self.buffer, self.clock, group.send, self.stats)
        self.scheduler = ChunkScheduler(sid, self.timing, *pieces, cut_in=cut_in_of(self.cfg, group))
        self.feed = MediaFeed(
            self.buffer,
            self.clock,
            self.timing,
            self.first_chunk,
            self.clock_start_timeout_s,
            self.on_video_frame,
            self.on_audio_frame,
        )
        self.pc = None
        self.video: VideoOut | None = None
        self.audio: AudioOut | None = None
        self.tasks: set[asyncio.Task] = set()
        self._opened: asyncio.Future | None = None
        self._closed_ack: asyncio.Future | None = None
        self._close_task: asyncio.Task | None = None
        self.final_report: dict | None = None
        self.worker_open_ms: float | None = None
        self.worker_preopened = False  # the worker had this session opened ahead (default face and prompt)
        self.codecs: dict[
            str, str
        ] = {}  # what the answer settled on: {"video": "VP8" | "H264", "audio": "opus"}
        self.prompt_switches = 0
        self._peer_rx: tuple[int, float] | None = (
            None  # (packets received from the client, when that changed)
        )
        self.barge_in_times: list[float] = []  # host times the agent was interrupted (barge-in, /interrupt)
        agent.on_interrupt = self._on_agent_interrupt

    # (the figures the timeline, the API and the tests read)
    @property
    def errors(self) -> list[str]:
        return self.stats.errors

    @property
    def ttff_ms(self) -> float | None:
        return self.stats.ttff_ms

    @property
    def in_flight(self) -> int:
        return self.planner.in_flight

    # ---- start ----------------------------------------------------------------------------------
    async def start(self, image: np.ndarray | None, offer_sdp: str, offer_type: str):
        """Open the session in the worker and answer the offer (concurrently). Returns the answer."""
        from aiortc import RTCPeerConnection, RTCSessionDescription

        loop = asyncio.get_running_loop()
        self._opened = loop.create_future()
        self.group.send(OpenSession(self.sid, image, self.prompt, self.seed))
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
        self.video = VideoOut(self.feed)
        pc.addTrack(self.video)
        if "audio" in kinds:
            self.audio = AudioOut(self.feed)
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
        self._start_tasks()
        return pc.localDescription

    async def start_local(self, image: np.ndarray | None) -> None:
        """Open the session in the worker with no peer connection: the caller reads ``self.video`` and
        ``self.audio`` (paced tracks on the session's media clock) in this process."""
        self._opened = asyncio.get_running_loop().create_future()
        self.group.send(OpenSession(self.sid, image, self.prompt, self.seed))
        self.video, self.audio = VideoOut(self.feed), AudioOut(self.feed)
        done, _ = await asyncio.wait({self._opened}, timeout=60.0)
        if not done:
            raise RuntimeError("the worker did not open the session within 60 s")
        self.worker_open_ms = self._opened.result()
        if self.state in ("closing", "closed"):
            raise RuntimeError(f"the session was closed while starting ({self.close_reason})")
        self.state = "streaming"
        self._start_tasks()

    def _start_tasks(self) -> None:
        self._spawn(self.scheduler.run(), "scheduler")
        self._spawn(self._watchdog(), "watchdog")
        if self.agent.run is not None:
            self._spawn(self.agent.run(), "agent")

    async def set_prompt(self, prompt: str) -> int:
        """Change the prompt from the next chunk planned on (the worker re-encodes it, padded to the model's
        fixed text length: the step keeps its shape; a LongLive family re-caches the recent chunks' K/V).
        Returns that chunk's index."""
        index = self.planner.next_chunk
        self.prompt = prompt
        self.prompt_switches += 1
        self.group.send(SwitchPrompt(self.sid, index, prompt))
        return index

    def _on_agent_interrupt(self) -> None:
        """The agent stopped speaking (barge-in or /interrupt): silence the speech already planned into
        chunks not yet played (their audio; their frames are made already), from the next audio frame."""
        self.barge_in_times.append(time.monotonic())
        nxt = self.audio.next_index if self.audio is not None else 0
        self.buffer.silence_from(nxt * self.timing.audio_frame_samples)

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

    # ---- worker replies (on the event loop) ---------------------------------------------------------
    def on_worker_message(self, msg) -> None:
        match msg:
            case Opened(ms=ms, preopened=preopened):
                if self._opened is not None and not self._opened.done():
                    self.worker_preopened = bool(preopened)
                    self._opened.set_result(ms)
            case ChunkDone(index=index, frames=frames, timings=tm):
                self.on_chunk(index, frames, tm)
            case Closed():
                if self._closed_ack is not None and not self._closed_ack.done():
                    self._closed_ack.set_result(True)
            case Error(message=text) | Died(reason=text):
                text = f"worker: {text}"
                self.errors.append(text)
                log.error("session %s: %s", self.sid, text)
                if self._opened is not None and not self._opened.done():
                    self._opened.set_exception(RuntimeError(text))
                if isinstance(msg, Died) and self._closed_ack is not None and not self._closed_ack.done():
                    self._closed_ack.set_result(False)
                self.close_soon("worker_error")

    def on_chunk(self, c: int, frames: np.ndarray, timings: ChunkTimings | dict) -> None:
        if self.state in ("closing", "closed"):  # the report's counts are final once closing
            return
        if isinstance(timings, dict):
            timings = ChunkTimings(**timings)
        now = time.monotonic()
        got = self.scheduler.arrived(c, now, timings)
        if got is None:
            return
        t_plan, lat, plan = got
        if not plan.prestart:  # the group's profile, across its sessions (the two prestart chunks queue)
            self.group.latency_profile.add_latency(lat / 1e3)
        t0 = self.clock.t0
        due = None if t0 is None else self.timing.chunk_due(t0, c)
        if due is not None and self.buffer.segments:  # after a cut-in: the chunk's own first frame
            due = self.timing.video_due(t0, self.buffer.chunk_start(c))
        late = due is not None and now > due
        budget = (due - t_plan) * 1e3 if due is not None else None
        before = self._counts()
        self.buffer.put_video(c, frames)
        self.first_chunk.set()
        if timings.memory:  # the worker's memory (MB) with this chunk: rss_mb, cuda_mb on CUDA
            self.server.metrics.set_worker_memory(self.group.index, timings.memory)
        self.stats.chunk(now, c, lat, timings, late, before, budget_ms=budget)

    # ---- track hooks -----------------------------------------------------------------------------
    def on_video_frame(self, k: int, fresh: bool, skipped: int, now: float) -> None:
        t0 = self.clock.t0
        lag = now - self.timing.video_due(t0, k) if t0 is not None else None
        marks = not self.buffer.last_fallback  # a frame queued before a cut-in is not its speech
        if self.stats.video_frame(k, fresh, skipped, now, lag, marks=marks) and self.state in (
            "starting",
            "connecting",
        ):
            self.state = "streaming"

    def on_audio_frame(self, n: int, complete: bool, skipped: int, now: float) -> None:
        t0 = self.clock.t0
        lag = now - self.timing.audio_due(t0, n) if t0 is not None else None
        self.stats.audio_frame(complete, skipped, lag)

    def _on_mic(self, samples: np.ndarray) -> None:
        self.stats.mic_frames += 1
        self.touch()
        samples, bad = clean(samples)  # a live track cannot be refused: NaN and infinity become silence
        if bad:
            if not self.stats.mic_nonfinite:
                log.warning(
                    "session %s: the microphone sent %d non-finite samples (NaN or infinity): replaced by "
                    "silence (the status counts the rest: mic_nonfinite_samples)",
                    self.sid,
                    bad,
                )
            self.stats.mic_nonfinite += bad
        self.agent.push_mic(samples)

    def _on_media_error(self, text: str) -> None:
        self.errors.append(text)
        log.warning("session %s: %s", self.sid, text)

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # ---- the watchdog ------------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            cfg = self.cfg  # read each time: the limits may be changed on a live session
            now = time.monotonic()
            if now - self.t_created > cfg.max_duration_s:
                self.close_soon("max_duration")
            elif now - self.last_activity > cfg.idle_timeout_s:
                self.close_soon("idle")
            elif (
                self.pc is not None
                and self.pc.connectionState != "connected"
                and self.ttff_ms is None
                and now - self.t_created > cfg.connect_timeout_s
            ):
                self.close_soon("connect_timeout")
            elif self._peer_silent_for(now) > PEER_SILENCE_S:
                self.close_soon("peer_gone")
            self.stats.timeline.tick(now, self._counts())
            self.update_metrics()

    def _peer_silent_for(self, now: float) -> float:
        """Seconds since the last packet from the client (RTP or RTCP, counted by the DTLS transport), once
        connected; 0 when it cannot be told."""
        if self.pc is None or self.pc.connectionState != "connected":
            return 0.0
        try:
            n = sum(
                s.packetsReceived
                for t in {tr.sender.transport for tr in self.pc.getTransceivers() if tr.sender.transport}
                for s in t._get_stats().values()  # aiortc's own (sync) transport stats
                if getattr(s, "type", None) == "transport"
            )
        except (AttributeError, TypeError):  # an aiortc without them: ICE consent still notices, later
            return 0.0
        if self._peer_rx is None or n != self._peer_rx[0]:
            self._peer_rx = (n, now)
        return now - self._peer_rx[1]

    # ---- status, metrics, report ------------------------------------------------------------------
    def fps(self, now: float | None = None) -> float:
        return self.stats.fps(now)

    def av_offset_ms(self) -> float | None:
        return self.stats.av_offset_ms()

    def degraded(self, now: float | None = None) -> bool:
        """Whether the stream is below real time, what the page calls "reduced" (``SessionStats.reduced``:
        after a start-up allowance, over a window of a few seconds)."""
        return self.stats.reduced(time.monotonic() if now is None else now)

    def buffer_ms(self) -> float:
        """Playout headroom: generated video not yet sent (ms of media from the next frame due to the
        end of the newest chunk that is back). Falls toward 0 before an underrun; ~lead when healthy."""
        newest = self.buffer.newest_video
        if newest is None or self.video is None:
            return 0.0
        frames = self.buffer.chunk_start(newest) + self.timing.frames_per_chunk - self.video.next_index
        return max(0.0, frames * 1e3 / self.timing.fps)

    def _counts(self) -> dict:
        """The cumulative counters the timeline cuts into windows."""
        return {
            "video_fresh": self.buffer.video_fresh,
            "chunks_done": self.stats.chunks_done,
            "underruns_video": self.buffer.video_underruns,
            "deadline_misses": self.stats.deadline_misses,
        }

    def update_metrics(self) -> None:
        m, s, st = self.server.metrics, self.sid, self.stats
        m.fps.labels(s).set(self.fps())
        m.video_underruns.labels(s).set(self.buffer.video_underruns)
        m.audio_underruns.labels(s).set(self.buffer.audio_underruns)
        m.deadline_misses.labels(s).set(st.deadline_misses)
        m.in_flight.labels(s).set(self.in_flight)
        m.buffer_ms.labels(s).set(self.buffer_ms())
        if st.ttff_ms is not None:
            m.ttff.labels(s).set(st.ttff_ms)
        off = self.av_offset_ms()
        if off is not None:
            m.av_offset.labels(s).set(off)
        if st.agent_latency_ms:
            m.agent_latency.labels(s).set(st.agent_latency_ms[-1])

    def status(self) -> dict:
        now = time.monotonic()
        end = self.t_closed or now
        closed = self.state == "closed"
        p = self.planner
        out = {
            "session_id": self.sid,
            "state": self.state,
            "agent": self.agent.name,
            "preset": self.engine_cfg.name,
            "weights_entry": self.engine_cfg.model.weights_entry,  # the checkpoint entry served
            "group": self.group.index,
            "close_reason": self.close_reason,
            "age_s": round(end - self.t_created, 3),
            "lead_ms": _r(p.lead * 1e3),
        }
        out.update(self.stats.status_fields(now, closed))
        out.update(
            {
                "video_frames_fresh": self.buffer.video_fresh,  # generated, not blank: what the viewer gets
                "video_frames_blank": self.buffer.video_blank,  # generated, blank: replaced by the last good one
                "underruns": {"video": self.buffer.video_underruns, "audio": self.buffer.audio_underruns},
                "chunks": {
                    "planned": self.stats.chunks_planned,
                    "done": self.stats.chunks_done,
                    "skipped": p.skipped,
                    "audio_only": p.audio_only,
                    "cut_ins": p.cut_ins,
                    "cut_in_fallback_frames": self.buffer.cut_in_fallback,
                    "late_dropped": self.buffer.late_chunks,
                    "in_flight": p.in_flight,
                },
                "degraded": self.degraded(now) if not closed else False,
                "worker_estimate_ms": {"latency": _r(p.latency * 1e3), "interval": _r(p.interval * 1e3)},
                "buffer_ms": _r(self.buffer_ms()) if not closed else 0.0,
                "agent_queued_s": round(self.agent.queued_samples / self.timing.sample_rate, 3),
                "agent_segments": self.agent.segments,
                "prompt_switches": self.prompt_switches,
                "connection": self.pc.connectionState if self.pc is not None else None,
                "video_codec": self.codecs.get("video"),
                "audio_codec": self.codecs.get("audio"),
            }
        )
        out.update(self.agent.status_fields())
        return out

    def report(self) -> dict:
        st = self.status()
        t_end = self.t_closed or time.monotonic()
        st.update(
            {
                "report": True,
                "started_at": self.wall_created,
                "duration_s": round(t_end - self.t_created, 3),
                "worker_open_ms": _r(self.worker_open_ms),
                "worker_preopened": self.worker_preopened,
            }
        )
        st.update(self.stats.report_fields(t_end, self.clock.t0, self.buffer.video_fresh, self._counts()))
        st.update(self.agent.report_fields())
        return st

    # ---- close ---------------------------------------------------------------------------------
    # Every wait in the teardown is bounded, so a close always ends: tasks 5 s, the peer connection
    # 10 s, the worker's release 10 s (then the worker is restarted). What has not stopped in time is
    # logged and handed to the server (``background``), whose shutdown waits for it, bounded too.
    TASKS_TIMEOUT_S = 5.0
    PC_CLOSE_TIMEOUT_S = 10.0

    async def _teardown(self) -> None:
        try:
            if self._opened is not None and not self._opened.done():  # still starting: stop waiting
                self._opened.set_exception(
                    RuntimeError(f"the session was closed while starting ({self.close_reason})")
                )
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
            await self._finish_close(self._release_group, "worker group")

    async def _release_group(self) -> None:
        """The worker lets the session go (``CloseSession``, answered ``Closed`` within 10 s; else the group
        is restarted), then the host takes the group back."""
        g = self.group
        if g.session_id != self.sid:
            return
        ok = False
        if g.ready.is_set():
            ack = self._closed_ack = asyncio.get_running_loop().create_future()
            g.send(CloseSession(self.sid))
            await asyncio.wait({ack}, timeout=10.0)
            ok = ack.done() and not ack.cancelled() and ack.result() is True
        if not ok:
            log.warning("worker %d did not release session %s: restarting it", g.index, self.sid)
            await g.restart()
        self.server.release(g, self.sid)

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
            log.warning(
                "session %s: %d task(s) still running %.0f s after cancel: %s",
                self.sid,
                len(pending),
                timeout,
                sorted(t.get_name() for t in pending),
            )
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
