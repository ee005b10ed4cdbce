"""Media in and out: the reference image, the driving audio, and MP4 output (H.264 + AAC).

``Mp4Writer`` is imported on first use: PyAV is a serving/CLI dependency, and the engine and the
training script import this package on machines without it (the GPU machines)."""

from cadence.media.audio import fit_audio, load_audio, synthetic_speech
from cadence.media.image import default_reference_image, load_reference_image


def __getattr__(name: str):
    if name == "Mp4Writer":
        from cadence.media.video import Mp4Writer

        return Mp4Writer
    raise AttributeError(f"module 'cadence.media' has no attribute {name!r}")


__all__ = [
    "Mp4Writer",
    "default_reference_image",
    "fit_audio",
    "load_audio",
    "load_reference_image",
    "synthetic_speech",
]
