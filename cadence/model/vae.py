"""Streaming causal video VAE of the Wan architecture (Wan 2.1: 4x8x8, z=16; Wan 2.2: 4x16x16, z=48).

Plain PyTorch, written for a live stream: the decoder keeps its causal memory in a per-session
:class:`StreamingDecoder` object, so one latent chunk is decoded per call and the next call carries
on exactly where the last one stopped (diffusers' ``AutoencoderKLWan.decode`` clears its cache on
every call, so it can only decode a whole clip).

Configuration is a diffusers ``AutoencoderKLWan`` config dict (``base_dim``, ``decoder_base_dim``,
``z_dim``, ``dim_mult``, ``num_res_blocks``, ``attn_scales``, ``temperal_downsample``,
``is_residual``, ``in_channels``/``out_channels``, ``patch_size``, ``latents_mean``/``latents_std``);
:func:`wan_vae_config` gives the two released geometries. Module names follow diffusers, so
``AutoencoderKLWan.state_dict()`` (or its ``diffusion_pytorch_model.safetensors``) loads with
:meth:`WanVAE.load_diffusers_state_dict` (strict; mismatches raise :class:`WeightsError`).

Causal memory (what a session keeps)
------------------------------------
* Every temporal 3x3x3 / 3x1x1 causal conv keeps the last ``CACHE_T = 2`` frames of its *input*;
  the next call's input is ``[zeros (2 - kept), kept frames, new frames]`` along time, which is the
  zero-padded causal conv of the whole sequence.
* The temporal upsampler (``upsample3d``: a 3x1x1 conv to 2x channels, split into 2 frames) does
  not run on a stream's first latent frame: the first frame stays one frame, its input is not
  remembered, and the second call starts from zero padding (as Wan does).
* The temporal downsampler (encoder, stride-2 3x1x1 conv) passes the first frame through and then
  convolves ``[last frame of the previous call, new frames]``.
* Wan 2.2's ``DupUp3D`` shortcut drops the frames the upsampler did not make on the first frame.

Frames: the first latent frame decodes to ONE video frame, every later latent frame to 4. In a
Cadence stream the first latent frame is the sink (the reference image through
:meth:`WanVAE.encode_image`): a session decodes it first (or with the first chunk) and drops that one
frame, so every generated chunk of ``k`` latent frames then maps to exactly ``4 k`` frames. Chunks
can hold any number of latent frames; the result does not depend on how the latents are split into
calls (tests/test_vae.py checks this against diffusers decoding the whole latent at once).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cadence.errors import ConfigError, WeightsError

#: Frames of input each temporal causal conv remembers across calls (kernel 3 -> 2 past frames).
CACHE_T = 2

# Wan 2.1's latent statistics (diffusers' defaults for AutoencoderKLWan). Wan 2.2's 48 (_WAN22_MEAN /
# _WAN22_STD, below) are the ones its own code normalises with (Wan-Video/Wan2.2 wan/modules/vae2_2.py
# ``Wan2_2_VAE``; tests/test_wan_vae_pth.py checks them against it); a diffusers folder's config.json wins.
_WAN21_MEAN = [
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
]
_WAN21_STD = [
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
]

_WAN22_MEAN = [
    -0.2289,
    -0.0052,
    -0.1323,
    -0.2339,
    -0.2799,
    0.0174,
    0.1838,
    0.1557,
    -0.1382,
    0.0542,
    0.2813,
    0.0891,
    0.157,
    -0.0098,
    0.0375,
    -0.1825,
    -0.2246,
    -0.1207,
    -0.0698,
    0.5109,
    0.2665,
    -0.2108,
    -0.2158,
    0.2502,
    -0.2055,
    -0.0322,
    0.1109,
    0.1567,
    -0.0729,
    0.0899,
    -0.2799,
    -0.123,
    -0.0313,
    -0.1649,
    0.0117,
    0.0723,
    -0.2839,
    -0.2083,
    -0.052,
    0.3748,
    0.0152,
    0.1957,
    0.1433,
    -0.2944,
    0.3573,
    -0.0548,
    -0.1681,
    -0.0667,
]
_WAN22_STD = [
    0.4765,
    1.0364,
    0.4514,
    1.1677,
    0.5313,
    0.499,
    0.4818,
    0.5013,
    0.8158,
    1.0344,
    0.5894,
    1.0901,
    0.6885,
    0.6165,
    0.8454,
    0.4978,
    0.5759,
    0.3523,
    0.7135,
    0.6804,
    0.5833,
    1.4146,
    0.8986,
    0.5659,
    0.7069,
    0.5338,
    0.4889,
    0.4917,
    0.4069,
    0.4999,
    0.6866,
    0.4093,
    0.5709,
    0.6065,
    0.6415,
    0.4944,
    0.5726,
    1.2042,
    0.5458,
    1.6887,
    0.3971,
    1.06,
    0.3943,
    0.5537,
    0.5444,
    0.4089,
    0.7468,
    0.7744,
]

_DEFAULTS = dict(
    base_dim=96,
    decoder_base_dim=None,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=None,
    latents_std=None,
    is_residual=False,
    in_channels=3,
    out_channels=3,
    patch_size=None,
    scale_factor_temporal=4,
    scale_factor_spatial=8,
)


def wan_vae_config(variant: str = "2.1", **overrides) -> dict:
    """The diffusers-style config of a released geometry ('2.1': 4x8x8 z16; '2.2': 4x16x16 z48).

    ``overrides`` replace fields, e.g. ``base_dim=8`` for a tiny test model.
    """
    if variant in ("2.1", "wan2.1", "21"):
        cfg = dict(_DEFAULTS, latents_mean=list(_WAN21_MEAN), latents_std=list(_WAN21_STD))
    elif variant in ("2.2", "wan2.2", "22"):
        cfg = dict(
            _DEFAULTS,
            base_dim=160,
            decoder_base_dim=256,
            z_dim=48,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            latents_mean=list(_WAN22_MEAN),
            latents_std=list(_WAN22_STD),
        )
    else:
        raise ConfigError(
            f"unknown Wan VAE variant {variant!r}; use '2.1' (4x8x8, z=16) or '2.2' (4x16x16, z=48)"
        )
    cfg.update(overrides)
    return cfg


# ---- building blocks ---------------------------------------------------------------------------------


def _zeros_frames(x: torch.Tensor, n: int) -> torch.Tensor:
    """n zero frames shaped like x's frames, in x's memory format (channels_last_3d stays so)."""
    b, c, _, h, w = x.shape
    z = x.new_zeros(b, c, n, h, w)
    if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        z = z.contiguous(memory_format=torch.channels_last_3d)
    return z


def _tail(prev: torch.Tensor | None, x: torch.Tensor, n: int = CACHE_T) -> torch.Tensor:
    """The last n frames of [prev, x] along time, as a fresh tensor (never a view that pins x)."""
    if x.shape[2] >= n or prev is None or prev.shape[2] == 0:
        return x[:, :, -n:].clone()
    return torch.cat([prev[:, :, -(n - x.shape[2]) :], x], 2)


def _per_frame(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply a 4D (N, C, H, W) op to each frame of x [B, C, T, H, W]: time folds into the batch
    (a view, no copy, when x is channels_last_3d or has one frame)."""
    b, c, t, h, w = x.shape
    y = fn(x.transpose(1, 2).reshape(b * t, c, h, w))
    return y.reshape(b, t, *y.shape[1:]).transpose(1, 2)


