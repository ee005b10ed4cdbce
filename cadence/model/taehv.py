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

:class:`PublishedTAEHV` is the layout of the published TAEHV weights (madebyollin/taehv's ``taew2_1.pth``
for Wan 2.1 latents, ``taew2_2.pth`` for Wan 2.2's), loaded from the published files by
:func:`load_published_taehv` and tested against the reference ``taehv.py`` (tests/test_taehv_format.py);
it streams through the same :class:`TAEHVStream`.
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
        self.conv = nn.Sequential(
            _conv(2 * c, c), nn.ReLU(inplace=True), _conv(c, c), nn.ReLU(inplace=True), _conv(c, c)
        )
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
    """Temporal kx (default 2): a 1x1 conv to kC channels, read as k consecutive frames (k = 1: a plain
    1x1 conv, as the published decoders have in their first stage)."""

    def __init__(self, c: int, stride: int = 2):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(c, stride * c, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        return self.conv(x).reshape(n * self.stride, c, h, w)  # frame i -> (ki, ..., ki + k - 1)


class TAEHV(nn.Module):
    """Tiny decoder. ``stride`` = (4, s, s) of the VAE whose latents it reads; ``channels`` per stage
    (len = log2(s) + 1, from the latent resolution to the output resolution)."""

    def __init__(
        self,
        z_dim: int = 16,
        stride: tuple[int, int, int] = (4, 8, 8),
        channels: tuple[int, ...] | None = None,
        blocks_per_stage: int = 1,
        shuffle: int = 1,
    ):
        super().__init__()
        st, s, s2 = stride
        n_up = int(round(math.log2(s)))
        n_t = int(round(math.log2(st)))
        n_sh = int(round(math.log2(shuffle))) if shuffle >= 1 else -1
        if s != s2 or 2**n_up != s or 2**n_t != st or n_t > n_up:
            raise ConfigError(f"TAEHV needs stride (2^a, 2^b, 2^b) with a <= b, got {stride}")
        if n_sh < 0 or 2**n_sh != shuffle or n_sh > n_up:
            raise ConfigError(
                f"TAEHV shuffle must be a power of two <= the spatial stride {s}, got {shuffle}"
            )
        n_conv = n_up - n_sh  # spatial 2x steps done by upsample + conv; the rest by one pixel shuffle
        channels = tuple(channels) if channels else tuple(max(32, 256 >> i) for i in range(n_conv + 1))
        if len(channels) != n_conv + 1:
            raise ConfigError(
                f"TAEHV channels needs {n_conv + 1} entries for stride {s} and shuffle {shuffle}, "
                f"got {len(channels)}"
            )
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
            layers += [
                nn.Upsample(scale_factor=2.0, mode="nearest"),
                _conv(channels[i], channels[i + 1], bias=False),
            ]
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
            x = x[:, :, self.stride[0] - 1 :]
        return torch.tanh(x)

    @torch.no_grad()
    def decode_video(self, latent: torch.Tensor) -> torch.Tensor:
        """Whole latent [z, F, h, w] (or batched) at once, from a fresh state."""
        single = latent.dim() == 4
        out = self._run(latent[None] if single else latent, [None] * self.n_slots, first=True)
        return out[0] if single else out

    def stream(self) -> TAEHVStream:
        return TAEHVStream(self)


def load_taehv(folder, device="cpu", dtype=torch.float32) -> TAEHV:
    """``taehv.json`` (constructor arguments) + ``taehv.safetensors`` in `folder` -> a TAEHV in eval mode."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(folder)
    kw = json.loads((folder / "taehv.json").read_text())
    model = TAEHV(
        kw["z_dim"],
        tuple(kw["stride"]),
        tuple(kw["channels"]),
        kw.get("blocks_per_stage", 1),
        kw.get("shuffle", 1),
    )
    model.load_state_dict(load_file(str(folder / "taehv.safetensors")), strict=True)
    return model.to(device=device, dtype=dtype).eval()


class _Clamp(nn.Module):
    """tanh(x / 3) * 3: the published decoders' soft clamp of the incoming latent."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class PublishedTAEHV(nn.Module):
    """The published TAEHV decoder layout (madebyollin/taehv ``taew2_1.pth`` / ``taew2_2.pth``), our own
    code with the same module indices, so the published state dict's ``decoder.*`` entries load as they
    are (its ``encoder.*`` entries are not used: Cadence encodes the reference image with the Wan VAE).

    ``decoder`` = soft clamp, conv z -> c0, ReLU, then per stage: 3 MemBlocks, nearest 2x upsample, a
    TGrow (x1 in the first stage, x2 after), a conv to the next width; ReLU and a conv to 3 p^2 channels
    (p = 2 for Wan 2.2: a pixel shuffle). Outputs are clamped to [0, 1] as the published code does, then
    mapped to [-1, 1] (the engine's frame contract). A stream's first latent frame keeps only its last
    frame (the published ``frames_to_trim`` = 3), so a stream decodes to Wan's frame count. It reads raw
    (denormalised) Wan latents, like diffusers' ``AutoencoderKLWan.decode``.
    """

    def __init__(
        self,
        latent_channels: int = 16,
        patch_size: int = 1,
        channels=(256, 128, 64, 64),
        time_upscale=(False, True, True),
        space_upscale=(True, True, True),
    ):
        super().__init__()
        c = tuple(channels)
        layers: list[nn.Module] = [_Clamp(), _conv(latent_channels, c[0]), nn.ReLU(inplace=True)]
        for i in range(3):
            layers += [
                MemBlock(c[i]),
                MemBlock(c[i]),
                MemBlock(c[i]),
                nn.Upsample(scale_factor=2 if space_upscale[i] else 1),
                TGrow(c[i], 2 if time_upscale[i] else 1),
                _conv(c[i], c[i + 1], bias=False),
            ]
        layers += [nn.ReLU(inplace=True), _conv(c[3], 3 * patch_size * patch_size)]
        self.decoder = nn.Sequential(*layers)
        self.latent_channels, self.patch_size, self.channels = latent_channels, patch_size, c
        st = 2 ** sum(bool(t) for t in time_upscale)
        ss = 2 ** sum(bool(t) for t in space_upscale) * patch_size
        self.stride = (st, ss, ss)
        self.n_slots = 0
        for m in self.modules():
            if isinstance(m, MemBlock):
                m.slot = self.n_slots
                self.n_slots += 1

    def _run(self, lat: torch.Tensor, mem: list, first: bool) -> torch.Tensor:
        """lat [B, z, F, h, w] -> [B, 3, T, H, W] in [-1, 1]."""
        b, z, f, h, w = lat.shape
        x = lat.to(self.decoder[1].weight.dtype).transpose(1, 2).reshape(b * f, z, h, w)
        for layer in self.decoder:
            x = layer(x, b, mem) if isinstance(layer, MemBlock) else layer(x)
        if self.patch_size > 1:
            x = F.pixel_shuffle(x, self.patch_size)
        n, c, hh, ww = x.shape
        x = x.reshape(b, n // b, c, hh, ww).transpose(1, 2).clamp(0, 1)
        if first:
            x = x[:, :, self.stride[0] - 1 :]
        return x * 2 - 1

    @torch.no_grad()
    def decode_video(self, latent: torch.Tensor) -> torch.Tensor:
        """Whole latent [z, F, h, w] (or batched) at once, from a fresh state; frames in [-1, 1]."""
        single = latent.dim() == 4
        out = self._run(latent[None] if single else latent, [None] * self.n_slots, first=True)
        return out[0] if single else out

    def stream(self) -> TAEHVStream:
        return TAEHVStream(self)


def load_published_taehv(path, device="cpu", dtype=torch.float32) -> PublishedTAEHV:
    """A published TAEHV file (``taew2_1.pth`` / ``taew2_2.pth``, or its ``.safetensors``) -> a
    :class:`PublishedTAEHV` in eval mode. The geometry (latent channels, patch size, stage widths, which
    stages grow time) is read off the tensors; anything else fails with one :class:`WeightsError` that
    names the file and lists the missing / mis-shaped decoder keys (the 'super' variant is refused)."""
    from pathlib import Path

    from cadence.errors import WeightsError

    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"TAEHV weights {path} do not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch / safetensors file
        raise WeightsError(f"cannot read TAEHV weights {path}: {e}") from None
    dec = {k[len("decoder.") :]: v for k, v in sd.items() if k.startswith("decoder.")}
    if not dec:
        raise WeightsError(
            f"TAEHV weights {path}: no decoder.* entries (first keys: {', '.join(list(sd)[:4])})"
        )
    if "0.weight" in dec and dec["0.weight"].ndim == 4 and dec["0.weight"].shape[-1] == 1:
        raise WeightsError(f"TAEHV weights {path}: the 'super' decoder variant is not supported")
    try:
        z = dec["1.weight"].shape[1]
        c = (
            dec["1.weight"].shape[0],
            dec["8.weight"].shape[0],
            dec["14.weight"].shape[0],
            dec["20.weight"].shape[0],
        )
        p = int(round((dec["22.weight"].shape[0] // 3) ** 0.5))
        grow = tuple(
            dec[f"{i}.conv.weight"].shape[0] // dec[f"{i}.conv.weight"].shape[1] == 2 for i in (7, 13, 19)
        )
    except KeyError as e:
        raise WeightsError(
            f"TAEHV weights {path}: not the published decoder layout (no decoder.{e.args[0]})"
        ) from None
    model = PublishedTAEHV(z, p, c, grow)
    want = model.decoder.state_dict()
    missing = sorted(set(want) - set(dec))
    unexpected = sorted(set(dec) - set(want))
    shapes = [
        f"{k}: {tuple(dec[k].shape)} vs {tuple(want[k].shape)}"
        for k in sorted(set(want) & set(dec))
        if dec[k].shape != want[k].shape
    ]
    if missing or unexpected or shapes:
        raise WeightsError(
            f"TAEHV weights {path} do not fit the published decoder (z={z}, patch {p}, widths {c}): "
            f"missing {missing[:6]}, unexpected {unexpected[:6]}, mis-shaped {shapes[:4]}"
        )
    model.decoder.load_state_dict(dec)
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


def tiny_decoder_from_config(cfg, device="cpu", dtype=torch.float32):
    """The 'taehv' decoder a configuration asks for: the published decoder from ``vae.taehv_weights`` (its
    latent geometry must match the VAE's), else Cadence's own from the ``vae.weights`` folder's
    ``taehv.safetensors``, else None (the caller builds a random one)."""
    from pathlib import Path

    from cadence.config import resolve_asset

    v = cfg.vae
    if v.taehv_weights:
        m = load_published_taehv(resolve_asset(v.taehv_weights), device, dtype)
        if (m.latent_channels, m.stride) != (v.latent_channels, tuple(v.stride)):
            raise ConfigError(
                f"TAEHV weights {v.taehv_weights} decode z={m.latent_channels} latents at stride "
                f"{m.stride}; the VAE is z={v.latent_channels} at {tuple(v.stride)}"
            )
        return m
    if v.weights and (Path(resolve_asset(v.weights)) / "taehv.safetensors").is_file():
        return load_taehv(resolve_asset(v.weights), device, dtype)
    return None
