"""The engine on the CPU: placement resolution, the overlapped decode equal to the serial order, order,
timings, overlap, the submit / collect API (caller's buffers, the delivery callback, dropped work), and
clean shutdown (early stop, errors on either side). CUDA-only checks skip."""

from __future__ import annotations

import gc
import math
import threading
import time

import pytest
import torch

from cadence.config import PipelineConfig, Placement, get_preset, resolve_placement
from cadence.engine.engine import Engine
from cadence.engine.session import Session, build_generator
from cadence.errors import ConfigError, InputError

TINY = get_preset("tiny")
SPC = TINY.audio_samples_per_chunk
N = 7  # more chunks than the window (4)


def image(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, 128, 128, generator=g) * 2 - 1


def speech(n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n * SPC) / 48_000
    return 0.3 * torch.sin(2 * math.pi * 220 * t) + 0.1 * torch.randn(n * SPC, generator=g)


def decode_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cadence-decode" and t.is_alive()]


def engines_gone() -> list[threading.Thread]:
    """The decode threads left once unreferenced engines are collected (an engine's thread ends with it)."""
    gc.collect()
    deadline = time.monotonic() + 5
    while decode_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return decode_threads()


@pytest.fixture(scope="module")
def gen():
    return build_generator(TINY, seed=0)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    assert engines_gone() == []
    yield
    assert engines_gone() == [], "a decode thread outlived its engine"


# ---- placement ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "decode, count, want",
    [
        ("auto", 0, ("cpu", "cpu", False)),  # no CUDA: everything on the CPU (decode in a CPU thread)
        ("cuda:1", 0, ("cpu", "cpu", False)),  # ... even when a GPU was asked for (with a note)
        ("auto", 1, ("cuda:0", "cuda:0", True)),  # one GPU: decode shares it on its own stream
        ("auto", 2, ("cuda:0", "cuda:1", False)),  # two: decode gets the free one
        ("same", 2, ("cuda:0", "cuda:0", True)),
        ("cuda:0", 2, ("cuda:0", "cuda:0", True)),  # naming the diffusion GPU = same GPU, separate stream
        ("cuda:1", 2, ("cuda:0", "cuda:1", False)),
        ("cpu", 1, ("cuda:0", "cpu", False)),
    ],
)
def test_resolve_placement_valid(decode, count, want):
    p = resolve_placement(PipelineConfig(decode_device=decode), count)
    assert isinstance(p, Placement)
    assert (p.diffusion_device, p.decode_device, p.separate_stream) == want
    assert p.cross_device == (want[0] != want[1])
    if count == 0 and decode.startswith("cuda"):
        assert any("no CUDA" in n and decode in n for n in p.notes)


def test_resolve_placement_diffusion_device_choice():
    p = resolve_placement(PipelineConfig(diffusion_devices=("cuda:1",), decode_device="auto"), 2)
    assert (p.diffusion_device, p.decode_device) == ("cuda:1", "cuda:0")
    p = resolve_placement(PipelineConfig(diffusion_devices=("cuda:2",), decode_device="auto"), 3)
    assert p.decode_device == "cuda:0"
    assert resolve_placement(PipelineConfig(diffusion_devices=("cpu",)), 2).decode_device == "cpu"


@pytest.mark.parametrize(
    "kw, count, match",
    [
        (
            dict(decode_device="cuda:1"),
            1,
            r"decode_device cuda:1 is out of range: 1 CUDA device\(s\) visible "
            r"\(cuda:0..cuda:0\)",
        ),
        (dict(decode_device="cuda:5"), 2, r"cuda:5 is out of range: 2 CUDA"),
        (dict(diffusion_devices=("cuda:3",)), 2, r"diffusion device cuda:3 is out of range"),
        (dict(diffusion_devices=("cpu",), decode_device="cuda:0"), 1, r"diffusion on the CPU"),
    ],
)
def test_resolve_placement_invalid(kw, count, match):
    with pytest.raises(ConfigError, match=match):
        resolve_placement(PipelineConfig(**kw), count)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(diffusion_devices=("cuda:0", "cuda:1")), r"exactly one device.*\['cuda:0', 'cuda:1'\]"),
        (dict(diffusion_devices=()), r"exactly one device"),
        (dict(decode_device="gpu1"), r"decode_device 'gpu1' must be"),
        (dict(diffusion_devices=("tpu",)), r"diffusion device 'tpu' must be"),
        (dict(queue_depth=0), r"queue_depth must be >= 1, got 0"),
        (dict(host_buffers=1), r"host_buffers must be >= 2, got 1"),
        (dict(max_graphs=0), r"max_graphs must be >= 1, got 0"),
        (dict(steps_in_flight=0), r"steps_in_flight must be >= 1, got 0"),
    ],
)
def test_pipeline_config_rejects(kw, match):
    with pytest.raises(ConfigError, match=match):
        PipelineConfig(**kw)


