"""Media in/out: reference-image fitting, audio decoding/resampling, MP4 round trips (CPU, fast)."""

from __future__ import annotations

import struct
import wave
import zlib
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from cadence.errors import InputError
from cadence.media import image as image_mod
from cadence.media.audio import fit_audio, load_audio, synthetic_speech
from cadence.media.image import default_reference_image, load_reference_image
from cadence.media.video import Mp4Writer

SR = 48_000


def _rgb01(t: torch.Tensor) -> np.ndarray:
    """[3, H, W] in [-1, 1] -> [H, W, 3] in [0, 255]."""
    return (t.permute(1, 2, 0).numpy() + 1.0) * 127.5


def _png_header_only(path: Path, w: int, h: int) -> None:
    """A tiny PNG whose header declares w x h pixels (the data does not follow)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


# ---- image ---------------------------------------------------------------------------------------


def test_image_covers_then_center_crops(tmp_path: Path) -> None:
    # 300x100: red | green | blue thirds. A square target keeps only the green middle (crop, not pad).
    a = np.zeros((100, 300, 3), np.uint8)
    a[:, :100, 0] = 255
    a[:, 100:200, 1] = 255
    a[:, 200:, 2] = 255
    Image.fromarray(a).save(tmp_path / "wide.png")
    t = load_reference_image(tmp_path / "wide.png", 64, 64)
    assert t.shape == (3, 64, 64) and t.dtype == torch.float32
    assert t.min() >= -1.0 and t.max() <= 1.0
    px = _rgb01(t)[4:-4, 4:-4]  # away from the Lanczos ringing at the cut
    assert np.allclose(px, [0, 255, 0], atol=3)

    # Non-square target from a square image: 96x48 (H x W) of a 200x200 image keeps the centre columns.
    b = np.zeros((200, 200, 3), np.uint8)
    b[:, :50] = 255  # white left quarter is cropped away
    Image.fromarray(b).save(tmp_path / "sq.png")
    t = load_reference_image(tmp_path / "sq.png", 96, 48)
    assert t.shape == (3, 96, 48)
    assert _rgb01(t)[:, 2:-2].max() < 4


def test_image_modes_become_rgb(tmp_path: Path) -> None:
    rgba = np.zeros((40, 40, 4), np.uint8)
    rgba[..., 0] = 255  # red, but fully transparent on the left half
    rgba[:, 20:, 3] = 255
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    px = _rgb01(load_reference_image(tmp_path / "a.png", 40, 40))
    assert np.allclose(px[:, :16], 255, atol=2)  # transparent -> white background
    assert np.allclose(px[:, 24:], [255, 0, 0], atol=2)  # opaque red stays red

    Image.new("L", (30, 50), 128).save(tmp_path / "g.png")
    px = _rgb01(load_reference_image(tmp_path / "g.png", 16, 16))
    assert np.allclose(px, 128, atol=1)

    Image.fromarray(np.full((20, 20), 40000, np.uint16)).save(tmp_path / "g16.png")  # 16-bit grey
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    px = _rgb01(load_reference_image(tmp_path / "g16.png", 8, 8))
    assert np.allclose(px, 40000 / 65535 * 255, atol=1.5)

    Image.new("RGB", (20, 20), (10, 200, 30)).convert("P").save(tmp_path / "p.png")
    px = _rgb01(load_reference_image(tmp_path / "p.png", 8, 8))
    assert np.allclose(px, [10, 200, 30], atol=8)

    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=95)  # red in CMYK
    px = _rgb01(load_reference_image(tmp_path / "c.jpg", 8, 8))
    assert px[..., 0].mean() > 200 and px[..., 1:].mean() < 60


def test_image_exif_orientation(tmp_path: Path) -> None:
    # Stored 60 wide x 30 tall, left half red, right half blue; EXIF 6 = "rotate 90 CW to display":
    # displayed 30 wide x 60 tall with red on top.
    a = np.zeros((30, 60, 3), np.uint8)
    a[:, :30, 0] = 255
    a[:, 30:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(a).save(tmp_path / "rot.jpg", exif=exif, quality=95)
    px = _rgb01(load_reference_image(tmp_path / "rot.jpg", 60, 30))
    top, bottom = px[:24].mean(axis=(0, 1)), px[36:].mean(axis=(0, 1))
    assert top[0] > 200 and top[2] < 60, top
    assert bottom[2] > 200 and bottom[0] < 60, bottom


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "not found"),
        ("text", "not an image"),
        ("empty", "empty"),
        ("dir", "not a file"),
        ("truncated", "could not decode"),
        ("zero", "not an image"),
        ("bomb_81mp", "too large"),
        ("bomb_400mp", "too large"),
    ],
)
def test_image_errors(tmp_path: Path, case: str, match: str) -> None:
    p = tmp_path / "x.png"
    if case == "text":
        p.write_text("this is not a picture\n")
    elif case == "empty":
        p.write_bytes(b"")
    elif case == "dir":
        p.mkdir()
    elif case == "truncated":
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(p)
        p.write_bytes(p.read_bytes()[:200])
    elif case == "zero":
        _png_header_only(p, 0, 10)
    elif case == "bomb_81mp":
        _png_header_only(p, 9000, 9000)  # over our 64 MP limit, under Pillow's own bomb guard
    elif case == "bomb_400mp":
        _png_header_only(p, 20000, 20000)  # Pillow's DecompressionBombError
    with pytest.raises(InputError, match=match) as ei:
        load_reference_image(p, 32, 32)
    assert "\n" not in str(ei.value)


def test_image_limit_is_checked_before_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Image.new("RGB", (100, 100)).save(tmp_path / "ok.png")
    monkeypatch.setattr(image_mod, "MAX_PIXELS", 9_999)
    with pytest.raises(InputError, match="too large"):
        load_reference_image(tmp_path / "ok.png", 32, 32)


def test_default_reference_image() -> None:
    t = default_reference_image(128, 96)
    assert t.shape == (3, 128, 96) and t.dtype == torch.float32
    assert t.min() >= -1.0 and t.max() <= 1.0 and t.std() > 0.2
    assert torch.equal(t, default_reference_image(128, 96))  # deterministic


# ---- audio ---------------------------------------------------------------------------------------


def _write_audio(
    path: Path,
    x: np.ndarray,
    rate: int,
    codec: str,
    fmt: str,
    sample_fmt: str,
    layout: str,
    frame_size: int = 1024,
) -> None:
    """Encode x [channels, samples] (float in [-1, 1]) with PyAV."""
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = layout
        s.format = sample_fmt
        packed = not sample_fmt.endswith("p")
        n = x.shape[1]
        for i in range(0, n, frame_size):
            blk = x[:, i : i + frame_size]
            if sample_fmt.startswith("s16"):
                blk = (blk * 32767).round().astype(np.int16)
            else:
                blk = blk.astype(np.float32)
            arr = blk.T.reshape(1, -1) if packed else blk
            f = av.AudioFrame.from_ndarray(np.ascontiguousarray(arr), format=sample_fmt, layout=layout)
            f.sample_rate, f.pts, f.time_base = rate, i, Fraction(1, rate)
            c.mux(s.encode(f))
        c.mux(s.encode(None))


def _tone(freq: float, seconds: float, rate: int, channels: int = 1, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return np.repeat((amp * np.sin(2 * np.pi * freq * t))[None], channels, axis=0)


def _peak_hz(x: torch.Tensor, rate: int = SR) -> float:
    spec = np.abs(np.fft.rfft(x.numpy() * np.hanning(x.shape[0])))
    return float(np.argmax(spec) * rate / x.shape[0])


def _has_encoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
        return True
    except Exception:
        return False


_CASES = [
    ("wav16k_stereo_s16.wav", 16_000, "pcm_s16le", "wav", "s16", "stereo"),
    ("wav44k_mono_flt.wav", 44_100, "pcm_f32le", "wav", "flt", "mono"),
    ("flac22k.flac", 22_050, "flac", "flac", "s16", "mono"),
    ("mp3_44k.mp3", 44_100, "libmp3lame", "mp3", "fltp", "stereo"),
    ("aac_48k.m4a", 48_000, "aac", "ipod", "fltp", "stereo"),
]


@pytest.mark.parametrize("name, rate, codec, fmt, sample_fmt, layout", _CASES, ids=[c[0] for c in _CASES])
def test_load_audio_resamples_and_keeps_pitch(
    tmp_path: Path, name: str, rate: int, codec: str, fmt: str, sample_fmt: str, layout: str
) -> None:
    if not _has_encoder(codec):
        pytest.skip(f"{codec} encoder not in this FFmpeg build")
    secs = 1.5
    x = _tone(440.0, secs, rate, channels=2 if layout == "stereo" else 1)
    fs = 1152 if codec == "libmp3lame" else (4608 if codec == "flac" else 1024)
    _write_audio(tmp_path / name, x, rate, codec, fmt, sample_fmt, layout, frame_size=fs)
    y = load_audio(tmp_path / name)
    assert y.dtype == torch.float32 and y.dim() == 1
    assert abs(y.shape[0] - secs * SR) <= 0.01 * secs * SR, y.shape
    assert abs(_peak_hz(y) - 440.0) < 2.0
    assert 0.3 < float(y.abs().max()) <= 1.0  # stereo down-mix keeps the level, nothing clipped away


def test_load_audio_other_rate_and_max_samples(tmp_path: Path) -> None:
    _write_audio(tmp_path / "a.wav", _tone(1000.0, 1.0, 48_000), 48_000, "pcm_s16le", "wav", "s16", "mono")
    y = load_audio(tmp_path / "a.wav", sample_rate=16_000)
    assert abs(y.shape[0] - 16_000) <= 160 and abs(_peak_hz(y, 16_000) - 1000.0) < 2.0
    head = load_audio(tmp_path / "a.wav", max_samples=12_345)
    assert head.shape == (12_345,)
    assert torch.allclose(head, load_audio(tmp_path / "a.wav")[:12_345])
    assert torch.equal(load_audio(tmp_path / "a.wav", max_samples=10**9), load_audio(tmp_path / "a.wav"))


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "not found"),
        ("text", "could not decode"),
        ("image", "no audio stream"),
        ("empty", "empty"),
        ("no_samples", "no samples"),
    ],
)
def test_load_audio_errors(tmp_path: Path, case: str, match: str) -> None:
    p = tmp_path / "x.wav"
    if case == "text":
        p.write_text("hello, I am not audio\n" * 20)
    elif case == "image":
        p = tmp_path / "x.png"
        Image.new("RGB", (16, 16), (1, 2, 3)).save(p)
    elif case == "empty":
        p.write_bytes(b"")
    elif case == "no_samples":
        with wave.open(str(p), "wb") as w:  # a valid WAV header with zero frames
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16_000)
            w.writeframes(b"")
    with pytest.raises(InputError, match=match) as ei:
        load_audio(p)
    assert "\n" not in str(ei.value)


def test_fit_audio() -> None:
    a = torch.arange(1, 11, dtype=torch.float32)
    assert torch.equal(fit_audio(a, 4), a[:4])
    padded = fit_audio(a, 15)
    assert padded.shape == (15,) and torch.equal(padded[:10], a) and not padded[10:].any()
    assert fit_audio(a, 0).shape == (0,)
    with pytest.raises(ValueError):
        fit_audio(a, -1)


def test_synthetic_speech() -> None:
    s = synthetic_speech(2.0, SR)
    assert s.shape == (2 * SR,) and s.dtype == torch.float32
    assert 0.4 < float(s.abs().max()) <= 0.5
    rms = s.reshape(-1, SR // 50).pow(2).mean(dim=1).sqrt()  # 20 ms windows
    assert (rms > 0.05).sum() > 20 and (rms < 1e-4).sum() > 5  # syllables and pauses
    assert torch.equal(s, synthetic_speech(2.0, SR))


def test_synthetic_speech_finite_for_every_seed() -> None:
    # regression: the syllable envelope sin(pi * x) ** 0.6 went NaN where sin rounds below zero
    # (17 of seeds 0-19 at 10 s produced NaN audio and peaks of ~3)
    for seed in range(12):
        s = synthetic_speech(10.0, SR, seed=seed)
        assert torch.isfinite(s).all(), seed
        assert abs(float(s.abs().max()) - 0.5) < 1e-6, seed


# ---- mp4 -----------------------------------------------------------------------------------------


def _probe(path: Path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        info = {
            "vcodec": v.codec_context.name,
            "rate": v.average_rate,
            "w": v.width,
            "h": v.height,
            "acodec": a.codec_context.name,
            "arate": a.rate,
        }
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(v)]
    with av.open(str(path)) as c:
        rs = av.AudioResampler(format="flt", layout="mono", rate=SR)
        pcm = [o.to_ndarray().reshape(-1) for f in c.decode(audio=0) for o in rs.resample(f)]
        pcm += [o.to_ndarray().reshape(-1) for o in rs.resample(None)]
    info["frames"] = np.stack(frames)
    info["audio"] = np.concatenate(pcm)
    return info


def test_mp4_round_trip(tmp_path: Path) -> None:
    fps, tpc, spc, chunks = 24, 4, 8000, 6
    speech = synthetic_speech(chunks * spc / SR, SR)
    colours = [(200, 30, 40), (20, 180, 60), (30, 60, 220)]
    out = tmp_path / "o.mp4"
    with Mp4Writer(out, 64, 48, fps=fps) as w:
        for i in range(chunks):  # interleaved, as the CLI writes it: a chunk's frames, then its audio
            frames = np.empty((tpc, 48, 64, 3), np.uint8)
            frames[:] = colours[i % 3]
            w.write_frames(torch.from_numpy(frames) if i % 2 else frames)
            w.write_audio(speech[i * spc : (i + 1) * spc])
    assert w.frames_written == chunks * tpc and w.samples_written == chunks * spc

    info = _probe(out)
    assert info["vcodec"] in ("h264", "mpeg4") and info["acodec"] == "aac"
    assert (info["w"], info["h"]) == (64, 48) and info["rate"] == fps and info["arate"] == SR
    assert info["frames"].shape[0] == chunks * tpc
    video_s, audio_s = chunks * tpc / fps, info["audio"].shape[0] / SR
    assert abs(video_s - audio_s) < tpc / fps  # within one chunk (166.7 ms)
    for i in range(chunks):  # colours survive rgb -> yuv420p -> rgb, in order
        assert np.abs(info["frames"][i * tpc + 1].astype(float).mean(axis=(0, 1)) - colours[i % 3]).max() < 12
    got = info["audio"][: speech.shape[0]]
    assert np.sqrt(np.mean(got**2)) > 0.05  # not silent
    corr = np.corrcoef(got, speech.numpy())[0, 1]
    assert corr > 0.9, corr  # and aligned with what went in (no offset)


def test_mp4_writer_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even"):
        Mp4Writer(tmp_path / "o.mp4", 63, 48)
    with pytest.raises(InputError, match="cannot write"):
        Mp4Writer(tmp_path / "missing_dir" / "o.mp4", 64, 48)
    (tmp_path / "a_dir.mp4").mkdir()
    with pytest.raises(InputError, match="cannot write"):
        Mp4Writer(tmp_path / "a_dir.mp4", 64, 48)
    with Mp4Writer(tmp_path / "o.mp4", 64, 48) as w:
        with pytest.raises(ValueError, match="frames must be"):
            w.write_frames(np.zeros((2, 32, 64, 3), np.uint8))
        with pytest.raises(ValueError, match="uint8"):
            w.write_frames(np.zeros((2, 48, 64, 3), np.float32))
        with pytest.raises(ValueError, match="mono"):
            w.write_audio(np.zeros((2, 100), np.float32))
        w.write_frames(np.zeros((1, 48, 64, 3), np.uint8))
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.write_frames(np.zeros((1, 48, 64, 3), np.uint8))


def test_mp4_falls_back_to_mpeg4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = av.codec.Codec

    def no_x264(name: str, mode: str = "r"):
        if name == "libx264":
            raise ValueError(f"unknown codec {name}")
        return real(name, mode)

    monkeypatch.setattr(av.codec, "Codec", no_x264)
    with caplog.at_level("WARNING", logger="cadence.media.video"):
        with Mp4Writer(tmp_path / "o.mp4", 32, 32) as w:
            w.write_frames(np.full((8, 32, 32, 3), 128, np.uint8))
            w.write_audio(synthetic_speech(8 / 24, SR))
    assert w.video_codec == "mpeg4"
    assert sum("libx264" in r.getMessage() for r in caplog.records) == 1
    info = _probe(tmp_path / "o.mp4")
    assert info["vcodec"] == "mpeg4" and info["frames"].shape[0] == 8


def test_cover_crop_of_any_size_stays_inside_the_image() -> None:
    """Issue 30 (found by bench soak's random uploads): a 241x196 image onto 128x128 computed a crop box a
    rounding error outside the image, which Pillow refuses ("box offset can't be negative"): a 500 for an
    upload. Every size from 1 to 700 on each side now fits, onto the square and the W1.3 geometry."""
    from cadence.media.image import _cover_crop

    sizes = [(241, 196), (196, 241), (1, 1), (1, 700), (700, 1)] + [
        (w, h) for w in range(40, 700, 37) for h in range(33, 700, 41)
    ]
    for w, h in sizes:
        img = Image.new("RGB", (w, h), (10, 20, 30))
        for tw, th in ((128, 128), (832, 480)):
            assert _cover_crop(img, tw, th).size == (tw, th), (w, h, tw, th)
