"""Quality of talking-character video (issue 7, issue 37): lip sync from face landmarks (``landmarks``, ``sync``),
drift over long streams (``drift``), both per stream (``measure``), the harness behind ``cadence eval``
(``clips``, ``harness``, ``report``), the measure's own check (``validate``) and the pixel metrics
(``metrics``)."""

from cadence.eval.metrics import audio_envelope, frame_distance, identity_drift, lipsync, mouth_opening

__all__ = ["audio_envelope", "frame_distance", "identity_drift", "lipsync", "mouth_opening"]