def test_engine_refuses_model_on_another_device(gen):
    with pytest.raises(InputError, match="model is on cpu but the placement diffuses on cuda:0"):
        Engine(gen, placement=Placement(("cuda:0",), "cuda:0", True))


SERIAL = PipelineConfig(diffusion_devices=("cpu",), decode_device="same", overlap=False)


# ---- parity, order, timings --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [{}, {"cache": "ring"}, {"cache": "ring", "sampler": "renoise"}])
def test_overlapped_engine_equals_serial_order(stream):
    cfg = TINY.with_overrides(stream=stream)
    g = build_generator(cfg, seed=0)
    audio = speech()
    ref = [
        (o.latents, o.frames.clone(), o.audio)
        for o in Engine(g, SERIAL).stream(image(), "a person talking", audio, N, seed=5)
    ]
    # the model is on the CPU: say so (the default 'auto' picks cuda:0 where a GPU exists; seen on the H200)
    eng = Engine(g, PipelineConfig(diffusion_devices=("cpu",), decode_device="same"))
    outs = list(eng.stream(image(), "a person talking", audio, N, seed=5))
    assert [o.index for o in outs] == list(range(N))
    for (lat, frames, au), o in zip(ref, outs):
        assert torch.equal(lat, o.latents)  # bitwise: same device work, same seed
        assert torch.equal(frames, o.frames)
        assert o.frames.dtype == torch.uint8 and o.frames.shape == (4, 128, 128, 3)
        assert o.frames.device.type == "cpu"
        assert torch.equal(o.audio, au)
    assert eng.last_run.chunks == N and eng.last_run.placement == "diffusion cpu -> decode cpu"


def test_stateful_decoder_matches_serial():
    # the streaming (stateful) decoder: frames depend on every earlier chunk, so order and the
    # decode-thread-only state must be right for this to match
    cfg = TINY.with_overrides(vae={"decoder": "taehv", "taehv_channels": (32, 16), "taehv_shuffle": 4})
    torch.manual_seed(0)
    g = build_generator(cfg, seed=0)
    audio = speech(5)
    ref = [o.frames.clone() for o in Engine(g, SERIAL).stream(image(), "p", audio, 5, seed=1)]
    # a CPU model: CPU placement (the default 'auto' picks cuda:0 on a GPU machine)
    cpu = PipelineConfig(diffusion_devices=("cpu",), decode_device="same")
    outs = list(Engine(g, cpu).stream(image(), "p", audio, 5, seed=1))
    assert all(torch.equal(r, o.frames) for r, o in zip(ref, outs))
    assert not torch.equal(outs[1].frames, outs[2].frames)


def test_timings_present_and_sane(gen):
    eng = Engine(gen)
    t_start = time.monotonic()
    outs = list(eng.stream(image(), "p", speech(), N, seed=0))
    wall_ms = (time.monotonic() - t_start) * 1e3
    ttff = eng.last_run.ttff_ms
    assert 0 < ttff <= wall_ms
    assert (
        ttff <= (outs[0].timings.t_done - t_start) * 1e3 + 0.5
    )  # from the stream's start to chunk 0's frames
    for o in outs:
        t = o.timings
        assert t.diffusion_ms > 0 and t.decode_ms > 0 and t.host_copy_ms >= 0
        # plan -> ready covers this chunk's diffusion and decode
        assert t.latency_ms >= t.diffusion_ms + t.decode_ms - 0.5
        assert t.latency_ms <= wall_ms and t.work_ms <= t.latency_ms + 0.5
        assert t.t_done > t.t_plan and t.memory["rss_mb"] > 50  # the worker's memory rides with each chunk
    plans = [o.timings.t_plan for o in outs]
    readies = [o.timings.t_done for o in outs]
    assert plans == sorted(plans) and readies == sorted(readies)
    # the first chunks run eagerly while the ring would fill: the runner says why
    assert outs[0].timings.step.startswith("eager:")


