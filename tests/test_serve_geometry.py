"""The live server follows the preset's geometry (issue 6 at W1.3: 12-frame, 24,000-sample, 500 ms chunks),
tested on the CPU at the tiny size with W1.3's chunk length (``latent_frames_per_chunk=3``); the worker's
fast-path options (off on the CPU, one note per option that cannot apply), its warm-up, the one reused session (ring
cache), and frames through shared memory.

The in-process pieces (options, the frame ring, the engine, the scheduler) take well under a second each;
one end-to-end run (a worker process + an aiortc client for ~3 s) takes ~15 s.
"""

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from cadence.config import PipelineConfig, get_preset
from cadence.engine.build import build_engine
from cadence.engine.messages import ChunkDone, ChunkRequest, ChunkTimings, Dropped, Error, WorkerInfo
from cadence.engine.recipe import EngineSpec
from cadence.engine.shm import SHM_MIN_BYTES, FrameRing
from cadence.engine.spec import FastPath
from cadence.errors import InputError
from cadence.serve.config import ServeConfig, worker_spec
from cadence.serve.pacing import AVBuffer, MediaTiming
from cadence.serve.workers import WorkerGroup

pytestmark = pytest.mark.timeout(120)

TWELVE = {"stream": {"latent_frames_per_chunk": 3}}  # tiny at W1.3's chunk length
W13_BYTES = 12 * 480 * 832 * 3
TINY12 = get_preset("tiny").with_overrides(**TWELVE)


def test_worker_spec_reference_on_cpu_fast_path_on_cuda():
    cfg = ServeConfig(engine=EngineSpec(model="tiny"))
    spec, shm = worker_spec(cfg, "cpu", frame_bytes=4 * 128 * 128 * 3)
    f = spec.recipe.fast
    assert (
        spec.recipe.notes == () and spec.recipe.warmup
    )  # every worker warms up (on the CPU: it measures its speed)
    assert f.kv_fp8 is f.fp8_linears is f.graphs is False and f.dtype == "float32"
    assert f.decoder == "standin" and not shm  # the recipe decides: tiny's own; its 196 KB stay on the pipe
    assert (
        f.compile is False
        and worker_spec(ServeConfig(engine=EngineSpec(fast=FastPath(compile=True))), "cpu")[
            0
        ].recipe.fast.compile
    )
    spec, shm = worker_spec(cfg, "cuda:0", frame_bytes=W13_BYTES)
    f = spec.recipe.fast
    assert (
        spec.recipe.notes == ()
        and f.kv_fp8
        and f.fp8_linears
        and f.graphs
        and spec.recipe.warmup
        and f.dtype == "bfloat16"
    )
    assert f.decoder == "taehv" and shm  # automatic: the recipe picks (tests/test_engine.py)
    # asked for explicitly on the CPU: off, one line each; a decoder may run anywhere
    spec, shm = worker_spec(
        ServeConfig(
            engine=EngineSpec(
                warmup=False, fast=FastPath(kv_fp8=True, fp8_linears=True, graphs=True, decoder="taehv")
            ),
            frame_transport="shm",
        ),
        "cpu",
    )
    assert (
        not (spec.recipe.fast.kv_fp8 or spec.recipe.fast.fp8_linears or spec.recipe.fast.graphs)
        and not spec.recipe.warmup
    )
    assert len(spec.recipe.notes) == 3 and all(
        "needs a CUDA worker" in n and n.endswith(": off") for n in spec.recipe.notes
    )
    assert spec.recipe.fast.decoder == "taehv" and shm
    # explicit off on CUDA stays off; a TP group resolves for its devices
    spec, shm = worker_spec(
        ServeConfig(engine=EngineSpec(fast=FastPath(graphs=False, kv_fp8=False))),
        "cuda:1+cuda:2",
        W13_BYTES - 1,
    )
    assert (
        not spec.recipe.fast.graphs and not spec.recipe.fast.kv_fp8 and spec.recipe.fast.fp8_linears and shm
    )
    assert spec.recipe.devices == ["cuda:1", "cuda:2"]
    assert worker_spec(cfg, "cpu", SHM_MIN_BYTES)[1]
    # capture_filling: opt-in, needs graphs (hence CUDA); one line where it cannot apply
    assert not worker_spec(cfg, "cuda:0", W13_BYTES)[0].recipe.fast.capture_filling
    assert worker_spec(
        ServeConfig(engine=EngineSpec(fast=FastPath(capture_filling=True))), "cuda:0", W13_BYTES
    )[0].recipe.fast.capture_filling
    for dev, kw, why in (
        ("cpu", {}, "this worker runs on cpu"),
        ("cuda:0", {"graphs": False}, "graphs are off"),
    ):
        spec, _ = worker_spec(ServeConfig(engine=EngineSpec(fast=FastPath(capture_filling=True, **kw))), dev)
        assert not spec.recipe.fast.capture_filling and spec.recipe.notes == (
            f"capture_filling: needs CUDA graphs ({why}): off",
        )
    # the CPU's thread count: chosen at warm-up unless given
    assert worker_spec(cfg, "cpu")[0].recipe.fast.threads == 0
    assert (
        worker_spec(ServeConfig(engine=EngineSpec(fast=FastPath(threads=2))), "cpu")[0].recipe.fast.threads
        == 2
    )
    for make, what in (
        (lambda: FastPath(decoder="vq"), "decoder"),
        (lambda: ServeConfig(frame_transport="tcp"), "frame_transport"),
        (lambda: EngineSpec(warmup_chunks=-1), "warmup_chunks"),
        (lambda: ServeConfig(max_in_flight=0), "max_in_flight"),
    ):
        with pytest.raises(Exception, match=what):
            make()


