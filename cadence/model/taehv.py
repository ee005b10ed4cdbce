"""A tiny causal video decoder (TAEHV-style, our own code): the cheap alternative to the Wan decoder.

Latent [z, F, h, w] -> frames [3, T, H, W] with the same geometry as the Wan VAE it stands next to
(stride 4 x s x s, s = 8 or 16). All convolutions are per-frame 2D convs; time enters only through

* :class:`MemBlock`: a residual block whose first conv sees ``[x_t, x_{t-1}]`` (the block's input
  one frame back: a one-frame causal memory per block), and
* :class:`TGrow`: a 1x1 conv to ``2C`` channels split into two consecutive frames (temporal 2x).

Two of the stages grow time (4x), all stages grow space 2x. A stream's first latent frame makes 4
frames of which only the last is kept, so frame counts match Wan's (1 + 4 (F - 1)). The stream
state (:class:`TAEHVStream`) holds one frame per MemBlock, so :meth:`TAEHVStream.decode_chunk`
called chunk by chunk equals :meth:`TAEHV.decode_video` on the whole latent (tests/test_vae.py).

``shuffle=k`` replaces the last log2(k) spatial 2x steps by one sub-pixel convolution (the last conv
writes 3 k^2 channels, ``pixel_shuffle`` spreads them over k x k pixels), so the expensive full-size
convolutions disappear: the trained default character (cadence.train.character) uses k = 4 to decode
128x128 on a 2-core CPU in real time. Randomly initialised unless a state dict of this layout is
loaded (``load_taehv``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from cadence.errors import ConfigError


def _conv(cin: int, cout: int, k: int = 3, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, padding=k // 2, bias=bias)


class MemBlock(nn.Module):
    """y_t = x_t + conv(relu(conv(relu(conv([x_t, x_{t-1}]))))) on [B*T, C, H, W] frames."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * c, c), nn.ReLU(inplace=True), _conv(c, c), nn.ReLU(inplace=True),
                                  _conv(c, c))
        self.slot = -1

    def forward(self, x: torch.Tensor, b: int, mem: list) -> torch.Tensor:
        n, c, h, w = x.shape
        t = n // b
        x5 = x.reshape(b, t, c, h, w)
        prev = mem[self.slot]
        prev = x5.new_zeros(b, 1, c, h, w) if prev is None else prev
        past = torch.cat([prev, x5[:, :-1]], 1).reshape(n, c, h, w)
        mem[self.slot] = x5[:, -1:].clone()
        return F.relu(x + self.conv(torch.cat([x, past], 1)))


