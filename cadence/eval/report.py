"""The picture of a ``cadence eval`` run, read at a glance: :func:`render_png` (Pillow only, no plotting library).

Top left, **mouth track over the audio envelope**: the first clip's speech energy per frame (grey, filled)
under the mouth opening the landmarks read, per configuration (first rerun) and for the ground truth, each
scaled to its own range: a mouth that follows the voice rises with the grey. Top right, **sync curve**: the
mean correlation of mouth and energy per offset (``cadence.eval.sync``), one line per configuration; the peak
is the offset, its height over the rest the confidence. Below, the **drift curves** per second (identity
geometry and embedding against the reference image, colour shift and sharpness against the first seconds;
``cadence.eval.drift``), from the long streams when ``--long`` ran. Last, one line per configuration: its
verdict.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from cadence.eval.drift import CURVES

W, H = 1400, 860
PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207),
           (140, 86, 75), (227, 119, 194), (188, 189, 34)]  # fmt: skip
GT_COLOUR = (0, 0, 0)
TITLES = {
    "identity_geometry": "identity: landmark geometry (eye distances)",
    "identity_embedding": "identity: face embedding (1 - cos)",
    "colour_shift": "colour shift vs first seconds (RGB units)",
    "sharpness": "sharpness / first seconds",
}


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _finite(xs) -> np.ndarray:
    return np.asarray([np.nan if x is None else x for x in xs], np.float64)


def _plot(d: ImageDraw.ImageDraw, box, series, title: str, xlabel: str, fill=None) -> None:
    """Line plot of ``series`` [(colour, xs, ys)] in ``box`` (x0, y0, x1, y1); ``fill``: (colour, xs, ys) drawn
    first as an area from 0."""
    x0, y0, x1, y1 = box
    f = _font(13)
    d.text((x0, y0 - 18), title, fill=(0, 0, 0), font=_font(15))
    d.rectangle(box, outline=(120, 120, 120))
    allx = [x for _, xs, _ in series for x in xs] + (list(fill[1]) if fill else [])
    ally = [y for _, _, ys in series for y in _finite(ys) if math.isfinite(y)]
    if not allx or not (ally or fill):
        d.text((x0 + 10, y0 + 10), "no data", fill=(120, 120, 120), font=f)
        return
    xa, xb = min(allx), max(allx)
    ya, yb = (min(ally), max(ally)) if ally else (0.0, 1.0)
    if yb - ya < 1e-9:
        ya, yb = ya - 0.5, yb + 0.5
    pad = 0.06 * (yb - ya)
    ya, yb = ya - pad, yb + pad
    xb = xb if xb > xa else xa + 1

    def px(x, y):
        return x0 + (x - xa) / (xb - xa) * (x1 - x0), y1 - (y - ya) / (yb - ya) * (y1 - y0)

    if fill:
        colour, xs, ys = fill
        pts = [px(x, y) for x, y in zip(xs, ys)]
        d.polygon([px(xs[0], ya), *pts, px(xs[-1], ya)], fill=colour)
    for colour, xs, ys in series:
        seg = []
        for x, y in zip(xs, _finite(ys)):
            if math.isfinite(y):
                seg.append(px(x, y))
            elif seg:
                if len(seg) > 1:
                    d.line(seg, fill=colour, width=2)
                seg = []
        if len(seg) > 1:
            d.line(seg, fill=colour, width=2)
        elif len(seg) == 1:
            d.ellipse((seg[0][0] - 2, seg[0][1] - 2, seg[0][0] + 2, seg[0][1] + 2), fill=colour)
    for v, y in ((yb - pad, y0), (ya + pad, y1)):
        d.text((x1 + 4, y - 7 if y == y0 else y - 14), f"{v:.3g}", fill=(80, 80, 80), font=f)
    d.text((x0, y1 + 3), f"{xa:g}", fill=(80, 80, 80), font=f)
    d.text((x1 - 40, y1 + 3), f"{xb:g} {xlabel}", fill=(80, 80, 80), font=f)


def _scaled(ys) -> list[float]:
    a = _finite(ys)
    ok = np.isfinite(a)
    if not ok.any():
        return list(a)
    lo, hi = np.nanmin(a), np.nanmax(a)
    return list((a - lo) / (hi - lo) if hi > lo else a * 0)


def _legend(d: ImageDraw.ImageDraw, x: int, y: int, names: Sequence[tuple[str, tuple]]) -> None:
    f = _font(14)
    for name, colour in names:
        d.rectangle((x, y + 4, x + 14, y + 14), fill=colour)
        d.text((x + 20, y), name, fill=(0, 0, 0), font=f)
        x += 30 + int(d.textlength(name, font=f))


def render_png(results: dict, path: str | Path, title: str = "") -> Path:
    """Draw the run's picture (module doc) to ``path``; returns it."""
    img = Image.new("RGB", (W, H), (255, 255, 255))
    d = ImageDraw.Draw(img)
    configs = {n: c for n, c in results["configs"].items() if "skipped" not in c}
    colours = {
        n: (GT_COLOUR if n == "ground_truth" else PALETTE[i % len(PALETTE)]) for i, n in enumerate(configs)
    }
    d.text((20, 10), title or "cadence eval", fill=(0, 0, 0), font=_font(20))
    _legend(d, 20, 40, [(n, colours[n]) for n in configs])
    # mouth track over the audio envelope
    first = next((c["track"] for c in configs.values() if c.get("track")), None)
    series = []
    fill = None
    if first:
        fps = first["fps"]
        n = min(len(first["energy"]), int(12 * fps))
        t = [i / fps for i in range(n)]
        fill = ((215, 215, 215), t, _scaled(first["energy"][:n]))
        for name, c in configs.items():
            tr = c.get("track")
            if tr:
                m = min(n, len(tr["mouth"]))
                series.append((colours[name], t[:m], _scaled(tr["mouth"][:m])))
    clip = first.get("clip", "") if first else ""
    _plot(
        d, (40, 100, 860, 330), series, f"mouth opening (lines) over speech energy (grey): {clip}", "s", fill
    )
    # sync curve
    curves = []
    for name, c in configs.items():
        by = c.get("sync_curve") or {}
        if by:
            ks = sorted(int(k) for k in by)
            curves.append((colours[name], ks, [by[str(k)] for k in ks]))
    _plot(d, (930, 100, 1330, 330), curves, "sync: correlation per offset (audio late > 0)", "frames")
    # drift curves
    drift_src = results.get("long", {}).get("configs") or results["configs"]
    where = "long streams" if results.get("long") else "clips"
    for i, name in enumerate(CURVES):
        x0 = 40 + i * 340
        series = []
        for cn, c in drift_src.items():
            ys = (c.get("curves") or {}).get(name)
            if ys and cn in colours:
                series.append((colours[cn], list(range(1, len(ys) + 1)), ys))
        _plot(d, (x0, 400, x0 + 280, 640), series, TITLES[name], "s")
    d.text(
        (40, 660),
        f"drift curves: per-second means over the {where} (all clips and reruns)",
        fill=(80, 80, 80),
        font=_font(13),
    )
    y = 690
    f = _font(14)
    for name, c in results["configs"].items():
        line = f"{name}: {c.get('verdict', '')}"
        long_v = results.get("long", {}).get("configs", {}).get(name, {}).get("verdict")
        if long_v and name != "ground_truth":
            line += f"  | long: {long_v}"
        for part in textwrap.wrap(line, 170, subsequent_indent="    ")[:3]:
            if y > H - 20:
                break
            d.text((40, y), part, fill=colours.get(name, (120, 120, 120)), font=f)
            y += 19
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


__all__ = ["render_png"]
