"""Media in and out: the reference image, the driving audio, and MP4 output (H.264 + AAC)."""

from cadence.media.audio import fit_audio, load_audio, synthetic_speech
from cadence.media.image import default_reference_image, load_reference_image
from cadence.media.video import Mp4Writer

__all__ = ["Mp4Writer", "default_reference_image", "fit_audio", "load_audio", "load_reference_image",
           "synthetic_speech"]
