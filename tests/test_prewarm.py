"""Warm-up and session reuse: a warmed-up engine streams exactly what a cold one streams, a session
reset in place equals a fresh session, graphs captured on a throwaway stream are replayed (not
recaptured) by the next stream on the same cache and never by a session with other buffers, and the
time-to-first-frame fields are there. CPU float32 comparisons are bitwise; graphs run through an
injected capture function on the CPU (the real CUDA capture is checked at the end, skipped here)."""

from __future__ import annotations

import math

import pytest
import torch
from fake_graph import FakeGraph

import cadence.runtime.graphs as graphs
from cadence.config import PipelineConfig, get_preset
from cadence.engine.engine import Engine
from cadence.engine.session import build_generator
from cadence.errors import ConfigError, InputError
from cadence.runtime.graphs import GraphRunner

TINY = get_preset("tiny")
# a stateful decoder, narrow (32 / 16 channels, a 4x pixel shuffle): what these tests check is the engine's
# reuse and graph logic, so the decode costs ~8 ms a chunk here instead of ~180 ms at the default width
RING = TINY.with_overrides(
    stream={"cache": "ring"}, vae={"decoder": "taehv", "taehv_channels": (32, 16), "taehv_shuffle": 4}
)
SPC = TINY.audio_samples_per_chunk
W = TINY.stream.window_chunks  # 4
N = W + 2  # past the window: fill, the first steady steps, the first sink move
CPU = dict(diffusion_devices=("cpu",), decode_device="same")