def test_geometry_follows_the_preset_and_overrides():
    e = worker_spec(ServeConfig(engine=EngineSpec(model="w1.3")), "cpu")[0].recipe.config
    t = MediaTiming.from_config(e)
    assert (t.frames_per_chunk, t.samples_per_chunk, t.chunk_seconds) == (12, 24000, 0.5)
    assert (e.stream.height, e.stream.width) == (480, 832)
    e = worker_spec(ServeConfig(engine=EngineSpec(model="tiny", overrides=TWELVE)), "cpu")[0].recipe.config
    t = MediaTiming.from_config(e)
    assert (t.frames_per_chunk, t.samples_per_chunk, e.stream.height) == (12, 24000, 128)
    buf = AVBuffer(t, 128, 128)
    with pytest.raises(ValueError, match="expected 12 frames and 24000 samples"):
        buf.put_chunk(0, np.zeros((4, 128, 128, 3), np.uint8), np.zeros(8000, np.float32))
    frames = np.arange(12, dtype=np.uint8)[:, None, None, None] * np.ones((1, 128, 128, 3), np.uint8)
    frames[:, -1, -1] = 255  # (one colour only would be a blank frame: not fresh)
    buf.put_chunk(0, frames, np.full(24000, 0.5, np.float32))
    assert [int(buf.video_frame(k)[0][0, 0, 0]) for k in range(12)] == list(range(12))
    assert all(buf.audio_frame(n)[1] for n in range(25))  # 25 x 20 ms = the whole 500 ms chunk
    assert not buf.audio_frame(25)[1]
    from cadence.serve.agents import make_agent

    assert make_agent("mirror").mic_backlog_s == 0.5  # the 166.7 ms chunks keep their backlog
    assert make_agent("mirror", 0.5).mic_backlog_s == pytest.approx(0.75)  # > one 500 ms chunk taken at once


