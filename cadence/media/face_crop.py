"""SoulX-FlashHead's optional face crop of the reference image (their ``use_face_crop``: ``flash_head/utils/facecrop.py``).

Their crop: MediaPipe's BlazeFace detector (``mp.solutions.face_detection``, full-range model, no confidence
floor) finds faces in the RGB image; the *first* detection's box (relative coordinates, converted to pixels)
gives a square of side ``ratio`` x the box's width (2.0), centred on the box horizontally and placed with 55 %
of it above the box's centre, clamped to the image (so it is not square near an edge); the crop is resized to
``size`` (512 x 512, Pillow's default filter). No face, or any error: the image is used as it is (their
``get_cond_image_dict`` logs the error and falls back).

:func:`crop_around_box` is that geometry (tested equal to their ``process_image`` with a given box);
:func:`detect_face` is the detector, through the ``mediapipe`` package when it is installed (not a Cadence
dependency: the release FlashHead pins, 0.10.9, needs protobuf < 4, and its detector fails on a face with the
protobuf 5+ most stacks have; a missing or failing detector is one log line and the uncropped image).
"""

from __future__ import annotations

import logging

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)


def crop_around_box(
    image: Image.Image, box: tuple[float, float, float, float], ratio: float = 2.0, size=(512, 512)
) -> Image.Image:
    """``image`` cropped around the face box (x1, y1, x2, y2 relative to the image) and resized to ``size``
    (width, height), as their ``get_scaled_bbox`` + ``resize``."""
    w, h = image.size
    x1, y1, x2, y2 = box[0] * w, box[1] * h, box[2] * w, box[3] * h
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    side = (x2 - x1) * ratio
    left, up = side * 0.5, side * 0.55
    crop = (
        int(max(0, cx - left)),
        int(max(0, cy - up)),
        int(min(w, cx + (side - left))),
        int(min(h, cy + (side - up))),
    )
    return image.crop(crop).resize(tuple(size))


def detect_face(image: Image.Image) -> tuple[float, float, float, float] | None:
    """The first face MediaPipe finds (relative x1, y1, x2, y2), or None; raises ImportError without
    ``mediapipe``."""
    import mediapipe as mp

    detector = mp.solutions.face_detection.FaceDetection(model_selection=1, min_detection_confidence=0.0)
    try:
        found = detector.process(np.asarray(image.convert("RGB"))).detections
    finally:
        detector.close()
    if not found:
        return None
    b = found[0].location_data.relative_bounding_box
    return (b.xmin, b.ymin, b.xmin + b.width, b.ymin + b.height)


def face_crop(image: Image.Image, ratio: float = 2.0, size=(512, 512), detector=detect_face) -> Image.Image:
    """Their ``use_face_crop``: the crop around the first detected face, else (no face, no detector, an error)
    the image unchanged, with one log line."""
    image = image.convert("RGB")
    try:
        box = detector(image)
    except Exception as e:  # ImportError without mediapipe; the detector's own errors
        log.warning("face crop skipped (%s: %s): the reference image is used uncropped", type(e).__name__, e)
        return image
    if box is None:
        log.warning("face crop: no face detected; the reference image is used uncropped")
        return image
    return crop_around_box(image, box, ratio, size)
