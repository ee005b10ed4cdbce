"""The stylised face the default character was trained on, drawn with Pillow: ``render_face``.

``face_params(seed, split)`` draws a face (shape, skin/hair/eye/backdrop colours, eye placement, hair style
and mouth size) from a seed; ``render_face`` draws one frame of it at any size with a given mouth opening,
eyes open or shut and a head offset (supersampled ``SUPERSAMPLE`` times, then box-downsampled: smooth edges
and sub-pixel motion). The mouth is a dark ellipse (its interior) inside a lip ellipse; the interior's
height is ``opening * max_open`` pixels, so its area is linear in the opening. Closed (opening 0), only a
thin lip line is drawn.

It lives in ``media`` because it is a picture: the built-in reference face (``cadence.media.image``) and
the synthetic training data (``cadence.train.data``, which animates it) both draw with it.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

#: Supersampling factor of the renderer (drawn at ss x size, then box-downsampled: smooth edges and
#: sub-pixel motion).
SUPERSAMPLE = 4

#: Disjoint hue ranges (0..1) for hair and backdrop per split; 'any' uses the whole circle.
HUE_RANGES = {"train": (0.0, 0.6), "test": (0.6, 1.0), "any": (0.0, 1.0)}

HAIR_STYLES = ("fringe", "side_part", "crop", "long", "bun")


@dataclass(frozen=True)
class FaceParams:
    """Everything that makes one face look the way it does (sizes relative to the shorter side)."""

    bg_top: tuple[int, int, int]
    bg_bottom: tuple[int, int, int]
    skin: tuple[int, int, int]
    hair: tuple[int, int, int]
    iris: tuple[int, int, int]
    shirt: tuple[int, int, int]
    hair_style: str
    face_w: float  # face half-width / side
    face_h: float  # face half-height / side
    center_y: float  # face centre y / height
    eye_dx: float  # eye distance from centre / face half-width
    eye_y: float  # eye height above centre / face half-height
    eye_size: float  # eye half-width / face half-width
    mouth_w: float  # mouth half-width / face half-width
    mouth_y: float  # mouth centre below face centre / face half-height
    mouth_max: float  # largest mouth-interior full height / face half-height
    motion_amp: float  # head translation amplitude / side


def face_params(seed: int, split: str = "any") -> FaceParams:
    """The face of ``seed`` drawn from ``split``'s ranges ('train', 'test' or 'any')."""
    if split not in HUE_RANGES:
        raise ValueError(f"split must be one of {sorted(HUE_RANGES)}, got {split!r}")
    rng = np.random.default_rng([seed, 1])
    lo, hi = HUE_RANGES[split]

    def hsv(h: float, s: float, v: float) -> tuple[int, int, int]:
        return tuple(round(255 * c) for c in colorsys.hsv_to_rgb(h % 1.0, s, v))

    bg_hue = rng.uniform(lo, hi)
    bg_s = rng.uniform(0.2, 0.5)
    tone = rng.uniform(0, 1)  # light .. dark skin; every tone in every split
    light, dark = np.array([246, 208, 178]), np.array([150, 102, 74])
    skin = tuple(round(c) for c in light + (dark - light) * tone)
    return FaceParams(
        bg_top=hsv(bg_hue, bg_s, rng.uniform(0.7, 0.9)),
        bg_bottom=hsv(bg_hue, bg_s, rng.uniform(0.45, 0.6)),
        skin=skin,
        hair=hsv(rng.uniform(lo, hi), rng.uniform(0.3, 0.75), rng.uniform(0.15, 0.6)),
        iris=hsv(rng.uniform(0, 1), rng.uniform(0.4, 0.8), rng.uniform(0.3, 0.6)),
        shirt=hsv(rng.uniform(0, 1), rng.uniform(0.25, 0.5), rng.uniform(0.6, 0.9)),
        hair_style=HAIR_STYLES[int(rng.integers(len(HAIR_STYLES)))],
        face_w=rng.uniform(0.24, 0.31),
        face_h=rng.uniform(0.33, 0.40),
        center_y=rng.uniform(0.49, 0.55),
        eye_dx=rng.uniform(0.33, 0.45),
        eye_y=rng.uniform(0.03, 0.17),
        eye_size=rng.uniform(0.15, 0.21),
        mouth_w=rng.uniform(0.28, 0.40),
        mouth_y=rng.uniform(0.46, 0.54),
        mouth_max=rng.uniform(0.16, 0.22),
        motion_amp=rng.uniform(0.012, 0.025),
    )


