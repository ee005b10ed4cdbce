"""Uploads: the body of ``POST /sessions`` (JSON with a base64 image, or a multipart form with an image
file), the reference image's decode, and speech audio (``POST /sessions/{id}/audio``).

The image is looked at only after its session was admitted (the manager's ``reserve``: a full server decodes
nothing). Its header is read before its pixels (over ``max_image_pixels``: 413, nothing decoded); decodes run
``decode_concurrency`` at a time on a pool of their own (:class:`ImageDecoder`, never the event loop's
shared executor) and give their memory back to the OS afterwards (glibc ``malloc_trim``: rounds of 8
parallel 64 MP uploads once left 2 GB behind, issue 20). Everything here runs in the web process, which
imports no torch: NumPy and Pillow only (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from cadence.errors import InputError
from cadence.media.pcm import NonFiniteAudio
from cadence.serve.agent import decode_audio_bytes
from cadence.serve.guard import ApiError, parse_json, short
from cadence.serve.heap import trim_memory

#: Formats a reference image may be in (Pillow plugin names); anything else is a 400 before any decoding.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO (phone photos)


# ---- the session request's body ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionBody:
    """What ``POST /sessions`` carried: its fields (to be checked by the body's model,
    ``cadence.serve.schemas.session_models``), a form's image bytes (None: none sent; ``b""``: an empty file,
    a 400 later) and whether it was a form (the seed's syntax differs)."""

    fields: dict
    image: bytes | None
    form: bool


async def read_session_body(request, max_image_bytes: int) -> SessionBody:
    """The body of ``POST /sessions`` as JSON or a multipart form, or a 400 / 413 / 415."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        body = parse_json(await request.body(), "request body")
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return SessionBody(body, None, form=False)
    if ctype.startswith("multipart/form-data"):
        return await _form_body(request, max_image_bytes)
    raise ApiError(
        415,
        f"POST /sessions takes application/json or multipart/form-data, got {short(ctype) or 'none'!r}",
    )


def base64_image(b64: str | None) -> bytes | None:
    """The image of a JSON ``POST /sessions`` (``image_base64``, a data URL's too), or a 400."""
    if not b64:
        return None
    if b64.startswith("data:"):
        b64 = b64.split(",", 1)[-1]
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "image_base64 is not valid base64") from None


async def _form_body(request, max_image_bytes: int) -> SessionBody:
    try:
        parsed = await request.form(max_files=1, max_fields=20)
    except ApiError:
        raise
    except Exception as e:
        raise ApiError(400, f"could not parse the multipart form: {e}") from None
    fields = {k: v for k, v in parsed.items() if isinstance(v, str) and k != "image"}
    image_bytes = None
    up = parsed.get("image")
    if up is not None and not isinstance(up, str):
        image_bytes = await up.read(max_image_bytes + 1)
        if len(image_bytes) > max_image_bytes:
            raise ApiError(413, f"reference image is too large (over {max_image_bytes} bytes)")
        if not image_bytes:
            image_bytes = None if not up.filename else b""
    return SessionBody(fields, image_bytes, form=True)


# ---- the reference image -----------------------------------------------------------------------------------


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """The image's (width, height) from its header alone (Pillow's ``open`` reads no pixel data), or an
    ApiError: 400 for data that is not an image in one of ``IMAGE_FORMATS``, 413 over ``max_pixels``."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
                w, h = im.size
    except Image.DecompressionBombError:
        raise ApiError(
            413, f"reference image is too large (over {max_pixels / 1e6:.1f} megapixels)"
        ) from None
    except UnidentifiedImageError:
        raise ApiError(
            400, f"reference image is not an image in a format the server takes ({', '.join(IMAGE_FORMATS)})"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ApiError(400, f"could not read the reference image's header: {short(str(e), 200)}") from None
    if w < 1 or h < 1:
        raise ApiError(400, f"reference image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ApiError(
            413,
            f"reference image is {w}x{h} pixels ({w * h / 1e6:.1f} megapixels); the limit is "
            f"{max_pixels / 1e6:.1f} megapixels",
        )
    return w, h


def decode_image(data: bytes, engine_cfg, limit: int, max_pixels: int) -> np.ndarray:
    """Bytes -> the engine's reference image (HxWx3 float in [-1, 1], covered and cropped). The header first
    (size, format: :func:`image_size`), the pixels only then; the memory goes back to the OS afterwards."""
    if len(data) > limit:
        raise ApiError(413, f"reference image is too large ({len(data)} bytes; limit {limit})")
    if not data:
        raise ApiError(400, "reference image is empty (0 bytes)")
    image_size(data, max_pixels)
    from cadence.media.image import load_reference_array  # (NumPy and Pillow: no torch in this process)

    fd, path = tempfile.mkstemp(prefix="cadence-upload-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            img = load_reference_array(path, engine_cfg.stream.height, engine_cfg.stream.width)
        except InputError as e:
            msg = str(e).replace(path, "upload").replace(": upload", "")
            raise ApiError(413 if "too large" in msg else 400, msg) from None
        return img
    finally:
        os.unlink(path)
        trim_memory()


class ImageDecoder:
    """Reference images decoded at most ``cfg.decode_concurrency`` at once, on a pool of that many threads."""

    def __init__(self, cfg, engine_cfg):
        self.cfg, self.engine_cfg = cfg, engine_cfg
        self._sem = asyncio.Semaphore(cfg.decode_concurrency)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            cfg.decode_concurrency, thread_name_prefix="cadence-decode"
        )

    def start(self) -> None:
        self._pool.submit(int).result()  # the decode thread exists from now on (a steady thread count)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def trim_soon(self) -> None:
        """Give freed heap memory back to the OS (``trim_memory``) on the decode thread, off the event loop."""
        try:
            self._pool.submit(trim_memory)
        except RuntimeError:  # shut down
            pass

    async def decode(self, data: bytes) -> np.ndarray:
        """The reference image as the engine takes it (:func:`decode_image`), off the event loop."""
        async with self._sem:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool,
                decode_image,
                data,
                self.engine_cfg,
                self.cfg.max_image_bytes,
                self.cfg.max_image_pixels,
            )


# ---- speech audio ------------------------------------------------------------------------------------------


async def decode_speech(data: bytes, limit: int) -> np.ndarray:
    """Any audio file FFmpeg decodes -> 48 kHz mono float32 in [-1, 1] (off the event loop), or 413 / 415, or
    400 for audio with NaN or infinite samples (a float WAV can carry them; they would blank the video)."""
    if len(data) > limit:
        raise ApiError(413, f"audio is too large ({len(data)} bytes; limit {limit})")
    try:
        return await asyncio.to_thread(decode_audio_bytes, data)
    except NonFiniteAudio as e:
        raise ApiError(400, str(e)) from None
    except InputError as e:
        raise ApiError(415, f"unsupported audio: {e}") from None
