"""The ``cadence`` CLI: wiring with a fake generator, one-line errors, bench dispatch, a real process."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from cadence.cli import main
from cadence.config import get_preset
from cadence.errors import InputError

REPO = Path(__file__).resolve().parents[1]
TINY = get_preset("tiny")


@dataclass
class _Chunk:
    index: int
    latents: torch.Tensor
    frames: torch.Tensor
    audio: torch.Tensor


class _FakeEngine:
    """Stands in for cadence.engine.engine.Engine: random uint8 frames of the right shape."""

    def __init__(self, cfg, calls: dict, fail_at: int | None = None) -> None:
        self.cfg, self.calls, self.fail_at = cfg, calls, fail_at

    def stream(self, image, prompt, audio, num_chunks, seed=0):
        self.calls["stream"] = dict(image=image, prompt=prompt, audio=audio, num_chunks=num_chunks, seed=seed)
        g = torch.Generator().manual_seed(seed)
        c, t, s = self.cfg, self.cfg.video_frames_per_chunk, self.cfg.audio_samples_per_chunk
        for i in range(num_chunks):
            if i == self.fail_at:
                raise InputError("fake engine failure at chunk 1")
            shape = (t, c.stream.height, c.stream.width, 3)
            frames = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
            yield _Chunk(i, torch.zeros(1), frames, audio[i * s : (i + 1) * s])

    def close(self) -> None:
        self.calls["closed"] = True


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Install a fake ``cadence.engine.build`` module; returns the dict its calls are recorded in."""
    calls: dict = {"builds": 0}

    def build_engine(recipe, device=None, **kw):  # generate builds its recipe (cadence.engine.recipe)
        calls["builds"] += 1
        cfg = recipe.config
        calls["build"] = dict(
            cfg=cfg, device=device, dtype=getattr(torch, recipe.fast.dtype), seed=recipe.seed
        )
        return _FakeEngine(cfg, calls, calls.get("fail_at"))

    mod = types.ModuleType("cadence.engine.build")
    mod.build_engine = build_engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cadence.engine.build", mod)
    return calls


def _count_video_frames(path: Path) -> tuple[int, float, int]:
    """(video frames, fps, decoded audio samples at 48 kHz mono) of an MP4."""
    with av.open(str(path)) as c:
        fps = float(c.streams.video[0].average_rate)
        n = sum(1 for _ in c.decode(video=0))
    with av.open(str(path)) as c:
        samples = sum(f.samples for f in c.decode(audio=0))
    return n, fps, samples