def test_frame_ring_lends_slots_and_leaves_nothing_behind():
    shape = (12, 8, 8, 3)
    ring = FrameRing.create(shape, 3)
    path = f"/dev/shm/{ring.name.lstrip('/')}"
    assert not os.path.isdir("/dev/shm") or os.path.exists(path)
    other = FrameRing.attach(ring.name, shape, 3)  # what the worker does
    slots = [ring.acquire() for _ in range(4)]
    assert slots[:3] == [0, 1, 2] and slots[3] is None  # all lent: that chunk goes through the pipe
    v = other.view(1)
    v[...] = 7
    del v
    # the reader thread's view of the answers: frames copied out of the slot, the slot freed
    tm = ChunkTimings(diffusion_ms=1.0)
    msg = WorkerGroup.take_frames(ring, ChunkDone("s", 5, None, tm, slot=1))
    assert (
        (msg.sid, msg.index, msg.slot) == ("s", 5, None)
        and msg.frames.shape == shape
        and (msg.frames == 7).all()
    )
    assert ring.free_slots == 1
    assert WorkerGroup.take_frames(ring, Dropped("s", 6, 0)) is None and ring.free_slots == 2
    assert WorkerGroup.take_frames(ring, Error("s", "boom", 2)) == Error("s", "boom")
    assert ring.free_slots == 3
    pipe_msg = ChunkDone("s", 7, np.zeros(shape, np.uint8), tm)
    assert WorkerGroup.take_frames(ring, pipe_msg) is pipe_msg
    assert isinstance(
        WorkerGroup.take_frames(ring, ChunkDone("s", 8, None, tm)), Error
    )  # never silently dropped
    other.close()
    ring.close()
    ring.close()  # idempotent
    assert not os.path.exists(path)
    assert ring.acquire() is None


def _stream_frames(eng, img, prompt, seed, audios) -> list[np.ndarray]:
    eng.open(img, prompt, seed)
    for i, a in enumerate(audios):
        eng.submit(i, a)
    out = [r.frames.numpy().copy() for r in eng.collect(block=True)]
    eng.end_stream()
    return out


@torch.no_grad()
def test_engine_twelve_frame_chunks_warmup_and_one_ring_cache_equal_fresh_sessions():
    from cadence.media.image import default_reference_image

    img = default_reference_image(128, 128)
    audio = (0.1 * np.sin(np.arange(24000) / 30.0)).astype(np.float32)
    ref = build_engine(TINY12, "cpu", FastPath(threads=1))
    assert ref.frame_shape == (12, 128, 128, 3) and ref.samples_per_chunk == 24000
    assert ref.applied["fp8_linears"] == 0 and not ref.applied["graphs"] and not ref.runner.enabled
    want = _stream_frames(ref, img, "a prompt", 3, [audio])[0]
    assert want.shape == (12, 128, 128, 3) and want.dtype == np.uint8
    ref.open(img, "a prompt", 3)
    with pytest.raises(InputError, match="24000 samples"):
        ref.submit(0, audio[:8000])
    ref.end_stream()
    # graphs asked for on the CPU: off with a note, the ring cache anyway; every stream is the one kept session
    # reset in place, and a stream on the reused cache gives exactly what a fresh session gives
    eng = build_engine(
        TINY12.with_overrides(stream={"cache": "ring"}), "cpu", FastPath(graphs=True, threads=1)
    )
    assert eng.applied["cache"] == "ring" and eng.describe()["reuse"] == "session"
    assert eng.notes == ["graphs: needs a CUDA worker (this one runs on cpu): off"]
    t = time.monotonic()
    warm = eng.warm_up(img, chunks=2, threads=1)
    assert time.monotonic() - t < 20.0
    assert warm.chunks == 2 and len(warm.chunk_ms) == 2 and warm.steady_chunk_ms > 0
    assert warm.threads == 1 and warm.thread_trials is None
    fresh = build_engine(TINY12.with_overrides(stream={"cache": "ring"}), "cpu", FastPath(threads=1))
    expect = _stream_frames(fresh, img, "another prompt", 5, [audio * (i + 1) for i in range(6)])
    caches = []
    for _ in range(2):  # twice: the second stream runs on what the first left in the ring
        eng.open(img, "another prompt", 5)
        caches.append(eng.session.cache)
        bufs = [np.empty(eng.frame_shape, np.uint8) for _ in range(6)]
        for i in range(6):
            eng.submit(i, audio * (i + 1), out=bufs[i])
        res = eng.collect(block=True)
        assert all(
            r.frames is None and r.timings.diffusion_ms > 0 and r.timings.step.startswith("eager")
            for r in res
        )
        eng.end_stream()
        for a, b in zip(bufs, expect):
            np.testing.assert_array_equal(a, b)
    assert caches[0] is caches[1]  # one cache: a graph captured once stays valid for every session


def _fake_graph_engine(**pcfg):
    from fake_graph import FakeGraph

    from cadence.engine.engine import Engine
    from cadence.engine.session import build_generator

    FakeGraph.made = []
    gen = build_generator(get_preset("tiny").with_overrides(stream={"cache": "ring"}), seed=0)
    return Engine(
        gen, PipelineConfig(diffusion_devices=("cpu",), decode_device="same", **pcfg), graph_capture=FakeGraph
    )


