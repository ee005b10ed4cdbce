"""Quality metrics for talking-character video (issue 7): lip sync and identity drift (``metrics``)."""

from cadence.eval.metrics import audio_envelope, frame_distance, identity_drift, lipsync, mouth_opening

__all__ = ["audio_envelope", "frame_distance", "identity_drift", "lipsync", "mouth_opening"]