def test_decode_overlaps_diffusion(gen, monkeypatch):
    """With an 80 ms step and an 80 ms decode (sleeps: they release the GIL like real kernels), chunk k
    decodes while chunk k+1 diffuses: the run takes ~n x 80 ms, not n x 160 ms."""
    prep, dec = Session.prepare_step, gen.vae.decode

    def slow_prepare(self, audio):
        time.sleep(0.08)
        return prep(self, audio)

    def slow_decode(lat):
        time.sleep(0.08)
        return dec(lat)

    monkeypatch.setattr(Session, "prepare_step", slow_prepare)
    monkeypatch.setattr(gen.vae, "decode", slow_decode)
    # every chunk overlapped from the start (first_chunk_alone would serialise chunk 0's decode once);
    # the clock starts after the session's opening (not part of the overlap; slow when cold on a busy CPU)
    eng = Engine(gen, PipelineConfig(first_chunk_alone=False))
    outs = list(eng.stream(image(), "p", speech(6), 6))
    wall = outs[-1].timings.t_done - outs[0].timings.t_plan
    serial = sum(o.timings.diffusion_ms + o.timings.decode_ms for o in outs) / 1e3
    assert serial > 6 * 0.16
    assert wall < 0.8 * serial, (wall, serial)


# ---- the request API: submit / collect, the caller's buffers, the delivery callback -----------------------


def test_submit_collect_writes_into_the_callers_buffers(gen):
    """What a server does: one request per chunk, frames straight into the buffer it lends (a shared-memory
    slot), results in order; equal to the stream of the same seed."""
    import numpy as np

    audio = speech()
    ref = [o.frames.clone() for o in Engine(gen, SERIAL).stream(image(), "p", audio, 4, seed=9)]
    eng = Engine(gen)
    eng.open(image(), "p", seed=9)
    slots = [np.zeros((4, 128, 128, 3), np.uint8) for _ in range(4)]
    for i in range(4):
        eng.submit(i, audio[i * SPC : (i + 1) * SPC].numpy(), out=slots[i], tag=("s", i))
    got = eng.collect(block=True)
    assert [r.index for r in got] == [0, 1, 2, 3] and [r.tag for r in got] == [("s", i) for i in range(4)]
    assert all(r.frames is None for r in got)  # written into the caller's buffer, not returned
    for i in range(4):
        assert np.array_equal(slots[i], ref[i].numpy())
    assert eng.collect(block=True) == []  # nothing outstanding
    eng.end_stream()


def test_on_chunk_delivers_on_the_decode_thread_and_end_stream_reports_dropped_work(gen, monkeypatch):
    """The worker process's path: results go to a callback as soon as they are decoded; ending the stream
    drops what was queued and names it (so a server can give back the slots it lent)."""
    got, threads = [], []

    def on_chunk(r):
        threads.append(threading.current_thread().name)
        got.append((r.index, r.frames.shape, r.tag))

    eng = Engine(gen, PipelineConfig(queue_depth=4, first_chunk_alone=False), on_chunk=on_chunk)
    eng.open(image(), "p", seed=0)
    eng.submit(0, speech(1))
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [(0, (4, 128, 128, 3), None)] and threads == ["cadence-decode"]
    dec = gen.vae.decode
    release = threading.Event()

    def blocked(lat):  # the decoder is busy: later chunks wait in its queue
        release.wait(10)
        return dec(lat)

    monkeypatch.setattr(gen.vae, "decode", blocked)
    for i in range(1, 4):
        eng.submit(i, speech(1), tag=("sid", i, i))
    time.sleep(0.1)
    release.set()
    dropped = eng.end_stream()
    delivered = [g[0] for g in got]
    assert delivered[0] == 0 and delivered == sorted(delivered)
    # every chunk was either delivered or reported dropped, never both, never lost
    assert sorted(delivered[1:] + [t[1] for t in dropped]) == [1, 2, 3], (delivered, dropped)
    assert len(decode_threads()) == 1  # the engine's decode thread, idle, kept for its next stream
    eng.close()
    assert decode_threads() == []