def _tone_wav(path: Path, seconds: float, rate: int = 16_000) -> None:
    import wave

    x = (0.4 * np.sin(2 * np.pi * 300 * np.arange(int(seconds * rate)) / rate) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(x.tobytes())


# ---- happy path with the fake engine ------------------------------------------------------------


def test_generate_with_fake_engine(tmp_path: Path, fake_engine: dict, capsys: pytest.CaptureFixture) -> None:
    img = tmp_path / "face.jpg"
    Image.new("RGB", (300, 200), (200, 150, 120)).save(img)
    wav = tmp_path / "speech.wav"
    _tone_wav(wav, 1.0)
    out = tmp_path / "out.mp4"
    rc = main(
        [
            "generate",
            "--preset",
            "tiny",
            "--image",
            str(img),
            "--audio",
            str(wav),
            "--chunks",
            "3",
            "--out",
            str(out),
            "--prompt",
            "hello",
            "--seed",
            "7",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    s = TINY.audio_samples_per_chunk
    b, st = fake_engine["build"], fake_engine["stream"]
    assert b["cfg"].name == "tiny" and b["device"] == "cpu" and b["dtype"] == torch.float32 and b["seed"] == 7
    assert st["image"].shape == (3, TINY.stream.height, TINY.stream.width)
    assert st["image"].dtype == torch.float32
    assert st["audio"].shape == (3 * s,) and st["audio"].dtype == torch.float32  # truncated: 1 s > 3 chunks
    assert st["prompt"] == "hello" and st["num_chunks"] == 3 and st["seed"] == 7
    frames, fps, samples = _count_video_frames(out)
    assert frames == 3 * TINY.video_frames_per_chunk and fps == TINY.stream.fps
    assert abs(samples - 3 * s) < s
    assert not list(tmp_path.glob("*.partial"))
    summary = captured.out.strip().splitlines()
    assert len(summary) == 1 and str(out) in summary[0] and "chunks/s" in summary[0]


def test_generate_defaults_cover_synthetic_audio(
    tmp_path: Path, fake_engine: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["generate"]) == 0  # built-in face, 2 s of synthetic speech, out.mp4 in the cwd
    st = fake_engine["stream"]
    chunks = math.ceil(2 * 48_000 / TINY.audio_samples_per_chunk)
    assert st["num_chunks"] == chunks and st["audio"].shape == (chunks * TINY.audio_samples_per_chunk,)
    assert _count_video_frames(tmp_path / "out.mp4")[0] == chunks * TINY.video_frames_per_chunk


def test_generate_speaks_through_the_whole_clip_it_was_asked_for(tmp_path: Path, fake_engine: dict) -> None:
    """Issue 30: ``cadence generate --chunks 24`` (the README's command) gave a 4-s clip whose second half was
    silent (2 s of built-in speech). The built-in speech now lasts as long as the clip."""
    out = tmp_path / "o.mp4"
    assert main(["generate", "--chunks", "24", "--out", str(out)]) == 0
    audio, spc = fake_engine["stream"]["audio"], TINY.audio_samples_per_chunk
    assert audio.shape == (24 * spc,)
    # speech (voiced syllables with short pauses) in every second of the clip, its last one included
    per_second = audio.reshape(-1, 48_000).abs().amax(dim=1)
    assert (per_second > 0.2).all(), per_second
    with av.open(str(out)) as c:  # and in the file, after AAC
        pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    assert np.abs(pcm[-48_000:]).max() > 0.1


def test_generate_default_chunks_round_up(tmp_path: Path, fake_engine: dict) -> None:
    wav = tmp_path / "a.wav"
    _tone_wav(wav, 0.9)  # 43,200 samples at 48 kHz -> 5.4 chunks -> 6, zero-padded
    assert main(["generate", "--audio", str(wav), "--out", str(tmp_path / "o.mp4")]) == 0
    audio = fake_engine["stream"]["audio"]
    assert fake_engine["stream"]["num_chunks"] == 6 and audio.shape == (6 * TINY.audio_samples_per_chunk,)
    assert audio[43_300:].abs().max() == 0 and audio[:43_000].abs().max() > 0.3


def test_engine_error_is_one_line_and_leaves_no_file(
    tmp_path: Path, fake_engine: dict, capsys: pytest.CaptureFixture
) -> None:
    fake_engine["fail_at"] = 1
    out = tmp_path / "o.mp4"
    assert main(["generate", "--chunks", "3", "--out", str(out)]) == 2
    err_lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert err_lines == ["error: fake engine failure at chunk 1"]
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    assert fake_engine["closed"]  # the engine's threads and buffers are released on failure too


# ---- errors ------------------------------------------------------------------------------------


def _bad_args(case: str, tmp: Path) -> list[str]:
    text = tmp / "notes.png"
    text.write_text("just text\n")
    png = tmp / "pic.png"
    Image.new("RGB", (8, 8)).save(png)
    out = ["--out", str(tmp / "o.mp4")]
    return {
        "missing_image": ["--image", str(tmp / "nope.png"), *out],
        "image_is_text": ["--image", str(text), *out],
        "missing_audio": ["--audio", str(tmp / "nope.wav"), *out],
        "audio_is_image": ["--audio", str(png), *out],
        "chunks_zero": ["--chunks", "0", *out],
        "chunks_negative": ["--chunks", "-1", *out],
        "unknown_preset": ["--preset", "w999", *out],
        "out_dir_missing": ["--out", str(tmp / "no" / "such" / "dir" / "o.mp4")],
        "out_is_dir": ["--out", str(tmp)],
        "bad_device": ["--device", "tpu", *out],
        "cuda_missing": ["--device", "cuda", *out],
        "missing_weights": ["--weights", str(tmp / "nope.safetensors"), *out],
        "weights_dir_without_checkpoint": ["--weights", str(tmp), *out],
        "vae_weights_not_a_folder": ["--vae-weights", str(png), *out],
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "missing_image",
        "image_is_text",
        "missing_audio",
        "audio_is_image",
        "chunks_zero",
        "chunks_negative",
        "unknown_preset",
        "out_dir_missing",
        "out_is_dir",
        "bad_device",
        "cuda_missing",
        "missing_weights",
        "weights_dir_without_checkpoint",
        "vae_weights_not_a_folder",
    ],
)
def test_generate_errors_are_one_line(
    case: str, tmp_path: Path, fake_engine: dict, capsys: pytest.CaptureFixture
) -> None:
    if case == "cuda_missing" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc = main(["generate", *_bad_args(case, tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert fake_engine["builds"] == 0  # inputs are checked before any model is built


def test_generate_loads_the_checkpoint_it_is_given(tmp_path: Path, fake_engine: dict) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model-00001.safetensors").write_bytes(b"")  # a folder of shards is taken as is
    assert (
        main(
            [
                "generate",
                "--chunks",
                "1",
                "--weights",
                str(ckpt),
                "--vae-weights",
                str(tmp_path),
                "--out",
                str(tmp_path / "o.mp4"),
            ]
        )
        == 0
    )
    cfg = fake_engine["build"]["cfg"]
    assert cfg.model.weights == str(ckpt.resolve()) and cfg.vae.weights == str(tmp_path.resolve())


@pytest.mark.parametrize("flag", ["--weights", "--vae-weights"])
def test_serve_refuses_missing_weights_before_starting(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["serve", "--port", "0", flag, str(tmp_path / "nope")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope" in lines[0], lines


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--chunks", "many"],
        ["generate", "--dtype", "int3"],
        ["generate", "--bogus"],
        [],
        ["frobnicate"],
    ],
)
def test_usage_errors_are_one_line(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_help_exits_zero(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--help"]) == 0
    assert "--chunks" in capsys.readouterr().out


# ---- bench dispatch ----------------------------------------------------------------------------


def test_bench_dispatches_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    mod = types.ModuleType("cadence.bench.step")
    mod.main = lambda args: seen.append(args) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cadence.bench.step", mod)
    assert main(["bench", "step", "--preset", "w57", "--iters", "3", "--help"]) == 0
    assert seen == [["--preset", "w57", "--iters", "3", "--help"]]


def test_unknown_bench_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "no_such_bench_xyz"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown benchmark 'no_such_bench_xyz'")


# ---- a real process ----------------------------------------------------------------------------


def test_real_process_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "face.png"
    bad.write_text("not an image")
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence",
            "generate",
            "--image",
            str(bad),
            "--chunks",
            "2",
            "--out",
            str(tmp_path / "o.mp4"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"error: not an image (unrecognised format): {bad}"]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert "cadence.bench" not in r.stderr


# ---- end to end with the real engine (once it exists) ------------------------------------------


def test_generate_tiny_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("cadence.engine.session")
    out = tmp_path / "tiny.mp4"
    rc = main(["generate", "--preset", "tiny", "--chunks", "3", "--out", str(out), "--seed", "1"])
    assert rc == 0, capsys.readouterr().err
    frames, fps, samples = _count_video_frames(out)
    assert frames == 3 * TINY.video_frames_per_chunk and fps == TINY.stream.fps
    assert samples > 0
    with av.open(str(out)) as c:
        pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    assert np.sqrt(np.mean(pcm**2)) > 0.01  # the synthetic speech made it into the file
