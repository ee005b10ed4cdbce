"""Issue 17 on the CPU: where the full decoder runs (serve's --decode-gpu, FastPath.decoder_fast, the
builder's step that applies it) and how bench pipeline accounts latency and deadline misses."""

from __future__ import annotations

import types

import pytest
import torch

from cadence.bench.pipeline import latency_fields, playout_misses
from cadence.engine.build import apply_decoder_fast
from cadence.engine.messages import ChunkTimings
from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.errors import ConfigError, InputError
from cadence.model.vae import WanVAE, wan_vae_config
from cadence.serve.config import ServeConfig, serve_groups, worker_spec

# ---- placement ------------------------------------------------------------------------------------


def test_serve_groups_leave_the_decode_gpu_out():
    assert tuple(map(str, serve_groups("cuda", 1, None, 2, decode_gpu=1))) == ("cuda:0",)
    assert tuple(map(str, serve_groups("cuda", 1, None, 2, decode_gpu=0))) == ("cuda:1",)
    assert tuple(map(str, serve_groups("cuda", 1, None, 4, decode_gpu=1))) == ("cuda:0", "cuda:2", "cuda:3")
    assert tuple(map(str, serve_groups("cuda", 2, None, 3, decode_gpu=2))) == ("cuda:0+cuda:1",)
    assert tuple(map(str, serve_groups("cuda", 1, None, 2))) == ("cuda:0", "cuda:1")  # unchanged without it
    with pytest.raises(InputError, match="decode-gpu 2"):
        serve_groups("cuda", 1, None, 2, decode_gpu=2)
    with pytest.raises(InputError, match="besides decode GPU 1"):
        serve_groups("cuda", 1, 2, 2, decode_gpu=1)


def test_worker_spec_decodes_on_the_decode_gpu():
    cfg = ServeConfig(
        engine=EngineSpec(model="w14", decode_device="cuda:1", fast=FastPath(decoder="wan")),
        groups=("cuda:0",),
    )
    spec, _ = worker_spec(cfg, "cuda:0")
    assert spec.recipe.decode_device == "cuda:1" and spec.recipe.fast.decoder_fast == "compile"
    assert not spec.recipe.notes
    # without it: the group's own GPU (its own stream)
    spec, _ = worker_spec(ServeConfig(engine=EngineSpec(model="w14"), groups=("cuda:0",)), "cuda:0")
    assert spec.recipe.decode_device == "same"
    # a tensor-parallel group decodes on its own GPUs, with a note; the CPU likewise
    tp = ServeConfig(engine=EngineSpec(model="w14", decode_device="cuda:2"), groups=("cuda:0+cuda:1",))
    spec, _ = worker_spec(tp, "cuda:0+cuda:1")
    assert spec.recipe.decode_device == "same" and any("tensor-parallel" in n for n in spec.recipe.notes)
    spec, _ = worker_spec(ServeConfig(engine=EngineSpec(decode_device="cuda:0"), groups=("cpu",)), "cpu")
    assert (
        spec.recipe.decode_device == "same" and spec.recipe.fast.decoder_fast == "off" and spec.recipe.notes
    )


def test_serve_config_refuses_a_decode_gpu_that_is_also_a_group():
    with pytest.raises(ConfigError, match="decode GPU 0"):
        ServeConfig(engine=EngineSpec(decode_device="cuda:0"), groups=("cuda:0", "cuda:1"))
    with pytest.raises(ConfigError, match="decode device must be"):
        EngineSpec(decode_device="cuda:-1")
    with pytest.raises(ConfigError, match="decoder_fast"):
        FastPath(decoder_fast="turbo")


def test_fast_path_resolves_the_decoder_fast_path():
    assert FastPath().resolve("cuda:0")[0].decoder_fast == "compile"
    assert FastPath().resolve("cpu")[0].decoder_fast == "off"
    assert FastPath(decoder_fast="fold").resolve("cpu")[0].decoder_fast == "fold"  # asked: kept


def _fake_engine(decoder: str, decode_device: str = "cpu"):
    wan = WanVAE(wan_vae_config("2.1", base_dim=8, num_res_blocks=1)).eval()
    vae = types.SimpleNamespace(wan=wan, taehv=object() if decoder == "taehv" else None)
    got = []

    def vae_on(dev):
        got.append(dev)
        return vae

    gen = types.SimpleNamespace(
        vae_on=vae_on, cfg=types.SimpleNamespace(vae=types.SimpleNamespace(decoder=decoder))
    )
    return (
        types.SimpleNamespace(gen=gen, placement=types.SimpleNamespace(decode_device=decode_device)),
        wan,
        got,
    )