def test_steps_without_decode_for_a_follower_rank(gen):
    """A tensor-parallel follower steps in lockstep and decodes nothing: its latents equal rank 0's."""
    audio = speech(3)
    ref = [o.latents for o in Engine(gen, SERIAL).stream(image(), "p", audio, 3, seed=4)]
    eng = Engine(gen)
    eng.open(image(), "p", seed=4, decode=False)
    assert decode_threads() == []
    for i in range(3):
        eng.submit(i, audio[i * SPC : (i + 1) * SPC], decode=False)
    assert eng.session.index == 3 and eng.state.submitted == 3  # the steps ran, no result is waiting
    assert eng.collect(block=True) == []
    with pytest.raises(RuntimeError, match="without a decoder"):
        eng.submit(3, speech(1))
    eng.end_stream()
    # the same session reset by the next open gives the same stream as a fresh one
    again = [o.latents for o in eng.stream(image(), "p", audio, 3, seed=4)]
    assert all(torch.equal(a, b) for a, b in zip(again, ref))


def test_preopen_then_open_with_the_key_only_reseeds(gen):
    audio = speech(3)
    ref = [o.frames.clone() for o in Engine(gen, SERIAL).stream(image(), "p", audio, 3, seed=7)]
    eng = Engine(gen)
    assert eng.preopen(image(), "p", "default") > 0
    assert eng.open(None, "p", seed=7, key="default") == "preopened" and eng.last_open_preopened
    for i in range(3):
        eng.submit(i, audio[i * SPC : (i + 1) * SPC])
    got = [r.frames.clone() for r in eng.collect(block=True)]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # another prompt (or another key) is a real open; None as the image is then an error
    eng.preopen(image(), "p", "default")
    assert eng.open(image(1), "q", seed=7, key="default") == "reused" and not eng.last_open_preopened
    with pytest.raises(InputError, match="needs a reference image"):
        eng.open(None, "p", seed=0, key="other")
    eng.close()


def test_warm_up_measures_latency_and_interval_and_picks_threads(gen):
    eng = Engine(gen)
    before = torch.get_num_threads()
    try:
        rep = eng.warm_up(image())
    finally:
        torch.set_num_threads(before)
    assert rep.steady_chunk_ms > 0 and rep.interval_ms > 0 and rep.media_chunk_ms == pytest.approx(166.7)
    import os

    if (os.cpu_count() or 1) > 2:  # the faster of 1 and 2 intra-op threads, timed
        assert rep.threads == int(min(rep.thread_trials, key=lambda k: rep.thread_trials[k]))
    else:  # two cores: the diffusion thread and the decode thread take one each
        assert rep.threads == 1 and rep.thread_trials is None
    assert rep.streams >= 2 and len(rep.chunk_ms) == eng.warm_chunks()
    # the decode thread the warm-up ran on (its cuDNN plans, its CUDA device) stays for the engine's streams
    assert eng.warmup_report is rep and len(decode_threads()) == 1
    eng.close()
    assert decode_threads() == []


# ---- shutdown ------------------------------------------------------------------------------------------


def test_consumer_stops_early(gen):
    it = Engine(gen).stream(image(), "p", speech(), N)
    first = next(it)
    second = next(it)
    assert (first.index, second.index) == (0, 1)
    assert len(decode_threads()) == 1  # running while the stream is open
    it.close()
    assert engines_gone() == []  # the stream's end dropped the last reference to its engine


def test_consumer_breaks_out_of_loop(gen):
    seen = []
    for out in Engine(gen).stream(image(), "p", speech(), N):
        seen.append(out.index)
        if out.index == 2:
            break
    assert seen == [0, 1, 2]
    # the abandoned generator is finalised when its last reference goes (CPython refcounting)
    assert engines_gone() == []


class DecodeBoom(RuntimeError):
    pass


def test_exception_in_decode_propagates_and_stops(gen, monkeypatch):
    calls = {"n": 0}
    dec = gen.vae.decode

    def flaky(lat):
        calls["n"] += 1
        if calls["n"] == 3:
            raise DecodeBoom("decoder failed on chunk 2")
        return dec(lat)

    monkeypatch.setattr(gen.vae, "decode", flaky)
    got = []
    with pytest.raises(DecodeBoom, match="chunk 2"):
        for out in Engine(gen).stream(image(), "p", speech(), N):
            got.append(out.index)
    assert got == [0, 1]  # the chunks before the failure still came out, in order
    assert engines_gone() == []


def test_exception_in_diffusion_propagates_and_stops(gen, monkeypatch):
    prep = Session.prepare_step

    def failing(self, audio):
        if self.index == 3:
            raise ValueError("step failed at chunk 3")
        return prep(self, audio)

    monkeypatch.setattr(Session, "prepare_step", failing)
    got = []
    with pytest.raises(ValueError, match="chunk 3"):
        for out in Engine(gen).stream(image(), "p", speech(), N):
            got.append(out.index)
    assert got == sorted(got) and len(got) <= 3
    assert engines_gone() == []