class CausalConv3d(nn.Conv3d):
    """3D conv, causal in time: ``2 * padding[0]`` past frames (kept ones from the session's memory,
    the rest zeros) are put in front; spatial padding is the conv's own symmetric zero padding."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        k = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        p = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        super().__init__(cin, cout, k, stride=stride, padding=(0, p[1], p[2]))
        self.tpad = 2 * p[0]
        self.slot = -1  # index of this conv's memory in a session's slot list (set by the VAE)
        #: the weight as a 2D conv over time folded into channels (``cadence.runtime.vae_fast``), or None
        self.w2d: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        if self.tpad:
            have = 0 if prev is None else prev.shape[2]
            parts = ([_zeros_frames(x, self.tpad - have)] if have < self.tpad else []) + (
                [prev.to(x.dtype)] if have else []
            )
            x = torch.cat(parts + [x], 2)
        if self.w2d is not None:
            return _conv_time_folded(x, self.w2d, self.bias, self.kernel_size[0], self.padding[1:])
        return super().forward(x)


def fold_time_weight(w: torch.Tensor) -> torch.Tensor:
    """A conv3d weight [O, I, kt, kh, kw] as a conv2d weight [O, kt * I, kh, kw] (channel = dt * I + i),
    channels_last: what :func:`_conv_time_folded` convolves with."""
    o, i, kt, kh, kw = w.shape
    w2 = w.permute(0, 2, 1, 3, 4).reshape(o, kt * i, kh, kw)
    return w2.contiguous(memory_format=torch.channels_last)


def _conv_time_folded(x: torch.Tensor, w2d: torch.Tensor, bias, kt: int, pad) -> torch.Tensor:
    """conv3d (temporal stride 1, no temporal padding: x is already causally padded) as ONE conv2d: each
    output frame's kt input frames are stacked along channels ([B * T_out, H, W, kt * C], channels-last),
    so cuDNN runs a 2D implicit GEMM with kt times the reduction depth. Output [B, O, T_out, H, W] in
    channels_last_3d. Same math as the conv3d (only the summation order differs)."""
    b, c, t, h, w = x.shape
    to = t - kt + 1
    if kt == 1:
        xs = x.permute(0, 2, 3, 4, 1).reshape(b * t, h, w, c)  # a view when x is channels_last_3d
    else:  # [B, C, To, H, W, kt] windows -> [B, To, H, W, kt, C]: one copy
        xs = x.unfold(2, kt, 1).permute(0, 2, 3, 4, 5, 1).reshape(b * to, h, w, kt * c)
    y = F.conv2d(xs.permute(0, 3, 1, 2), w2d, bias, padding=tuple(pad))  # NHWC in, NHWC out
    o, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    return y.permute(0, 2, 3, 1).reshape(b, to, ho, wo, o).permute(0, 4, 1, 2, 3)


class _Memory:
    """One session's causal state for one of the coders: a slot per temporal conv, and whether the
    next call is the stream's first latent frame."""

    def __init__(self, slots: int):
        self.slots: list[torch.Tensor | None] = [None] * slots
        self.first = True


