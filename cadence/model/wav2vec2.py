"""wav2vec2 audio features as an audio-driven family uses them, whole clip or streamed chunk by chunk.

The family is InfiniteTalk's (MeiGen-AI/InfiniteTalk; SoulX-FlashTalk builds on its audio path):

* a ``transformers`` ``Wav2Vec2Model`` (a local folder: config.json + weights, and the feature extractor's
  preprocessor_config.json) at 16 kHz; the samples normalised to zero mean and unit variance
  (``Wav2Vec2FeatureExtractor``'s ``do_normalize``, over the samples encoded together);
* its CNN features *linearly interpolated* (``align_corners=True``) to the number of video frames the audio
  spans (25 fps: 640 samples a frame) before the feature projection and the transformer encoder;
* every encoder layer's hidden state stacked: [frames, layers, dim] (``hidden_states[1:]``);
* per video frame t, the frames t-2 .. t+2 (``audio_window`` 5; clamped to the clip at its ends):
  [frames, 5, layers, dim].

:class:`Wav2Vec2Features` is that path for a whole clip (``encode``; ``frame_windows`` for the windows).
:class:`Wav2Vec2Stream` is the live version: audio arrives in pieces of any length; a chunk of
``chunk_frames`` video frames is emitted once the audio reaches 2 frames past it (the window's look-ahead:
80 ms at 25 fps), encoded from the last ``context_frames`` frames of audio ending there. The reference encodes
the whole clip at once (its transformer attends over all of it, and the interpolation grid depends on the
clip's length), so a stream's features equal the reference's on the *window it encoded*, not on the whole
clip: ``tests/test_wav2vec2.py`` checks the first exactly against InfiniteTalk's own code and measures the
second. Not wired into the engine yet (Cadence's media clock is 48 kHz; no audio-driven family is registered).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F

WINDOW = 5  # InfiniteTalk's audio_window: frames t-2 .. t+2


def frame_windows(
    emb: torch.Tensor, first: int, n: int, offset: int = 0, last: int | None = None
) -> torch.Tensor:
    """Frames first .. first+n-1's windows: emb [frames, ...] holds frames offset .. -> [n, WINDOW, ...];
    indices clamped to [0, last] (last: the clip's last frame, None = no end clamp), as InfiniteTalk's
    ``center_indices``."""
    half = WINDOW // 2
    idx = torch.arange(first, first + n)[:, None] + torch.arange(-half, half + 1)[None, :]
    idx = idx.clamp(min=0) if last is None else idx.clamp(min=0, max=last)
    idx = idx - offset
    if int(idx.min()) < 0 or int(idx.max()) >= emb.shape[0]:
        raise ValueError(f"frames {first}..{first + n - 1} need frames outside the {emb.shape[0]} encoded")
    return emb[idx.to(emb.device)]


class Wav2Vec2Features:
    """A ``transformers`` ``Wav2Vec2Model`` folder -> per-video-frame features [frames, layers, dim]."""

    def __init__(self, model, fps: int = 25, device: str | torch.device = "cpu", dtype=torch.float32):
        from transformers import Wav2Vec2Model

        folder = Path(model) if isinstance(model, (str, Path)) else None
        self.model = (Wav2Vec2Model.from_pretrained(str(folder)) if folder is not None else model).eval()
        self.model.to(device=device, dtype=dtype).requires_grad_(False)
        pre_file = folder / "preprocessor_config.json" if folder is not None else None
        pre = json.loads(pre_file.read_text()) if pre_file is not None and pre_file.is_file() else {}
        self.sample_rate = int(pre.get("sampling_rate", 16000))
        self.normalize = bool(pre.get("do_normalize", True))
        self.fps = fps
        if self.sample_rate % fps:
            raise ValueError(f"{self.sample_rate} Hz does not split into {fps} fps frames")
        self.hop = self.sample_rate // fps
        self.device, self.dtype = torch.device(device), dtype

    @property
    def layers(self) -> int:
        return self.model.config.num_hidden_layers

    @torch.no_grad()
    def encode(self, samples: torch.Tensor, frames: int | None = None) -> torch.Tensor:
        """samples [n] at ``sample_rate`` -> [frames, layers, dim] (frames default: the whole video frames the
        samples span, as the reference's ``int(len / sr * fps)``)."""
        m = self.model
        x = samples.detach().to("cpu", torch.float64).flatten()
        if frames is None:
            frames = int(x.numel() / self.sample_rate * self.fps)
        if self.normalize:  # Wav2Vec2FeatureExtractor.zero_mean_unit_var_norm (population variance, eps 1e-7)
            x = (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-7)
        x = x.to(self.device, self.dtype)[None]
        feats = m.feature_extractor(x)  # [1, C, T]
        feats = F.interpolate(feats, size=frames, mode="linear", align_corners=True).transpose(1, 2)
        hidden, _ = m.feature_projection(feats)
        outs: list[torch.Tensor] = []

        def keep(_mod, _inp, out):
            outs.append(out[0] if isinstance(out, tuple) else out)

        hooks = [layer.register_forward_hook(keep) for layer in m.encoder.layers]
        try:
            last = m.encoder(hidden)
        finally:
            for h in hooks:
                h.remove()
        last = last[0] if isinstance(last, tuple) else last.last_hidden_state
        if m.config.do_stable_layer_norm:  # the stable-norm encoder's last hidden state is the normed one
            outs[-1] = last
        return torch.stack(outs, dim=2)[0]  # [frames, layers, dim]


class Wav2Vec2Stream:
    """Live audio -> one [chunk_frames, WINDOW, layers, dim] block per chunk of video frames (see the module
    docstring). ``push(samples)`` returns the chunks its audio completed (maybe none)."""

    def __init__(self, features: Wav2Vec2Features, chunk_frames: int, context_frames: int):
        self.f, self.n = features, chunk_frames
        self.lookahead = WINDOW // 2
        if context_frames < chunk_frames + 2 * self.lookahead:
            raise ValueError(
                f"context_frames {context_frames} cannot hold a chunk of {chunk_frames} frames and its "
                f"windows (need >= {chunk_frames + 2 * self.lookahead})"
            )
        self.context = context_frames
        self.reset()

    def reset(self) -> None:
        self.buf = torch.zeros(0, dtype=torch.float32)
        self.buf_start = 0  # video frame of buf[0]
        self.next = 0  # the next video frame to emit
        self.windows: deque[tuple[int, int]] = deque(maxlen=64)  # (first, end) frames encoded per chunk

    def push(self, samples: torch.Tensor) -> list[torch.Tensor]:
        hop = self.f.hop
        self.buf = torch.cat([self.buf, samples.detach().to("cpu", torch.float32).flatten()])
        out = []
        while self.buf_start + self.buf.numel() // hop >= self.next + self.n + self.lookahead:
            b = self.next + self.n + self.lookahead
            a = max(0, b - self.context)
            audio = self.buf[(a - self.buf_start) * hop : (b - self.buf_start) * hop]
            emb = self.f.encode(audio, b - a)
            out.append(frame_windows(emb, self.next, self.n, offset=a))
            self.windows.append((a, b))
            self.next += self.n
            keep = max(0, self.next + self.n + self.lookahead - self.context)  # the next window's first frame
            if keep > self.buf_start:
                self.buf = self.buf[(keep - self.buf_start) * hop :]
                self.buf_start = keep
        return out
