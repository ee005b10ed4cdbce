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
second. The engine's clip session for SoulX-FlashTalk (``cadence.engine.flashtalk``) uses FlashTalk's own per-clip
window (``cadence.model.flashtalk.FlashTalkAudio``: ``Resampler``, the loudness functions and ``encode`` below),
not :class:`Wav2Vec2Stream`.
"""

from __future__ import annotations

import json
import math
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


# ---- loudness (ITU-R BS.1770-4 integrated loudness, as pyloudnorm measures it) --------------------------------


def _biquad(x: torch.Tensor, b: tuple[float, float, float], a: tuple[float, float, float]) -> torch.Tensor:
    """Direct-form IIR filter (a[0] = 1) on float64 samples, zero initial state (scipy ``lfilter``'s result): the
    FIR part as a convolution, the two-pole recursion in blocks of ``L`` samples (each block's zero-state
    response by one matmul with the recursion's impulse response, the two carried outputs chained across
    blocks), exact up to float64 rounding."""
    n, L = x.numel(), 256
    xp = F.pad(x, (2, 0))
    v = b[0] * xp[2:] + b[1] * xp[1:-1] + b[2] * xp[:-2]
    a1, a2 = a[1], a[2]
    h = [1.0, -a1]  # impulse response of 1 / (1 + a1 z^-1 + a2 z^-2)
    g1, g2 = [-a1, a1 * a1 - a2], [-a2, a1 * a2]  # responses to y[-1] = 1, to y[-2] = 1
    for _ in range(L - 2):
        h.append(-a1 * h[-1] - a2 * h[-2])
        g1.append(-a1 * g1[-1] - a2 * g1[-2])
        g2.append(-a1 * g2[-1] - a2 * g2[-2])
    h_t = torch.tensor(h, dtype=torch.float64)
    idx = torch.arange(L)
    lag = idx[None, :] - idx[:, None]  # T[j, i] = h[i - j] for i >= j
    toeplitz = torch.where(lag >= 0, h_t[lag.clamp(min=0)], torch.zeros((), dtype=torch.float64))
    blocks = (n + L - 1) // L
    zero_state = F.pad(v, (0, blocks * L - n)).view(blocks, L) @ toeplitz
    g1_t, g2_t = torch.tensor(g1, dtype=torch.float64), torch.tensor(g2, dtype=torch.float64)
    last, prev = 0.0, 0.0  # y at the end of the block before: y[-1], y[-2]
    carry1, carry2 = [], []
    zs = zero_state[:, -2:].tolist()
    for k in range(blocks):
        carry1.append(last)
        carry2.append(prev)
        new_last = zs[k][1] + g1[L - 1] * last + g2[L - 1] * prev
        new_prev = zs[k][0] + g1[L - 2] * last + g2[L - 2] * prev
        last, prev = new_last, new_prev
    c1 = torch.tensor(carry1, dtype=torch.float64)[:, None]
    c2 = torch.tensor(carry2, dtype=torch.float64)[:, None]
    return (zero_state + c1 * g1_t + c2 * g2_t).flatten()[:n]


def _rbj_biquad(kind: str, gain_db: float, q: float, fc: float, rate: float):
    """RBJ Audio-EQ-Cookbook biquads (high shelf / high pass), normalised by a0: (b, a)."""
    amp = 10 ** (gain_db / 40.0)
    w0 = 2.0 * math.pi * (fc / rate)
    cw, alpha = math.cos(w0), math.sin(w0) / (2.0 * q)
    if kind == "high_shelf":
        s = 2 * math.sqrt(amp) * alpha
        b = (
            amp * ((amp + 1) + (amp - 1) * cw + s),
            -2 * amp * ((amp - 1) + (amp + 1) * cw),
            amp * ((amp + 1) + (amp - 1) * cw - s),
        )
        a = ((amp + 1) - (amp - 1) * cw + s, 2 * ((amp - 1) - (amp + 1) * cw), (amp + 1) - (amp - 1) * cw - s)
    else:  # high_pass
        b = ((1 + cw) / 2, -(1 + cw), (1 + cw) / 2)
        a = (1 + alpha, -2 * cw, 1 - alpha)
    return tuple(c / a[0] for c in b), tuple(c / a[0] for c in a)


def integrated_loudness(samples, rate: int, block: float = 0.4, overlap: float = 0.75) -> float:
    """Integrated loudness (LUFS) of mono samples, ITU-R BS.1770-4 as ``pyloudnorm.Meter(rate)`` measures it: the
    K-weighting pair designed at ``rate`` from the cookbook (high shelf +4 dB at 1500 Hz, Q 1/sqrt 2; high pass
    38 Hz, Q 0.5), 400 ms blocks every 100 ms (``round((T - 0.4) / 0.1) + 1`` of them, each mean square over
    the nominal block length), an absolute gate at -70 LUFS and a relative one 10 LU below the gated mean.
    -inf for silence."""
    x = torch.as_tensor(samples).detach().to("cpu", torch.float64).flatten()
    for kind, gain, q, fc in (("high_shelf", 4.0, 1 / math.sqrt(2), 1500.0), ("high_pass", 0.0, 0.5, 38.0)):
        x = _biquad(x, *_rbj_biquad(kind, gain, q, fc, rate))
    step = 1.0 - overlap
    duration = x.numel() / rate
    n_blocks = int(round((duration - block) / (block * step))) + 1
    sq = x * x
    z = torch.stack(
        [
            sq[int(block * (j * step) * rate) : int(block * (j * step + 1) * rate)].sum() / (block * rate)
            for j in range(n_blocks)
        ]
    )
    with torch.no_grad():
        lj = -0.691 + 10.0 * torch.log10(z)
        gated = z[lj >= -70.0]
        rel = -0.691 + 10.0 * math.log10(float(gated.mean())) - 10.0 if gated.numel() else float("nan")
        keep = z[(lj > rel) & (lj > -70.0)]
        mean = float(keep.mean()) if keep.numel() else 0.0
    return -0.691 + 10.0 * math.log10(mean) if mean > 0 else float("-inf")


def loudness_normalize(
    samples, rate: int, target: float = -23.0, loudness: float | None = None
) -> torch.Tensor:
    """InfiniteTalk's / FlashTalk's ``loudness_norm``: the samples scaled by 10^((target - L) / 20) where L is
    :func:`integrated_loudness` (or ``loudness``, measured already); returned unchanged (float64) when
    |L| > 100 (silence, or nearly). float64."""
    x = torch.as_tensor(samples).detach().to("cpu", torch.float64).flatten()
    loud = integrated_loudness(x, rate) if loudness is None else loudness
    if abs(loud) > 100:
        return x
    return 10.0 ** ((target - loud) / 20.0) * x


class Resampler:
    """Streaming sample-rate conversion with ``soxr`` at its 'HQ' quality: what ``librosa.load(path, sr=...)``
    does to a whole file (its default ``res_type='soxr_hq'``), the same output samples when fed in pieces
    (``flush`` at the end gives the tail a whole-file call has). float32 in, float32 out."""

    def __init__(self, rate_in: int, rate_out: int):
        self.rate_in, self.rate_out = rate_in, rate_out
        self._stream = None
        if rate_in != rate_out:
            try:
                import soxr
            except ImportError as e:  # pragma: no cover - soxr comes with the test extra
                raise ImportError(f"resampling {rate_in} -> {rate_out} Hz needs the 'soxr' package") from e
            self._stream = soxr.ResampleStream(rate_in, rate_out, 1, dtype="float32", quality="HQ")

    def push(self, samples, last: bool = False) -> torch.Tensor:
        x = torch.as_tensor(samples).detach().to("cpu", torch.float32).flatten()
        if self._stream is None:
            return x
        return torch.from_numpy(self._stream.resample_chunk(x.numpy(), last=last).copy())

    def flush(self) -> torch.Tensor:
        """The tail held back for the filter's look-ahead; the stream ends here (a later push starts anew)."""
        out = self.push(torch.zeros(0), last=True)
        if self._stream is not None:
            self._stream.clear()
        return out
