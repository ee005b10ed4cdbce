"""The graph runner's decisions on the CPU: step keys, eager fallbacks (one log line per reason and
key), the capture path through an injected capture function, LRU eviction and its bound, and a
stream whose conditioning length changes every few chunks."""

from __future__ import annotations

import logging

import pytest
import torch
from fake_graph import FakeGraph

import cadence.runtime.graphs as graphs
from cadence.config import PipelineConfig, get_preset
from cadence.engine.engine import Engine
from cadence.engine.session import build_generator
from cadence.runtime.graphs import GraphRunner

TINY = get_preset("tiny")
RING = TINY.with_overrides(stream={"cache": "ring"})
SPC = TINY.audio_samples_per_chunk
W = TINY.stream.window_chunks  # 4
LOGGER = "cadence.runtime.graphs"


def image() -> torch.Tensor:
    return torch.rand(3, 128, 128, generator=torch.Generator().manual_seed(0)) * 2 - 1


def audio(n: int) -> torch.Tensor:
    return torch.randn(n * SPC, generator=torch.Generator().manual_seed(1)) * 0.1


@pytest.fixture(autouse=True)
def fresh_fakes():
    FakeGraph.made = []
    graphs.reset_log_once()
    yield


@pytest.fixture(scope="module")
def ring_gen():
    return build_generator(RING, seed=0)


def run_steps(gen, runner, n, prompts=None, seed=3):
    sess = gen.session(image(), "a person talking", seed=seed)
    a = audio(n)
    out, did = [], []
    for i in range(n):
        if prompts and i in prompts:
            sess.set_prompt(prompts[i])
        out.append(sess.step(a[i * SPC : (i + 1) * SPC], runner=runner))
        did.append(runner.last if runner is not None else "")
    return out, did, sess


def graph_logs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


# ---- keys ----------------------------------------------------------------------------------------------


def test_step_key_tracks_shape_and_fill(ring_gen):
    sess = ring_gen.session(image(), "p", seed=0)
    keys = []
    a = audio(W + 1)
    for i in range(W + 1):
        inp = sess.prepare_step(a[i * SPC : (i + 1) * SPC])
        keys.append(sess.step_key(inp))
        sess.denoise(inp)
        sess.next_frame += 1
    assert [k.filled for k in keys] == [False] * (W - 1) + [True, True]
    k = keys[-1]
    assert (k.tokens_per_chunk, k.text_len, k.cache, k.window_chunks, k.commit, k.passes, k.sampler) == (
        64,
        16,
        "ring-bf16",
        W,
        "last_pass",
        4,
        "euler",
    )
    assert k.latent_shape == (16, 1, 16, 16) and k.audio_shape == (1, 4, 64) and k.device == "cpu"
    assert keys[-1] == keys[-2] and hash(keys[-1]) == hash(keys[-2])  # steady state: one key
    # a different conditioning length is a different key; so is another session's cache
    sess.set_prompt(torch.randn(9, 64))
    inp = sess.prepare_step(a[:SPC])
    k9 = sess.step_key(inp)
    assert k9.text_len == 9 and k9 != k
    other = ring_gen.session(image(), "p", seed=0)
    assert other.step_key(inp).cache_id != k.cache_id


def test_step_key_policy_fields():
    g = build_generator(
        RING.with_overrides(stream={"kv_fp8": True, "commit": "clean_pass", "sampler": "renoise"}), seed=0
    )
    sess = g.session(image(), "p", seed=0)
    inp = sess.prepare_step(audio(1))
    k = sess.step_key(inp)
    assert (k.cache, k.commit, k.sampler) == ("ring-fp8", "clean_pass", "renoise")
    assert inp.renoise is not None and inp.renoise.shape == (3, 16, 1, 16, 16)


# ---- eager fallbacks -------------------------------------------------------------------------------------


def test_cpu_skips_real_capture_with_one_log_line(ring_gen, monkeypatch, caplog):
    def no_capture(*a, **k):
        raise AssertionError("real CUDA capture attempted on the CPU")

    monkeypatch.setattr(graphs, "cuda_capture", no_capture)
    runner = GraphRunner()  # default capture: real CUDA graphs
    caplog.set_level(logging.INFO, logger=LOGGER)
    out, did, _ = run_steps(ring_gen, runner, W + 4)
    ref, _, _ = run_steps(ring_gen, None, W + 4)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))
    assert did == ["eager:not_cuda"] * (W + 4)
    logs = graph_logs(caplog)
    assert len(logs) == 1 and "need a CUDA device" in logs[0]
    assert len(runner) == 0 and runner.stats.captures == 0 and runner.stats.eager == W + 4
    # a second session (new runner) in the same process does not repeat the line
    run_steps(ring_gen, GraphRunner(), 2)
    assert len(graph_logs(caplog)) == 1