@torch.no_grad()
def test_engine_capture_filling_warms_up_twice_then_replays_every_chunk_of_a_session():
    """With capture_filling the warm-up runs two streams (each fill stage eager in the first, captured in the
    second); a user's stream then replays a graph at every chunk, the first included, and its frames equal a
    fresh eager stream's. Graphs run through the injected stand-in capture on the CPU."""
    from cadence.media.image import default_reference_image

    img = default_reference_image(128, 128)
    audio = (0.1 * np.sin(np.arange(8000) / 30.0)).astype(np.float32)
    w = get_preset("tiny").stream.window_chunks
    eng = _fake_graph_engine(capture_filling=True)
    assert eng.runner.capture_filling and eng.runner.max_graphs == 4 + w
    warm = eng.warm_up(img, threads=1)
    assert warm.fill_streams == 2 and warm.chunks == w + 2
    # the second stream captures the W-1 fill stages; the steady step was captured by the first
    assert warm.steps == ["capture"] * (w - 1) + ["replay"] * 3
    assert warm.slowest_chunk_ms > 0 and warm.steady_chunk_ms > 0
    assert warm.media_chunk_ms == pytest.approx(166.7)
    fresh = build_engine(
        get_preset("tiny").with_overrides(stream={"cache": "ring"}), "cpu", FastPath(threads=1)
    )
    expect = _stream_frames(fresh, img, "a prompt", 4, [audio * (i + 1) for i in range(w + 2)])
    eng.open(img, "a prompt", 4)
    for i in range(w + 2):
        eng.submit(i, audio * (i + 1))
    res = eng.collect(block=True)
    eng.end_stream()
    assert [r.timings.step for r in res] == ["replay"] * (w + 2)
    for r, e in zip(res, expect, strict=True):
        np.testing.assert_array_equal(r.frames.numpy(), e)
    assert eng.runner.stats.captures == w and len(eng.runner) == w


@torch.no_grad()
def test_engine_with_the_length_on_the_device_warms_up_once_and_replays_every_chunk(monkeypatch):
    """FP8 K/V on the Triton path (``RingCache.length_on_device``, forced here on the CPU reference
    path): filling steps share the steady graph, so even with capture_filling one warm-up stream is
    enough and a user's stream replays from its first chunk."""
    from cadence.cache.ring import RingCache
    from cadence.media.image import default_reference_image

    monkeypatch.setattr(RingCache, "length_on_device", property(lambda self: True))
    img = default_reference_image(128, 128)
    eng = _fake_graph_engine(capture_filling=True)
    warm = eng.warm_up(img, threads=1)
    assert warm.fill_streams == 1 and warm.steps[:2] == ["eager:warmup", "capture"]
    audio = (0.1 * np.sin(np.arange(8000) / 30.0)).astype(np.float32)
    eng.open(img, "a prompt", 4)
    for i in range(3):
        eng.submit(i, audio)
    assert [r.timings.step for r in eng.collect(block=True)] == ["replay"] * 3
    eng.end_stream()
    assert eng.runner.stats.captures == 1


def _fake_streams(eng, monkeypatch, streams):
    """The warm-up's streams (steps only, decode=False) get these (work_ms, step) lists in turn."""
    it = iter(streams)

    def fake_steps(engine, image, audio, n):
        assert engine is eng
        rows = next(it)
        assert len(rows) == n
        return [ChunkTimings(work_ms=ms, step=st, t_done=i * 0.1) for i, (ms, st) in enumerate(rows)]

    from cadence.engine import warmup  # the warm-up's measuring (Engine.warm_up runs it)

    monkeypatch.setattr(warmup, "_steps_only", fake_steps)


def _rows(times, steps):
    return list(zip(times, steps, strict=True))


