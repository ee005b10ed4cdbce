"""The SyncNet-style offset / confidence estimator (cadence.eval.sync) on signals whose answer is known, and
the landmark lip-sync measure's known-shift check on synthetic faces (cadence.eval.landmarks + sync)."""

import functools
import os

import numpy as np
import pytest

from cadence.eval.metrics import audio_envelope
from cadence.eval.sync import MAX_OFFSET, av_sync, delay_audio, window_starts
from cadence.media.audio import synthetic_speech
from cadence.media.face import face_params, render_face
from cadence.train.data import held_out_split, mouth_open_from_audio

FPS, SPF = 24, 2000  # 48 kHz / 24 fps


@functools.lru_cache(maxsize=64)
def _speech(seed: int, seconds: float) -> np.ndarray:
    a = synthetic_speech(seconds, seed=seed).numpy().astype(np.float32)
    return a * np.float32(0.5 / np.abs(a).max())


# ---- the estimator on plain signals ------------------------------------------------------------------


@pytest.mark.parametrize("k", range(-5, 6))
def test_delayed_audio_gives_its_delay(k):
    audio = _speech(3, 6.0)
    mouth = mouth_open_from_audio(audio, SPF)  # a mouth that follows the loudness, no lag
    r = av_sync(mouth, audio_envelope(delay_audio(audio, k * SPF), FPS))
    assert r.offset_frames == k  # sign: > 0 = the audio is late
    assert r.corr > 0.8 and r.confidence > 0.5 and r.windows >= 4


def test_silence_and_still_mouths_have_no_confidence():
    audio = _speech(4, 4.0)
    mouth = mouth_open_from_audio(audio, SPF)
    quiet = av_sync(mouth, audio_envelope(np.zeros_like(audio), FPS))
    assert quiet.offset_frames is None and quiet.confidence == 0.0 and quiet.windows == 0
    faint = av_sync(mouth, audio_envelope(audio * 1e-4, FPS))  # -80 dB: below the speech gate
    assert faint.offset_frames is None and faint.confidence == 0.0
    still = av_sync(np.full(len(mouth), 0.3), audio_envelope(audio, FPS))
    assert still.confidence == 0.0 and still.corr == 0.0
    nobody = av_sync(np.full(len(mouth), np.nan), audio_envelope(audio, FPS))  # no face in any frame
    assert nobody.offset_frames is None and nobody.face_fraction == 0.0


def test_short_face_dropouts_are_bridged():
    audio = _speech(5, 6.0)
    mouth = mouth_open_from_audio(audio, SPF).astype(np.float64)
    mouth[30:34] = np.nan  # the face lost for 4 frames
    r = av_sync(mouth, audio_envelope(delay_audio(audio, 2 * SPF), FPS))
    assert r.offset_frames == 2 and r.face_fraction == pytest.approx(1 - 4 / len(mouth))


def test_window_layout():
    starts, w = window_starts(200, MAX_OFFSET, 48)
    assert w == 48 and starts[0] == MAX_OFFSET and starts[-1] + w + MAX_OFFSET == 200
    assert all(b - a <= 24 for a, b in zip(starts, starts[1:]))  # hop of half a window
    starts, w = window_starts(40, MAX_OFFSET, 48)  # shorter than a window: one window of what fits
    assert starts == [MAX_OFFSET] and w == 40 - 2 * MAX_OFFSET
    assert window_starts(20, MAX_OFFSET, 48)[0] == []  # too short to read any timing
    assert list(delay_audio(np.arange(5.0), 2)) == [0, 0, 0, 1, 2]
    assert list(delay_audio(np.arange(5.0), -2)) == [2, 3, 4, 0, 0]


# ---- the landmark measure: known shifts on synthetic faces ---------------------------------------------


@pytest.fixture(scope="module")
def tracker_ok():
    from cadence.eval.landmarks import available

    ok, why = available()
    if not ok:
        if os.environ.get("CI"):  # the test extra installs mediapipe and the model: CI must run this
            pytest.fail(f"the landmark tracker must run in CI: {why}")
        pytest.skip(why)


LEVELS = 8  # mouth openings drawn per face


@pytest.fixture(scope="module")
def face_tracks(tracker_ok):
    """20 held-out synthetic faces (128x128) talking for 3 s: the mouth opening of each frame is the audio's
    loudness (``mouth_open_from_audio``) rounded to one of 8 levels, the head still, the eyes open. Each
    face's 8 distinct frames are tracked once (landmarks are read from each frame on its own, so a frame's
    result does not depend on its neighbours) and the clip's mouth track is assembled from them."""
    from cadence.eval.landmarks import FaceTracker

    out = []
    with FaceTracker(prefer="landmarks", blendshapes=False) as tr:  # one model load for all faces
        for spec in held_out_split(0, 20, seed=7)[1]:
            audio = _speech(spec.seed % 100_000, 3.0)
            level = np.rint(mouth_open_from_audio(audio, SPF) * (LEVELS - 1)).astype(int)
            p = face_params(spec.seed, "test")
            faces = tr.track(
                np.stack([render_face(p, 128, 128, i / (LEVELS - 1), False) for i in range(LEVELS)])
            )
            assert faces.found.all(), spec.seed
            out.append((faces.mouth[level], audio))
    return out


def test_landmarks_recover_every_known_shift_on_20_faces(face_tracks):
    misses = []
    for i, (mouth, audio) in enumerate(face_tracks):
        for k in range(-5, 6):
            r = av_sync(mouth, audio_envelope(delay_audio(audio, k * SPF), FPS))
            if r.offset_frames != k:
                misses.append((i, k, r.offset_frames))
    assert not misses  # 20 clips x 11 shifts, every one exact


def test_landmark_confidence_separates_matched_from_mismatched_and_silence(face_tracks):
    matched, mismatched = [], []
    for i, (mouth, audio) in enumerate(face_tracks):
        matched.append(av_sync(mouth, audio_envelope(audio, FPS)).confidence)
        other = face_tracks[(i + 1) % len(face_tracks)][1]
        mismatched.append(av_sync(mouth, audio_envelope(other, FPS)).confidence)
        assert av_sync(mouth, audio_envelope(np.zeros_like(audio), FPS)).confidence == 0.0
    assert min(matched) > max(mismatched), (sorted(matched)[:3], sorted(mismatched)[-3:])
    assert np.median(matched) > 2 * np.median(mismatched)


@pytest.mark.slow  # two 4 s streams of the shipped character on the CPU with the tracker
def test_known_shifts_on_the_shipped_character(tracker_ok):
    """The character's own streams (trained weights, held-out faces and voices): delaying the audio by k moves
    the measured offset by exactly k from the stream's own (0 or -1 frames on these). On 8 streams the
    recorded check (docs/perf/eval/NOTES.md) recovered 84 of 88: the 4 misses all on one stream whose mouth
    does not follow its voice (confidence 0.14 at its own offset)."""
    import torch

    from cadence.eval.validate import character

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steady on a shared 2-core machine
    try:
        r = character(2, 4.0, "cpu")
    finally:
        torch.set_num_threads(threads)
    assert r["recovered"] == r["of"] == 22, r["misses"]
    assert r["confidence_matched"]["min"] > r["confidence_mismatched"]["max"]
    assert r["confidence_silence"]["max"] == 0.0
