"""Drift curves (cadence.eval.drift) and the face tracker (cadence.eval.landmarks): the per-frame features on
cases whose answer is known, the per-second curves and their one-number summaries, the landmark tracker on
the shipped character and synthetic faces, and its pixel fallback."""

import math
import os

import numpy as np
import pytest
from PIL import Image, ImageFilter

from cadence.eval.drift import (
    DriftMeter,
    face_embedding,
    laplacian_variance,
    procrustes_rms,
    summarise,
    tail_seconds,
)
from cadence.eval.landmarks import FaceTracker, available
from cadence.train.data import make_clip


@pytest.fixture(scope="module")
def clip():
    return make_clip(2**30 + 5, 6.0, split="test")  # 128x128, 144 frames


def _degrade(frames: np.ndarray) -> np.ndarray:
    """Blur growing to radius 2 px and a red tint growing to +40 over the clip."""
    out = []
    for t, f in enumerate(frames):
        a = t / len(frames)
        x = np.asarray(Image.fromarray(f).filter(ImageFilter.GaussianBlur(radius=2.0 * a)), np.float32)
        x[..., 0] += 40 * a
        out.append(np.clip(x, 0, 255).astype(np.uint8))
    return np.stack(out)


def _curves(frames, ref, face_box, prefer):
    with FaceTracker(face_box, prefer=prefer) as tr:
        d = DriftMeter(ref, tr, 24, face_box)
        for i in range(0, len(frames), 8):  # chunk by chunk
            d.add(frames[i : i + 8], tr.track(frames[i : i + 8]))
    return d.curves()


def test_features_on_known_cases():
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(26, 2)) * 20 + 64
    th = 0.3
    rot = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    assert procrustes_rms(1.7 * pts @ rot + 5.0, pts) < 1e-9  # a moved, turned, scaled head: no change
    bent = pts.copy()
    bent[:5] += 3.0
    assert procrustes_rms(bent, pts) > 0.5
    img = make_clip(3, 0.1).frames[0]
    blurred = np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(2)))
    assert laplacian_variance(blurred) < 0.3 * laplacian_variance(img)
    e = face_embedding(img)
    assert e @ e == pytest.approx(1.0, abs=1e-5)
    brighter = np.clip(img.astype(np.float32) * 0.8 + 20, 0, 255).astype(np.uint8)
    assert 1 - face_embedding(brighter) @ e < 0.02  # brightness and contrast do not count
    other = make_clip(9, 0.1).frames[0]
    assert 1 - face_embedding(other) @ e > 0.1  # another face does
    assert tail_seconds(60) == 5 and tail_seconds(8) == 2 and tail_seconds(2) == 1


def test_pixel_curves_see_blur_and_tint_and_nothing_on_the_clip_itself(clip):
    same = _curves(clip.frames, clip.reference, clip.face_box, "pixels")
    assert len(same["sharpness"]) == 6 and all(
        math.isnan(x) for x in same["identity_geometry"]
    )  # no landmarks
    s = summarise(same)
    assert s["drift_colour_shift"] < 3.0 and abs(s["drift_sharpness"] - 1) < 0.1
    bad = _curves(_degrade(clip.frames), clip.reference, clip.face_box, "pixels")
    b = summarise(bad)
    assert b["drift_colour_shift"] > 20 and b["drift_sharpness"] < 0.3
    assert b["drift_identity_embedding"] > s["drift_identity_embedding"]
    assert bad["colour_shift"][-1] > bad["colour_shift"][2] > bad["colour_shift"][0]  # it grows
    assert bad["sharpness"][-1] < bad["sharpness"][2] < bad["sharpness"][0]


@pytest.fixture(scope="module")
def landmarks_ok():
    ok, why = available()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"the landmark tracker must run in CI: {why}")
        pytest.skip(why)


def test_landmarks_find_the_shipped_character_and_synthetic_faces(landmarks_ok):
    from cadence.media.face import face_params, render_face
    from cadence.media.image import DEFAULT_FACE_SEED, default_reference_image

    char = ((default_reference_image(128, 128).permute(1, 2, 0).numpy() + 1) * 127.5).round().astype(np.uint8)
    faces = [char] + [
        render_face(face_params(s, split), n, n, o, False)
        for s, split in ((DEFAULT_FACE_SEED, "train"), (2**30 + 1, "test"), (2**30 + 2, "test"))
        for n in (128, 256)
        for o in (0.0, 1.0)
    ]
    with FaceTracker(prefer="landmarks") as tr:
        got = [tr.track(f[None]) for f in faces]
    assert all(g.found[0] for g in got)
    assert tr.tracker == "landmarks"
    # the mouth opening reads larger with the mouth open, on every face and size
    opens = [g.mouth[0] for g in got[1:]]
    assert all(b > a for a, b in zip(opens[0::2], opens[1::2])), opens


def test_landmark_curves_stay_flat_on_the_clip_and_rise_when_degraded(landmarks_ok, clip):
    frames = clip.frames[:72]  # 3 s
    s = summarise(_curves(frames, clip.reference, clip.face_box, "landmarks"))
    assert s["drift_identity_geometry"] < 0.05  # eye-distance units: the same face
    b = summarise(_curves(_degrade(frames), clip.reference, clip.face_box, "landmarks"))
    assert b["drift_colour_shift"] > 20 and b["drift_sharpness"] < 0.3
    assert b["drift_identity_embedding"] > s["drift_identity_embedding"] + 0.05


def test_tracker_falls_back_to_pixels_with_one_warning(monkeypatch, caplog, clip):
    monkeypatch.setenv("CADENCE_FACE_LANDMARKER", "/nonexistent/face_landmarker.task")
    with caplog.at_level("WARNING", logger="cadence.eval"):
        tr = FaceTracker(clip.face_box)
    assert tr.tracker == "pixels" and "/nonexistent" in tr.why
    faces = tr.track(clip.frames[:24])
    assert faces.found.all() and np.corrcoef(faces.mouth, clip.mouth_open[:24])[0, 1] > 0.8
    with pytest.raises(RuntimeError, match="cannot run"):
        FaceTracker(prefer="landmarks")


def test_astronaut_reference_is_found_at_every_family_size(landmarks_ok):
    pytest.importorskip("skimage")  # the `eval` extra's; `--images astronaut`
    from cadence.eval.clips import load_image

    with FaceTracker(prefer="landmarks") as tr:
        for hw in ((128, 128), (480, 832), (768, 448)):  # the character, Self-Forcing, FlashTalk
            im = load_image("astronaut", *hw)
            assert im.shape == (*hw, 3) and tr.track(im[None]).found[0], hw
