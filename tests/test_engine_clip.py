"""The engine's clip stream (``cadence.engine.flashtalk.ClipSession``: SoulX-FlashTalk) against the family's offline
reference path (``cadence.model.flashtalk.generate_offline``, itself tested against FlashTalk's own
``generate_video`` in tests/test_flashtalk_encoders.py), at a tiny random configuration (the flashtalk fixture's
model sizes, a 4-wide random Wan VAE, random CLIP vision and wav2vec2), float32 on the CPU.

The engine runs the audio one video frame behind its clock (``AUDIO_LAG``: the live resampler's look-ahead), so
its stream is compared with ``generate_offline`` on the same audio with 40 ms of silence in front. Measured:
every clip's denoised latent bit-identical (relative error 0.0; bound 1e-5) and the uint8 frames equal to the
reference's float frames rounded (0 of 258,048 values differ; bound: at most 1 level, on < 0.1% of values).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from family_fixtures import rel
from test_families_flashtalk import HW, TINY

pytest.importorskip("soxr")
pytest.importorskip("transformers")

import cadence.model.flashtalk as ft  # noqa: E402
from cadence.engine.build import build_engine  # noqa: E402
from cadence.engine.flashtalk import AUDIO_LAG, ClipSession  # noqa: E402
from cadence.engine.recipe import session_rules  # noqa: E402
from cadence.engine.session import Session, StreamSession, session_type  # noqa: E402
from cadence.engine.spec import FastPath  # noqa: E402
from cadence.errors import ConfigError  # noqa: E402
from cadence.model.encoders import locate  # noqa: E402
from cadence.model.families import FAMILIES, family_config  # noqa: E402

TINY_VAE = {"base_dim": 4}
SIZE = (HW["height"], HW["width"])
N = 3


def tiny_cfg():
    return family_config("flashtalk", model=TINY, stream=HW, vae=TINY_VAE)


@pytest.fixture(scope="module")
def eng():
    e = build_engine(tiny_cfg(), "cpu", FastPath(), seed=3)
    yield e
    e.close()


@pytest.fixture(scope="module")
def inputs(eng):
    g = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (*SIZE, 3), generator=g, dtype=torch.uint8).numpy()
    t = torch.arange(N * eng.samples_per_chunk) / 48000
    voice = 0.3 * torch.sin(2 * torch.pi * 180 * t) * (1 + torch.sin(2 * torch.pi * 3 * t))
    audio = voice + 0.05 * torch.randn(t.shape, generator=g)
    return image, audio


def run_engine(eng, image, audio, seed=5, prompts=None):
    ref = ft.reference_image(image, SIZE)[:, 0]  # the engine's [3, H, W] image, as FlashTalk prepares it
    return [
        (r.frames.clone(), r.latents.clone(), r.audio.clone(), r.timings.step)
        for r in eng.stream(ref, "a person talking", audio, N, seed=seed, prompts=prompts)
    ]


def run_offline(eng, image, audio, seed=5, lag=AUDIO_LAG):
    gen, latents, real = eng.gen, [], ft.sample_clip

    def sample_clip(*a, **k):
        latents.append(real(*a, **k))
        return latents[-1]

    emb = gen.text_encoder("a person talking")
    text = torch.zeros(1, TINY["text_len"], TINY["text_dim"])
    text[0, : emb.shape[0]] = emb
    ft.sample_clip = sample_clip
    try:
        frames = ft.generate_offline(
            gen.model, gen.vae.wan, gen.image_encoder, ft.FlashTalkAudio(gen.audio), image,
            torch.cat([torch.zeros(lag), audio]), text, SIZE, seed,
        )  # fmt: skip
    finally:
        ft.sample_clip = real
    return frames, latents


def test_engine_clip_stream_equals_the_offline_reference(eng, inputs):
    image, audio = inputs
    got = run_engine(eng, image, audio)
    frames, latents = run_offline(eng, image, audio)
    assert len(got) == len(frames) == N
    spc = eng.samples_per_chunk
    assert spc == 53760 and eng.frame_shape == (28, *SIZE, 3)
    for k, (f, lat, a, step) in enumerate(got):
        assert f.shape == (28, *SIZE, 3) and f.dtype == torch.uint8 and step == "clip"
        err = rel(lat, latents[k])
        assert err <= 1e-5, (k, err)
        diff = (f.float() - frames[k].round()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3, (k, diff.max(), (diff > 0).sum())
        assert torch.equal(a, audio[k * spc : (k + 1) * spc])  # the chunk's audio goes out with its frames
    assert eng.last_run.graphs["captures"] == 0
    # the clip session is driven through the same interface as the K/V session
    assert isinstance(eng.session, ClipSession) and isinstance(eng.session, StreamSession)


def test_the_parity_check_can_fail(eng, inputs):
    """The comparison above is sensitive: the offline path without the engine's audio lag, another seed, or
    other audio all give latents far from the engine's."""
    image, audio = inputs
    got = run_engine(eng, image, audio)
    _, unlagged = run_offline(eng, image, audio, lag=0)
    assert rel(got[-1][1], unlagged[-1]) > 1e-3
    other_seed = run_engine(eng, image, audio, seed=6)
    assert rel(other_seed[0][1], got[0][1]) > 1e-2
    quiet = run_engine(eng, image, audio * 0.1 + 0.02 * torch.randn(audio.shape))
    assert rel(quiet[1][1], got[1][1]) > 1e-4


def test_reused_session_and_a_prompt_change(eng, inputs):
    image, audio = inputs
    a = run_engine(eng, image, audio)
    b = run_engine(eng, image, audio)  # the kept session reset in place, the reference's encodings remembered
    assert eng.last_run.session == "reused"
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    c = run_engine(eng, image, audio, prompts={1: "someone singing loudly"})
    assert torch.equal(c[0][0], a[0][0]) and rel(c[1][1], a[1][1]) > 1e-4