def test_bad_input_fails_before_any_thread(gen):
    with pytest.raises(InputError, match=str(N * SPC)):
        next(Engine(gen).stream(image(), "p", speech(1), N))
    with pytest.raises(InputError, match="positive"):
        next(Engine(gen).stream(image(), "p", speech(1), 0))


def test_set_prompt_validates(gen):
    sess = gen.session(image(), "p")
    with pytest.raises(InputError, match=r"\[L, 64\] with 1 <= L <= 16, got \[17, 64\]"):
        sess.set_prompt(torch.zeros(17, 64))
    with pytest.raises(InputError):
        sess.set_prompt(torch.zeros(0, 64))
    sess.set_prompt(torch.randn(5, 64))
    assert sess.text.kv[0][0].shape[1] == 5


# ---- CUDA (skipped here) -------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode", ["same", "auto", "cpu"])
@pytest.mark.parametrize("decoder", ["standin", "taehv"])
def test_cuda_engine_matches_serial(decode, decoder):
    """taehv: a stateful decoder, primed by the decode thread on its own streams as the stream opens
    (ordered after the open by an event): the frames must equal the serial order's."""
    cfg = TINY.with_overrides(stream={"cache": "ring"}, vae={"decoder": decoder})
    g = build_generator(cfg, device="cuda:0", seed=0)
    audio = speech(8)
    serial = PipelineConfig(decode_device="same", overlap=False, graphs=False)
    ref = [
        (o.latents.clone(), o.frames.clone())
        for o in Engine(g, serial).stream(image(), "p", audio, 8, seed=2)
    ]
    eng = Engine(g, PipelineConfig(decode_device=decode))
    outs = []
    for o in eng.stream(image(), "p", audio, 8, seed=2):
        outs.append((o.index, o.latents.clone(), o.frames.clone(), o.frames.is_pinned(), o.timings))
    assert [o[0] for o in outs] == list(range(8))
    for (rl, rf), (_, lat, fr, pinned, t) in zip(ref, outs, strict=True):
        # graphs replay the same kernels; allow bf16-free float32 rounding differences of replays
        torch.testing.assert_close(lat, rl, rtol=1e-4, atol=1e-4)
        assert (fr.int() - rf.int()).abs().max() <= 1
        assert pinned == (eng.placement.decode_device != "cpu")
        assert t.diffusion_ms > 0 and t.decode_ms >= 0 and t.latency_ms > 0
    if decode == "same":
        assert eng.runner.stats.captures >= 1 and eng.runner.stats.replays >= 1


# ---- the benchmark's CPU smoke run --------------------------------------------------------------------------


