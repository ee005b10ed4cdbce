"""3D rotary position embedding over (frame, height, width), as Wan splits a head.

A head of D channels is split into D - 4*(D//6) frame channels and 2*(D//6) channels each for
height and width; channel pairs (2i, 2i+1) are rotated together (interleaved layout, as in Wan and
diffusers). Angles are computed in float32 from integer positions: ``pos * inv_freq``. Positions are
in token units (latent frame index, and patch row / column).
"""

from __future__ import annotations

import torch


def inv_freqs(dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of one rotary part of `dim` channels (dim/2 values), float64 then float32."""
    return (1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)).float()


class Rope3D:
    """Builds (cos, sin) tables for token grids; holds its frequency vectors on one device."""

    def __init__(self, split: tuple[int, int, int], theta: float, device: torch.device | str = "cpu"):
        self.split = split
        self.inv = [inv_freqs(d, theta).to(device) for d in split]

    def to(self, device) -> Rope3D:
        self.inv = [f.to(device) for f in self.inv]
        return self

    def frame_angles(self, frames: torch.Tensor) -> torch.Tensor:
        """[F] integer frame positions -> [F, split[0]/2] float32 angles."""
        return frames.to(torch.float32)[:, None] * self.inv[0][None, :]

    def angles(self, frames: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """Angles for tokens ordered (frame, row, column): [F*grid_h*grid_w, D/2] float32.

        `frames` is a device tensor of integer frame positions (one per latent frame of the grid).
        """
        dev = self.inv[0].device
        f = self.frame_angles(frames)
        h = torch.arange(grid_h, device=dev, dtype=torch.float32)[:, None] * self.inv[1][None, :]
        w = torch.arange(grid_w, device=dev, dtype=torch.float32)[:, None] * self.inv[2][None, :]
        nf = f.shape[0]
        return torch.cat(
            [
                f[:, None, None, :].expand(nf, grid_h, grid_w, -1),
                h[None, :, None, :].expand(nf, grid_h, grid_w, -1),
                w[None, None, :, :].expand(nf, grid_h, grid_w, -1),
            ],
            dim=-1,
        ).reshape(nf * grid_h * grid_w, -1)

    def cos_sin(self, frames: torch.Tensor, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.angles(frames, grid_h, grid_w)
        return torch.cos(a), torch.sin(a)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of x [B, N, H, D] by angles given as cos/sin [N, D/2].

    Each pair (x[2i], x[2i+1]) is read as the complex number x[2i] + j x[2i+1] and multiplied by
    cos + j sin, in float32 (three passes over the tensor: upcast, complex product, downcast);
    returned in x's dtype.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rot = torch.complex(cos, sin)[None, :, None, :]
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)