def test_disabled_runs_eagerly_with_one_log_line(ring_gen, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    runner = GraphRunner(enabled=False, capture=FakeGraph)
    _, did, _ = run_steps(ring_gen, runner, W + 3)
    assert did == ["eager:disabled"] * (W + 3) and FakeGraph.made == []
    assert [m for m in graph_logs(caplog) if "disabled" in m] == [graph_logs(caplog)[0]]
    assert len(graph_logs(caplog)) == 1


def test_length_on_device_ring_shares_one_graph_from_the_first_chunk(ring_gen, monkeypatch):
    """A ring whose visible length lives on the device (FP8 on the Triton path; why that is safe:
    tests/test_ring.py::test_length_on_device_means_attend_ignores_the_host_fill_state) gives its
    filling chunks the steady key: one graph, warmed on chunk 0, captured on chunk 1, replayed from
    then on, through the fill stages, the first sink move and past the window; the same latents as
    eager. Emulated here on the CPU reference path (the attribute forced, the stand-in capture)."""
    from cadence.cache.ring import RingCache

    monkeypatch.setattr(RingCache, "length_on_device", property(lambda self: True))
    sess = ring_gen.session(image(), "p", seed=0)
    inp = sess.prepare_step(audio(1))
    k = sess.step_key(inp)
    assert k.filled and k.fill == W  # chunk 0 already has the steady key
    runner = GraphRunner(capture=FakeGraph)
    n = W + 3
    out, did, _ = run_steps(ring_gen, runner, n)
    ref, _, _ = run_steps(ring_gen, None, n)
    assert all(torch.equal(x, y) for x, y in zip(out, ref, strict=True))
    assert did == ["eager:warmup", "capture"] + ["replay"] * (n - 2)
    assert len(FakeGraph.made) == 1 and runner.stats.captures == 1
    assert "ring_filling" not in runner.stats.eager_reasons


def test_naive_cache_is_never_captured(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    g = build_generator(TINY, seed=0)  # naive cache
    runner = GraphRunner(capture=FakeGraph)
    _, did, _ = run_steps(g, runner, W + 3)
    assert did == ["eager:not_ring_cache"] * (W + 3) and FakeGraph.made == []
    logs = graph_logs(caplog)
    assert len(logs) == 1 and "ring cache" in logs[0] and "naive" in logs[0]


def test_capture_after_fill_and_warmup_matches_eager(ring_gen, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    runner = GraphRunner(capture=FakeGraph)
    n = W + 5
    out, did, _ = run_steps(ring_gen, runner, n)
    ref, _, _ = run_steps(ring_gen, None, n)
    # the replayed steps compute exactly what eager steps compute (same kernels, static inputs copied in)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))
    assert did == ["eager:ring_filling"] * (W - 1) + ["eager:warmup", "capture"] + ["replay"] * (n - W - 1)
    assert len(FakeGraph.made) == 1 and FakeGraph.made[0].replays == n - W
    assert runner.stats.captures == 1 and runner.stats.replays == n - W
    logs = graph_logs(caplog)
    # one line per reason: filling (once, not 3x), warm-up, capture
    assert len(logs) == 3
    assert "still filling" in logs[0] and "warm-up" in logs[1] and "captured" in logs[2]


def test_same_length_prompt_change_reuses_graph_with_new_text(ring_gen):
    runner = GraphRunner(capture=FakeGraph)
    n = W + 5
    change = {W + 3: "a completely different prompt"}
    out, did, _ = run_steps(ring_gen, runner, n, prompts=change)
    ref, _, _ = run_steps(ring_gen, None, n, prompts=change)
    assert did[W + 3] == "replay" and len(FakeGraph.made) == 1  # same text length: same graph
    assert all(torch.equal(x, y) for x, y in zip(out, ref))  # ... fed the new prompt's K/V


def test_capture_failure_falls_back_once(ring_gen, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    tries = []

    def broken(fn):
        tries.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    runner = GraphRunner(capture=broken)
    out, did, _ = run_steps(ring_gen, runner, W + 5)
    ref, _, _ = run_steps(ring_gen, None, W + 5)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))
    assert len(tries) == 1 and runner.stats.capture_failures == 1  # never retried for that shape
    assert did[W + 1 :] == ["eager:capture_failed"] * 4
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not permitted" in warnings[0].getMessage()


def test_span_recorder_forces_eager(ring_gen):
    from cadence.telemetry.spans import SpanRecorder

    runner = GraphRunner(capture=FakeGraph)
    with SpanRecorder("cpu"):
        _, did, _ = run_steps(ring_gen, runner, W + 2)
    assert did[-1] == "eager:span_recorder_active" and FakeGraph.made == []


# ---- bounded: LRU and recapture limit ----------------------------------------------------------------------


def prompts_cycling(n, every, lengths):
    g = torch.Generator().manual_seed(7)
    embs = {L: torch.randn(L, 64, generator=g) for L in lengths}
    return {i: embs[lengths[(i // every) % len(lengths)]] for i in range(0, n, every)}


def test_lru_eviction_bound_and_frees(ring_gen, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    runner = GraphRunner(max_graphs=2, capture=FakeGraph, max_captures_per_key=3)
    n = 40
    prompts = prompts_cycling(n, 2, [16, 8, 12])  # 3 shapes in turn, 2 chunks each, 2 graphs kept
    sizes = []
    sess = ring_gen.session(image(), "p", seed=0)
    a = audio(n)
    out = []
    for i in range(n):
        if i in prompts:
            sess.set_prompt(prompts[i])
        out.append(sess.step(a[i * SPC : (i + 1) * SPC], runner=runner))
        sizes.append(len(runner))
    assert max(sizes) == 2  # never more than max_graphs alive
    live = [f for f in FakeGraph.made if not f.freed]
    assert len(live) == 2 and {f.output.data_ptr() for f in live} == {
        runner._graphs[k].handle.output.data_ptr() for k in runner.keys()
    }
    assert runner.stats.evictions == len(FakeGraph.made) - 2 > 0  # every evicted graph was freed
    # captures are bounded per shape: 3 shapes x 3 captures at most, then those shapes stay eager
    assert runner.stats.captures <= 9
    assert runner.stats.eager_reasons.get("recapture_limit", 0) > 0
    assert sum(m.count("eager from now on") for m in graph_logs(caplog)) <= 3  # once per shape
    ref = []
    s2 = ring_gen.session(image(), "p", seed=0)
    for i in range(n):
        if i in prompts:
            s2.set_prompt(prompts[i])
        ref.append(s2.step(a[i * SPC : (i + 1) * SPC]))
    assert all(torch.equal(x, y) for x, y in zip(out, ref))


def test_runner_rejects_bad_bounds():
    with pytest.raises(ValueError, match="max_graphs >= 1"):
        GraphRunner(max_graphs=0)


# ---- the pipeline with a changing conditioning length ---------------------------------------------------------


def test_engine_conditioning_length_changes_every_few_chunks(ring_gen):
    n = 24
    prompts = prompts_cycling(n, 3, [16, 6, 11, 16, 3])
    cfg = PipelineConfig(max_graphs=2)
    pipe = Engine(ring_gen, cfg, graph_capture=FakeGraph)
    sizes, outs = [], []
    for o in pipe.stream(image(), "p", audio(n), n, seed=4, prompts=prompts):
        sizes.append(len(pipe.runner))
        outs.append(o)
    assert [o.index for o in outs] == list(range(n))
    assert max(sizes) <= 2 and pipe.runner.stats.replays > 0
    # the session's graphs are kept for the next stream (reuse_session), at most max_graphs, and freed by close()
    assert 0 < len([f for f in FakeGraph.made if not f.freed]) == len(pipe.runner) <= 2
    pipe.close()
    assert len([f for f in FakeGraph.made if not f.freed]) == 0 and pipe.session is None
    # the same stream stepped eagerly, one chunk after another, with the same prompt changes
    sess, a = ring_gen.session(image(), "p", seed=4), audio(n)
    for i, o in enumerate(outs):
        if i in prompts:
            sess.set_prompt(prompts[i])
        assert torch.equal(sess.step(a[i * SPC : (i + 1) * SPC]), o.latents), i
    steps = [o.timings.step for o in outs]
    assert "replay" in steps and any(s.startswith("eager:warmup") for s in steps)