def image(seed: int = 0) -> torch.Tensor:
    return torch.rand(3, 128, 128, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def speech(n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n * SPC) / 48_000
    return 0.3 * torch.sin(2 * math.pi * 220 * t) + 0.1 * torch.randn(n * SPC, generator=g)


@pytest.fixture(autouse=True)
def fresh():
    FakeGraph.made = []
    graphs.reset_log_once()
    yield


@pytest.fixture(scope="module")
def gen():
    torch.manual_seed(0)  # the random TAEHV decoder
    return build_generator(RING, seed=0)


def collect(pipe, img, prompt, audio, n, seed):
    return [
        (o.latents.clone(), o.frames.clone(), o.timings.step)
        for o in pipe.stream(img, prompt, audio, n, seed=seed)
    ]


def test_prewarmed_stream_equals_cold_stream(gen):
    audio = speech()
    cold = Engine(gen, PipelineConfig(**CPU, reuse_session=False))
    ref = collect(cold, image(1), "a person talking", audio, N, 7)
    assert cold.session is None and cold.last_run.session == "new"

    pipe = Engine(gen, PipelineConfig(**CPU), graph_capture=FakeGraph)
    info = pipe.warm_up(threads=1)
    assert info.chunks == pipe.warm_chunks() == W + 2 and info.ms > 0 and info.first_stream_ttff_ms > 0
    # one capture in the first stream; every later warm-up stream replayed it (the capture chunk replays too)
    assert info.graphs["captures"] == 1 and info.graphs["replays"] >= 2
    assert pipe.session is not None and len(pipe.runner) == 1
    out = collect(pipe, image(1), "a person talking", audio, N, 7)
    for i, ((rl, rf, _), (ol, of, _)) in enumerate(zip(ref, out)):
        assert torch.equal(rl, ol), i  # bitwise: the same work on a reset session, graphs replayed
        assert torch.equal(rf, of), i
    # the next stream used the kept session and the prewarm's graph: no warm-up run, no capture
    steps = [s for _, _, s in out]
    assert steps == ["eager:ring_filling"] * (W - 1) + ["replay"] * (N - W + 1)
    lr = pipe.last_run
    assert lr.session == "reused" and lr.warmed_up and lr.graphs_at_start == 1
    assert lr.graphs["captures"] == 0 and lr.graphs["replays"] == N - W + 1
    assert 0 < lr.open_ms < lr.ttff_ms and lr.first_chunk["step"] == "eager:ring_filling"
    pipe.close()
    assert pipe.session is None and all(f.freed for f in FakeGraph.made)


def test_session_reset_equals_fresh_session(gen):
    a = speech(N + 2, seed=3)
    sess = gen.session(image(2), "first prompt", seed=11)
    for i in range(W + 1):  # past the window, with a prompt of another length mid-way
        if i == 2:
            sess.set_prompt(torch.randn(5, RING.model.text_dim, generator=torch.Generator().manual_seed(0)))
        sess.decode(sess.step(a[i * SPC : (i + 1) * SPC]))
    cache, decoder = sess.cache, sess.decoder
    sess.reset(image(3), "second prompt", seed=12)
    assert sess.cache is cache and sess.decoder is decoder and sess.streams == 2
    fresh = gen.session(image(3), "second prompt", seed=12)
    b = speech(W + 1, seed=4)
    for i in range(W + 1):
        x, y = sess.step(b[i * SPC : (i + 1) * SPC]), fresh.step(b[i * SPC : (i + 1) * SPC])
        assert torch.equal(x, y), i
        assert torch.equal(sess.decode(x), fresh.decode(y)), i
    with pytest.raises(InputError, match="reference image must be"):
        sess.reset(torch.zeros(3, 64, 64), "p", 0)
    pipe = Engine(gen, PipelineConfig(**CPU))
    list(pipe.stream(image(), "p", speech(1), 1, seed=0))
    kept = pipe.session
    with pytest.raises(InputError, match="prompt embedding"):  # a bad input keeps the session
        list(pipe.stream(image(), torch.zeros(3, 3), speech(1), 1, seed=0))
    assert pipe.session is kept


def test_graph_of_one_cache_never_replays_for_another(gen):
    runner = GraphRunner(capture=FakeGraph)
    a, b = gen.session(image(), "p", seed=1), gen.session(image(), "p", seed=1)
    audio = speech(N + 2)
    for i in range(N):
        a.step(audio[i * SPC : (i + 1) * SPC], runner=runner)
    assert runner.graphs_for(a.cache) == 1 and runner.graphs_for(b.cache) == 0
    did, outs = [], []
    for i in range(N):
        outs.append(b.step(audio[i * SPC : (i + 1) * SPC], runner=runner))
        did.append(runner.last)
    # b's steady steps have their own key (its cache): warm-up and a capture of its own, never a's graph
    assert did[W - 1 : W + 1] == ["eager:warmup", "capture"] and runner.graphs_for(b.cache) == 1
    assert all(
        e.keep is k_cache for e, k_cache in zip(runner._graphs.values(), (a.cache, b.cache))
    )  # each graph holds its cache
    ref = gen.session(image(), "p", seed=1)
    for i in range(N):
        assert torch.equal(ref.step(audio[i * SPC : (i + 1) * SPC]), outs[i]), i


def test_fresh_session_per_stream_recaptures(gen):
    pipe = Engine(gen, PipelineConfig(**CPU, reuse_session=False), graph_capture=FakeGraph)
    pipe.warm_up(threads=1)
    assert pipe.session is None and all(f.freed for f in FakeGraph.made)  # nothing kept
    list(pipe.stream(image(), "p", speech(), N, seed=0))
    assert pipe.last_run.session == "new" and pipe.last_run.graphs["captures"] == 1


def test_early_close_keeps_session_error_drops_it(gen, monkeypatch):
    pipe = Engine(gen, PipelineConfig(**CPU), graph_capture=FakeGraph)
    it = pipe.stream(image(), "p", speech(), N, seed=0)
    next(it)
    it.close()
    kept = pipe.session
    assert kept is not None
    ref = collect(Engine(gen, PipelineConfig(**CPU, reuse_session=False)), image(4), "q", speech(), N, 2)
    out = collect(pipe, image(4), "q", speech(), N, 2)
    assert pipe.session is kept and pipe.last_run.session == "reused"
    assert all(torch.equal(r[0], o[0]) and torch.equal(r[1], o[1]) for r, o in zip(ref, out))

    def boom(*a, **k):
        raise RuntimeError("step failed")

    monkeypatch.setattr(type(kept), "step", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        list(pipe.stream(image(), "p", speech(2), 2, seed=0))
    assert pipe.session is None and all(f.freed for f in FakeGraph.made)
    monkeypatch.undo()
    list(pipe.stream(image(), "p", speech(2), 2, seed=0))
    assert pipe.last_run.session == "new"


def test_one_stream_at_a_time(gen):
    pipe = Engine(gen, PipelineConfig(**CPU))
    it = pipe.stream(image(), "p", speech(), N, seed=0)
    next(it)
    with pytest.raises(RuntimeError, match="already running"):
        next(pipe.stream(image(), "p", speech(), N, seed=0))
    with pytest.raises(RuntimeError, match="while a stream is running"):
        pipe.close()
    it.close()
    pipe.close()


def test_first_chunk_alone_orders_chunk_one_after_first_frames(gen):
    for alone in (True, False):
        pipe = Engine(gen, PipelineConfig(**CPU, first_chunk_alone=alone))
        outs = list(pipe.stream(image(), "p", speech(3), 3, seed=0))
        if alone:  # chunk 1 was planned only once chunk 0's frames were ready
            assert outs[1].timings.t_plan >= outs[0].timings.t_done
        assert [o.index for o in outs] == list(range(3))


def test_prewarm_config_validation():
    with pytest.raises(ConfigError, match="prewarm_chunks must be >= 0"):
        PipelineConfig(prewarm_chunks=-1)
    assert PipelineConfig(prewarm_chunks=3).reuse_session


def test_bench_pipeline_prewarm_fields(tmp_path):
    import json

    from cadence.bench.pipeline import main

    assert (
        main(
            [
                "--preset",
                "tiny",
                "--chunks",
                "8",
                "--shape-change-every",
                "0",
                "--out-dir",
                str(tmp_path),
                "--window",
                "2",
            ]
        )
        == 0
    )
    (f,) = (tmp_path / "pipeline").glob("*.json")
    assert "-w2" in f.name
    r = json.loads(f.read_text())["results"]
    assert r["prewarm"] is True and r["ttff_ms"] > 0 and r["ttff_cold_ms"] > 0 and r["prewarm_s"] > 0
    assert r["session"] == "reused" and r["open_ms"] > 0 and r["window_chunks"] == 2
    assert (
        main(
            [
                "--preset",
                "tiny",
                "--chunks",
                "6",
                "--shape-change-every",
                "0",
                "--out-dir",
                str(tmp_path),
                "--no-prewarm",
                "--no-record",
            ]
        )
        == 0
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_cuda_prewarm_graphs_replay_for_reset_session(kv):
    """Real CUDA graphs captured on the prewarm's throwaway stream replay for the next (reset) session
    and give what a fresh eager session gives. FP8 K/V (Triton, the visible length on the device): the
    steady graph replays for the ring-filling chunks too, so every chunk of the stream replays; bf16
    K/V: the first W-1 chunks (filling) run eagerly."""
    cfg = TINY.with_overrides(stream={"cache": "ring", "kv_fp8": kv == "fp8"})
    g = build_generator(cfg, device="cuda:0", seed=0)
    audio = speech(N + 2)
    serial = PipelineConfig(decode_device="same", overlap=False, graphs=False)
    ref = [
        (o.latents.clone(), o.frames.clone())
        for o in Engine(g, serial).stream(image(5), "p", audio, N + 2, seed=9)
    ]
    pipe = Engine(g, PipelineConfig(decode_device="same"))
    info = pipe.warm_up()
    assert info.graphs["captures"] == 1
    outs = [
        (o.latents.clone(), o.frames.clone(), o.timings.step)
        for o in pipe.stream(image(5), "p", audio, N + 2, seed=9)
    ]
    filling_replays = kv == "fp8"
    assert pipe.last_run.graphs["captures"] == 0
    assert pipe.last_run.graphs["replays"] == N + 2 - (0 if filling_replays else W - 1)
    assert outs[0][2] == ("replay" if filling_replays else "eager:ring_filling")
    for (rl, rf), (lat, fr, _) in zip(ref, outs, strict=True):
        torch.testing.assert_close(lat, rl, rtol=1e-4, atol=1e-4)
        assert (fr.int() - rf.int()).abs().max() <= 1
    pipe.close()


def test_capture_filling_replays_the_whole_stream(gen):
    """capture_filling: prewarm runs graph_warmup + 1 streams (each fill stage warmed eagerly, then
    captured), and the next stream replays every step, the first chunk included, with the same output
    as a cold eager stream. One graph per fill stage (fill = 1..W-1) plus the steady one."""
    audio = speech(N, seed=5)
    cold = Engine(gen, PipelineConfig(**CPU, reuse_session=False, graphs=False))
    ref = collect(cold, image(1), "a person talking", audio, N, 7)
    pipe = Engine(gen, PipelineConfig(**CPU, capture_filling=True), graph_capture=FakeGraph)
    info = pipe.warm_up(threads=1)
    assert info.fill_streams == 2 and len(pipe.runner) == W  # W-1 fill stages + steady
    assert pipe.runner.max_graphs == PipelineConfig().max_graphs + W
    out = collect(pipe, image(1), "a person talking", audio, N, 7)
    for i, ((rl, rf, _), (ol, of, _)) in enumerate(zip(ref, out)):
        assert torch.equal(rl, ol), i
        assert torch.equal(rf, of), i
    assert [s for _, _, s in out] == ["replay"] * N
    lr = pipe.last_run
    assert lr.graphs["captures"] == 0 and lr.graphs["replays"] == N and lr.first_chunk["step"] == "replay"
    fills = sorted(k.fill for k in pipe.runner.keys())
    assert fills == list(range(1, W + 1))
    pipe.close()
    assert all(f.freed for f in FakeGraph.made)


def test_capture_filling_off_keeps_filling_eager(gen):
    pipe = Engine(gen, PipelineConfig(**CPU), graph_capture=FakeGraph)
    assert pipe.warm_up(threads=1).fill_streams == 1 and pipe.runner.max_graphs == PipelineConfig().max_graphs
    assert all(k.filled for k in pipe.runner.keys())
    pipe.close()


def test_capture_filling_needs_no_second_stream_when_the_length_is_on_the_device(gen, monkeypatch):
    """With a ring that reads its visible length on the device the filling steps share the steady key
    (tests/test_graphs.py), so capture_filling has nothing to capture: one prewarm stream, one graph,
    and the next stream replays every chunk."""
    from cadence.cache.ring import RingCache

    monkeypatch.setattr(RingCache, "length_on_device", property(lambda self: True))
    pipe = Engine(gen, PipelineConfig(**CPU, capture_filling=True), graph_capture=FakeGraph)
    info = pipe.warm_up(threads=1)
    assert info.fill_streams == 1 and len(pipe.runner) == 1
    out = collect(pipe, image(1), "a person talking", speech(N, seed=5), N, 7)
    assert [s for _, _, s in out] == ["replay"] * N
    pipe.close()


def test_decoder_is_primed_by_the_decode_thread_before_the_first_chunk(gen, monkeypatch):
    """The sink-latent prime of a stateful decoder runs in the decode thread as the stream opens (it
    overlaps the first chunk's diffusion), not inside the first chunk's decode; the frames equal the
    plain generator's, whose first ``decode`` primes lazily."""
    import threading

    from cadence.engine.session import Session

    calls = []
    prime, decode = Session.prime_decoder, Session.decode

    def spy_prime(self):
        did = prime(self)
        calls.append(("prime", did, threading.current_thread().name))
        return did

    def spy_decode(self, lat):
        calls.append(("decode", None, threading.current_thread().name))
        return decode(self, lat)

    monkeypatch.setattr(Session, "prime_decoder", spy_prime)
    monkeypatch.setattr(Session, "decode", spy_decode)
    pipe = Engine(gen, PipelineConfig(**CPU, reuse_session=False))
    out = collect(pipe, image(2), "a person talking", speech(3), 3, 1)
    assert calls[0] == ("prime", True, "cadence-decode")  # first, from the decode thread
    assert [c for c in calls if c[0] == "prime" and c[1]] == [calls[0]]  # and only once
    assert [c[0] for c in calls[1:]] == ["decode", "prime"] * 3
    assert all(c[2] == "cadence-decode" for c in calls)
    monkeypatch.undo()
    serial = Engine(gen, PipelineConfig(**CPU, overlap=False))
    ref = [
        (o.latents, o.frames.clone())
        for o in serial.stream(image(2), "a person talking", speech(3), 3, seed=1)
    ]
    for (ol, of, _), (rl, rf) in zip(out, ref, strict=True):
        assert torch.equal(ol, rl) and torch.equal(of, rf)