def test_builder_applies_the_decoder_fast_path_on_the_decode_device():
    eng, wan, got = _fake_engine("wan")
    notes: list[str] = []
    # compile asked with a CPU decode device: channels-last only, one note
    assert apply_decoder_fast(eng, "compile", notes) == "channels_last"
    assert got == ["cpu"] and len(notes) == 1 and "CUDA" in notes[0]
    assert wan.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last_3d)
    eng, wan, _ = _fake_engine("taehv")
    assert apply_decoder_fast(eng, "compile", []).startswith("off")  # the tiny decoder has none
    assert wan.decoder.conv_in.weight.is_contiguous()
    assert apply_decoder_fast(_fake_engine("wan")[0], "off", []) == "off"


# ---- latency accounting ---------------------------------------------------------------------------


def _t(plan: float, done: float) -> ChunkTimings:
    return ChunkTimings(
        diffusion_ms=1.0, decode_ms=1.0, host_copy_ms=0.0, work_ms=1.0, t_plan=plan, t_recv=plan, t_done=done
    )


def test_deadline_is_the_playout_time_at_the_lead_not_one_chunk_of_latency():
    chunk = 500.0
    # back to back at 2 chunks/s of work: every latency is 600 ms (above one chunk of media), but each
    # chunk is ready before it plays at a 700 ms lead -> no miss
    ts = [_t(0.4 * i, 0.4 * i + 0.6) for i in range(10)]
    late = playout_misses(ts, chunk, 700.0)
    assert all(x < 0 for x in late)
    f = latency_fields(ts, chunk, 700.0, skip=2)
    assert f["deadline_misses"] == 0 and f["latency_p50_ms"] == pytest.approx(600.0)
    # at a 500 ms lead the first chunk (600 ms) is late by 100 ms; the rest catch up (0.4 s per 0.5 s chunk)
    f = latency_fields(ts, chunk, 500.0, skip=2)
    assert f["deadline_misses"] == 1 and f["first_miss"] == 0
    assert f["worst_lateness_ms"] == pytest.approx(100.0)
    # slower than real time (0.6 s per 0.5 s chunk): misses pile up whatever the latency
    slow = [_t(0.6 * i, 0.6 * i + 0.3) for i in range(10)]
    f = latency_fields(slow, chunk, 400.0, skip=0)
    assert f["latency_p99_ms"] == pytest.approx(300.0)
    assert f["first_miss"] == 2 and f["deadline_misses"] == 8
    assert f["deadline_miss_rate"] == pytest.approx(0.8)


# ---- the engine end to end (CPU) ----------------------------------------------------------------------


def _engine_frames(decoder_fast: str, overlap: bool):
    from cadence.config import PipelineConfig, get_preset
    from cadence.engine.build import build_engine

    cfg = get_preset("tiny").with_overrides(
        vae={"decoder": "wan", "base_dim": 8}, stream={"height": 64, "width": 64}
    )
    pcfg = PipelineConfig(diffusion_devices=("cpu",), decode_device="same", overlap=overlap)
    torch.manual_seed(0)  # the random VAE weights come from the global generator
    eng = build_engine(
        cfg, "cpu", FastPath(threads=1, decoder="wan", decoder_fast=decoder_fast), pipeline=pcfg
    )
    spc = cfg.audio_samples_per_chunk
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, 64, 64, generator=g) * 2 - 1
    audio = 0.1 * torch.randn(4 * spc, generator=g)
    try:
        outs = [(o.index, o.frames.clone()) for o in eng.stream(image, "a face", audio, 4, seed=0)]
    finally:
        eng.close()
    return eng.applied["decoder_fast"], outs


def test_engine_decodes_the_same_frames_in_order_with_the_fast_path():
    """The builder's decoder fast path ('cl': channels-last weights, activations and causal memory) through
    the whole engine, decode on its own thread: chunks come back in order with the plain path's frames
    (uint8, at most one level apart: float summation order only)."""
    plain_applied, plain = _engine_frames("off", overlap=False)
    fast_applied, fast = _engine_frames("cl", overlap=True)
    assert plain_applied == "off" and fast_applied == "channels_last"
    assert [i for i, _ in fast] == [0, 1, 2, 3] == [i for i, _ in plain]
    for (_, a), (_, b) in zip(fast, plain):
        assert a.shape == b.shape and int((a.int() - b.int()).abs().max()) <= 1
