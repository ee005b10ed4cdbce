"""The reference image: load any picture a user hands us as a [3, H, W] tensor in [-1, 1].

NumPy and Pillow only at import: the live server's web process decodes uploads with
``load_reference_array`` and imports no torch; the tensor-returning functions import it when called.

Fit policy: **crop, not pad: a face fills the frame.** The image is scaled (aspect ratio kept,
Lanczos) until it *covers* the target size, then the overflow is cut off evenly on both sides.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from cadence.errors import InputError

if TYPE_CHECKING:
    import torch

#: Largest reference image accepted, in pixels (64 megapixels; a phone photo is 12-50).
MAX_PIXELS = 64_000_000

#: Colour a transparent cut-out is composited onto (white, as image viewers show it).
ALPHA_BACKGROUND = (255, 255, 255)


def load_reference_image(path: str | os.PathLike, height: int, width: int) -> torch.Tensor:
    """Load ``path`` as a float32 tensor [3, height, width] in [-1, 1] (``load_reference_array``'s)."""
    import torch

    return torch.from_numpy(load_reference_array(path, height, width))


def load_reference_array(path: str | os.PathLike, height: int, width: int) -> np.ndarray:
    """Load ``path`` as float32 [3, height, width] in [-1, 1] (NumPy).

    Fit: scale (aspect kept, Lanczos) so the image covers ``height x width``, then center-crop:
    crop, not pad: a face fills the frame. EXIF orientation is applied first; any mode (RGBA,
    LA, P, L, 1, CMYK, 16-bit, float) becomes RGB, transparency composited onto white.

    Raises ``InputError`` (one line) for a missing file, a file Pillow cannot identify or decode,
    an image over ``MAX_PIXELS`` (decompression bombs included) or a zero-size image.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"target size must be positive, got {height}x{width}")
    p = Path(path)
    if not p.exists():
        raise InputError(f"reference image not found: {p}")
    if not p.is_file():
        raise InputError(f"reference image is not a file: {p}")
    if p.stat().st_size == 0:
        raise InputError(f"reference image is empty (0 bytes): {p}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(p) as img:
                _check_size(img.size, p)
                img.load()
                img = ImageOps.exif_transpose(img)
                rgb = _to_rgb(img, p)
    except InputError:
        raise
    except Image.DecompressionBombError:
        raise InputError(
            f"reference image is too large (over {2 * (Image.MAX_IMAGE_PIXELS or 0) / 1e6:.0f} "
            f"megapixels, a decompression bomb?; limit {MAX_PIXELS // 10**6}): {p}"
        ) from None
    except UnidentifiedImageError:
        raise InputError(f"not an image (unrecognised format): {p}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt data
        raise InputError(f"could not decode reference image {p}: {_one_line(e)}") from None
    arr = np.asarray(_cover_crop(rgb, width, height), dtype=np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1)) / np.float32(127.5) - np.float32(1.0)


#: The built-in face: seed of the face renderer (cadence.media.face) in the train split, so the
#: shipped default character (trained on that renderer's faces) is in its own domain out of the box.
DEFAULT_FACE_SEED = 7


def default_reference_image(height: int, width: int) -> torch.Tensor:
    """A built-in stylised face (float32 [3, height, width] in [-1, 1]) for runs without ``--image``.

    Drawn by the renderer that made the default character's training data (``cadence.media.face``,
    face ``DEFAULT_FACE_SEED`` of the train split, mouth closed, eyes open); any size.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"target size must be positive, got {height}x{width}")
    import torch

    from cadence.media.face import face_params, render_face

    frame = render_face(face_params(DEFAULT_FACE_SEED, "train"), height, width, 0.0, False)
    return torch.from_numpy(np.array(frame)).permute(2, 0, 1).float() / 127.5 - 1.0


def _check_size(size: tuple[int, int], p: Path) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise InputError(f"reference image has zero size ({w}x{h}): {p}")
    if w * h > MAX_PIXELS:
        raise InputError(
            f"reference image is too large ({w}x{h} = {w * h / 1e6:.0f} megapixels; limit "
            f"{MAX_PIXELS // 10**6}): {p}"
        )


def _to_rgb(img: Image.Image, p: Path) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB; transparency composited onto ``ALPHA_BACKGROUND``."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        # 16-bit / 32-bit grey: Pillow's convert() clips instead of scaling, so scale here.
        a = np.asarray(img, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or (mode == "I" and a.max(initial=0) > 255) else 255.0
        if mode == "F":
            top = 1.0 if a.max(initial=0) <= 1.0 else 255.0
        g = np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(np.stack([g] * 3, axis=-1), "RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "La", "RGBa")
    if has_alpha or (mode in ("P", "L", "RGB") and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND + (255,))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    try:
        return img.convert("RGB")
    except (ValueError, OSError) as e:
        raise InputError(f"unsupported image mode {mode!r} ({_one_line(e)}): {p}") from None


def _cover_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Scale so the image covers width x height (aspect kept), crop the centre; one resample."""
    w, h = img.size
    scale = max(width / w, height / h)
    # source region that maps onto the target; min(): width / (height / h) can round to a hair over w (241x196
    # onto 128x128 gave a box 1e-13 outside the image, which Pillow refuses: "box offset can't be negative")
    cw, ch = min(w, width / scale), min(h, height / scale)
    left, top = (w - cw) / 2, (h - ch) / 2
    return img.resize(
        (width, height), Image.Resampling.LANCZOS, box=(left, top, left + cw, top + ch), reducing_gap=3.0
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
