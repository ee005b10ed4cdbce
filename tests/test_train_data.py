"""The synthetic talking-face clip generator (cadence.train.data, issue 7 item 1)."""

import numpy as np
import pytest

from cadence.train.data import (
    HUE_RANGES,
    TEST_SEED_BASE,
    face_params,
    held_out_split,
    make_clip,
    mouth_open_from_audio,
)


@pytest.fixture(scope="module")
def clip():
    return make_clip(3, 8.0)


def test_shapes_and_ranges(clip):
    assert clip.frames.shape == (192, 128, 128, 3) and clip.frames.dtype == np.uint8
    assert clip.audio.shape == (192 * 2000,) and clip.audio.dtype == np.float32
    assert np.isfinite(clip.audio).all() and np.abs(clip.audio).max() <= 1.0
    assert clip.mouth_open.shape == (192,) and clip.mouth_open.dtype == np.float32
    assert clip.mouth_open.min() == 0.0 and clip.mouth_open.max() == 1.0  # pauses close it, speech opens it
    assert np.array_equal(clip.reference, clip.frames[0])
    x0, y0, x1, y1 = clip.face_box
    assert 0 <= x0 < x1 <= 128 and 0 <= y0 < y1 <= 128 and 50 < x1 - x0 < 90


def test_other_sizes_and_rates():
    c = make_clip(1, 0.5, height=96, width=160, fps=25, sample_rate=16000)
    assert c.frames.shape == (12, 96, 160, 3) and c.audio.shape == (12 * 640,)
    with pytest.raises(ValueError):
        make_clip(1, 0.5, fps=7)  # 48000 / 7 is not a whole number of samples
    with pytest.raises(ValueError):
        make_clip(1, 0.5, speech="whisper")


def test_deterministic():
    a, b, c = make_clip(11, 1.0), make_clip(11, 1.0), make_clip(12, 1.0)
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)
    assert np.array_equal(a.mouth_open, b.mouth_open) and a.face_box == b.face_box
    assert not np.array_equal(a.frames[0], c.frames[0]) and not np.array_equal(a.audio, c.audio)


def test_mouth_follows_loudness(clip):
    spf = 2000
    rms = np.sqrt((clip.audio.reshape(-1, spf).astype(np.float64) ** 2).mean(1))
    assert np.corrcoef(rms, clip.mouth_open)[0, 1] > 0.9
    assert np.array_equal(mouth_open_from_audio(clip.audio, spf), clip.mouth_open)
    silent = np.convolve(rms > 0, np.ones(3), mode="same") == 0  # the frame and both neighbours silent
    assert silent.sum() > 5 and (clip.mouth_open[silent] == 0).all()
    # Open-mouth frames differ from closed ones in the mouth area, darker there.
    x0, y0, x1, y1 = clip.face_box
    mouth = clip.frames[:, (y0 + y1) // 2 : y1, x0:x1].astype(float).mean(axis=(1, 2, 3))
    assert mouth[clip.mouth_open > 0.8].mean() < mouth[clip.mouth_open == 0].mean() - 2


def test_blinks(clip):
    assert not clip.blink[0]
    runs = np.diff(np.concatenate([[0], clip.blink.astype(int), [0]]))
    starts, ends = np.flatnonzero(runs == 1), np.flatnonzero(runs == -1)
    assert len(starts) >= 2  # 8 s, one every 2-5 s
    assert ((ends - starts) >= 2).all() and ((ends - starts) <= 4).all()
    # Shut eyes show no eye white: far fewer near-white pixels in the eye band.
    x0, y0, x1, y1 = clip.face_box
    band = clip.frames[:, y0 + (y1 - y0) // 4 : (y0 + y1) // 2, x0:x1]
    white = (band.min(axis=-1) > 235).sum(axis=(1, 2))
    assert white[clip.blink].max() < 0.3 * white[~clip.blink].mean()


def test_head_moves(clip):
    off = clip.head_offset
    assert np.allclose(off[0], 0)
    assert np.ptp(off[:, 0]) > 1.0 and np.ptp(off[:, 1]) > 0.5  # pixels
    assert np.abs(np.diff(off, axis=0)).max() < 0.5  # smooth: under half a pixel per frame
    # The forehead/hair band (untouched by mouth and eyes) shifts with the head.
    _x0, y0, _x1, y1 = clip.face_box
    top = clip.frames[:, max(y0 - 4, 0) : y0 + (y1 - y0) // 5].astype(float)
    far = int(np.argmax(np.abs(off).sum(1)))
    assert np.abs(top[far] - top[0]).mean() > 3 * np.abs(top[1] - top[0]).mean() + 0.5


def test_varied_faces():
    params = [face_params(s) for s in range(30)]
    assert len({p.hair_style for p in params}) >= 4
    assert len({p.skin for p in params}) >= 20
    assert np.std([p.face_w for p in params]) > 0.01 and np.std([p.eye_y for p in params]) > 0.02


def test_held_out_split():
    train, test = held_out_split(50, 20, seed=0)
    assert len(train) == 50 and len(test) == 20
    assert {s.split for s in train} == {"train"} and {s.split for s in test} == {"test"}
    assert max(s.seed for s in train) < TEST_SEED_BASE <= min(s.seed for s in test)
    assert len({s.seed for s in train}) == 50
    assert held_out_split(50, 20, seed=0) == (train, test) and held_out_split(50, 20, seed=1) != (train, test)
    import colorsys

    def hue(rgb):
        return colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0]

    lo, hi = HUE_RANGES["train"]
    for spec in train[:10]:
        p = face_params(spec.seed, spec.split)
        assert lo - 0.01 <= hue(p.bg_top) <= hi + 0.01
    lo, hi = HUE_RANGES["test"]
    for spec in test[:10]:
        p = face_params(spec.seed, spec.split)
        assert lo - 0.01 <= hue(p.bg_top) <= hi + 0.01 or hue(p.bg_top) < 0.01
    c = test[0].make(0.25)
    assert c.frames.shape[0] == 6 and c.seed == test[0].seed


def test_espeak_speech():
    import shutil

    if shutil.which("espeak-ng") is None:
        with pytest.raises(RuntimeError, match="espeak-ng"):
            make_clip(0, 1.0, speech="espeak")
        return
    c = make_clip(0, 2.0, speech="espeak", text="Hello there, how are you today?")
    assert c.audio.shape == (96_000,) and np.abs(c.audio).max() > 0.1
    assert c.mouth_open.max() == 1.0 and (c.mouth_open < 0.3).any()
    d = make_clip(0, 2.0, speech="espeak", text="Hello there, how are you today?")
    assert np.array_equal(c.audio, d.audio)
