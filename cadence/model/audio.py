"""Audio features aligned to latent frames: the audio front end.

The media clock is 48 kHz; one latent frame covers 4 video frames = 166.7 ms = 8,000 samples at
24 fps. Each latent frame's samples are cut into ``audio_tokens_per_frame`` equal windows; each
window becomes one token of ``audio_dim`` log-mel energies (Hann window, power spectrum, triangular
mel filters between 40 Hz and 12 kHz). A stand-in for wav2vec2-style features (whose weights are
not available here) with the same contract: [frames, tokens, audio_dim] per chunk, computed on the
device from the chunk's samples only (no look-ahead).

It is a front end a family declares (``cadence.model.families.LogMelAudio``: the presets' and the text-driven
families'); an audio-driven family declares its own (``Wav2Vec2Audio``: FlashTalk), built the same way from
the recipe (``cadence.model.encoders``).
"""

from __future__ import annotations

import math

import torch

from cadence.config import AUDIO_SAMPLE_RATE, CadenceConfig


def mel_filterbank(
    n_mels: int, n_fft: int, sr: int, fmin: float = 40.0, fmax: float = 12_000.0
) -> torch.Tensor:
    """[n_mels, n_fft//2 + 1] triangular filters on the mel scale (HTK formula)."""

    def hz_to_mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    mels = torch.linspace(hz_to_mel(fmin), hz_to_mel(min(fmax, sr / 2)), n_mels + 2, dtype=torch.float64)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = torch.fft.rfftfreq(n_fft, 1.0 / sr).to(torch.float64)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (bins[None] - lo) / (mid - lo).clamp_min(1e-9)
    down = (hi - bins[None]) / (hi - mid).clamp_min(1e-9)
    fb = torch.clamp(torch.minimum(up, down), min=0.0)
    # filters narrower than a bin would be empty: give them their nearest bin
    empty = fb.sum(1) == 0
    if empty.any():
        idx = torch.searchsorted(bins, mid[empty, 0]).clamp(max=bins.numel() - 1)
        fb[empty.nonzero()[:, 0], idx] = 1.0
    return fb.float()


class AudioFeatures:
    """48 kHz mono samples -> [latent_frames, tokens_per_frame, audio_dim] log-mel tokens."""

    def __init__(self, cfg: CadenceConfig, device: torch.device | str = "cpu"):
        m = cfg.model
        self.tokens = m.audio_tokens_per_frame
        self.dim = m.audio_dim
        self.samples_per_frame = cfg.audio_samples_per_chunk // cfg.stream.latent_frames_per_chunk
        if self.samples_per_frame % self.tokens:
            raise ValueError(
                f"{self.samples_per_frame} samples per latent frame do not split into "
                f"{self.tokens} audio tokens"
            )
        self.win = self.samples_per_frame // self.tokens
        self.n_fft = 1 << max(self.win - 1, 1).bit_length()
        self.window = torch.hann_window(self.win, periodic=True, device=device)
        self.fb = mel_filterbank(self.dim, self.n_fft, AUDIO_SAMPLE_RATE).to(device)

    def __call__(self, samples: torch.Tensor) -> torch.Tensor:
        """samples [n * samples_per_frame] -> [n, tokens, audio_dim] float32 on the samples' device."""
        x = samples.float().reshape(-1, self.tokens, self.win) * self.window
        spec = torch.fft.rfft(x, n=self.n_fft).abs().pow(2)
        return torch.log(spec @ self.fb.T + 1e-6) / 4.0