def test_engine_warm_up_says_when_chunks_are_slower_than_real_time(monkeypatch):
    """The warm-up's verdict comes from its per-chunk times (faked here): chunk 0 of a single warm-up
    stream is the cold one and does not count, nor does a capture; slow chunks get a second stream,
    and those that are slow there too are a note."""
    from cadence.media.image import default_reference_image

    eng = _fake_graph_engine()
    w = eng.gen.cfg.stream.window_chunks
    n = w + 2
    fill = ["eager:ring_filling"] * w
    first = _rows([5000.0] + [400.0] * (w - 1) + [900.0, 60.0], fill + ["capture", "replay"])
    steady = _rows([60.0] * n, ["replay"] * n)
    again = _rows([100.0] + [400.0] * (w - 1) + [60.0, 60.0], fill + ["replay"] * 2)
    # the paced stream runs until the window is full (w - 1 filling chunks) and its last two count: a
    # query's attention grows while the window fills, so earlier paced chunks are faster than the steady one
    paced = _rows([20.0] * (w - 1) + [60.0] * 2, fill[: w - 1] + ["replay"] * 2)
    _fake_streams(eng, monkeypatch, [first, steady, again, paced])
    warm = eng.warm_up(default_reference_image(128, 128), decode=False, threads=1)
    assert warm.repeat_stream and warm.streams == 4
    assert warm.steady_chunk_ms == 60.0 and warm.slowest_chunk_ms == 400.0
    assert warm.first_stream_chunk_ms == [ms for ms, _ in first] and warm.chunk_ms == [ms for ms, _ in again]
    assert eng.notes == [
        (
            f"warm-up: {w - 1} chunk(s) of a stream take up to 400 ms, longer than a chunk's "
            "167 ms of media: expect underruns there in every stream (eager ring-filling "
            "steps: --capture-filling captures them)"
        )
    ]


def test_engine_warm_up_tells_one_time_work_from_slow_chunks(monkeypatch):
    """What the W14 TP=2 worker showed on 2x H200: one replayed chunk of the warm-up (the 21st) took
    671 ms once, ~130 ms otherwise. A second warm-up stream runs it fast, so it is not an underrun
    warning (a note says what happened); a warm-up with no slow chunk runs no repeat stream."""
    from cadence.media.image import default_reference_image

    eng = _fake_graph_engine()
    w = eng.gen.cfg.stream.window_chunks
    n = w + 2
    steps = ["eager:warmup", "capture"] + ["replay"] * w
    first = _rows([5000.0, 900.0] + [100.0] * (w - 2) + [671.0, 130.0], steps)
    steady = _rows([130.0] * n, ["replay"] * n)
    again = _rows([100.0] * w + [120.0, 130.0], ["replay"] * n)
    paced = _rows([90.0] * (w - 1) + [130.0, 130.0], ["replay"] * (w + 1))
    _fake_streams(eng, monkeypatch, [first, steady, again, paced])
    warm = eng.warm_up(default_reference_image(128, 128), decode=False, threads=1)
    assert warm.repeat_stream and warm.slowest_chunk_ms == 130.0 and warm.steady_chunk_ms == 130.0
    assert eng.notes == [
        (
            f"warm-up: chunk(s) [{w}] took up to 671 ms in the first stream only (one-time work); "
            "120 ms in the next"
        )
    ]
    eng2 = _fake_graph_engine()
    _fake_streams(eng2, monkeypatch, [_rows([5000.0, 900.0] + [100.0] * w, steps), steady, paced])
    warm = eng2.warm_up(default_reference_image(128, 128), decode=False, threads=1)
    assert not warm.repeat_stream and warm.first_stream_chunk_ms is None and eng2.notes == []


@torch.no_grad()
@pytest.mark.parametrize("reuse", [False, True])
def test_engine_preopened_session_is_reseeded_and_equals_a_fresh_open(reuse):
    """preopen makes the next default session ready; an open with the same key and prompt only re-seeds it
    (and streams exactly what a fresh open with that seed streams); an open of another image or prompt uses
    it up and opens normally."""
    from cadence.media.image import default_reference_image

    img = default_reference_image(128, 128)
    audio = (0.1 * np.sin(np.arange(8000) / 30.0)).astype(np.float32)
    ring = get_preset("tiny").with_overrides(stream={"cache": "ring"})
    fresh = build_engine(ring, "cpu", FastPath(threads=1))
    expect = _stream_frames(fresh, img, "p", 11, [audio * (i + 1) for i in range(3)])
    eng = build_engine(ring, "cpu", FastPath(threads=1), pipeline=PipelineConfig(reuse_session=reuse))
    assert eng.preopen(img, "p", "default") > 0
    assert eng.open(None, "p", 11, key="default") == "preopened" and eng.last_open_preopened
    for i in range(3):
        eng.submit(i, audio * (i + 1))
    got = [r.frames.numpy().copy() for r in eng.collect(block=True)]
    for a, b in zip(got, expect, strict=True):
        np.testing.assert_array_equal(a, b)
    eng.preopen(img, "p", "default")
    eng.open(img, "another prompt", 11, key="default")  # the prompt differs: a normal open
    assert not eng.last_open_preopened
    eng.open(img, "p", 11, key="default")  # nothing ready any more (the last open used it up): a normal open
    assert not eng.last_open_preopened
    eng.close()


