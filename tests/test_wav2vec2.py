"""wav2vec2 audio features (``cadence.model.wav2vec2``) against an audio-driven family's own code: InfiniteTalk's
``Wav2Vec2Model`` (CNN features interpolated to 25 fps, every layer's hidden state) and its 5-frame windows
(fixture: tests/fixtures/wav2vec2, made by scripts/fixtures/make_wav2vec2.py at a tiny random Wav2Vec2Config,
reference commit and transformers version in fixture.json).

Error measure: ||cadence - reference|| / ||reference||, float32 on the CPU; tolerance 1e-5 (the issue's bound
for encoders). Cadence runs the saved folder with the installed ``transformers`` (5.x, SDPA attention) where the
reference ran 4.49 (eager attention): ~5e-7 measured.

* whole clip: ``Wav2Vec2Features.encode`` = the reference's ``get_embedding`` of the clip;
* the windows: ``frame_windows`` = the reference's clamped t-2..t+2 gather (exact);
* streaming: the clip pushed in pieces of odd sizes through ``Wav2Vec2Stream`` (8-frame chunks, 20 frames of
  audio context, 2 frames of look-ahead): each chunk = the reference's ``get_embedding`` of the audio window
  the stream encoded (its frames recorded in the fixture), windowed. The stream is *not* equal to the
  whole-clip features (the reference attends over the whole clip and normalises / interpolates over it);
  that drift is measured here (2.5e-2 .. 1.4e-1 on this tiny random model; a property of streaming this
  encoder, to be measured on the real weights before a family relies on it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cadence.model.wav2vec2 import Wav2Vec2Features, Wav2Vec2Stream, frame_windows

FIX = Path(__file__).parent / "fixtures" / "wav2vec2"
META = json.loads((FIX / "fixture.json").read_text())
DATA = torch.load(FIX / "data.pt", weights_only=True)
S = META["stream"]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def features():
    return Wav2Vec2Features(FIX / "wav2vec2_tiny")


def test_whole_clip_matches_infinitetalk(features):
    assert (features.sample_rate, features.hop, features.normalize) == (16000, 640, True)
    got = features.encode(DATA["clip"])
    assert got.shape == DATA["whole"].shape == (META["config"]["clip_frames"], features.layers, 32)
    err = rel(got, DATA["whole"])
    assert err <= 1e-5, err


def test_frame_windows_are_infinitetalks(features):
    n = DATA["whole_windows"].shape[0]
    last = DATA["whole"].shape[0] - 1
    assert torch.equal(frame_windows(DATA["whole"], 0, n, last=last), DATA["whole_windows"])
    assert rel(frame_windows(features.encode(DATA["clip"]), 0, n, last=last), DATA["whole_windows"]) <= 1e-5
    with pytest.raises(ValueError, match="outside"):
        frame_windows(DATA["whole"], 40, 10)  # frame 51 is not encoded (no end clamp)


def test_stream_chunks_match_the_reference_on_their_windows(features):
    stream = Wav2Vec2Stream(features, S["chunk_frames"], S["context_frames"])
    clip, chunks, i = DATA["clip"], [], 0
    for size in (1000, 5000, 3, 7000, 640 * 8, 9000, 100_000):  # pieces of any length
        chunks += stream.push(clip[i : i + size])
        i += size
    windows = list(stream.windows)
    assert [tuple(w) for w in DATA["window_frames"].tolist()] == windows
    drift = []
    for k, (c, (a, _b)) in enumerate(zip(chunks, windows)):
        n = S["chunk_frames"]
        ref = frame_windows(DATA["windows"][k], k * n, n, offset=a)
        err = rel(c, ref)
        assert c.shape == (n, 5, features.layers, 32) and err <= 1e-5, (k, err)
        drift.append(rel(c, DATA["whole_windows"][k * n : (k + 1) * n]))
    assert max(drift) > 1e-3  # a window is not the whole clip (see the module docstring)


def test_stream_needs_room_for_its_windows(features):
    with pytest.raises(ValueError, match="need >= 12"):
        Wav2Vec2Stream(features, 8, 11)
