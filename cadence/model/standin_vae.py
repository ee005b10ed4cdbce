"""A weightless stand-in autoencoder with the VAE's geometry (the streaming Wan VAE is separate).

Each latent pixel stands for a (4 frames x s x s pixels x 3 colours) block. The encoder keeps, per
colour, the lowest 2D DCT coefficients (zig-zag order) of the block's time-average, z // 3 of them
per colour; the decoder inverts that projection and repeats it over the block's frames (the first
latent frame of a stream, the reference image, is one frame). Orthonormal, so decode(encode(x)) is
the best low-pass approximation of x in that basis: blurry but recognisable, enough to see a stream.
"""

from __future__ import annotations

import math

import torch

from cadence.config import CadenceConfig


def _dct_basis(n: int) -> torch.Tensor:
    """Orthonormal DCT-II basis [n, n] (row k = frequency k)."""
    i = torch.arange(n, dtype=torch.float64)
    b = torch.cos(math.pi * (i[None, :] + 0.5) * i[:, None] / n)
    b[0] /= math.sqrt(2.0)
    return (b * math.sqrt(2.0 / n)).float()


class StandInVAE:
    def __init__(self, cfg: CadenceConfig, device: torch.device | str = "cpu"):
        self.t, self.s, _ = cfg.vae.stride
        self.z = cfg.vae.latent_channels
        s = self.s
        per = self.z // 3
        d = _dct_basis(s)
        freqs = sorted(((u, v) for u in range(s) for v in range(s)), key=lambda p: (p[0] + p[1], p[0]))[:per]
        basis = torch.stack([torch.outer(d[u], d[v]).flatten() for u, v in freqs])  # [per, s*s]
        full = torch.zeros(self.z, 3, s * s)
        for c in range(3):
            full[c * per : (c + 1) * per, c] = basis
        self.basis = full.reshape(self.z, 3 * s * s).to(device)  # rows orthonormal

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """video [3, T, H, W] in [-1, 1] (T = 1 for an image, else a multiple of 4) -> [z, F, H/s, W/s]."""
        c, t, h, w = video.shape
        s = self.s
        frames = video.float().reshape(c, -1, self.t if t > 1 else 1, h, w).mean(2)  # [3, F, H, W]
        blocks = frames.reshape(3, -1, h // s, s, w // s, s).permute(1, 2, 4, 0, 3, 5)
        lat = blocks.reshape(*blocks.shape[:3], 3 * s * s) @ self.basis.T  # [F, h, w, z]
        return lat.permute(3, 0, 1, 2).contiguous()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [z, F, h, w] -> uint8 frames [F * 4, H, W, 3] (on the latents' device)."""
        z, f, h, w = latents.shape
        s = self.s
        blocks = latents.float().permute(1, 2, 3, 0) @ self.basis  # [F, h, w, 3*s*s]
        img = blocks.reshape(f, h, w, 3, s, s).permute(0, 1, 4, 2, 5, 3).reshape(f, h * s, w * s, 3)
        img = img.repeat_interleave(self.t, dim=0)
        return ((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