def test_engine_compile_is_opt_in_and_says_why_it_is_off(monkeypatch):
    monkeypatch.setenv("CADENCE_COMPILE", "0")  # apply_compile's own switch: no compiler run in CI
    tiny = get_preset("tiny")
    eng = build_engine(tiny, "cpu", FastPath(compile=True, threads=1))
    assert eng.applied["compile"].startswith("compile off") and "CADENCE_COMPILE=0" in eng.applied["compile"]
    assert eng.notes == [f"compile: {eng.applied['compile']}"]
    plain = build_engine(tiny, "cpu", FastPath(threads=1))
    assert plain.applied["compile"] == "off" and plain.notes == []


def _info(warmup) -> WorkerInfo:
    return WorkerInfo(
        preset="tiny",
        device="cpu",
        tp=1,
        build_ms=1.0,
        threads=1,
        fast_path={},
        notes=[],
        warmup=warmup,
        preopen_ms=1.0,
        frame_transport="pipe",
        frames_per_chunk=12,
        audio_samples_per_chunk=24000,
    )


def test_manager_lead_follows_the_measured_chunk_time():
    pytest.importorskip("prometheus_client")
    from cadence.serve.manager import SessionManager

    mgr = SessionManager(ServeConfig(engine=EngineSpec(model="tiny", overrides=TWELVE), lead_ms=100.0))
    g = mgr.groups[0]
    assert g.frame_shape == (12, 128, 128, 3) and g.slots == 3
    assert not g.shm and g.spec.recipe.notes == ()
    assert mgr.lead_ms(g) == 100.0  # nothing measured yet: the configured lead
    g.info = _info({"steady_chunk_ms": 400.0, "interval_ms": 300.0})
    # the worker's 400 ms + the web side's pipe and loop (10 ms), as it would be in 30% CPU steal (one thread:
    # / 0.7), + 15% + 20 ms
    assert mgr.lead_ms(g) == pytest.approx(410 / 0.7 * 1.15 + 20)
    lead, latency, interval = mgr.worker_speed(g)
    assert latency == pytest.approx(0.41) and interval == pytest.approx(0.3)
    g.info = _info({"steady_chunk_ms": 50.0, "interval_ms": 30.0})
    assert mgr.lead_ms(g) == pytest.approx(60 / 0.7 * 1.15 + 20)
    g.info = _info({"steady_chunk_ms": 30.0, "interval_ms": 20.0})
    assert mgr.lead_ms(g) == 100.0  # never below lead_ms
    mgr.cfg = ServeConfig(engine=EngineSpec(model="tiny"), lead_auto=False)
    g.info = _info({"steady_chunk_ms": 400.0})
    assert mgr.lead_ms(g) == 100.0