def backdrop(p: FaceParams, height: int, width: int) -> Image.Image:
    """The supersampled backdrop of face ``p``: a vertical gradient (reused for every frame)."""
    h, w = height * SUPERSAMPLE, width * SUPERSAMPLE
    t = np.linspace(0.0, 1.0, h)[:, None, None]
    bg = np.array(p.bg_top)[None, None] * (1 - t) + np.array(p.bg_bottom)[None, None] * t
    return Image.fromarray(np.ascontiguousarray(np.broadcast_to(bg, (h, w, 3)).astype(np.uint8)), "RGB")


def render_face(
    p: FaceParams,
    height: int,
    width: int,
    opening: float,
    eyes_shut: bool,
    offset: tuple[float, float] | np.ndarray = (0.0, 0.0),
    background: Image.Image | None = None,
) -> np.ndarray:
    """One frame (uint8 [H, W, 3]) of face ``p`` with the mouth ``opening`` (0..1) and head ``offset`` px."""
    ss = SUPERSAMPLE
    w, h = width * ss, height * ss
    img = (background if background is not None else backdrop(p, height, width)).copy()
    c = _Canvas(ImageDraw.Draw(img), p, w / 2 + offset[0] * ss, h * p.center_y + offset[1] * ss, min(w, h))
    c.head()
    c.eyes(eyes_shut)
    c.mouth(opening)
    img = img.resize((width, height), Image.Resampling.BOX)
    return np.asarray(img, dtype=np.uint8)


