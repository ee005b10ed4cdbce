"""The engine's FlashHead clip stream (``cadence.engine.flashhead.FlashHeadSession``: ``--model flashhead-pro`` /
``flashhead-lite``) against the family's offline stream (``cadence.model.flashhead_stream.generate_offline``,
itself tested against the authors' pipeline in tests/test_families_flashhead.py), float32 on the CPU.

The engine is built from the tiny released-layout fixture (tests/fixtures/flashhead/SoulX-FlashHead-tiny: the
fixture's Model_Pro / Model_Lite made by the authors' code, VAE_Wan -> the tiny Wan 2.1 VAE, VAE_LTX a tiny
random LTX-Video VAE at the Lite model's 8 x 32 x 32 geometry, and wav2vec2-tiny beside it) through ``--weights
DIR``'s path: the family's builder reads every size from the folder. The engine runs the audio one video frame
behind its clock (``AUDIO_LAG``: the live resampler's look-ahead), so its stream is compared with
``generate_offline`` on the same audio with 40 ms of silence in front, the same codec object (Lite's LTX VAE
samples its posterior: the reference latent from a generator seeded ``REFERENCE_SEED``, the motion encodes from
one seeded ``seed + 1``, on both sides). Measured: every clip's denoised latent bit-identical (bound 1e-5) and
the uint8 frames equal to the reference's float frames rounded (bound: at most 1 level, on < 0.1% of values).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from family_fixtures import rel

pytest.importorskip("soxr")
pytest.importorskip("transformers")

import cadence.model.flashhead_stream as fs  # noqa: E402
from cadence.engine.build import build_engine  # noqa: E402
from cadence.engine.flashhead import AUDIO_LAG, FlashHeadSession  # noqa: E402
from cadence.engine.recipe import EngineSpec, resolve  # noqa: E402
from cadence.engine.session import StreamSession  # noqa: E402
from cadence.engine.spec import FastPath  # noqa: E402
from cadence.errors import ConfigError  # noqa: E402
from cadence.model.families import FAMILIES, family_config, get_model  # noqa: E402
from cadence.model.flashtalk import reference_image  # noqa: E402
from cadence.runtime.graphs import GraphRunner  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "flashhead"
TINY_DIR = FIX / "SoulX-FlashHead-tiny"
PIXELS = {"pro": 32, "lite": 64}
NEW = {"pro": 28, "lite": 24}
N = 3


def tiny_cfg(variant: str, weights=TINY_DIR):
    hw = PIXELS[variant]
    return family_config(f"flashhead-{variant}", weights=str(weights), stream=dict(height=hw, width=hw))


def engine(variant: str):
    e = build_engine(tiny_cfg(variant), "cpu", FastPath(), seed=3)
    e.variant = variant
    return e


@pytest.fixture(scope="module", params=["pro", "lite"])
def eng(request):
    e = engine(request.param)
    yield e
    e.close()


@pytest.fixture(scope="module", params=["lite", pytest.param("pro", marks=pytest.mark.slow)])
def eng_more(request):
    """Lite in the fast tier; Pro's tiny Wan VAE makes these two streams each ~5-15 s on two cores: slow."""
    e = engine(request.param)
    yield e
    e.close()


def inputs(eng):
    g = torch.Generator().manual_seed(0)
    size = PIXELS[eng.variant]
    image = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
    t = torch.arange(N * eng.samples_per_chunk) / 48000
    voice = 0.3 * torch.sin(2 * torch.pi * 180 * t) * (1 + torch.sin(2 * torch.pi * 3 * t))
    return image, voice + 0.05 * torch.randn(t.shape, generator=g)


def run_engine(eng, image, audio, seed=5):
    size = (PIXELS[eng.variant],) * 2
    ref = reference_image(image, size)[:, 0]  # the engine's [3, H, W] image, as FlashHead prepares it
    return [
        (r.frames.clone(), r.latents.clone(), r.audio.clone(), r.timings.step)
        for r in eng.stream(ref, "ignored: prompt-free", audio, N, seed=seed)
    ]


def run_offline(eng, image, audio, seed=5, lag=AUDIO_LAG):
    gen, latents, real = eng.gen, [], fs.sample_clip
    mf = gen.rules.stream.motion_frames

    def sample_clip(*a, **k):
        latents.append(real(*a, **k))
        return latents[-1]

    fs.sample_clip = sample_clip
    try:
        audio_in = fs.FlashHeadAudio(gen.audio, 48000, 33, mf, window=gen.model.fcfg.audio_window)
        frames = fs.generate_offline(
            gen.model, gen.clip_codec, audio_in, image, torch.cat([torch.zeros(lag), audio]),
            (PIXELS[eng.variant],) * 2, seed,
        )  # fmt: skip
    finally:
        fs.sample_clip = real
    return frames[:N], latents[:N]


