"""Media in and out: the reference image, the driving audio, and MP4 output (H.264 + AAC).

Every name is imported on first use (PEP 562): the live server's web process decodes uploaded images
here (``load_reference_array``, NumPy and Pillow only) and must not import torch on the way, and PyAV
(``Mp4Writer``) is a serving/CLI dependency that the GPU machines lack."""

from importlib import import_module

_WHERE = {
    "Mp4Writer": "cadence.media.video",
    "NonFiniteAudio": "cadence.media.pcm",
    "default_reference_image": "cadence.media.image",
    "fit_audio": "cadence.media.audio",
    "load_audio": "cadence.media.audio",
    "load_reference_array": "cadence.media.image",
    "load_reference_image": "cadence.media.image",
    "synthetic_speech": "cadence.media.audio",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'cadence.media' has no attribute {name!r}")


__all__ = sorted(_WHERE)
