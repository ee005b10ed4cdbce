"""The server's side of the speech cut-in (``cadence.serve.pacing``: ``cut_in_point``, ``ChunkPlanner.cut_in``,
``AVBuffer.cut``; ``cadence.serve.scheduler.ChunkScheduler._try_cut_in``).

(a) The frame arithmetic, pure: the first replaceable frame, when a cut-in is allowed, the grid's shift after it,
which chunk every frame and every audio sample is read from (the frames before the cut as they were queued, the
cut-in's from it on, what was queued standing in while the cut-in's frames are not back).
(c) The scheduler on the event loop with a fake worker (a clip in 30 ms) at 100 fps and 24 frames a chunk (a
0.24 s clip, so a few seconds hold several utterances at spread phases): speech -> first speaking frame
(``SessionStats.agent_latency_ms``, what ``agent_audio_to_frame_ms`` reports) is about lead + half a clip on the
grid and about lead + a frame with the cut-in, every speech sample plays once, and every frame shown is the frame
planned with the audio of its media instant. The chunk grid (``cut_in`` None, every family but the clip streams)
never cuts in."""

from __future__ import annotations

import asyncio
import statistics
from unittest.mock import MagicMock

import numpy as np
import pytest

from cadence.engine.messages import ChunkTimings
from cadence.serve.agent import Agent
from cadence.serve.pacing import AVBuffer, ChunkPlanner, CutIn, MediaTiming, cut_in_point, first_frame_after
from cadence.serve.rtc import MediaClock
from cadence.serve.scheduler import ChunkScheduler
from cadence.serve.stats import SessionStats

T = MediaTiming(fps=25, frames_per_chunk=24)  # FlashHead Lite's clip: 24 new frames at 25 fps
LITE = CutIn(max_rewind=39, motion_frames=9)


# ---- (a) the arithmetic -----------------------------------------------------------------------------------
def test_the_first_replaceable_frame_is_the_first_due_after_the_clip_is_back():
    assert first_frame_after(10.0, 10.0, 25) == 0
    assert first_frame_after(10.0401, 10.0, 25) == 2  # 40.1 ms: frame 1 (40 ms) is due before it
    assert first_frame_after(10.04, 10.0, 25) == 1
    p = ChunkPlanner(T, lead=0.1, latency=0.088, interval=0.088)
    # one clip's latency as the lead covers it (p90 x 1.1 + 20 ms = 116.8 ms) after now: frame ceil(25 x 0.5168)
    assert p.cut_in_frame(now=100.4, t0=100.0) == 13
    p.busy_until = 100.5  # the worker is still on a clip: from when it is free
    assert p.cut_in_frame(now=100.4, t0=100.0) == 16


def test_where_a_cut_in_may_start():
    # frames 0..47 made in one run, 48 the first not yet planned: a cut at 30 replays 18 frames
    assert cut_in_point(30, 48, 0, 48, LITE) == 30
    assert cut_in_point(48, 48, 0, 48, LITE) is None  # no earlier than the next chunk on the grid
    assert cut_in_point(30, 72, 0, 48, LITE) is None  # the last chunk planned was audio-only (not made)
    assert cut_in_point(30, 48, 24, 48, LITE) is None  # its 9 motion frames (21..29) were not all made
    assert cut_in_point(8, 48, 0, 48, LITE) is None  # 40 frames back: more than the session keeps
    assert cut_in_point(30, 48, 0, 48, LITE, not_before=40) is None  # inside the last cut-in's clip


def test_the_grid_moves_by_the_cut():
    p = ChunkPlanner(T, lead=0.1, latency=0.05, interval=0.05, prestart=0)
    p.next_chunk = 2  # chunks 0, 1 planned: frames 0..47
    plan = p.cut_in(now=100.5, t0=100.0, k=30)
    assert (plan.chunk, plan.start_frame, plan.generate, plan.cut_in) == (2, 30, True, True)
    assert p.shift == -18 and p.start_frame(3) == 54 and p.next_chunk == 3
    assert p.chunk_due(100.0, 3) == pytest.approx(100.0 + 54 / 25)
    assert p.in_flight == 1 and p.cut_ins == 1
    plan, wait = p.poll(100.5, 100.0)  # chunk 3 is planned `lead` before frame 54 is due
    assert plan is None and wait == pytest.approx(54 / 25 - 0.1 - 0.5)