def test_speech_goes_into_the_earliest_chunk_not_yet_planned():
    for mod in ("fastapi", "aiortc", "prometheus_client"):
        pytest.importorskip(mod)
    from cadence.serve.agents import make_agent
    from cadence.serve.manager import SessionManager
    from cadence.serve.session import LiveSession

    async def main():
        mgr = SessionManager(ServeConfig(engine=EngineSpec(model="tiny", overrides=TWELVE), lead_ms=100.0))
        mgr.groups[0].info = _info({"steady_chunk_ms": 30.0, "interval_ms": 30.0})
        sess = LiveSession(mgr, "s0123456789", mgr.groups[0], make_agent("say"), mgr.engine_cfg, "p", 0)
        sent = []
        sess.group.send = lambda m: sent.append((time.monotonic(), m))
        sess.scheduler.send = sess.group.send
        t0 = sess.clock.start()
        sess._spawn(sess.scheduler.run(), "scheduler")
        await asyncio.sleep(0.05)
        # chunk 0 was due at t0 (now): too late for the worker, its audio plays over the held frame; chunk 1
        # waits for t0 + 0.4
        assert sent == [] and sess.planner.audio_only == 1 and 0 in sess.buffer.audio
        speech = np.linspace(0.1, 0.9, 30000, dtype=np.float32)
        t_agent = time.monotonic()
        sess.agent.speak(speech, t_agent=t_agent)
        await asyncio.sleep(0.55)
        await sess._stop_tasks(1.0)
        assert [m.index for _, m in sent] == [1] and all(isinstance(m, ChunkRequest) for _, m in sent)
        t1, m1 = sent[0]
        assert t1 - t0 == pytest.approx(0.4, abs=0.06)  # planned lead (100 ms) before its due time t0 + 0.5
        np.testing.assert_array_equal(m1.audio, speech[:24000])  # the whole window, from the speech's start
        np.testing.assert_array_equal(sess.buffer.audio[1], speech[:24000])  # in the buffer since its plan
        assert sess.stats._pending_marks == [(12, t_agent, "speech")]  # it starts at chunk 1's first frame
        assert sess.agent.queued_samples == 6000

    asyncio.run(main())


def test_clock_waits_for_the_first_chunk_but_not_for_ever():
    pytest.importorskip("aiortc")
    from cadence.serve.rtc import MediaClock, MediaFeed, VideoOut

    def feed(timeout):
        t = MediaTiming()
        return MediaFeed(
            AVBuffer(t, 8, 8), MediaClock(), t, asyncio.Event(), timeout, lambda *a: None, lambda *a: None
        )

    async def main():
        f = feed(5.0)
        tr = VideoOut(f)
        t = time.monotonic()
        asyncio.get_running_loop().call_later(0.15, f.first_chunk.set)
        t0 = await tr._t0()
        assert 0.13 <= t0 - t <= 0.5 and f.clock.t0 == t0
        assert await VideoOut(f)._t0() == t0  # the other track: the same clock, no wait
        f = feed(0.1)  # the first chunk never comes: start anyway (underruns are counted)
        t = time.monotonic()
        t0 = await VideoOut(f)._t0()
        assert 0.09 <= t0 - t <= 0.5

    asyncio.run(main())