def test_bench_pipeline_tiny_smoke(tmp_path, capsys):
    import json

    from cadence.bench.pipeline import main

    assert (
        main(["--preset", "tiny", "--chunks", "12", "--shape-change-every", "3", "--out-dir", str(tmp_path)])
        == 0
    )
    files = list((tmp_path / "pipeline").glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["bench"] == "pipeline" and doc["preset"] == "tiny"
    r = doc["results"]
    for key in (
        "fps",
        "chunk_p50_ms",
        "chunk_p99_ms",
        "deadline_ms",
        "deadline_miss_rate",
        "ttff_ms",
        "diffusion_ms",
        "decode_ms",
        "host_copy_ms",
        "chunks",
        "shape_changes",
    ):
        assert key in r, key
    assert r["chunks"] == 12 and r["deadline_ms"] == pytest.approx(1000 * 4 / 24)
    assert r["fps"] > 0 and 0 <= r["deadline_miss_rate"] <= 1 and r["chunk_p99_ms"] >= r["chunk_p50_ms"] > 0
    assert r["shape_changes"] >= 2 and r["shape_change_run"]["chunks"] == 12
    assert len(r["per_chunk"]) == 12
    assert "fps (sustained)" in capsys.readouterr().out


def test_bench_pipeline_decode_gpu_flag(tmp_path, capsys):
    """`--decode-gpu K` (the issue's spelling) is `--decode-device cuda:K`; without that GPU the placement
    maps it to the CPU with one log line; the two flags exclude each other."""
    import json

    from cadence.bench.pipeline import main, parse

    with pytest.raises(SystemExit):
        parse(["--decode-gpu", "1", "--decode-device", "cpu"])
    if torch.cuda.device_count() > 1:
        pytest.skip("a machine with a second GPU would really decode there")
    capsys.readouterr()
    assert (
        main(
            [
                "--preset",
                "tiny",
                "--chunks",
                "2",
                "--shape-change-every",
                "0",
                "--decode-gpu",
                "1",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "cuda:1 mapped to cpu" in capsys.readouterr().err
    (f,) = (tmp_path / "pipeline").glob("*.json")
    assert json.loads(f.read_text())["placement"] == "diffusion cpu -> decode cpu"


def test_automatic_decoder_follows_the_weights(tmp_path):
    """FastPath(decoder=None): the preset's own on the CPU; on CUDA the tiny decoder when it is trained or
    nothing is (random benchmarks), else the full Wan VAE the given weights belong to."""
    from cadence.engine.recipe import choose_decoder

    cuda, cpu = True, False
    w14 = get_preset("w14")
    assert choose_decoder(w14, cpu) == w14.vae.decoder and choose_decoder(w14, cuda) == "taehv"
    vae = tmp_path / "vae"
    vae.mkdir()
    assert choose_decoder(w14.with_overrides(vae={"weights": str(vae)}), cuda) == "wan"
    (vae / "taehv.safetensors").write_bytes(b"")
    assert choose_decoder(w14.with_overrides(vae={"weights": str(vae)}), cuda) == "taehv"
    assert choose_decoder(w14.with_overrides(vae={"taehv_weights": "taew2_2.pth"}), cuda) == "taehv"
    character = get_preset("character")  # trained, shipped: its own tiny decoder everywhere
    assert choose_decoder(character, cpu) == "taehv" and choose_decoder(character, cuda) == "taehv"


def test_a_model_family_builds_and_streams_through_the_one_engine():
    """--model NAME: the family's configuration (here Self-Forcing at a tiny width) goes through the same
    build_engine and loop; its sampler's model timesteps are the warped shift-5 table's, and each chunk is
    its 3 latent frames = 12 video frames."""
    from cadence.engine.build import build_engine
    from cadence.engine.spec import FastPath
    from cadence.model.families import model_config

    cfg = model_config(
        "self-forcing",
        {
            "model": dict(
                dim=64, num_heads=2, head_dim=32, ffn_dim=128, num_layers=1, text_dim=32, text_len=8
            ),
            "stream": dict(height=64, width=64),
        },
    )
    assert cfg.model.family == "self-forcing" and cfg.video_frames_per_chunk == 12
    eng = build_engine(cfg, "cpu", FastPath(threads=1))
    ts = eng.gen.timesteps.tolist()
    assert ts[:4] == pytest.approx([1000.0, 937.5, 833.333, 625.0], abs=1e-3) and ts[-1] == 0.0
    spc = cfg.audio_samples_per_chunk
    outs = list(eng.stream(image()[:, :64, :64], "a dog", torch.zeros(2 * spc), 2))
    assert [tuple(o.frames.shape) for o in outs] == [(12, 64, 64, 3)] * 2


def test_shorten_switch_interval_lowers_never_raises_and_zero_leaves_it():
    import sys

    from cadence.engine.engine import shorten_switch_interval
    from cadence.errors import ConfigError

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert shorten_switch_interval(0.5) is True
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert shorten_switch_interval(2.0) is False  # never raised
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(0.005)
        assert shorten_switch_interval(0) is False  # 0: left alone
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ConfigError, match="gil_switch_ms"):
        PipelineConfig(gil_switch_ms=-1)


def test_one_decode_thread_per_engine_across_streams_ended_by_close_or_collection(gen):
    """Each stream's decode stage runs on the engine's one decode thread (per-thread caches such as cuDNN's
    execution plans survive from stream to stream); close() ends it, and so does dropping the engine."""
    names = []
    eng = Engine(
        gen,
        PipelineConfig(first_chunk_alone=False),
        on_chunk=lambda r: names.append(threading.current_thread()),
    )
    for seed in (1, 2):
        eng.open(image(), "p", seed=seed)
        for i in range(2):
            eng.submit(i, speech(1))
        deadline = time.monotonic() + 30
        while len(names) < 2 * seed and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.end_stream()
    assert len(names) == 4 and len({id(t) for t in names}) == 1, names  # both streams, one thread
    (th,) = decode_threads()
    eng.close()
    assert not th.is_alive() and decode_threads() == []
    eng = Engine(gen)
    list(eng.stream(image(), "p", speech(), 2))
    assert len(decode_threads()) == 1
    del eng
    assert engines_gone() == []