def _chunk(c: int, f: int = 24) -> np.ndarray:
    x = np.full((f, 4, 4, 3), 100, np.uint8)
    x[:, 0, 0, 0] = c
    x[:, 0, 0, 1] = np.arange(f)
    return x


def test_the_buffer_plays_what_was_queued_before_the_cut_and_the_cut_in_after_it():
    b = AVBuffer(T, 4, 4)
    spc, spf = T.samples_per_chunk, T.samples_per_frame
    b.put_audio(0, np.zeros(spc, np.float32))
    b.put_audio(1, np.zeros(spc, np.float32))
    b.put_video(0, _chunk(0))
    b.put_video(1, _chunk(1))
    assert b.silent_from(30, 48)
    b.cut(2, 30)
    speech = np.linspace(0.1, 0.9, spc, dtype=np.float32)
    b.put_audio(2, speech)
    assert not b.silent_from(30, 48) and b.chunk_start(2) == 30 and b.chunk_start(3) == 54
    shown, heard, fallback = [], [], []
    for k in range(54):  # the two tracks in step: a 40 ms video frame, two 20 ms audio frames
        if k == 31:
            b.put_video(2, _chunk(2))
        shown.append(b.video_frame(k)[0][0, 0, :2].tolist())
        fallback.append(b.last_fallback)
        heard += [b.audio_frame(2 * k)[0], b.audio_frame(2 * k + 1)[0]]
    assert shown[:30] == [[0, i] for i in range(24)] + [[1, i] for i in range(6)]  # before the cut: as queued
    # frame 30: the cut-in's frames are not back, what was queued stands in (never a frozen face), counted
    assert shown[30] == [1, 6] and fallback[30] and b.cut_in_fallback == 1
    assert shown[31:] == [[2, i] for i in range(1, 24)] and not any(fallback[31:])
    # the audio: the queued silence up to the cut's first sample, then the cut-in's samples, each once
    out = np.concatenate(heard)
    assert not out[: 30 * spf].any() and np.array_equal(out[30 * spf : 54 * spf], speech)
    assert b.audio_underruns == 0 and b.video_underruns == 0


def test_a_cut_in_cannot_go_back_before_the_last_one():
    b = AVBuffer(T, 4, 4)
    b.cut(2, 30)
    with pytest.raises(ValueError, match="goes back"):
        b.cut(3, 20)


# ---- (c) the scheduler on the event loop -------------------------------------------------------------------
FAST = MediaTiming(fps=100, frames_per_chunk=24)  # a 0.24 s clip: several utterances in a few seconds
WORK = 0.03  # the fake worker's time per clip


async def _simulate(cut: CutIn | None, utterances: int = 5, every: float = 0.37):
    loop = asyncio.get_running_loop()
    planner = ChunkPlanner(FAST, lead=0.06, latency=WORK, interval=WORK)
    buffer = AVBuffer(FAST, 4, 4)
    cuts = []
    real_cut = buffer.cut
    buffer.cut = lambda c, k: (cuts.append((c, k)), real_cut(c, k))[1]
    clock = MediaClock(now=loop.time)
    stats = SessionStats(FAST.fps, FAST.frames_per_chunk, 60.0, MagicMock(), "s", loop.time())
    agent = Agent()
    busy = [0.0]

    def send(req):  # the worker: one clip at a time, WORK each, in order
        start = max(loop.time(), busy[0])
        busy[0] = start + WORK

        def back(c=req.index):
            sched.arrived(c, loop.time(), ChunkTimings())
            buffer.put_video(c, _chunk(c))

        loop.call_at(busy[0], back)

    sched = ChunkScheduler("s", FAST, planner, agent, buffer, clock, send, stats, cut_in=cut)
    task = asyncio.ensure_future(sched.run())
    while not buffer.has_chunk(0):
        await asyncio.sleep(0.005)
    t0 = clock.start()
    end = 0.4 + utterances * every + 0.4
    rng = np.random.default_rng(0)
    said = [rng.uniform(0.2, 0.9, 4800).astype(np.float32) for _ in range(utterances)]  # 0.1 s each
    shown, heard = [], []

    async def video():
        for k in range(int(end * FAST.fps)):
            await asyncio.sleep(max(0.0, FAST.video_due(t0, k) - loop.time()))
            frame, fresh = buffer.video_frame(k)
            stats.video_frame(k, fresh, 0, loop.time(), None, marks=not buffer.last_fallback)
            shown.append((k, tuple(frame[0, 0, :2].tolist()), buffer.last_fallback))

    async def audio():
        for n in range(int(end / 0.02)):
            await asyncio.sleep(max(0.0, FAST.audio_due(t0, n) - loop.time()))
            heard.append(buffer.audio_frame(n)[0])

    async def speak():
        for i, s in enumerate(said):
            await asyncio.sleep(max(0.0, t0 + 0.4 + i * every - loop.time()))
            agent.speak(s)

    await asyncio.gather(video(), audio(), speak())
    task.cancel()
    return stats.agent_latency_ms, planner, cuts, shown, np.concatenate(heard), said