def _causal(conv: CausalConv3d, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
    prev = mem.slots[conv.slot]
    mem.slots[conv.slot] = _tail(prev, x)
    return conv(x, prev)


class RMSNorm(nn.Module):
    """L2-normalise over channels (dim 1), times sqrt(C) and a per-channel gain (parameter ``gamma``
    shaped as diffusers stores it: [C, 1, 1, 1] for video, [C, 1, 1] for images)."""

    def __init__(self, dim: int, images: bool = False):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1) if images else torch.ones(dim, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        g = self.gamma.reshape(-1, *([1] * (x.dim() - 2)))
        return F.normalize(xf, dim=1).to(x.dtype) * (self.scale * g)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = RMSNorm(cin)
        self.conv1 = CausalConv3d(cin, cout, 3, padding=1)
        self.norm2 = RMSNorm(cout)
        self.conv2 = CausalConv3d(cout, cout, 3, padding=1)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        skip = self.conv_shortcut(x)
        x = _causal(self.conv1, F.silu(self.norm1(x)), mem)
        x = _causal(self.conv2, F.silu(self.norm2(x)), mem)
        return x + skip


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (no memory across frames)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def _frames(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(n, 3 * c, h * w).transpose(1, 2)  # [N, HW, 3C]
        q, k, v = qkv[:, None].chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v)[:, 0]  # [N, HW, C]
        return self.proj(o.transpose(1, 2).reshape(n, c, h, w))

    def forward(self, x: torch.Tensor, mem: _Memory | None = None) -> torch.Tensor:
        return x + _per_frame(self._frames, x)


class _Pad01(nn.Module):
    """Zero pad one pixel at the right and bottom (before a stride-2 3x3 conv)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 1, 0, 1))


class _Nearest2x(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest")


class Resample(nn.Module):
    """Spatial 2x up/down (per frame) with an optional temporal 2x (causal, see module docstring).

    ``resample`` is a Sequential whose index 1 is the conv, as diffusers names it."""

    def __init__(self, dim: int, mode: str, out_dim: int | None = None):
        super().__init__()
        self.mode = mode
        out_dim = dim // 2 if out_dim is None else out_dim
        if mode in ("upsample2d", "upsample3d"):
            self.resample = nn.Sequential(_Nearest2x(), nn.Conv2d(dim, out_dim, 3, padding=1))
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode in ("downsample2d", "downsample3d"):
            self.resample = nn.Sequential(_Pad01(), nn.Conv2d(dim, dim, 3, stride=2))
            if mode == "downsample3d":
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))
        else:
            raise ConfigError(f"unknown resample mode {mode!r}")
        #: the 2D conv as four 2x2 sub-pixel convs at the low resolution (``cadence.runtime.vae_fast``), or None
        self.w_subpixel: torch.Tensor | None = None

    def _spatial(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_subpixel is not None:
            conv = self.resample[1]
            return _per_frame(lambda y: _up2_conv3x3(y, self.w_subpixel, conv.bias), x)
        return _per_frame(self.resample, x)

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        if self.mode == "upsample3d":
            slot = self.time_conv.slot
            prev = mem.slots[slot]
            if prev is None:  # the stream's first frame: no temporal upsampling, nothing remembered
                mem.slots[slot] = x[:, :, :0].clone()
            else:
                mem.slots[slot] = _tail(prev, x)
                y = self.time_conv(x, prev)  # [B, 2C, T, H, W]: frame t -> (2t, 2t+1)
                b, c2, t, h, w = y.shape
                x = (
                    y.reshape(b, 2, c2 // 2, t, h, w)
                    .permute(0, 2, 3, 1, 4, 5)
                    .reshape(b, c2 // 2, 2 * t, h, w)
                )
        x = self._spatial(x)
        if self.mode == "downsample3d":
            slot = self.time_conv.slot
            prev = mem.slots[slot]
            mem.slots[slot] = x[:, :, -1:].clone()
            if prev is not None:  # later calls: stride-2 conv over [last previous frame, new frames]
                x = self.time_conv(torch.cat([prev, x], 2))
        return x


# rows (or columns) of a 3-tap kernel that each output phase of "nearest 2x, then 3x3 conv" reads, as two
# taps on the low-resolution input: phase 0 reads inputs (i-1, i, i) -> taps (k0, k1 + k2); phase 1 reads
# (i, i, i+1) -> taps (k0 + k1, k2)
_SUBPIXEL_TAPS = (((1.0, 0.0, 0.0), (0.0, 1.0, 1.0)), ((1.0, 1.0, 0.0), (0.0, 0.0, 1.0)))


def subpixel_weight(w: torch.Tensor) -> torch.Tensor:
    """A 3x3 conv weight [O, C, 3, 3] applied after a nearest 2x upsample, as the 2x2 weights of its four
    output phases on the low-resolution input: [4 O, C, 2, 2], phase p = 2 a + b (row parity a, column
    parity b); channels_last. 2.25x fewer multiply-adds than the conv at the high resolution."""
    r = torch.tensor(_SUBPIXEL_TAPS, dtype=torch.float64, device=w.device)  # [2 phases, 2 taps, 3]
    w4 = torch.einsum("ark,bsl,ockl->abocrs", r, r, w.double())  # [2, 2, O, C, 2, 2]
    o, c = w.shape[:2]
    return w4.reshape(4 * o, c, 2, 2).to(w.dtype).contiguous(memory_format=torch.channels_last)


def _up2_conv3x3(x: torch.Tensor, w4: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv3x3(nearest2x(x), padding=1)`` for x [N, C, H, W] from :func:`subpixel_weight`'s w4: one 2x2
    conv of the zero-padded low-resolution input to the four phases, then the phases interleaved."""
    n, _, h, w = x.shape
    o = w4.shape[0] // 4
    y = F.conv2d(F.pad(x, (1, 1, 1, 1)), w4, None if bias is None else bias.repeat(4))  # [N, 4 O, H+1, W+1]
    rows = [
        torch.stack([y[:, (2 * a + b) * o : (2 * a + b + 1) * o, a : a + h, b : b + w] for b in (0, 1)], -1)
        for a in (0, 1)
    ]  # each [N, O, H, W, 2 (b)]
    out = torch.stack(rows, 3).reshape(n, o, 2 * h, 2 * w)  # [N, O, H, 2 (a), W, 2 (b)] -> [N, O, 2H, 2W]
    cl = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return out.contiguous(memory_format=torch.channels_last) if cl else out


class AvgDown3D(nn.Module):
    """Wan 2.2 encoder shortcut: space/time-to-channel fold, then mean over channel groups."""

    def __init__(self, cin: int, cout: int, ft: int, fs: int):
        super().__init__()
        self.cout, self.ft, self.fs = cout, ft, fs
        self.group = cin * ft * fs * fs // cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ft, fs = self.ft, self.fs
        x = F.pad(x, (0, 0, 0, 0, (-x.shape[2]) % ft, 0))  # front-pad time to a multiple of ft
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        return x.reshape(b, self.cout, self.group, t // ft, h // fs, w // fs).mean(2)


class DupUp3D(nn.Module):
    """Wan 2.2 decoder shortcut: repeat channels, unfold them into time/space (inverse of AvgDown3D)."""

    def __init__(self, cin: int, cout: int, ft: int, fs: int):
        super().__init__()
        self.cout, self.ft, self.fs = cout, ft, fs
        self.repeats = cout * ft * fs * fs // cin

    def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        ft, fs = self.ft, self.fs
        b, _, t, h, w = x.shape
        x = x.repeat_interleave(self.repeats, dim=1).reshape(b, self.cout, ft, fs, fs, t, h, w)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.cout, t * ft, h * fs, w * fs)
        return x[:, :, ft - 1 :] if first else x


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        x = self.resnets[0](x, mem)
        for attn, res in zip(self.attentions, self.resnets[1:]):
            x = res(attn(x), mem)
        return x


class ResidualDownBlock(nn.Module):
    """Wan 2.2 encoder stage: residual blocks + downsampler, plus an AvgDown3D shortcut."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, down: bool):
        super().__init__()
        self.avg_shortcut = AvgDown3D(cin, cout, 2 if temporal else 1, 2 if down else 1)
        self.resnets = nn.ModuleList(
            [ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks)]
        )
        self.downsampler = Resample(cout, "downsample3d" if temporal else "downsample2d") if down else None

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        skip = self.avg_shortcut(x)
        for res in self.resnets:
            x = res(x, mem)
        if self.downsampler is not None:
            x = self.downsampler(x, mem)
        return x + skip


class UpBlock(nn.Module):
    """Wan 2.1 decoder stage: num_res_blocks + 1 residual blocks, then an optional upsampler."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, mode: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1)]
        )
        self.upsamplers = nn.ModuleList([Resample(cout, mode)]) if mode else None

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        for res in self.resnets:
            x = res(x, mem)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, mem)
        return x


