"""3D rotary position embedding over (frame, height, width), as Wan splits a head.

A head of D channels is split into D - 4*(D//6) frame channels and 2*(D//6) channels each for
height and width; channel pairs (2i, 2i+1) are rotated together (interleaved layout, as in Wan and
diffusers). Angles are computed in float32 from integer positions: ``pos * inv_freq``. Positions are
in token units (latent frame index, and patch row / column).

Two forms of the rotation, the same function: :func:`apply_rope` (the reference: complex float32, three passes
over the tensor) and :func:`apply_rope_real` (the same products written as real float32 arithmetic, one pass
where a compiler fuses it: the whole-sequence path's fast form, ``ElementwiseOps.apply_rope`` compiled by
``cadence.runtime.compile``). The tables of a grid whose frames are consecutive are kept per geometry
(:meth:`Rope3D.grid_cos_sin`): a clip-streamed family runs every pass of every clip at the same positions.
"""

from __future__ import annotations

import torch


def inv_freqs(dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of one rotary part of `dim` channels (dim/2 values), float64 then float32."""
    return (1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)).float()


class Rope3D:
    """Builds (cos, sin) tables for token grids; holds its frequency vectors on one device."""

    #: geometries whose tables are kept (:meth:`grid_cos_sin`); past it a new geometry is computed, not kept
    MAX_TABLES = 16

    def __init__(self, split: tuple[int, int, int], theta: float, device: torch.device | str = "cpu"):
        self.split = split
        self.inv = [inv_freqs(d, theta).to(device) for d in split]
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def to(self, device) -> Rope3D:
        self.inv = [f.to(device) for f in self.inv]
        self._tables = {}
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

    def grid_cos_sin(
        self, first: int, frames: int, grid_h: int, grid_w: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` of the consecutive frames ``first .. first + frames - 1`` (host ints), computed once per
        geometry and kept (the same values: the angles are a function of the positions alone). Kept tables are
        never replaced, so a CUDA graph that read one keeps reading valid memory; none is kept while a CUDA
        graph is being captured (its memory would belong to the graph's pool), and past ``MAX_TABLES``
        geometries new ones are computed per call."""
        key = (first, frames, grid_h, grid_w)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        dev = self.inv[0].device
        out = self.cos_sin(torch.arange(first, first + frames, device=dev), grid_h, grid_w)
        capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if len(self._tables) < self.MAX_TABLES and not capturing:
            self._tables[key] = out
        return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of x [B, N, H, D] by angles given as cos/sin [N, D/2].

    Each pair (x[2i], x[2i+1]) is read as the complex number x[2i] + j x[2i+1] and multiplied by
    cos + j sin, in float32 (three passes over the tensor: upcast, complex product, downcast);
    returned in x's dtype.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rot = torch.complex(cos, sin)[None, :, None, :]
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


def apply_rope_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in real float32 arithmetic: (a, b) -> (a cos - b sin, a sin + b cos), the complex
    product's own two sums, in x's dtype. No complex tensors, so a compiler (Inductor) fuses the upcast, the
    rotation and the downcast into one pass that reads x and the float32 table once and writes the result once
    (the Triton ring writes rotate with the same formula). Equal to :func:`apply_rope` up to the contraction of a
    multiply-add (one float32 rounding), hence to one unit of x's dtype on a small share of elements."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)