def test_server_streams_twelve_frame_chunks_through_shared_memory():
    for mod in ("fastapi", "uvicorn", "aiortc", "prometheus_client", "httpx", "multipart"):
        pytest.importorskip(mod)
    import multiprocessing

    import httpx

    from cadence.devtools.client import run_client
    from cadence.serve.server import ServerThread

    cfg = ServeConfig(
        engine=EngineSpec(
            model="tiny", overrides=TWELVE, warmup=True, warmup_chunks=2, fast=FastPath(kv_fp8=True)
        ),
        port=0,
        frame_transport="shm",
    )
    srv = ServerThread(cfg).start()
    try:
        g = srv.manager.groups[0]
        shm_path = f"/dev/shm/{g.ring.name.lstrip('/')}"
        c = httpx.get(srv.url + "/config").json()
        assert (c["frames_per_chunk"], c["audio_samples_per_chunk"], c["chunk_ms"]) == (12, 24000, 500.0)
        (w,) = c["workers"]
        assert w["frame_transport"] == "shm" and w["frames_per_chunk"] == 12
        assert w["notes"] == ["kv_fp8: needs a CUDA worker (this one runs on cpu): off"]
        assert w["fast_path"]["kv_fp8"] is False and w["fast_path"]["fp8_linears"] == 0
        assert (
            w["warmup"]["chunks"] == 2
            and w["warmup"]["steady_chunk_ms"] > 0
            and w["warmup"]["threads"] in (1, 2)
        )
        res = asyncio.run(run_client(srv.url, 3.0))
        assert res.error is None, res.error
        assert 22.0 <= res.media_fps(3750) <= 26.0, (res.media_fps(3750), res.video_fps())
        rep = res.report
        # whole frame periods; jumps only where the pacer skipped frames or held them (a held frame is not
        # sent: the receiver keeps the last one), so every frame received is a fresh one
        bad, missing = res.pts_gaps(3750)
        assert bad == [] and missing <= rep["video_frames_skipped"] + rep["underruns"]["video"], (
            res.pts_steps(),
            rep,
        )
        assert rep["video_frames_skipped"] <= 12 and len(res.video) <= rep["video_frames_fresh"], rep
        # 3 s at 24 fps: 72 frames generated in time, sent, or skipped by the pacer after a stall of this
        # test process's event loop (server and client share it; a GC pause after the in-process models
        # of the tests before this one skipped 3 frames in 1 of 5 runs)
        assert rep["frames_per_chunk"] == 12
        assert rep["video_frames_fresh"] + rep["video_frames_skipped"] >= 72, rep
        assert rep["chunks"]["done"] >= 6 and rep["underruns"]["video"] <= 2, rep
        assert rep["ttff_ms"] is not None and not rep["errors"], rep
        assert g.ring.free_slots == g.slots  # every lent slot came back
    finally:
        srv.stop()
    assert multiprocessing.active_children() == []
    assert not os.path.exists(shm_path)  # the segment was unlinked with the worker


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a machine without CUDA (the worker must fail to start)"
)
def test_a_worker_that_cannot_start_fails_startup_once_and_leaves_nothing_behind():
    pytest.importorskip("prometheus_client")
    pytest.importorskip("aiortc")
    import multiprocessing

    from cadence.serve.manager import SessionManager

    async def main():
        mgr = SessionManager(
            ServeConfig(
                engine=EngineSpec(model="tiny", overrides=TWELVE),
                groups=("cuda:0",),
                frame_transport="shm",
                worker_start_timeout_s=60,
            )
        )
        g = mgr.groups[0]
        assert (
            g.spec.recipe.warmup and g.spec.recipe.fast.graphs
        )  # a CUDA group: the fast path, resolved up front
        t = time.monotonic()
        try:
            with pytest.raises(RuntimeError, match=r"worker 0 \(cuda:0\): worker start failed"):
                await mgr.start()
            assert time.monotonic() - t < 45  # reported at once, not after the start timeout
            path = f"/dev/shm/{g.ring.name.lstrip('/')}"
            await asyncio.sleep(0.5)
            assert g.restarts == 0  # not restarted in a loop
        finally:
            await mgr.stop()
        assert g.ring is None and not os.path.exists(path)

    asyncio.run(main())
    assert multiprocessing.active_children() == []


@torch.no_grad()
def test_worker_serves_the_checkpoint_it_is_given(tmp_path):
    """``cadence serve --weights``: the worker's engine loads the checkpoint (overrides from
    ``weight_overrides``) and streams exactly what that model streams, not its own random weights."""
    from cadence.engine.flags import weight_overrides
    from cadence.engine.session import build_generator
    from cadence.media.image import default_reference_image
    from cadence.model.weights import save_weights

    img = default_reference_image(128, 128)
    audio = (0.1 * np.sin(np.arange(8000) / 30.0)).astype(np.float32)
    tiny = get_preset("tiny")
    src = build_generator(tiny, seed=5)  # the "trained" model: random weights of seed 5
    save_weights(src.model, tmp_path / "dit.safetensors")
    over = weight_overrides(str(tmp_path / "dit.safetensors"), None)
    eng = build_engine(tiny.with_overrides(**over), "cpu", FastPath(threads=1), seed=0)
    plain = build_engine(tiny, "cpu", FastPath(threads=1), seed=0)
    for name, p in src.model.state_dict().items():
        assert torch.equal(eng.gen.model.state_dict()[name], p), name
    assert not torch.equal(plain.gen.model.blocks[0].ffn.fc1.weight, src.model.blocks[0].ffn.fc1.weight)
    frames = [_stream_frames(e, img, "a prompt", 3, [audio])[0] for e in (eng, plain)]
    ref = build_engine(tiny, "cpu", FastPath(threads=1), seed=5)  # the same model built from seed 5 directly
    want = _stream_frames(ref, img, "a prompt", 3, [audio])[0]
    assert np.array_equal(frames[0], want) and not np.array_equal(frames[1], want)
