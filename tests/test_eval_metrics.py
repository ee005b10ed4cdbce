"""Lip-sync and identity-drift metrics (cadence.eval.metrics, issue 7 item 4) on generated clips."""

import numpy as np
import pytest
import torch

from cadence.eval.metrics import (
    audio_envelope,
    frame_distance,
    identity_drift,
    lagged_corr,
    lipsync,
    mouth_opening,
)
from cadence.train.data import make_clip


@pytest.fixture(scope="module")
def clip():
    return make_clip(5, 20.0)  # long enough that unrelated speech cannot correlate by chance


@pytest.fixture(scope="module")
def clips():
    return [make_clip(s, 4.0, split=("train", "test")[s % 2]) for s in range(20, 26)]


def _delay(frames, k):
    """The video k frames late (k > 0): repeat the first frame k times, drop the last k."""
    return (
        np.concatenate([np.repeat(frames[:1], k, 0), frames[:-k]])
        if k > 0
        else np.concatenate([frames[-k:], np.repeat(frames[-1:], -k, 0)])
    )


def test_mouth_opening_recovers_ground_truth(clips):
    for c in clips:  # every hair style / skin tone in the sample; no face box needed
        m = mouth_opening(c.frames)
        assert m.shape == (c.frames.shape[0],)
        assert np.corrcoef(m, c.mouth_open)[0, 1] > 0.9
        assert np.corrcoef(mouth_opening(c.frames, c.face_box), c.mouth_open)[0, 1] > 0.9
        assert m[c.mouth_open == 0].max() < 0.2 * m.max()  # closed mouth reads ~0


def test_mouth_opening_accepts_engine_tensors(clips):
    c = clips[0]
    as_float = torch.from_numpy(c.frames).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [T, 3, H, W] in [-1, 1]
    assert np.allclose(mouth_opening(as_float), mouth_opening(c.frames), atol=0.01)


def test_audio_envelope():
    a = np.zeros(48_000, np.float32)
    a[2000:4000] = 0.5
    a[4000:6000] = np.where(np.arange(2000) % 2, 0.25, -0.25)
    env = audio_envelope(a)
    assert env.shape == (24,)
    assert np.allclose(env[:4], [0, 0.5, 0.25, 0]) and np.allclose(env[4:], 0)
    assert audio_envelope(a, fps=25, sample_rate=48_000).shape == (25,)


def test_lipsync_in_sync(clip):
    r = lipsync(clip.frames, clip.audio)
    assert r["offset_frames"] == 0
    assert r["corr_at_zero"] > 0.7 and r["corr"] == r["corr_at_zero"]
    assert set(r["corr_by_offset"]) == set(range(-6, 7))


@pytest.mark.parametrize("k", [3, -2])
def test_lipsync_finds_offset(clip, k):
    # Sign: positive offset = the video lags the audio (the mouth opens k frames after the sound).
    r = lipsync(_delay(clip.frames, k), clip.audio)
    assert r["offset_frames"] == k
    assert r["corr"] > 0.7 and r["corr_at_zero"] < r["corr"] - 0.2


def test_lipsync_other_speech_is_low(clip):
    other = make_clip(1005, 20.0).audio  # another voice's speech, same length
    r = lipsync(clip.frames, other)
    assert abs(r["corr_at_zero"]) < 0.3 and r["corr"] < 0.3
    assert lipsync(clip.frames, clip.audio)["corr"] - r["corr"] > 0.5


def test_lagged_corr_sign():
    x = np.sin(np.arange(100) / 3.0)
    video = np.concatenate([np.zeros(4), x[:-4]])  # video 4 frames late
    assert lagged_corr(video, x, 4) > 0.999 and lagged_corr(video, x, -4) < 0.9


def test_identity_drift(clip):
    ref = clip.reference
    still = np.repeat(ref[None], 24 * 10, 0)
    d = identity_drift(still, ref, at_seconds=(1, 10, 60))
    assert set(d) == {1, 10} and d[1] == 0.0 and d[10] == 0.0  # 60 s is past the end: left out
    same = identity_drift(clip.frames, ref, at_seconds=(1, 10, 20))
    assert all(0.0 < v < 0.04 for v in same.values())  # same face, just talking, blinking, moving
    for seed in (6, 7, 8):
        other = make_clip(seed, 1.0)
        far = identity_drift(other.frames, ref, at_seconds=(1,))[1]
        assert far > 0.05 and far > 2 * max(same.values())
    # The face box restricts the comparison to the face: a changed backdrop alone then hardly counts.
    swapped = clip.frames[:24].copy()
    x0, y0, x1, y1 = clip.face_box
    mask = np.ones(swapped.shape[1:3], bool)
    mask[y0:y1, x0:x1] = False
    swapped[:, mask] = 255 - swapped[:, mask]
    assert identity_drift(swapped, ref, (1,))[1] > 0.1
    assert identity_drift(swapped, ref, (1,), face_box=clip.face_box)[1] < 0.04
    assert frame_distance(ref, ref)[0] == 0.0