class TGrow(nn.Module):
    """Temporal 2x: a 1x1 conv to 2C channels, read as 2 consecutive frames."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, 2 * c, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        return self.conv(x).reshape(n * 2, c, h, w)  # frame i -> (2i, 2i+1)


class TAEHV(nn.Module):
    """Tiny decoder. ``stride`` = (4, s, s) of the VAE whose latents it reads; ``channels`` per stage
    (len = log2(s) + 1, from the latent resolution to the output resolution)."""

    def __init__(self, z_dim: int = 16, stride: tuple[int, int, int] = (4, 8, 8),
                 channels: tuple[int, ...] | None = None, blocks_per_stage: int = 1, shuffle: int = 1):
        super().__init__()
        st, s, s2 = stride
        n_up = int(round(math.log2(s)))
        n_t = int(round(math.log2(st)))
        n_sh = int(round(math.log2(shuffle))) if shuffle >= 1 else -1
        if s != s2 or 2 ** n_up != s or 2 ** n_t != st or n_t > n_up:
            raise ConfigError(f"TAEHV needs stride (2^a, 2^b, 2^b) with a <= b, got {stride}")
        if n_sh < 0 or 2 ** n_sh != shuffle or n_sh > n_up:
            raise ConfigError(f"TAEHV shuffle must be a power of two <= the spatial stride {s}, got {shuffle}")
        n_conv = n_up - n_sh  # spatial 2x steps done by upsample + conv; the rest by one pixel shuffle
        channels = tuple(channels) if channels else tuple(max(32, 256 >> i) for i in range(n_conv + 1))
        if len(channels) != n_conv + 1:
            raise ConfigError(f"TAEHV channels needs {n_conv + 1} entries for stride {s} and shuffle {shuffle}, "
                              f"got {len(channels)}")
        self.z_dim, self.stride, self.channels, self.shuffle = z_dim, tuple(stride), channels, shuffle
        self.conv_in = _conv(z_dim, channels[0])
        # temporal 2x steps: one per stage from the first, any left over all in the first stage (cheap:
        # it runs at the latent resolution)
        grows = [1 if i < n_t else 0 for i in range(max(n_conv, 1))]
        grows[0] += n_t - sum(grows)
        stages = []
        for i in range(n_conv):
            layers: list[nn.Module] = [MemBlock(channels[i]) for _ in range(blocks_per_stage)]
            layers += [TGrow(channels[i]) for _ in range(grows[i])]
            layers += [nn.Upsample(scale_factor=2.0, mode="nearest"), _conv(channels[i], channels[i + 1], bias=False)]
            stages.append(nn.ModuleList(layers))
        if n_conv == 0:
            stages.append(nn.ModuleList([TGrow(channels[0]) for _ in range(n_t)]))
        self.stages = nn.ModuleList(stages)
        self.head = MemBlock(channels[-1])
        self.conv_out = _conv(channels[-1], 3 * shuffle * shuffle)
        self.n_slots = 0
        for m in self.modules():
            if isinstance(m, MemBlock):
                m.slot = self.n_slots
                self.n_slots += 1

    def _run(self, lat: torch.Tensor, mem: list, first: bool) -> torch.Tensor:
        """lat [B, z, F, h, w] -> [B, 3, stride_t * F (minus the trimmed first frames), H, W]."""
        b, z, f, h, w = lat.shape
        x = lat.to(self.conv_in.weight.dtype).transpose(1, 2).reshape(b * f, z, h, w)
        x = F.relu(self.conv_in(x))
        for stage in self.stages:
            for layer in stage:
                x = layer(x, b, mem) if isinstance(layer, MemBlock) else layer(x)
        x = self.conv_out(F.relu(self.head(x, b, mem)))
        if self.shuffle > 1:
            x = F.pixel_shuffle(x, self.shuffle)
        n, c, hh, ww = x.shape
        x = x.reshape(b, n // b, c, hh, ww).transpose(1, 2)
        if first:  # the stream's first latent frame keeps only its last frame (Wan's frame count)
            x = x[:, :, self.stride[0] - 1:]
        return torch.tanh(x)

    @torch.no_grad()
    def decode_video(self, latent: torch.Tensor) -> torch.Tensor:
        """Whole latent [z, F, h, w] (or batched) at once, from a fresh state."""
        single = latent.dim() == 4
        out = self._run(latent[None] if single else latent, [None] * self.n_slots, first=True)
        return out[0] if single else out

    def stream(self) -> "TAEHVStream":
        return TAEHVStream(self)


def load_taehv(folder, device="cpu", dtype=torch.float32) -> "TAEHV":
    """``taehv.json`` (constructor arguments) + ``taehv.safetensors`` in `folder` -> a TAEHV in eval mode."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(folder)
    kw = json.loads((folder / "taehv.json").read_text())
    model = TAEHV(kw["z_dim"], tuple(kw["stride"]), tuple(kw["channels"]), kw.get("blocks_per_stage", 1),
                  kw.get("shuffle", 1))
    model.load_state_dict(load_file(str(folder / "taehv.safetensors")), strict=True)
    return model.to(device=device, dtype=dtype).eval()


class TAEHVStream:
    """One session's state for :class:`TAEHV` (one frame per MemBlock); same API as the Wan
    :class:`~cadence.model.vae.StreamingDecoder`."""

    def __init__(self, model: TAEHV):
        self.vae = model
        self.reset()

    def reset(self) -> None:
        self._mem: list = [None] * self.vae.n_slots
        self.latent_frames = 0
        self.video_frames = 0

    @torch.no_grad()
    def decode_chunk(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent [z, F, h, w] (or batched) -> frames [3, T, H, W] in [-1, 1]; T = 4F, 1 + 4(F-1) first."""
        single = latent.dim() == 4
        out = self.vae._run(latent[None] if single else latent, self._mem, first=self.latent_frames == 0)
        self.latent_frames += latent.shape[-3]
        self.video_frames += out.shape[2]
        return out[0] if single else out
