"""Training of Cadence's own small default character (issue 7): synthetic data first (``data``)."""

from cadence.train.data import Clip, ClipSpec, FaceParams, held_out_split, make_clip

__all__ = ["Clip", "ClipSpec", "FaceParams", "held_out_split", "make_clip"]