def test_engine_stream_equals_the_offline_stream(eng):
    image, audio = inputs(eng)
    got = run_engine(eng, image, audio)
    frames, latents = run_offline(eng, image, audio)
    size, spc = PIXELS[eng.variant], eng.samples_per_chunk
    assert spc == NEW[eng.variant] * 1920 and eng.frame_shape == (NEW[eng.variant], size, size, 3)
    assert len(got) == len(frames) == N
    for k, (f, lat, a, step) in enumerate(got):
        assert f.dtype == torch.uint8 and step == "clip"
        err = rel(lat, latents[k])
        assert err <= 1e-5, (k, err)
        diff = (f.float() - frames[k].round()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3, (k, diff.max(), (diff > 0).sum())
        assert torch.equal(a, audio[k * spc : (k + 1) * spc])  # the chunk's audio goes out with its frames
    assert isinstance(eng.session, FlashHeadSession) and isinstance(eng.session, StreamSession)
    assert eng.gen.text_encoder is None  # prompt-free: no text encoder built


def test_the_parity_check_can_fail(eng_more):
    """The comparison above is sensitive: the offline path without the audio lag, or another seed, differ."""
    eng = eng_more
    image, audio = inputs(eng)
    got = run_engine(eng, image, audio)
    _, unlagged = run_offline(eng, image, audio, lag=0)
    assert rel(got[-1][1], unlagged[-1]) > 1e-4
    other = run_engine(eng, image, audio, seed=6)
    assert rel(other[0][1], got[0][1]) > 1e-2


def test_a_reused_session_and_a_preopened_one_equal_a_fresh_one(eng_more):
    eng = eng_more
    image, audio = inputs(eng)
    a = run_engine(eng, image, audio)
    b = run_engine(eng, image, audio)  # the kept session reset in place, the reference latent remembered
    assert eng.last_run.session == "reused" and all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    ref = reference_image(image, (PIXELS[eng.variant],) * 2)[:, 0]
    eng.preopen(ref, "", key="face")  # a server opens the next stream ahead, with seed 0, then re-seeds it
    assert eng.open(None, "", seed=5, key="face") == "preopened"
    spc = eng.samples_per_chunk
    for k in range(N):
        eng.submit(k, audio[k * spc : (k + 1) * spc])
    c = [r.frames.clone() for r in eng.collect(block=True)]
    eng.end_stream()
    assert len(c) == N and all(torch.equal(x[0], y) for x, y in zip(a, c))


def test_the_model_pass_replayed_from_a_graph_is_the_eager_pass(eng):
    """``graphs`` on: the session captures its model pass (a fake capture on the CPU: the same function run on
    the static buffers, as a CUDA replay runs the captured kernels) and replays it for every pass: the clips
    are the eager clips exactly."""
    from fake_graph import FakeGraph

    image, audio = inputs(eng)
    ref = reference_image(image, (PIXELS[eng.variant],) * 2)[:, 0]
    spc = eng.samples_per_chunk
    runner = GraphRunner(enabled=True, warmup=1, capture=FakeGraph)
    graphed, eager = eng.gen.session(ref, "", 5), eng.gen.session(ref, "", 5)
    for k in range(N):
        chunk = audio[k * spc : (k + 1) * spc]
        assert torch.equal(graphed.step(chunk, runner), eager.step(chunk, None))
        assert torch.equal(graphed.last_latent, eager.last_latent)
    assert runner.stats.captures == 1 and runner.stats.replays == 4 * N - 1  # one eager warm-up pass


def test_built_from_random_weights_at_a_tiny_geometry():
    """No --weights: the DiT, the VAE and wav2vec2 random at the configuration's sizes (the released ones by
    default; here the fixture's, through config overrides)."""
    tiny = dict(dim=24, num_heads=2, head_dim=12, ffn_dim=48, num_layers=2, freq_dim=16, audio_dim=8)
    tiny.update(audio_layers=2, audio_hidden=16, audio_tokens_per_frame=4, audio_context_dim=24)
    cfg = family_config("flashhead-lite", model=tiny, stream=dict(height=64, width=64), vae={"base_dim": 2})
    e = build_engine(cfg, "cpu", FastPath(), seed=3)
    try:
        audio = 0.1 * torch.randn(2 * e.samples_per_chunk, generator=torch.Generator().manual_seed(1))
        out = list(e.stream(torch.zeros(3, 64, 64), "", audio, 2, seed=1))
        assert [tuple(r.frames.shape) for r in out] == [(24, 64, 64, 3)] * 2
        assert e.applied["decoder"] == "ltx" and e.gen.model.fcfg.patch == (1, 1, 1)
    finally:
        e.close()


def test_the_recipe_keeps_the_fast_paths_a_clip_session_applies():
    """On CUDA the recipe keeps FP8 linears, compile, CUDA graphs (the session's own capture of the model pass)
    and the decoder's fast path for FlashHead, pins its decoder, and turns off what needs a K/V cache (no ring
    cache is folded in); FlashTalk's clip session still refuses graphs and the decoder's fast path."""
    for name, decoder in (("flashhead-lite", "ltx"), ("flashhead-pro", "wan")):
        r = resolve(EngineSpec(name, fast=FastPath(compile=True)), "cuda:0")
        f = r.fast
        assert f.graphs and f.fp8_linears and f.compile and f.decoder_fast == "compile" and not f.kv_fp8
        assert r.config.vae.decoder == decoder and r.config.stream.cache == "naive"
        assert r.warmup_chunks == 2 and [n.split(" (")[0] for n in r.notes] == [f"{name}: kv_fp8 off"]
        assert not r.rules.prompt and get_model(name).prompt_free
    r = resolve(EngineSpec("flashhead-lite", fast=FastPath(kv_fp8=True, decoder="wan")), "cuda:0")
    assert r.config.vae.decoder == "ltx" and any("kv_fp8, decoder wan off" in n for n in r.notes), r.notes
    r = resolve(EngineSpec("flashtalk"), "cuda:0")
    assert not r.fast.graphs and r.fast.decoder_fast == "off"
    lite = family_config("flashhead-lite")  # the released geometry
    assert lite.stream.latent_frames_per_chunk == 3 and lite.vae.stride == (8, 32, 32)
    assert lite.audio_samples_per_chunk == 46080 and lite.tokens_per_chunk == 3 * 16 * 16


def released(tmp_path: Path) -> Path:
    """The tiny fixture laid out as a download: SoulX-FlashHead-1_3B/ with wav2vec2-base-960h/ beside it."""
    root = tmp_path / "SoulX-FlashHead-1_3B"
    shutil.copytree(TINY_DIR, root)
    shutil.copytree(FIX / "wav2vec2-tiny", tmp_path / "wav2vec2-base-960h")
    return root


def test_a_wrong_or_incomplete_folder_is_one_clear_error(tmp_path):
    root = released(tmp_path)
    assert tiny_cfg("lite", root).model.num_layers == 2  # complete: every size from its files
    shutil.rmtree(root / "VAE_LTX")
    shutil.rmtree(tmp_path / "wav2vec2-base-960h")
    with pytest.raises(ConfigError) as e:
        tiny_cfg("lite", root)
    assert "missing VAE_LTX/" in str(e.value) and "a wav2vec2 folder" in str(e.value)
    cfg = json.loads((TINY_DIR / "Model_Pro" / "config.json").read_text())
    with pytest.raises(ConfigError, match="prompt-free"):
        family_config("flashhead-pro", text_encoder="/t5")
    assert cfg["vae_stride"] == [4, 8, 8]


def test_the_command_line_says_what_is_missing_in_one_line(tmp_path, capsys):
    from cadence.cli import main

    empty = tmp_path / "SoulX-FlashHead-1_3B"
    empty.mkdir()
    (empty / "README.md").write_text("not the model")
    rc = main(["recipe", "--model", "flashhead-pro", "--weights", str(empty), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: FlashHead pro weights"), err
    assert "Model_Pro/" in err[0] and "VAE_Wan/Wan2.1_VAE.pth" in err[0]
    rc = main(["models"])
    out = capsys.readouterr().out
    assert rc == 0 and "flashhead-lite: " in out and "prompt-free" in out


@pytest.fixture
def tiny_family(monkeypatch):
    """``--model flashhead-lite`` at the tiny fixture's sizes and 64 x 64 for the command-line tools."""
    f = FAMILIES["flashhead-lite"]
    monkeypatch.setitem(
        FAMILIES, "flashhead-lite", dataclasses.replace(f, stream=dict(f.stream, height=64, width=64))
    )


def test_cli_generate_and_bench_pipeline_from_the_folder(tiny_family, tmp_path, capsys):
    av = pytest.importorskip("av")
    from cadence.cli import main

    out = tmp_path / "fh.mp4"
    words = ["--model", "flashhead-lite", "--weights", str(TINY_DIR)]
    rc = main(["generate", *words, "--chunks", "2", "--out", str(out), "--seed", "1"])
    assert rc == 0, capsys.readouterr().err
    with av.open(str(out)) as c:
        assert float(c.streams.video[0].average_rate) == 25
        assert sum(1 for _ in c.decode(video=0)) == 48  # 2 clips of 24 new frames
    rc = main(["bench", "pipeline", *words, "--chunks", "3", "--shape-change-every", "0", "--no-record"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert (
        "bench pipeline: flashhead-lite" in printed.out
        and "decoder                         ltx" in printed.out
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_ltx_decoder_checks_its_folder_and_runs_the_wan_modes_as_compile():
    from cadence.engine.ltx import LTXVAEAdapter, random_config

    cfg = tiny_cfg("lite")  # vae.weights: the fixture's VAE_LTX (8 channels, 8 x 32 x 32)
    bad = cfg.with_overrides(vae={"latent_channels": 16}, model={"in_channels": 16, "out_channels": 16})
    with pytest.raises(ConfigError, match="makes 8-channel latents at stride 8x32"):
        LTXVAEAdapter(bad, "cpu", torch.float32)
    notes: list[str] = []
    assert LTXVAEAdapter(cfg, "cpu", torch.float32).accelerate("fold", notes) == "channels_last+compile"
    assert "the LTX-Video VAE runs compile" in notes[0]
    with pytest.raises(ConfigError, match="not one"):
        random_config(cfg.with_overrides(vae={"stride": (8, 32, 16)}))
    assert random_config(family_config("flashhead-lite"))["patch_size"] == 4  # the released VAE's config


def test_the_worker_command_loop_and_the_media_clock_carry_its_clips():
    """The server path below the web side, in this process (fast): the recipe a server resolves for a CPU group
    (``--model flashhead-lite --weights DIR``), the worker's command loop (open, chunk requests, close) answering
    with each clip's 24 frames, and the session's AV buffer playing them on the 25 fps media clock beside the
    chunk's 46,080 samples (the live server is tests/test_engine_flashhead_serve.py, slow tier)."""
    import time

    import numpy as np

    from cadence.engine.messages import (
        ChunkDone,
        ChunkRequest,
        Closed,
        CloseSession,
        Opened,
        OpenSession,
        Stop,
    )
    from cadence.engine.worker import run_commands
    from cadence.media.image import default_reference_image
    from cadence.serve.pacing import AVBuffer, MediaTiming

    over = {"model": {"weights": str(TINY_DIR)}, "stream": {"height": 64, "width": 64}}
    recipe = resolve(EngineSpec("flashhead-lite", overrides=over, warmup=False), "cpu")
    done: list = []
    e = build_engine(recipe, on_chunk=lambda r: done.append((r.tag, r.frames.clone())))
    timing = MediaTiming.from_config(e.gen.cfg)
    assert (timing.fps, timing.frames_per_chunk, timing.samples_per_chunk) == (25, 24, 46080)
    audio = (0.2 * np.sin(np.arange(3 * 46080) / 48000 * 2 * np.pi * 220)).astype(np.float32)

    def messages():  # what the web side sends; it closes once the frames are back, as a live session does
        yield OpenSession("s", None, "", 1)
        for k in range(3):
            yield ChunkRequest("s", k, audio[k * 46080 : (k + 1) * 46080], 0.0)
        deadline = time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield CloseSession("s")
        yield Stop()

    msgs = messages()
    said: list = []
    try:
        run_commands(e, lambda: next(msgs), said.append, default_reference_image(64, 64))
    finally:
        e.close()
    assert isinstance(said[0], Opened) and isinstance(said[-1], Closed), said
    assert [tag[1] for tag, _ in done] == [0, 1, 2] and not [m for m in said if isinstance(m, ChunkDone)]
    buf = AVBuffer(timing, 64, 64)
    for (_, k, _), frames in done:
        buf.put_chunk(k, frames.numpy(), audio[k * 46080 : (k + 1) * 46080])
    fresh, sound = [], []
    for f in range(3 * 24):  # both tracks read in media order, as the pacers do (1920 samples a frame)
        fresh.append(buf.video_frame(f)[1])
        sound += [buf.audio_frame(n)[1] for n in range(f * 2, f * 2 + 2)]
    assert all(fresh) and all(sound) and buf.video_underruns == buf.audio_underruns == 0