class _Canvas:
    """:func:`render_face`'s drawing, in painting order: the head (shoulders, neck, hair, ears, face), the
    eyes and brows, the nose, cheeks and mouth; ``(cx, cy)`` the face's centre, ``s`` the frame's short side
    (supersampled pixels)."""

    def __init__(self, d: ImageDraw.ImageDraw, p: FaceParams, cx: float, cy: float, s: float):
        self.d, self.p, self.cx, self.cy, self.s = d, p, cx, cy, s
        self.fw, self.fh = p.face_w * s, p.face_h * s
        self.skin = np.array(p.skin, np.float64)

    @staticmethod
    def shade(c: np.ndarray, k) -> tuple[int, int, int]:
        return tuple(int(np.clip(round(v), 0, 255)) for v in c * np.asarray(k, np.float64))

    def ell(self, x0: float, y0: float, rx: float, ry: float, **kw) -> None:
        self.d.ellipse((x0 - rx, y0 - ry, x0 + rx, y0 + ry), **kw)

    def head(self) -> None:
        d, p, cx, cy, fw, fh, ell = self.d, self.p, self.cx, self.cy, self.fw, self.fh, self.ell
        hair, skin = p.hair, self.skin
        if p.hair_style == "long":  # hair hanging beside the face, down to the shoulders
            d.rectangle((cx - fw * 1.15, cy - fh * 0.2, cx + fw * 1.15, cy + fh * 1.05), fill=hair)
        ell(cx, cy + fh * 1.3, fw * 1.75, fh * 0.6, fill=p.shirt)  # shoulders
        d.rectangle(
            (cx - fw * 0.35, cy + fh * 0.6, cx + fw * 0.35, cy + fh * 1.0), fill=self.shade(skin, 0.9)
        )
        if p.hair_style != "crop":
            ell(cx, cy - fh * 0.12, fw * 1.12, fh * 1.02, fill=hair)  # hair behind
        if p.hair_style == "bun":
            ell(cx, cy - fh * 1.1, fw * 0.45, fh * 0.3, fill=hair)
        ell(cx - fw, cy, fw * 0.16, fh * 0.2, fill=self.shade(skin, 0.96))  # ears
        ell(cx + fw, cy, fw * 0.16, fh * 0.2, fill=self.shade(skin, 0.96))
        ell(cx, cy, fw, fh, fill=p.skin)  # face
        if p.hair_style in ("fringe", "long", "bun"):
            d.chord((cx - fw * 1.05, cy - fh * 1.08, cx + fw * 1.05, cy - fh * 0.2), 180, 360, fill=hair)
        elif p.hair_style == "side_part":
            d.chord((cx - fw * 1.05, cy - fh * 1.08, cx + fw * 1.05, cy - fh * 0.35), 180, 360, fill=hair)
            d.polygon(
                [
                    (cx - fw * 1.02, cy - fh * 0.5),
                    (cx - fw * 0.1, cy - fh * 0.95),
                    (cx - fw * 0.9, cy - fh * 0.05),
                ],
                fill=hair,
            )
        else:  # crop: a thin cap
            d.chord((cx - fw * 1.0, cy - fh * 1.03, cx + fw * 1.0, cy - fh * 0.55), 180, 360, fill=hair)

    def eyes(self, shut: bool) -> None:
        d, p, cx, cy, fw, fh, s, ell = self.d, self.p, self.cx, self.cy, self.fw, self.fh, self.s, self.ell
        ey = cy - fh * p.eye_y
        er = fw * p.eye_size
        for sx in (-1, 1):
            ex = cx + sx * fw * p.eye_dx
            if shut:
                d.line(
                    (ex - er, ey, ex + er, ey), fill=self.shade(self.skin, 0.45), width=max(1, int(s * 0.012))
                )
            else:
                ell(ex, ey, er, er * 0.5, fill=(250, 250, 250))  # eye white
                ell(ex, ey, er * 0.45, er * 0.45, fill=p.iris)  # iris
                ell(ex, ey, er * 0.22, er * 0.22, fill=(15, 15, 15))  # pupil
                ell(ex + er * 0.15, ey - er * 0.15, er * 0.1, er * 0.1, fill=(255, 255, 255))
            d.line(
                (ex - er, ey - fh * 0.13, ex + er, ey - fh * 0.15),
                fill=self.shade(np.array(p.hair, float), 0.8),
                width=max(1, int(s * 0.012)),
            )  # brow

    def mouth(self, opening: float) -> None:
        """The nose and cheeks, then the mouth: lips around a dark interior whose height is linear in the
        opening."""
        d, p, cx, cy, fw, fh, skin, ell = (
            self.d,
            self.p,
            self.cx,
            self.cy,
            self.fw,
            self.fh,
            self.skin,
            self.ell,
        )
        d.line(
            (cx, cy + fh * 0.02, cx - fw * 0.08, cy + fh * 0.26, cx + fw * 0.04, cy + fh * 0.28),
            fill=self.shade(skin, 0.8),
            width=max(1, int(self.s * 0.008)),
        )  # nose
        for sx in (-1, 1):
            ell(
                cx + sx * fw * 0.62,
                cy + fh * 0.3,
                fw * 0.16,
                fh * 0.08,
                fill=self.shade(skin, (1.02, 0.9, 0.9)),
            )  # cheeks
        my, mw = cy + fh * p.mouth_y, fw * p.mouth_w
        lips = self.shade(skin, (0.72, 0.42, 0.45))
        inner_h = float(np.clip(opening, 0, 1)) * p.mouth_max * fh
        lip_t = fh * 0.035
        if inner_h < 0.5:
            d.line((cx - mw, my, cx + mw, my), fill=lips, width=max(1, int(lip_t * 1.2)))
        else:
            ell(cx, my, mw + lip_t, inner_h / 2 + lip_t, fill=lips)
            ell(cx, my, mw, inner_h / 2, fill=(38, 10, 16))
