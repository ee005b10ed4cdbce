"""The clip streams' side of the speech cut-in (FlashHead, FlashTalk: ``ChunkRequest.rewind``; the server's side is
``cadence.serve.pacing.cut_in_point`` and ``cadence.serve.scheduler.ChunkScheduler``).

A clip stream makes each clip whole from its audio and the motion latents of the frames before it. A cut-in starts
the next clip ``rewind`` frames before the end of the last one made (frame k), so that speech that arrives while
silent clips are queued reaches the screen one clip's latency later instead of after them: the clip's motion
latents are the re-encode of the ``motion_frames`` frames before k as they were sent (uint8), its audio window the
stream's up to k (:class:`CutInHistory` rebuilds it from the samples it kept), and the frames from k on are
forgotten. The session keeps its last ``CLIPS_KEPT`` clips' frames, so a cut-in can go back at most that many
clips less the motion frames (``cut_in_frames``, what the worker reports as ``WorkerInfo.cut_in``).
"""

from __future__ import annotations

import torch

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.errors import InputError

#: Clips whose frames the session keeps for a cut-in (``FlashHeadSession.rewind``).
CLIPS_KEPT = 2
#: A clip session runs its audio one video frame (25 fps) behind the engine's clock: the resampler's hold-back.
AUDIO_LAG = AUDIO_SAMPLE_RATE // 25


class CutInHistory:
    """What a clip stream keeps to start a clip inside the last ones (a speech cut-in): the 48 kHz samples it
    was given (the session's lag first: the last ``keep_samples``, cut in whole video frames of ``per_frame``)
    and the frames it made (uint8 [n, H, W, 3], the last ``clips`` clips').

    ``rebuild`` gives a fresh audio window (``FlashTalkAudio``'s kind) the state it would have had after these
    samples, with the clips made up to the end of the last whole clip: the window ends there, the rest is
    pending. Fed from the stream's start it is the same state (tested); cut, the resampler's first few output
    samples differ, more than the window's length (8 s) before its end when ``keep_samples`` exceeds the window
    by the rewind plus the filter."""

    def __init__(self, per_frame: int, keep_samples: int):
        self.per_frame, self.keep = per_frame, keep_samples
        self.samples = torch.zeros(0)
        self.start = 0  # the stream sample of samples[0]
        self.frames: torch.Tensor | None = None
        self.made = 0  # video frames made (the audio behind them: lag + made x per_frame samples)

    def push(self, samples: torch.Tensor, frames: torch.Tensor | None = None, clips: int = 2) -> None:
        self.samples = torch.cat([self.samples, samples.float()])
        over = (self.samples.numel() - self.keep) // self.per_frame * self.per_frame
        if over > 0:
            self.samples, self.start = self.samples[over:], self.start + over
        if frames is not None:
            self.made += frames.shape[0]
            kept = frames if self.frames is None else torch.cat([self.frames, frames])
            self.frames = kept[-clips * frames.shape[0] :]

    def rewind(self, frames: int) -> None:
        """Forget the last ``frames`` frames and their samples."""
        self.samples = self.samples[: self.samples.numel() - frames * self.per_frame]
        self.frames = self.frames[: self.frames.shape[0] - frames]
        self.made -= frames

    def rebuild(self, audio):
        """``audio`` (fresh) as if it had been given these samples and made a clip of every whole slice up to the
        frames made: the window ends at frame ``made`` of the stream, what follows is pending."""
        ratio = audio.resampler.rate_in // audio.rate  # 48 -> 16 kHz: 3 (whole frames: a multiple of it)
        out = audio.resampler.push(self.samples)
        end = self.made * self.per_frame // ratio - self.start // ratio
        done = out[: max(0, end)].double()
        size = audio.window.numel()
        take = min(size, done.numel())
        if take:
            audio.window = torch.cat([audio.window[: size - take], done[done.numel() - take :]])
        audio.pending = out[max(0, end) :]
        return audio


def cut_in_history(audio) -> CutInHistory:
    """The history a session with this audio window keeps: whole video frames of the window's input rate (25 fps),
    its 8 s and 3 s more (the most a cut-in goes back, two Pro clips = 2.24 s, and the resampler's filter)."""
    ratio = audio.resampler.rate_in // audio.rate
    return CutInHistory(
        audio.resampler.rate_in // audio.f.fps, (audio.window.numel() + 3 * audio.rate) * ratio
    )


class ClipCutIn:
    """What every clip session (FlashHead, FlashTalk) shares, the cut-in among them (mixed in): needs ``cfg``,
    ``audio`` (its window), ``index``, ``next_frame``, ``decode_device``, ``motion_frames``, ``heard`` (a
    :class:`CutInHistory` every clip's samples and frames go to, :meth:`_clip_out`), ``model``, ``_new_audio()``
    (a fresh audio window), ``_encode_motion(video)`` and ``_set_motion(latents)``."""

    def _check_image(self, image: torch.Tensor) -> None:
        h, w = self.cfg.stream.height, self.cfg.stream.width
        if tuple(image.shape) != (3, h, w):
            raise InputError(
                f"reference image must be [3, {h}, {w}] for {self.cfg.name}, got {list(image.shape)}"
            )

    def _clip_audio(self, samples: torch.Tensor):
        """The one clip's audio windows a chunk's 48 kHz ``samples`` (float32, on the host) complete."""
        clips = self.audio.push(samples)
        if len(clips) != 1:  # the lag covers the resampler's hold-back; anything else is a broken clock
            raise RuntimeError(
                f"chunk {self.index}: its audio completed {len(clips)} clips (expected 1): the resampler held "
                f"back more than the session's {AUDIO_LAG}-sample lag"
            )
        return clips[0]

    def _clip_out(self, samples: torch.Tensor, video: torch.Tensor) -> torch.Tensor:
        """The clip's video [3, T, H, W] in [-1, 1] as uint8 frames [T, H, W, 3], kept with its samples for a
        cut-in; the stream's clock moves on by one chunk."""
        self.next_frame += self.cfg.stream.latent_frames_per_chunk
        self.index += 1
        out = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()
        self.heard.push(samples, out, CLIPS_KEPT)
        return out

    def prime_decoder(self) -> bool:
        return False

    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """The step's frames, already pixels: moved to the decode device."""
        return frames.to(self.decode_device)

    @classmethod
    def cut_in_frames(cls, gen) -> tuple[int, int]:
        """(the most frames the next clip may start before the last one's end, the motion frames it needs)."""
        new, motion = gen.cfg.video_frames_per_chunk, gen.rules.stream.motion_frames
        return CLIPS_KEPT * new - motion, motion

    @torch.no_grad()
    def rewind(self, frames: int) -> None:
        """The next clip starts ``frames`` frames before the end of the last one (module docstring)."""
        shown = self.heard.frames
        if frames <= 0 or shown is None or frames + self.motion_frames > shown.shape[0]:
            have = 0 if shown is None else shown.shape[0]
            raise InputError(
                f"rewind {frames}: the session keeps {have} frames, {self.motion_frames} needed before the cut"
            )
        keep = shown.shape[0] - frames
        before = shown[keep - self.motion_frames : keep].to(self.model.device)
        self._set_motion(self._encode_motion(before.permute(3, 0, 1, 2).float() / 127.5 - 1.0))
        self.heard.rewind(frames)
        self.audio = self.heard.rebuild(self._new_audio())
        self.cut_ins += 1
