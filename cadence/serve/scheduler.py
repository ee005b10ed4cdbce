"""A session's chunk scheduler: an asyncio task that plans chunks on the media clock.

It only moves small messages: each chunk's audio window is taken from the agent when the chunk is planned
(``lead`` before it is due, ``pacing.ChunkPlanner``), put in the session's buffer at once (so the audio
always plays), and, when the planner predicts the worker can have its frames back in time, sent to the
worker as a :class:`~cadence.engine.messages.ChunkRequest`. Frames come back on the worker group's reader
thread and reach the session on the event loop (``LiveSession.on_worker_message`` -> ``arrived``).

Agent latency (first audio -> first speaking frame): speech is taken from the agent at plan time, so it
goes into the earliest chunk not yet planned, at its start when nothing was queued: it waits for the next
plan (0..one chunk period), then ``lead`` until that chunk is due, where its first frame plays. ``lead``
cannot be below one chunk's latency (plan -> frames back) or every chunk would be late, so the agent
latency is at least one chunk's work and on average lead + half a chunk period. The planner follows the
worker's measured latency, so the lead is no longer than needed.

The clip streams' cut-in (``cut_in``: what the group's engine can do, ``WorkerInfo.cut_in``, unless switched off):
a clip is 0.96 s (FlashHead Lite) to 1.12 s, so half a chunk period is most of that latency. While speech is
queued and the clips planned ahead are silent, the scheduler (it looks every frame) plans the next clip to start
at the first frame still replaceable instead (``ChunkPlanner.cut_in``, ``AVBuffer.cut``; the request's
``rewind`` tells the session), so the speech plays about lead + a frame after it arrives. A session with
``cut_in`` None (every chunk-grid family) never takes that path: its pacing is the grid's alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cadence.engine.messages import ChunkRequest, ChunkTimings
from cadence.media.pcm import clean
from cadence.serve.pacing import AVBuffer, ChunkPlanner, CutIn, MediaTiming, Plan, cut_in_point
from cadence.serve.rtc import MediaClock
from cadence.serve.stats import SessionStats

log = logging.getLogger("cadence.serve")


async def wait_events(timeout: float, *events: asyncio.Event) -> None:
    """Return when one of ``events`` is set or after ``timeout`` seconds.

    Not ``asyncio.wait_for(event.wait(), timeout)``: on Python 3.11, ``wait_for`` swallows a cancellation
    that arrives while the awaited event has just been set (its inner task finished, its done-callback not
    yet run: a window of about two loop iterations) and returns normally, so the cancelled task runs on. A
    chunk arriving (``wake``) just as a session closes hit that window and left the scheduler running
    forever. ``asyncio.wait`` always lets the CancelledError through.
    """
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class ChunkScheduler:
    def __init__(
        self,
        sid: str,
        timing: MediaTiming,
        planner: ChunkPlanner,
        agent,
        buffer: AVBuffer,
        clock: MediaClock,
        send: Callable[[object], None],
        stats: SessionStats,
        cut_in: CutIn | None = None,
    ):
        self.sid, self.timing, self.planner, self.agent = sid, timing, planner, agent
        self.buffer, self.clock, self.send, self.stats = buffer, clock, send, stats
        self.plans: dict[int, tuple[Plan, float]] = {}  # generated chunks not back yet: (plan, t_plan)
        self.wake = asyncio.Event()
        self.cut_in = cut_in  # None: the chunk grid only (every family but the clip streams, or switched off)
        self.made_from = self.made_to = 0  # the frames [from, to) the worker was asked for, without a gap
        # the agent's queued speech samples when last seen to change, and when (``_speech_ready``)
        self._queued: tuple[int, float] = (0, 0.0)

    def _plan_chunk(self, plan: Plan, now: float, rewind: int = 0) -> None:
        """Take the chunk's audio from the agent into the buffer and, if it is generated, send it."""
        c, spc, timing = plan.chunk, self.timing.samples_per_chunk, self.timing
        start = plan.start_frame if plan.start_frame is not None else c * timing.frames_per_chunk
        window, marks = self.agent.take(spc)
        window = self._finite(window)
        self.buffer.put_audio(c, window)  # the audio plays whether or not its frames are made
        self.stats.chunks_planned += 1
        for mark in marks:
            self.stats.mark_speech(start + timing.frame_of_sample(mark.offset), mark.t_agent, mark.kind)
        if plan.generate:
            if start != self.made_to and not rewind:  # after an audio-only or skipped chunk: a new run
                self.made_from = start
            self.made_to = start + timing.frames_per_chunk
            self.plans[c] = (plan, now)
            self.send(ChunkRequest(self.sid, c, window, now, rewind=rewind))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if self.cut_in is not None and self._try_cut_in(now):
                continue
            plan, wait = self.planner.poll(now, self.clock.t0)
            if plan is not None:
                self._plan_chunk(plan, now)
                continue
            self.wake.clear()
            if self.clock.t0 is None:
                await wait_events(1.0, self.wake, self.clock.started)
            else:
                wait = wait if wait is not None else 1.0
                if self.cut_in is not None:  # look for speech every frame (the agents set no event)
                    wait = min(wait, 1.0 / self.timing.fps)
                await wait_events(wait, self.wake)

    def _try_cut_in(self, now: float) -> bool:
        """Speech is queued while the clips planned ahead are silent: plan the next clip from the first frame
        still replaceable (``ChunkPlanner.cut_in_frame``) instead of after them, if the worker made every frame
        before it that the clip's motion needs and none of the audio it replaces is speech
        (:func:`cadence.serve.pacing.cut_in_point`). Returns whether it planned one."""
        t0, p = self.clock.t0, self.planner
        if t0 is None or not self._speech_ready(now) or p.in_flight >= p.max_in_flight:
            return False
        end = p.start_frame(p.next_chunk)
        k = cut_in_point(
            p.cut_in_frame(now, t0),
            end,
            self.made_from,
            self.made_to,
            self.cut_in,
            self.buffer.segments[-1][1] + self.timing.frames_per_chunk if self.buffer.segments else 0,
        )
        if k is None or not self.buffer.silent_from(k, end):
            return False
        plan = p.cut_in(now, t0, k)
        self.buffer.cut(plan.chunk, k)
        self._plan_chunk(plan, now, rewind=self.made_to - k)
        return True

    def _speech_ready(self, now: float) -> bool:
        """Whether the queued speech can start a cut-in clip: a whole chunk of it, or less that has not grown for
        a frame (an utterance given whole). Speech still arriving in pieces (a TTS streaming in real time) waits:
        taken now, the clip's audio would be its first piece and silence, a gap inside the utterance."""
        q = self.agent.queued_samples
        if q != self._queued[0]:
            self._queued = (q, now)
        return q >= self.timing.samples_per_chunk or (
            q > 0 and now - self._queued[1] >= 1.0 / self.timing.fps
        )

    def _finite(self, window):
        """The last guard before the worker: every sample finite and within [-1, 1] (the agents refuse or
        clean what they are given; a sample that still is not is silenced, counted, and logged once)."""
        window, bad = clean(window)
        if bad:
            if not self.stats.audio_nonfinite:
                log.warning(
                    "session %s: %d non-finite audio samples reached the scheduler: silenced (a bug; "
                    "the report counts them: audio_nonfinite_samples)",
                    self.sid,
                    bad,
                )
            self.stats.audio_nonfinite += bad
        return window

    def arrived(self, index: int, now: float, tm: ChunkTimings) -> tuple[float, float, Plan] | None:
        """A generated chunk is back: ``(t_plan, latency_ms, plan)``, or None for a chunk this session did not
        ask for (a stale reply). Feeds the planner what the worker measured."""
        got = self.plans.pop(index, None)
        if got is None:
            return None
        plan, t_plan = got
        interval = max(tm.diffusion_ms, tm.decode_ms + tm.host_copy_ms) / 1e3 if tm.diffusion_ms else None
        self.planner.observe(now, plan, interval)
        self.wake.set()
        return t_plan, (now - t_plan) * 1e3, plan

    def failed(self, index: int | None) -> None:
        """A request failed at the worker: its place is free again."""
        if index is not None and self.plans.pop(index, None) is not None:
            self.planner.lost()
            self.wake.set()