@pytest.mark.timeout(60)
def test_speech_reaches_the_screen_a_frame_after_the_lead_with_the_cut_in():
    grid, p_grid, cuts_grid, _, heard_grid, said = asyncio.run(_simulate(None))
    cut, p_cut, cuts, shown, heard, _ = asyncio.run(_simulate(LITE))
    assert p_grid.cut_ins == 0 and not cuts_grid  # the chunk grid never cuts in
    # (an utterance shorter than a chunk waits one frame for more: the grid's plan may take it first)
    assert len(grid) == len(cut) == len(said) and len(said) - 1 <= p_cut.cut_ins == len(cuts)
    lead = p_cut.lead * 1e3
    # the grid: lead .. lead + a clip (240 ms), lead + 120 ms on average; the cut-in: lead + about a frame
    assert statistics.fmean(grid) > lead + 60, (grid, lead)
    assert max(cut) < lead + 50 and statistics.fmean(cut) < statistics.fmean(grid) - 60, (cut, grid, lead)
    for out in (heard_grid, heard):  # every speech sample plays, once, in order
        starts = [int(np.flatnonzero(out == s[0])[0]) for s in said]
        assert all(np.array_equal(out[i : i + s.size], s) for i, s in zip(starts, said, strict=True))
        assert np.count_nonzero(out) == sum(s.size for s in said)
    # every frame shown is the one planned with its media instant's audio (or, counted, what stood in)
    plan = AVBuffer(FAST, 4, 4, segments=list(cuts))
    for k, (c, i), fallback in shown:
        if not fallback:
            assert (c, i) == plan._covering(k)[0], k


def test_a_session_cuts_in_only_on_a_clip_streams_group_with_the_switch_on():
    from types import SimpleNamespace

    from cadence.serve.config import ServeConfig
    from cadence.serve.session import cut_in_of

    def group(cut):
        return SimpleNamespace(info=SimpleNamespace(cut_in=cut))

    on, off = ServeConfig(), ServeConfig(cut_in=False)
    assert cut_in_of(on, group((39, 9))) == CutIn(39, 9)
    assert cut_in_of(on, group([39, 9])) == CutIn(39, 9)  # a fleet group's info, through JSON
    assert cut_in_of(off, group((39, 9))) is None  # --no-cut-in
    assert cut_in_of(on, group(None)) is None  # the chunk grid's engines (the CPU default `character`)
    assert cut_in_of(on, SimpleNamespace(info=None)) is None  # not ready yet


def test_speech_still_arriving_in_pieces_waits_for_a_chunk_of_it_or_a_frame_without_more():
    agent = Agent()
    sched = ChunkScheduler("s", T, None, agent, None, None, None, None, cut_in=LITE)
    assert not sched._speech_ready(10.0)  # nothing queued
    agent.speak(np.full(960, 0.5, np.float32))  # a TTS's first 20 ms
    assert not sched._speech_ready(10.00)
    agent.speak(np.full(960, 0.5, np.float32), new_segment=False)  # more of it 20 ms later
    assert not sched._speech_ready(10.02) and not sched._speech_ready(10.05)
    assert sched._speech_ready(10.061)  # no more for a frame (40 ms): an utterance given whole
    agent.speak(np.full(T.samples_per_chunk, 0.5, np.float32))
    assert sched._speech_ready(10.062)  # a whole chunk of it: at once