class ResidualUpBlock(nn.Module):
    """Wan 2.2 decoder stage: residual blocks + upsampler, plus a DupUp3D shortcut."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.avg_shortcut = DupUp3D(cin, cout, 2 if temporal else 1, 2) if up else None
        self.resnets = nn.ModuleList(
            [ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1)]
        )
        self.upsampler = (
            Resample(cout, "upsample3d" if temporal else "upsample2d", out_dim=cout) if up else None
        )

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        skip = self.avg_shortcut(x, mem.first) if self.avg_shortcut is not None else None
        for res in self.resnets:
            x = res(x, mem)
        if self.upsampler is not None:
            x = self.upsampler(x, mem)
        return x if skip is None else x + skip


class Encoder(nn.Module):
    def __init__(
        self, cin: int, dim: int, z2: int, dim_mult, num_res_blocks: int, attn_scales, tdown, residual: bool
    ):
        super().__init__()
        dims = [dim * m for m in [1, *dim_mult]]
        last = len(dim_mult) - 1
        self.conv_in = CausalConv3d(cin, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        scale = 1.0
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            if residual:
                blocks.append(
                    ResidualDownBlock(
                        a, b, num_res_blocks, temporal=i != last and bool(tdown[i]), down=i != last
                    )
                )
                continue
            for _ in range(num_res_blocks):
                blocks.append(ResidualBlock(a, b))
                if scale in attn_scales:
                    blocks.append(AttentionBlock(b))
                a = b
            if i != last:
                blocks.append(Resample(b, "downsample3d" if tdown[i] else "downsample2d"))
                scale /= 2.0
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], z2, 3, padding=1)

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        x = _causal(self.conv_in, x, mem)
        for blk in self.down_blocks:
            x = blk(x, mem)
        x = self.mid_block(x, mem)
        return _causal(self.conv_out, F.silu(self.norm_out(x)), mem)


class Decoder(nn.Module):
    def __init__(self, dim: int, z: int, dim_mult, num_res_blocks: int, tup, cout: int, residual: bool):
        super().__init__()
        dims = [dim * m for m in [dim_mult[-1], *dim_mult[::-1]]]
        last = len(dim_mult) - 1
        self.conv_in = CausalConv3d(z, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            up = i != last
            temporal = up and bool(tup[i])
            if residual:
                blocks.append(ResidualUpBlock(a, b, num_res_blocks, temporal, up))
            else:  # Wan 2.1: each upsampler halves the channels, so later stages start at half width
                mode = ("upsample3d" if temporal else "upsample2d") if up else None
                blocks.append(UpBlock(a // 2 if i > 0 else a, b, num_res_blocks, mode))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], cout, 3, padding=1)

    def forward(self, x: torch.Tensor, mem: _Memory) -> torch.Tensor:
        x = _causal(self.conv_in, x, mem)
        x = self.mid_block(x, mem)
        for blk in self.up_blocks:
            x = blk(x, mem)
        return _causal(self.conv_out, F.silu(self.norm_out(x)), mem)


def _assign_slots(module: nn.Module) -> int:
    n = 0
    for m in module.modules():
        if isinstance(m, CausalConv3d) and m.kernel_size[0] > 1:
            m.slot = n
            n += 1
    return n


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, C*p*p, T, H/p, W/p], channel order (c, pw, ph) as Wan 2.2 uses."""
    if p == 1:
        return x
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, t, h // p, w // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """Inverse of :func:`patchify`."""
    if p == 1:
        return x
    b, cp, t, h, w = x.shape
    x = x.reshape(b, cp // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cp // (p * p), t, h * p, w * p)


# ---- the model ---------------------------------------------------------------------------------------


class WanVAE(nn.Module):
    """Wan video VAE (both variants) with a streaming decoder; see the module docstring.

    Tensors use diffusers' value range: video in [-1, 1]; latents raw (before normalisation).
    """

    def __init__(self, cfg: dict | None = None, **overrides):
        super().__init__()
        c = dict(_DEFAULTS)
        c.update({k: v for k, v in (cfg or {}).items() if not k.startswith("_")})
        c.update(overrides)
        z = int(c["z_dim"])
        nd = len(c["dim_mult"]) - 1
        if len(c["temperal_downsample"]) < nd:
            raise ConfigError(f"temperal_downsample has {len(c['temperal_downsample'])} entries; need {nd}")
        self.patch = int(c["patch_size"] or 1)
        if c["in_channels"] != 3 * self.patch**2 or c["out_channels"] != 3 * self.patch**2:
            raise ConfigError(
                f"in/out_channels {c['in_channels']}/{c['out_channels']} must be 3 * patch_size^2 = "
                f"{3 * self.patch**2}"
            )
        self.config = c
        self.z_dim = z
        tdown = list(c["temperal_downsample"])[:nd]
        self.stride = (2 ** sum(bool(t) for t in tdown), 2**nd * self.patch, 2**nd * self.patch)
        self.encoder = Encoder(
            c["in_channels"],
            c["base_dim"],
            2 * z,
            c["dim_mult"],
            c["num_res_blocks"],
            c["attn_scales"],
            tdown,
            bool(c["is_residual"]),
        )
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder(
            c["decoder_base_dim"] or c["base_dim"],
            z,
            c["dim_mult"],
            c["num_res_blocks"],
            tdown[::-1],
            c["out_channels"],
            bool(c["is_residual"]),
        )
        self.enc_slots = _assign_slots(self.encoder)
        self.dec_slots = _assign_slots(self.decoder)
        mean = c["latents_mean"] if c["latents_mean"] is not None else [0.0] * z
        std = c["latents_std"] if c["latents_std"] is not None else [1.0] * z
        if len(mean) != z or len(std) != z:
            raise ConfigError(f"latents_mean/std have {len(mean)}/{len(std)} values; z_dim is {z}")
        self.register_buffer("latents_mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("latents_std", torch.tensor(std, dtype=torch.float32), persistent=False)

    # ---- weights ------------------------------------------------------------------------------------
    def load_diffusers_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load an ``AutoencoderKLWan`` state dict (same key names); WeightsError on any mismatch."""
        own = self.state_dict()
        missing = sorted(set(own) - set(sd))
        unexpected = sorted(set(sd) - set(own))
        shapes = [
            f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
            for k in own
            if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)
        ]
        if missing or unexpected or shapes:

            def few(xs):
                return ", ".join(xs[:5]) + (f" (+{len(xs) - 5} more)" if len(xs) > 5 else "")

            parts = [
                f"missing {len(missing)}: {few(missing)}" if missing else "",
                f"unexpected {len(unexpected)}: {few(unexpected)}" if unexpected else "",
                f"shape mismatch {len(shapes)}: {few(shapes)}" if shapes else "",
            ]
            raise WeightsError("Wan VAE checkpoint does not fit: " + "; ".join(p for p in parts if p))
        self.load_state_dict(sd, strict=True)

    @classmethod
    def from_wan_pth(cls, path: str | Path, device="cpu", dtype=torch.float32) -> WanVAE:
        """Wan's original VAE file: ``Wan2.1_VAE.pth`` (Wan-Video's ``WanVAE_`` module names, mapped onto
        diffusers' names by :func:`wan21_vae_to_diffusers`) or ``Wan2.2_VAE.pth`` (``vae2_2.py``'s names,
        :func:`wan22_vae_to_diffusers`; told apart by its nested ``downsamples.i.downsamples.j``). Widths,
        z, residual blocks per stage and (2.2) the temporal down-sampling flags are read off the tensors;
        the latent statistics are the variant's own (the values Wan's code hard-codes: 16 for 2.1, 48 for
        2.2), never 0 / 1."""
        path = Path(path)
        if not path.is_file():
            raise WeightsError(f"Wan VAE checkpoint {path} does not exist")
        try:
            sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # not a torch file
            raise WeightsError(f"cannot read Wan VAE checkpoint {path}: {e}") from None
        if "encoder.conv1.weight" not in sd or "conv2.weight" not in sd:
            raise WeightsError(
                f"Wan VAE checkpoint {path}: not Wan 2.1's or 2.2's VAE layout (no encoder.conv1 / conv2; "
                f"first keys: {', '.join(list(sd)[:4])})"
            )
        base, z = sd["encoder.conv1.weight"].shape[0], sd["conv2.weight"].shape[0]
        if "encoder.downsamples.0.downsamples.0.residual.0.gamma" in sd:  # Wan 2.2's nested stages
            cfg = wan_vae_config("2.2", base_dim=int(base), z_dim=int(z))
            nrb = 0
            while f"encoder.downsamples.0.downsamples.{nrb}.residual.0.gamma" in sd:
                nrb += 1
            stages = len(cfg["dim_mult"])
            cfg.update(
                num_res_blocks=nrb,
                decoder_base_dim=int(sd["decoder.head.0.gamma"].shape[0]) // cfg["dim_mult"][0]
                if "decoder.head.0.gamma" in sd
                else None,
                temperal_downsample=[
                    f"encoder.downsamples.{i}.downsamples.{nrb}.time_conv.weight" in sd
                    for i in range(stages - 1)
                ],
            )
            vae, mapped = cls(cfg), wan22_vae_to_diffusers(sd, nrb)
        else:
            vae = cls(wan_vae_config("2.1", base_dim=int(base), z_dim=int(z)))
            mapped = wan21_vae_to_diffusers(sd, vae.config["num_res_blocks"], len(vae.config["dim_mult"]))
        try:
            vae.load_diffusers_state_dict(mapped)
        except WeightsError as e:
            raise WeightsError(f"{path}: {e}") from None
        return vae.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_diffusers_dir(cls, path: str | Path, device="cpu", dtype=torch.float32) -> WanVAE:
        """A diffusers ``vae/`` folder: config.json + diffusion_pytorch_model.safetensors."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        # diffusers' name when present (the folder may also hold other models' files, e.g. taehv.safetensors)
        files = sorted(path.glob("diffusion_pytorch_model*.safetensors")) or sorted(
            path.glob("*.safetensors")
        )
        if not files:
            raise WeightsError(f"no .safetensors file in {path}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        vae = cls(cfg)
        vae.load_diffusers_state_dict(sd)
        return vae.to(device=device, dtype=dtype).eval()

    # ---- latent statistics --------------------------------------------------------------------------
    def _stat(self, v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        shape = [1] * like.dim()
        shape[-4] = -1  # channel dim of [z, F, h, w] or [B, z, F, h, w]
        return v.to(like.device, like.dtype).reshape(shape)

    def normalize_latents(self, lat: torch.Tensor) -> torch.Tensor:
        """Raw VAE latent -> the diffusion model's space: (z - latents_mean) / latents_std."""
        return (lat - self._stat(self.latents_mean, lat)) / self._stat(self.latents_std, lat)

    def denormalize_latents(self, lat: torch.Tensor) -> torch.Tensor:
        """Diffusion-model latent -> raw VAE latent: z * latents_std + latents_mean."""
        return lat * self._stat(self.latents_std, lat) + self._stat(self.latents_mean, lat)

    # ---- encoder ------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """video [3, T, H, W] or [B, 3, T, H, W] in [-1, 1], T = 1 + 4k -> latent mean [.., z, 1 + k, h, w]
        (the posterior's mode, as diffusers' ``encode(x).latent_dist.mode()``)."""
        return self.encode_with_grad(video)

    def encode_with_grad(self, video: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` without ``no_grad`` (training)."""
        single = video.dim() == 4
        x = video[None] if single else video
        t = x.shape[2]
        if (t - 1) % self.stride[0]:
            raise ConfigError(f"encode needs 1 + {self.stride[0]}k frames, got {t}")
        p = self.param_dtype()
        x = patchify(x.to(p), self.patch)
        mem = _Memory(self.enc_slots)
        outs = [self.encoder(x[:, :, :1], mem)]  # the first frame alone (causal start)
        mem.first = False
        if t > 1:
            outs.append(self.encoder(x[:, :, 1:], mem))
        mu = self.quant_conv(torch.cat(outs, 2))[:, : self.z_dim]
        return mu[0] if single else mu

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """Reference image [3, H, W] (or [B, 3, H, W]) in [-1, 1] -> raw sink latent [.., z, 1, h, w]."""
        return self.encode(image.unsqueeze(-3))

    def param_dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    # ---- decoder ------------------------------------------------------------------------------------
    def stream(self) -> StreamingDecoder:
        """A fresh per-session decoder state."""
        return StreamingDecoder(self)

    def frames_for(self, latent_frames: int, first: bool = True) -> int:
        """Video frames decoded from `latent_frames` latent frames (a stream's first makes only one)."""
        return (
            (1 + self.stride[0] * (latent_frames - 1) if first else self.stride[0] * latent_frames)
            if latent_frames
            else 0
        )


_WAN21_RES = [
    (r"\.residual\.0\.", ".norm1."),
    (r"\.residual\.2\.", ".conv1."),
    (r"\.residual\.3\.", ".norm2."),
    (r"\.residual\.6\.", ".conv2."),
    (r"\.shortcut\.", ".conv_shortcut."),
]


def _wan_common_key(n: str) -> str:
    """The renames Wan 2.1's and 2.2's original VAE keys share: conv1 / conv2 -> quant_conv /
    post_quant_conv; {en,de}coder.conv1 / head.0 / head.2 -> conv_in / norm_out / conv_out; middle.0/1/2 ->
    mid_block.resnets.0 / attentions.0 / resnets.1."""
    if re.match(r"conv1\.", n):
        n = "quant_conv." + n[len("conv1.") :]
    elif re.match(r"conv2\.", n):
        n = "post_quant_conv." + n[len("conv2.") :]
    n = re.sub(r"^(encoder|decoder)\.conv1\.", r"\1.conv_in.", n)
    n = re.sub(r"^(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0.", n)
    n = re.sub(r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0.", n)
    n = re.sub(r"^(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1.", n)
    n = re.sub(r"^(encoder|decoder)\.head\.0\.", r"\1.norm_out.", n)
    return re.sub(r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out.", n)


def wan21_vae_to_diffusers(
    sd: dict[str, torch.Tensor], num_res_blocks: int = 2, stages: int = 4
) -> dict[str, torch.Tensor]:
    """Wan 2.1's ``WanVAE_`` state dict -> ``AutoencoderKLWan`` names (what :class:`WanVAE` uses).

    conv1 / conv2 -> quant_conv / post_quant_conv; {en,de}coder.conv1 -> conv_in; middle.0/1/2 ->
    mid_block.resnets.0 / attentions.0 / resnets.1; head.0/2 -> norm_out / conv_out; residual.0/2/3/6 ->
    norm1 / conv1 / norm2 / conv2, shortcut -> conv_shortcut; encoder.downsamples.i -> down_blocks.i
    (both flat); decoder.upsamples.i (flat: per stage num_res_blocks + 1 blocks, then an upsampler except
    after the last stage) -> up_blocks.s.resnets.j / up_blocks.s.upsamplers.0. Keys that fit none of
    these are kept as they are (the strict load then names them)."""
    per = num_res_blocks + 2  # resnets + upsampler of every stage but the last
    out = {}
    for k, v in sd.items():
        n = _wan_common_key(k)
        n = re.sub(r"^encoder\.downsamples\.", "encoder.down_blocks.", n)
        m = re.match(r"decoder\.upsamples\.(\d+)\.(.*)", n)
        if m:
            i = int(m.group(1))
            s, j = divmod(i, per)
            if s >= stages - 1:  # the last stage has no upsampler
                s, j = stages - 1, i - (stages - 1) * per
            where = "upsamplers.0" if j == num_res_blocks + 1 else f"resnets.{j}"
            n = f"decoder.up_blocks.{s}.{where}.{m.group(2)}"
        for p, r in _WAN21_RES:
            n = re.sub(p, r, n)
        out[n] = v
    return out


def wan22_vae_to_diffusers(sd: dict[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    """Wan 2.2's ``WanVAE_`` (``vae2_2.py``) state dict -> ``AutoencoderKLWan`` names (is_residual=True).

    conv1 / conv2 -> quant_conv / post_quant_conv; {en,de}coder.conv1 / head.0 / head.2 -> conv_in /
    norm_out / conv_out; middle.0/1/2 -> mid_block.resnets.0 / attentions.0 / resnets.1;
    encoder.downsamples.i.downsamples.j -> down_blocks.i.resnets.j (j < num_res_blocks) or
    down_blocks.i.downsampler (j = num_res_blocks); decoder.upsamples.i.upsamples.j -> up_blocks.i.resnets.j
    (j <= num_res_blocks) or up_blocks.i.upsampler (j = num_res_blocks + 1); residual.0/2/3/6 -> norm1 /
    conv1 / norm2 / conv2, shortcut -> conv_shortcut. The AvgDown3D / DupUp3D shortcuts hold no weights.
    Keys that fit none of these are kept as they are (the strict load then names them)."""
    out = {}
    for k, v in sd.items():
        n = _wan_common_key(k)
        m = re.match(r"encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.(.*)", n)
        if m:
            j = int(m.group(2))
            where = "downsampler" if j == num_res_blocks else f"resnets.{j}"
            n = f"encoder.down_blocks.{m.group(1)}.{where}.{m.group(3)}"
        m = re.match(r"decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.(.*)", n)
        if m:
            j = int(m.group(2))
            where = "upsampler" if j == num_res_blocks + 1 else f"resnets.{j}"
            n = f"decoder.up_blocks.{m.group(1)}.{where}.{m.group(3)}"
        for p, r in _WAN21_RES:
            n = re.sub(p, r, n)
        out[n] = v
    return out


class StreamingDecoder:
    """One session's decode state for a :class:`WanVAE`: feed latent chunks in stream order.

    The causal memory (2 input frames per temporal conv, the temporal upsamplers' priming) lives in
    this object and persists across :meth:`decode_chunk` calls; sessions never share it.
    """

    def __init__(self, vae: WanVAE):
        self.vae = vae
        self.reset()

    def reset(self) -> None:
        """Forget the stream: the next latent frame decodes as a stream's first (to one frame)."""
        self._mem = _Memory(self.vae.dec_slots)
        self.latent_frames = 0  #: latent frames decoded so far
        self.video_frames = 0  #: video frames produced so far

    @torch.no_grad()
    def decode_chunk(self, latent: torch.Tensor) -> torch.Tensor:
        """Raw latent [z, F, h, w] (or [B, z, F, h, w]) -> frames [3, T, H, W] (or batched) in [-1, 1].

        T = 4F, except on the stream's first call, where the first latent frame gives one frame
        (T = 1 + 4(F - 1)). Output dtype/device are the VAE's."""
        return self.decode_with_grad(latent, clamp=True)

    def decode_with_grad(self, latent: torch.Tensor, clamp: bool = False) -> torch.Tensor:
        """:meth:`decode_chunk` without ``no_grad`` and, unless asked, without the final clamp (training)."""
        single = latent.dim() == 4
        x = latent[None] if single else latent
        vae = self.vae
        x = vae.post_quant_conv(x.to(vae.param_dtype()))
        if (
            vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last_3d)
            and not vae.decoder.conv_in.weight.is_contiguous()
        ):
            x = x.contiguous(memory_format=torch.channels_last_3d)
        outs = []
        mem = self._mem
        if mem.first and x.shape[2]:
            outs.append(vae.decoder(x[:, :, :1], mem))
            mem.first = False
            x = x[:, :, 1:]
        if x.shape[2]:
            outs.append(vae.decoder(x, mem))
        if not outs:
            raise ValueError("decode_chunk got a latent with no frames")
        n = latent.shape[-3]
        out = unpatchify(torch.cat(outs, 2) if len(outs) > 1 else outs[0], vae.patch)
        if clamp:
            out = out.clamp_(-1.0, 1.0)
        self.latent_frames += n
        self.video_frames += out.shape[2]
        return out[0] if single else out


def load_wan_vae(path: str | Path, device="cpu", dtype=torch.float32) -> WanVAE:
    """A Wan VAE from a diffusers ``vae/`` folder or Wan's original ``.pth`` file, 2.1 or 2.2 (what
    ``VAEConfig.weights`` may name)."""
    path = Path(path)
    return (
        WanVAE.from_diffusers_dir(path, device, dtype)
        if path.is_dir()
        else WanVAE.from_wan_pth(path, device, dtype)
    )