def test_fast_paths_that_do_not_apply_fall_back_with_a_note():
    cfg = tiny_cfg()
    assert session_type(session_rules(cfg)) is ClipSession
    assert session_type(session_rules(family_config("self-forcing"))) is Session
    e = build_engine(cfg, "cpu", FastPath(decoder="taehv", decoder_fast="cl"), seed=3)
    try:
        assert e.applied["decoder"] == "wan" and e.applied["graphs"] is False
        assert any("flashtalk" in n and "decoder taehv" in n for n in e.notes), e.notes
        warm = e.warm_up(chunks=2)
        assert warm.chunks == 2 and warm.graphs["captures"] == 0
    finally:
        e.close()


def test_encoder_files_beside_the_weights(tmp_path):
    """The family's front ends say where their files are (``Beside``): all are looked up before any is built."""
    fam = FAMILIES["flashtalk"]
    front = (fam.image_encoder, fam.audio_encoder)
    ckpt = tmp_path / "SoulX-FlashTalk-14B"
    ckpt.mkdir()
    (ckpt / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="CLIP vision encoder.*and the wav2vec2 folder"):
        locate(ckpt, front, "flashtalk")
    clip = ckpt / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    clip.write_bytes(b"")
    w2v = tmp_path / "chinese-wav2vec2-base"
    w2v.mkdir()
    with pytest.raises(ConfigError, match="wav2vec2 folder"):
        locate(ckpt, front, "flashtalk")
    (w2v / "config.json").write_text("{}")
    assert locate(ckpt, front) == [clip, w2v]
    assert locate(ckpt / "diffusion_pytorch_model.safetensors", front) == [clip, w2v]
    # the fixture's folder holds the transformer only: one clear error before any stream
    folder = Path(__file__).parent / "fixtures" / "flashtalk" / "flashtalk_tiny"
    cfg = family_config("flashtalk", weights=str(folder), model=TINY, stream=HW, vae=TINY_VAE)
    with pytest.raises(ConfigError, match="flashtalk weights.*not found"):
        build_engine(cfg, "cpu", FastPath(), seed=3)


@pytest.fixture
def tiny_family(monkeypatch):
    """``--model flashtalk`` at the tiny configuration for the command-line tools (in this process)."""
    f = FAMILIES["flashtalk"]
    tiny = dataclasses.replace(
        f, model=dict(f.model, **TINY), stream=dict(f.stream, **HW), vae=dict(f.vae, **TINY_VAE)
    )
    monkeypatch.setitem(FAMILIES, "flashtalk", tiny)


def test_cli_generate_and_bench_pipeline(tiny_family, tmp_path, capsys):
    av = pytest.importorskip("av")
    from cadence.cli import main

    out = tmp_path / "ft.mp4"
    words = ["--chunks", "2", "--out", str(out), "--seed", "1", "--random-weights"]  # (a family: asked for)
    rc = main(["generate", "--model", "flashtalk", *words])
    assert rc == 0, capsys.readouterr().err
    with av.open(str(out)) as c:
        assert float(c.streams.video[0].average_rate) == 25
        assert sum(1 for _ in c.decode(video=0)) == 56  # 2 clips of 28 new frames
    with av.open(str(out)) as c:
        assert sum(f.samples for f in c.decode(audio=0)) > 48000
    assert "(flashtalk, 32x32, 2 chunks)" in capsys.readouterr().out
    rc = main(["bench", "pipeline", "--model", "flashtalk", "--chunks", "3", "--no-record"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "bench pipeline: flashtalk" in printed.out and "decoder                         wan" in printed.out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_cut_in_clip_starts_from_the_frames_sent_before_it(eng, inputs):
    """FlashTalk's cut-in (``ClipCutIn.rewind``; FlashHead's in tests/test_cut_in_engine.py): the next clip ``r``
    frames before the last one's end (frame k) has the re-encode of the 5 frames sent before k as its motion
    latents, its audio window is the lagged stream resampled up to k, exactly, and the frames before k stay."""
    from cadence.model.wav2vec2 import Resampler

    img, audio = inputs
    new, motion, spf = eng.gen.cfg.video_frames_per_chunk, eng.gen.rules.stream.motion_frames, 1920
    assert eng.cut_in() == (2 * new - motion, motion)
    s = eng.gen.session(ft.reference_image(img, SIZE)[:, 0], "a person talking", 5)
    sent = torch.cat([s.step(audio[: new * spf]), s.step(audio[new * spf : 2 * new * spf])])
    r = 7
    k = 2 * new - r
    s.rewind(r)
    vae = eng.gen.vae.wan
    before = sent[k - motion : k].permute(3, 0, 1, 2).float() / 127.5 - 1.0
    assert torch.equal(s.motion, vae.normalize_latents(vae.encode(before.to(vae.param_dtype())).float()))
    whole = Resampler(48000, 16000).push(torch.cat([torch.zeros(AUDIO_LAG), audio[: k * spf]]))
    assert torch.equal(s.audio.window[-k * 640 :], whole[: k * 640].double())
    assert torch.equal(s.audio.pending, whole[k * 640 :])
    out = s.step(audio[2 * new * spf : 3 * new * spf])
    assert out.shape[0] == new and s.heard.made == k + new and s.cut_ins == 1
    kept, first = s.heard.frames, k + new - s.heard.frames.shape[0]
    assert torch.equal(kept[: k - first], sent[first:k]) and torch.equal(kept[k - first :], out)
