"""The LTX-Video causal video VAE as SoulX-FlashHead's Lite model uses it (Cadence's own plain PyTorch).

    vae = LTXVideoVAE.from_folder("SoulX-FlashHead-1_3B/VAE_LTX", device="cuda", dtype=torch.bfloat16)
    lat = vae.encode(frames, generator=g)     # [3, T, H, W] in [-1, 1] -> normalised latents [C, F, h, w]
    video = vae.decode(lat)                   # normalised latents -> [3, 1 + 8 (F - 1), H, W] (not clamped)
    for chunk in vae.stream_decode(lat, chunk_frames=4): ...   # the same frames, emitted as they are final

The folder (what FlashHead's ``CausalVideoAutoencoder.from_pretrained`` reads from ``VAE_LTX/``): diffusers'
layout, ``config.json`` (``_class_name: AutoencoderKLLTXVideo``, the 14 keys of LTX-Video 0.9.0's VAE) and
``diffusion_pytorch_model.safetensors`` (diffusers' key names, ``latents_mean`` / ``latents_std`` included).
Their loader accepts that folder only when the config equals the 0.9.0 one and maps it to its own block list;
this module reads every size from the config instead (``block_out_channels``, ``layers_per_block``,
``spatio_temporal_scaling``, ``latent_channels``, ``patch_size``, optional ``decoder_*`` sizes; absent, the
decoder mirrors the encoder as in 0.9.0 and in FlashHead's mapping) and checks every tensor's shape against
it. Blocks of later LTX VAEs (0.9.1+: timestep conditioning, decoder noise injection, residual or
channel-reducing upsamplers, the 0.9.5 down blocks, temporal patches) are refused with a ConfigError: FlashHead's
wrapper could not run them either (it decodes with no timestep; its table maps the 0.9.0 config only).

Geometry of the released Lite VAE (the 0.9.0 config): 128 latent channels, patch 4 then three spatio-temporal
2x stages: spatial stride 32, temporal stride 8. Encoder widths 128 -> 256 -> 512 -> 512 (4, 3, 3, 3 residual
blocks, 4 in the mid block); decoder 512 (conv_in; 4 + 3 blocks) -> 512 (3) -> 256 (3) -> 128 (4) -> 48 ->
unpatchify. A 33 x 512 x 512 clip <-> latents [128, 5, 16, 16]; FlashHead's 9 motion frames <-> [128, 2, 16,
16]. Decoding F latent frames gives 1 + 8 (F - 1) frames (each upsampler makes 2 frames per frame and drops the
clip's first). Normalisation ``(z - latents_mean) / latents_std`` per channel (FlashHead's LtxVAE
``normalize_latents``, in the latents' dtype), inverted before decoding.

What FlashHead calls, reproduced exactly:

* ``encode``: the encoder is causal (each 3x3x3 conv pads time with copies of the first frame; the three
  downsamplers are stride-2 convs). Its last conv gives C means and ONE log-variance channel (0.9.0's "uniform"
  log-variance, repeated over the channels); FlashHead SAMPLES the posterior (``latent_dist.sample()``: mean +
  exp(logvar / 2) * N(0, 1), the noise drawn from torch's global RNG in the latents' dtype, logvar clamped to
  [-30, 20]). ``encode(..., generator=g)`` draws the same noise from ``g`` (on the CPU a generator seeded s
  gives exactly what ``torch.manual_seed(s)`` would); ``sample=False`` returns the mean.
* ``decode``: NOT timestep-conditioned (FlashHead calls ``decode`` with no timestep; the released config has
  no ``timestep_conditioning``) and noise-free; the decoder is NOT causal (0.9.0's ``decoder_causal: false``:
  each 3x3x3 conv pads time with one copy of the first frame in front and one of the last behind). Each
  33-frame clip is decoded on its own (no memory across clips); FlashHead's next clip depends on this one only
  through the re-encoded last 9 frames.
* dtype: FlashHead runs the VAE in bfloat16 (weights, frames, latents and the normalisation); this module
  computes in the weights' dtype with the same op order (pixel norm ``x / sqrt(mean(x^2) + 1e-8)`` over
  channels, SiLU, LayerNorm over channels in the width-changing blocks' shortcut).

Streaming (:class:`LTXDecodeStream`): every op is per frame except the convs' 3-frame temporal windows, and
the norms are per pixel (pixel norm, LayerNorm over channels; no GroupNorm), so a decode can run in time
chunks with each conv keeping its last two input frames: exact (tests/test_ltx_vae.py: streamed == whole). But
the decoder is non-causal: each conv looks one frame ahead at its own rate, and the 16 convs at the latent rate
(conv_in, 4 + 3 residual blocks, the first upsampler) chain that to 16 latent frames, so NO pixel is final
before the clip's last latent frame has been pushed (a 5-latent clip needs all 5); pushing latents as a
sampler produces them gains nothing. What streaming does give is early output within one decode: after the
clip's latents are in, the low-rate stages (cheap) finish and the full-rate stages run chunk by chunk, so the
first frames leave before the last frames' full-rate convs run. At 512x512, counting multiply-adds on the
meta device (``cadence bench vae --decoder ltx`` prints it), the first chunk is final after 44-46% of the
decode's work and the first 8 frames after 61-65% (pieces of 1-8 frames; docs/perf/vae/LTX_NOTES.md).
Smaller pieces run smaller convs (slower per frame on a GPU); the engine chooses.
The encoder is causal and could stream too, but FlashHead encodes a whole 9-frame tail after the clip is
decoded, so nothing waits on it.

Fast paths (channels-last, torch.compile, FP8 convs) are applied from outside: ``cadence.runtime.ltx_fast``.
Parity with FlashHead's code: tests/test_ltx_vae.py (fixture from scripts/fixtures/make_ltx_vae.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cadence.errors import ConfigError, WeightsError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
CLASS_NAME = "AutoencoderKLLTXVideo"
PIXEL_NORM_EPS = 1e-8
LOGVAR_RANGE = (-30.0, 20.0)  # diffusers' DiagonalGaussianDistribution clamp

#: The released ``VAE_LTX/config.json`` (LTX-Video 0.9.0's VAE): the one config FlashHead's loader accepts.
RELEASED_CONFIG = {
    "_class_name": CLASS_NAME,
    "_diffusers_version": "0.32.0.dev0",
    "block_out_channels": [128, 256, 512, 512],
    "decoder_causal": False,
    "encoder_causal": True,
    "in_channels": 3,
    "latent_channels": 128,
    "layers_per_block": [4, 3, 3, 3, 4],
    "out_channels": 3,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-06,
    "scaling_factor": 1.0,
    "spatio_temporal_scaling": [True, True, True, False],
}
_REQUIRED = (
    "block_out_channels",
    "layers_per_block",
    "spatio_temporal_scaling",
    "latent_channels",
    "patch_size",
)
_OPTIONAL = {
    "in_channels": 3,
    "out_channels": 3,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "scaling_factor": 1.0,  # read by nobody: FlashHead's wrapper normalises with latents_mean / latents_std
    "encoder_causal": True,
    "decoder_causal": False,
    "decoder_block_out_channels": None,
    "decoder_layers_per_block": None,
    "decoder_spatio_temporal_scaling": None,
    "spatial_compression_ratio": None,
    "temporal_compression_ratio": None,
}
# later diffusers keys: only the value 0.9.0 implies is built here (what each other value would need)
_FEATURES = {
    "timestep_conditioning": (lambda v: v is False, "a timestep-conditioned decoder (LTX-Video 0.9.1+)"),
    "decoder_inject_noise": (lambda v: not any(v), "decoder noise injection (LTX-Video 0.9.1+)"),
    "upsample_residual": (lambda v: not any(v), "residual upsamplers (LTX-Video 0.9.1+)"),
    "upsample_factor": (lambda v: all(int(f) == 1 for f in v), "channel-reducing upsamplers (0.9.1+)"),
    "down_block_types": (
        lambda v: all(t == "LTXVideoDownBlock3D" for t in v),
        "LTX-Video 0.9.5's down blocks",
    ),
    "downsample_type": (lambda v: all(t == "conv" for t in v), "LTX-Video 0.9.5's downsamplers"),
}


def _check_keys(d: dict) -> None:
    if d.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ConfigError(f"_class_name is {d['_class_name']!r}; an LTX-Video VAE folder has {CLASS_NAME!r}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}")
    known = (*_REQUIRED, *_OPTIONAL, *_FEATURES)
    unknown = sorted(k for k in d if not k.startswith("_") and k not in known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} (not an LTX-Video 0.9.x VAE config)")
    for key, (ok, what) in _FEATURES.items():
        if key not in d:
            continue
        try:
            fine = ok(d[key])
        except (TypeError, ValueError):  # not even the right kind of value
            raise ConfigError(f"{key}={d[key]!r} is not a value an LTX-Video VAE config takes") from None
        if not fine:
            raise ConfigError(f"{key}={d[key]!r} asks for {what}, which FlashHead's VAE does not use")


def _ints(d: dict, key: str, n: int | None = None, least: int = 1) -> tuple[int, ...]:
    v = d[key]
    ok = isinstance(v, (list, tuple)) and v
    if not ok or not all(isinstance(x, int) and not isinstance(x, bool) and x >= least for x in v):
        raise ConfigError(f"{key} must be a list of integers >= {least}, got {v!r}")
    if n is not None and len(v) != n:
        raise ConfigError(f"{key} has {len(v)} entries; need {n}")
    return tuple(v)


def _bools(d: dict, key: str, n: int) -> tuple[bool, ...]:
    v = d[key]
    if not isinstance(v, (list, tuple)) or len(v) != n or not all(isinstance(x, bool) for x in v):
        raise ConfigError(f"{key} must be a list of {n} booleans, got {v!r}")
    return tuple(v)


@dataclass(frozen=True)
class LTXVAEConfig:
    """The sizes of an LTX-Video 0.9.0-style VAE, read from a diffusers ``AutoencoderKLLTXVideo`` config."""

    latent_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: tuple[int, ...]
    spatio_temporal_scaling: tuple[bool, ...]
    decoder_block_out_channels: tuple[int, ...]
    decoder_layers_per_block: tuple[int, ...]
    decoder_spatio_temporal_scaling: tuple[bool, ...]
    patch_size: int
    in_channels: int = 3
    out_channels: int = 3
    resnet_norm_eps: float = 1e-6
    encoder_causal: bool = True
    decoder_causal: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> LTXVAEConfig:
        """Validate a config dict (``_``-keys ignored); ConfigError naming the key on anything unsupported."""
        _check_keys(d)
        o = {k: d.get(k, v) for k, v in _OPTIONAL.items()}
        if o["patch_size_t"] != 1:
            raise ConfigError(f"patch_size_t={o['patch_size_t']}: only 1 (FlashHead's VAE) is supported")
        for key in ("latent_channels", "patch_size"):
            o[key] = d[key]
        for key in ("latent_channels", "patch_size", "in_channels", "out_channels"):
            if not isinstance(o[key], int) or isinstance(o[key], bool) or o[key] < 1:
                raise ConfigError(f"{key} must be a positive integer, got {o[key]!r}")
        boc = _ints(d, "block_out_channels")
        sizes = {"block_out_channels": boc}
        sizes["layers_per_block"] = _ints(d, "layers_per_block", len(boc) + 1, least=0)
        sizes["spatio_temporal_scaling"] = _bools(d, "spatio_temporal_scaling", len(boc))
        # absent decoder sizes: the decoder mirrors the encoder (0.9.0, and FlashHead's one block list)
        dd = {
            f"decoder_{k}": d[f"decoder_{k}"] if o[f"decoder_{k}"] is not None else v
            for k, v in sizes.items()
        }
        dboc = _ints(dd, "decoder_block_out_channels")
        sizes["decoder_block_out_channels"] = dboc
        sizes["decoder_layers_per_block"] = _ints(dd, "decoder_layers_per_block", len(dboc) + 1, least=0)
        sizes["decoder_spatio_temporal_scaling"] = _bools(dd, "decoder_spatio_temporal_scaling", len(dboc))
        if sum(sizes["decoder_spatio_temporal_scaling"]) != sum(sizes["spatio_temporal_scaling"]):
            raise ConfigError(
                "decoder_spatio_temporal_scaling and spatio_temporal_scaling have different numbers of "
                "2x stages: the decoder would not invert the encoder's geometry"
            )
        cfg = cls(
            latent_channels=o["latent_channels"],
            patch_size=o["patch_size"],
            in_channels=o["in_channels"],
            out_channels=o["out_channels"],
            resnet_norm_eps=float(o["resnet_norm_eps"]),
            encoder_causal=bool(o["encoder_causal"]),
            decoder_causal=bool(o["decoder_causal"]),
            **sizes,
        )
        for key, have in (
            ("spatial_compression_ratio", cfg.spatial_stride),
            ("temporal_compression_ratio", cfg.temporal_stride),
        ):
            if o[key] is not None and o[key] != have:
                raise ConfigError(f"{key}={o[key]} but the blocks give {have}")
        return cfg

    @property
    def spatial_stride(self) -> int:
        return self.patch_size * 2 ** sum(self.spatio_temporal_scaling)

    @property
    def temporal_stride(self) -> int:
        return 2 ** sum(self.spatio_temporal_scaling)


# ---- ops ------------------------------------------------------------------------------------------------
def pixel_norm(x: torch.Tensor) -> torch.Tensor:
    """x / RMS over channels (dim 1), in x's dtype (FlashHead's PixelNorm op order)."""
    return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + PIXEL_NORM_EPS)


def norm_act(x: torch.Tensor) -> torch.Tensor:
    return F.silu(pixel_norm(x))


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, C p^2, T, H / p, W / p]; channel = (c, w offset, h offset) as LTX-Video orders it."""
    if p == 1:
        return x
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, t, h // p, w // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """The inverse of :func:`patchify`."""
    if p == 1:
        return x
    b, cpp, t, h, w = x.shape
    c = cpp // (p * p)
    x = x.reshape(b, c, p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, c, t, h * p, w * p)


def depth_to_space(x: torch.Tensor, s: tuple[int, int, int]) -> torch.Tensor:
    """[B, C st ss ss, T, H, W] -> [B, C, T st, H ss, W ss] (channel = (c, t offset, h offset, w offset))."""
    b, cs, t, h, w = x.shape
    c = cs // (s[0] * s[1] * s[2])
    x = x.reshape(b, c, s[0], s[1], s[2], t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, c, t * s[0], h * s[1], w * s[2])


def pad_frames(x: torch.Tensor, front: int, back: int) -> torch.Tensor:
    """x with ``front`` copies of its first frame before it and ``back`` of its last after it (dim 2); keeps
    x's memory format (a ``cat`` with an expanded frame would not)."""
    return F.pad(x, (0, 0, 0, 0, front, back), mode="replicate") if front or back else x


# ---- modules (diffusers' module names, so the released state dict loads as it is) -------------------------
class TimeConv(nn.Module):
    """A k x k x k conv padded in time with copies of the edge frames: causal (k - 1 copies of the first frame
    in front) or centred ((k - 1) / 2 copies of the first in front and of the last behind); zero-padded in
    space. ``self.conv`` is the plain ``Conv3d`` (spatial padding only), as LTX-Video's CausalConv3d."""

    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1, causal: bool = True):
        super().__init__()
        self.kt = k
        self.causal = causal
        self.conv = nn.Conv3d(cin, cout, k, stride=stride, padding=(0, k // 2, k // 2))

    @property
    def pads(self) -> tuple[int, int]:
        """(frames in front, frames behind)."""
        return (self.kt - 1, 0) if self.causal else ((self.kt - 1) // 2, (self.kt - 1) // 2)

    def pad_time(self, x: torch.Tensor) -> torch.Tensor:
        return pad_frames(x, *self.pads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pad_time(x))


class ResBlock(nn.Module):
    """conv2(silu(norm(conv1(silu(norm(x)))))) + shortcut(x); the shortcut is LayerNorm over channels + a 1x1x1
    conv where the width changes (diffusers' ``norm3`` / ``conv_shortcut``), else x."""

    def __init__(self, cin: int, cout: int, eps: float, causal: bool):
        super().__init__()
        self.conv1 = TimeConv(cin, cout, 3, causal=causal)
        self.conv2 = TimeConv(cout, cout, 3, causal=causal)
        self.norm3 = nn.LayerNorm(cin, eps=eps) if cin != cout else None
        self.conv_shortcut = TimeConv(cin, cout, 1, causal=causal) if cin != cout else None

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv_shortcut is None:
            return x
        x = self.norm3(x.movedim(1, -1)).movedim(-1, 1)
        return self.conv_shortcut(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(norm_act(self.conv1(norm_act(x))))
        return h + self.shortcut(x)


class Upsampler(nn.Module):
    """conv to C x 8 channels, depth-to-space 2x2x2, the clip's first frame dropped (T -> 2T - 1)."""

    stride = (2, 2, 2)

    def __init__(self, c: int, causal: bool):
        super().__init__()
        self.conv = TimeConv(c, c * 8, 3, causal=causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return depth_to_space(self.conv(x), self.stride)[:, :, self.stride[0] - 1 :]


class DownBlock(nn.Module):
    """Residual blocks at the input width, a stride-2 conv (when the stage scales), a width-changing block."""

    def __init__(self, cin: int, cout: int, layers: int, scale: bool, eps: float, causal: bool):
        super().__init__()
        self.resnets = nn.ModuleList(ResBlock(cin, cin, eps, causal) for _ in range(layers))
        self.downsamplers = nn.ModuleList([TimeConv(cin, cin, 3, stride=2, causal=causal)] if scale else [])
        self.conv_out = ResBlock(cin, cout, eps, causal) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.resnets:
            x = m(x)
        for m in self.downsamplers:
            x = m(x)
        return x if self.conv_out is None else self.conv_out(x)


class MidBlock(nn.Module):
    def __init__(self, c: int, layers: int, eps: float, causal: bool):
        super().__init__()
        self.resnets = nn.ModuleList(ResBlock(c, c, eps, causal) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.resnets:
            x = m(x)
        return x


class UpBlock(nn.Module):
    """A width-changing block (when the width changes), the 2x2x2 upsampler (when the stage scales), blocks."""

    def __init__(self, cin: int, cout: int, layers: int, scale: bool, eps: float, causal: bool):
        super().__init__()
        self.conv_in = ResBlock(cin, cout, eps, causal) if cin != cout else None
        self.upsamplers = nn.ModuleList([Upsampler(cout, causal)] if scale else [])
        self.resnets = nn.ModuleList(ResBlock(cout, cout, eps, causal) for _ in range(layers))

    def parts(self) -> list[nn.Module]:
        return ([] if self.conv_in is None else [self.conv_in]) + [*self.upsamplers, *self.resnets]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.parts():
            x = m(x)
        return x


class Encoder(nn.Module):
    """pixels [B, 3, T, H, W] -> [B, C + 1, F, h, w]: C posterior means and one log-variance channel."""

    def __init__(self, cfg: LTXVAEConfig):
        super().__init__()
        eps, causal, boc = cfg.resnet_norm_eps, cfg.encoder_causal, cfg.block_out_channels
        self.patch = cfg.patch_size
        self.conv_in = TimeConv(cfg.in_channels * self.patch**2, boc[0], 3, causal=causal)
        n = len(boc)
        self.down_blocks = nn.ModuleList(
            DownBlock(
                boc[i],
                boc[min(i + 1, n - 1)],
                cfg.layers_per_block[i],
                cfg.spatio_temporal_scaling[i],
                eps,
                causal,
            )
            for i in range(n)
        )
        self.mid_block = MidBlock(boc[-1], cfg.layers_per_block[-1], eps, causal)
        self.conv_out = TimeConv(boc[-1], cfg.latent_channels + 1, 3, causal=causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(patchify(x, self.patch))
        for m in self.down_blocks:
            x = m(x)
        return self.conv_out(norm_act(self.mid_block(x)))


class Decoder(nn.Module):
    """raw latents [B, C, F, h, w] -> pixels [B, 3, 1 + 8 (F - 1), H, W] (for three 2x stages)."""

    def __init__(self, cfg: LTXVAEConfig):
        super().__init__()
        eps, causal = cfg.resnet_norm_eps, cfg.decoder_causal
        boc = cfg.decoder_block_out_channels[::-1]
        layers = cfg.decoder_layers_per_block[::-1]
        scale = cfg.decoder_spatio_temporal_scaling[::-1]
        self.patch = cfg.patch_size
        self.conv_in = TimeConv(cfg.latent_channels, boc[0], 3, causal=causal)
        self.mid_block = MidBlock(boc[0], layers[0], eps, causal)
        self.up_blocks = nn.ModuleList(
            UpBlock(boc[max(i - 1, 0)], boc[i], layers[i + 1], scale[i], eps, causal) for i in range(len(boc))
        )
        self.conv_out = TimeConv(boc[-1], cfg.out_channels * self.patch**2, 3, causal=causal)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for m in self.up_blocks:
            x = m(x)
        return unpatchify(self.conv_out(norm_act(x)), self.patch)

    def stages(self) -> list[nn.Module]:
        """The decoder as a chain of per-frame-streamable parts (:class:`LTXDecodeStream`)."""
        parts: list[nn.Module] = [self.conv_in, *self.mid_block.resnets]
        for up in self.up_blocks:
            parts += up.parts()
        return [*parts, self.conv_out]


# ---- the VAE ----------------------------------------------------------------------------------------------
class LTXVideoVAE(nn.Module):
    """Encoder + decoder + the per-channel latent statistics (buffers ``latents_mean`` / ``latents_std``, as
    in the released state dict). Pixels in [-1, 1]; latents in and out are NORMALISED (FlashHead's space)."""

    def __init__(self, cfg: LTXVAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.register_buffer("latents_mean", torch.zeros(cfg.latent_channels))
        self.register_buffer("latents_std", torch.ones(cfg.latent_channels))

    # ---- geometry ---------------------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.config.latent_channels

    @property
    def spatial_stride(self) -> int:
        return self.config.spatial_stride

    @property
    def temporal_stride(self) -> int:
        return self.config.temporal_stride

    def latent_frames(self, frames: int) -> int:
        """Latent frames of ``frames`` pixel frames (each causal stride-2 conv: T -> (T - 1) // 2 + 1)."""
        for _ in range(sum(self.config.spatio_temporal_scaling)):
            frames = (frames - 1) // 2 + 1
        return frames

    def frames(self, latent_frames: int) -> int:
        """Pixel frames decoded from ``latent_frames``: 1 + temporal_stride (F - 1)."""
        return 1 + self.temporal_stride * (latent_frames - 1)

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        s = self.spatial_stride
        return (self.latent_channels, self.latent_frames(frames), height // s, width // s)

    def param_dtype(self) -> torch.dtype:
        return self.decoder.conv_in.conv.weight.dtype

    # ---- latent statistics ------------------------------------------------------------------------------
    def _stat(self, v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return v.to(like.device, like.dtype).view(1, -1, 1, 1, 1)

    def normalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents [B, C, F, h, w] -> FlashHead's space: (z - mean) / std, in z's dtype."""
        return (z - self._stat(self.latents_mean, z)) / self._stat(self.latents_std, z)

    def denormalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        return z * self._stat(self.latents_std, z) + self._stat(self.latents_mean, z)

    # ---- encode / decode --------------------------------------------------------------------------------
    def _batched(self, x: torch.Tensor, dims: int, what: str) -> tuple[torch.Tensor, bool]:
        if x.dim() == dims - 1:
            return x[None], True
        if x.dim() != dims:
            raise ConfigError(f"{what} must be {dims - 1}D or {dims}D (batched), got shape {tuple(x.shape)}")
        return x, False

    @torch.no_grad()
    def encode(
        self, frames: torch.Tensor, *, sample: bool = True, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """frames [3, T, H, W] (or [B, 3, T, H, W]) in [-1, 1] -> normalised latents [C, F, H/s, W/s].
        ``sample`` (FlashHead's choice): mean + std * noise, the noise from ``generator`` (None: torch's global
        RNG, as FlashHead) in the weights' dtype; False: the posterior mean."""
        x, single = self._batched(frames, 5, "frames")
        s = self.spatial_stride
        if x.shape[1] != self.config.in_channels or x.shape[-2] % s or x.shape[-1] % s:
            raise ConfigError(
                f"encode takes [{self.config.in_channels}, T, H, W] with H and W multiples of {s}, got "
                f"{tuple(frames.shape)}"
            )
        h = self.encoder(x.to(self.param_dtype()))
        c = self.latent_channels
        z = h[:, :c]
        if sample:
            logvar = h[:, c:].clamp(*LOGVAR_RANGE)
            std = torch.exp(0.5 * logvar)
            gen_dev = generator.device if generator is not None else z.device
            noise = torch.randn(z.shape, generator=generator, device=gen_dev, dtype=z.dtype).to(z.device)
            z = z + std * noise
        z = self.normalize_latents(z)
        return z[0] if single else z

    def _raw_latents(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.param_dtype())
        if z.shape[1] != self.latent_channels:
            raise ConfigError(
                f"decode takes {self.latent_channels}-channel latents, got {tuple(latents.shape)}"
            )
        return self.denormalize_latents(z)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [C, F, h, w] (or batched) -> pixels [3, 1 + 8 (F - 1), H, W] (not clamped)."""
        z, single = self._batched(latents, 5, "latents")
        x = self.decoder(self._raw_latents(z))
        return x[0] if single else x

    def stream_decode(self, latents: torch.Tensor, chunk_frames: int = 4) -> Iterator[torch.Tensor]:
        """:meth:`decode` of one clip as pixel chunks [3, n, H, W] (or batched), each emitted as soon as it is
        final; their concatenation equals ``decode(latents)``. See :class:`LTXDecodeStream`."""
        z, single = self._batched(latents, 5, "latents")
        st = LTXDecodeStream(self, chunk_frames)
        for chunk in _chain(st.push(z), st.close()):
            yield chunk[0] if single else chunk

    # ---- loading ----------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict | LTXVAEConfig, device="cpu", dtype=torch.float32) -> LTXVideoVAE:
        """Random weights at a config (benchmarks; tests). ``cfg``: a diffusers config dict or a parsed one."""
        cfg = cfg if isinstance(cfg, LTXVAEConfig) else LTXVAEConfig.from_dict(cfg)
        with torch.device(device):  # initialised where it will run (the released size: 419M parameters)
            vae = cls(cfg)
        return vae.to(dtype=dtype).eval()

    @classmethod
    def from_folder(cls, path: str | Path, device="cpu", dtype=torch.float32) -> LTXVideoVAE:
        """The released ``VAE_LTX/`` folder (``config.json`` + ``diffusion_pytorch_model.safetensors``).
        ConfigError for a missing folder / file or a config this module cannot build; WeightsError for tensors
        that do not fit the config (missing, unexpected, wrong shape)."""
        cfg, sd = read_folder(path)
        vae = cls(cfg)
        load_state_dict_strict(vae, sd, f"{Path(path) / WEIGHTS_FILE}")
        return vae.to(device=device, dtype=dtype).eval()


def _chain(*its):
    for it in its:
        yield from it


def read_folder(path: str | Path) -> tuple[LTXVAEConfig, dict[str, torch.Tensor]]:
    """(config, state dict) of an LTX VAE folder; ConfigError naming what is missing or wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"LTX VAE folder {path} does not exist (FlashHead's VAE_LTX/)")
    cfg_path, w_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    missing = [p.name for p in (cfg_path, w_path) if not p.is_file()]
    if missing:
        hint = ""
        if (path / "autoencoder.pth").is_file():
            hint = (
                " (this is LTX-Video's original autoencoder.pth layout; FlashHead releases diffusers' layout)"
            )
        raise ConfigError(
            f"LTX VAE folder {path} has no {' or '.join(missing)}: it needs {CONFIG_FILE} and {WEIGHTS_FILE}"
            + hint
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_path}: not a JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_path}: not a JSON object")
    try:
        cfg = LTXVAEConfig.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None
    try:
        sd = load_file(str(w_path))
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{w_path}: not a readable safetensors file ({e})") from None
    return cfg, sd


def load_state_dict_strict(vae: LTXVideoVAE, sd: dict[str, torch.Tensor], where: str) -> None:
    """Load diffusers' key names into ``vae``; WeightsError naming the missing / unexpected / mis-shaped ones."""
    own = vae.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = [
        f"{k} {tuple(sd[k].shape)} (config: {tuple(v.shape)})"
        for k, v in own.items()
        if k in sd and sd[k].shape != v.shape
    ]

    def few(xs: list[str]) -> str:
        return ", ".join(xs[:4]) + (f" (+{len(xs) - 4} more)" if len(xs) > 4 else "")

    parts = [
        f"missing {len(missing)}: {few(missing)}" if missing else "",
        f"unexpected {len(unexpected)}: {few(unexpected)}" if unexpected else "",
        f"shape mismatch {len(shapes)}: {few(shapes)}" if shapes else "",
    ]
    if any(parts):
        raise WeightsError(f"{where} does not fit its config.json: " + "; ".join(p for p in parts if p))
    vae.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=True)


# ---- streaming decode -------------------------------------------------------------------------------------
class _ConvState:
    """One :class:`TimeConv` run over a clip pushed in pieces: keeps its last k - 1 (padded) input frames;
    each push returns the output frames that no later input can change (None when there are none yet)."""

    def __init__(self, conv: TimeConv):
        self.conv = conv
        self.tail: torch.Tensor | None = None

    def push(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        buf = pad_frames(x, self.conv.pads[0], 0) if self.tail is None else torch.cat([self.tail, x], 2)
        k = self.conv.kt
        self.tail = buf[:, :, buf.shape[2] - (k - 1) :] if k > 1 else buf[:, :, :0]
        return self.conv.conv(buf) if buf.shape[2] >= k else None

    def close(self) -> torch.Tensor | None:
        """The last frames: the clip's last frame repeated behind it (centred convs; causal ones have none)."""
        back = self.conv.pads[1]
        if not back or self.tail is None:
            return None
        buf, self.tail = pad_frames(self.tail, 0, back), None
        return self.conv.conv(buf)


def _cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else torch.cat([a, b], 2)


class _ResState:
    """A :class:`ResBlock` over pieces: the shortcut frames wait for the two convs' (lagging) output."""

    def __init__(self, block: ResBlock):
        self.block = block
        self.c1, self.c2 = _ConvState(block.conv1), _ConvState(block.conv2)
        self.pending: torch.Tensor | None = None

    def _out(self, h: torch.Tensor | None) -> torch.Tensor | None:
        if h is None:
            return None
        n = h.shape[2]
        out = h + self.pending[:, :, :n]
        self.pending = self.pending[:, :, n:]
        return out

    def push(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        self.pending = _cat(self.pending, self.block.shortcut(x))
        h = self.c1.push(norm_act(x))
        return self._out(self.c2.push(None if h is None else norm_act(h)))

    def close(self) -> torch.Tensor | None:
        h = self.c1.close()
        h = _cat(self.c2.push(None if h is None else norm_act(h)), self.c2.close())
        return self._out(h)


class _UpState:
    """An :class:`Upsampler` over pieces: the clip's first output frame is dropped once."""

    def __init__(self, up: Upsampler):
        self.up = up
        self.conv = _ConvState(up.conv)
        self.dropped = False

    def _out(self, y: torch.Tensor | None) -> torch.Tensor | None:
        if y is None:
            return None
        up = self.up
        y = depth_to_space(y, up.stride)
        if not self.dropped:
            y, self.dropped = y[:, :, up.stride[0] - 1 :], True
        return y if y.shape[2] else None

    def push(self, x):
        return self._out(self.conv.push(x))

    def close(self):
        return self._out(self.conv.close())


class _ConvStage:
    """conv_in (``pre``/``post`` None) or the output conv (norm + SiLU before, unpatchify after)."""

    def __init__(self, conv: TimeConv, pre=None, post=None):
        self.conv, self.pre, self.post = _ConvState(conv), pre, post

    def _out(self, y):
        return y if y is None or self.post is None else self.post(y)

    def push(self, x):
        return self._out(self.conv.push(x if x is None or self.pre is None else self.pre(x)))

    def close(self):
        return self._out(self.conv.close())


class LTXDecodeStream:
    """One clip's decode pushed in pieces (any number of latent frames per :meth:`push`, then :meth:`close`):
    every stage keeps the frames its next outputs need and passes on, ``chunk_frames`` at a time and depth
    first, the frames no later input can change, so pixel chunks leave as early as the decoder's structure
    allows (see the module docstring: for the non-causal 0.9.0 decoder that is after the clip's last latent
    frame, then chunk by chunk through the full-rate stages). The chunks' concatenation equals
    ``LTXVideoVAE.decode`` of the whole clip (same convs on the same frames; float summation order aside)."""

    def __init__(self, vae: LTXVideoVAE, chunk_frames: int = 4):
        if chunk_frames < 1:
            raise ConfigError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.vae = vae
        self.chunk = chunk_frames
        dec = vae.decoder
        stages: list = []
        for m in dec.stages():
            if m is dec.conv_out:
                stages.append(_ConvStage(m, pre=norm_act, post=lambda y: unpatchify(y, dec.patch)))
            elif isinstance(m, ResBlock):
                stages.append(_ResState(m))
            elif isinstance(m, Upsampler):
                stages.append(_UpState(m))
            else:
                stages.append(_ConvStage(m))
        self.stages = stages
        self.closed = False
        self.emitted = 0

    def _drive(self, i: int, x: torch.Tensor | None) -> Iterator[torch.Tensor]:
        if x is None:
            return
        if i == len(self.stages):
            self.emitted += x.shape[2]
            yield x
            return
        y = self.stages[i].push(x)
        if y is None:
            return
        for piece in y.split(self.chunk, dim=2):
            yield from self._drive(i + 1, piece)

    @torch.no_grad()
    def push(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Normalised latents [B, C, f, h, w] (the clip's next f frames) -> the pixel chunks now final."""
        if self.closed:
            raise ConfigError("this decode stream is closed: start a new one for the next clip")
        z = self.vae._raw_latents(latents)
        for piece in z.split(self.chunk, dim=2):
            yield from self._drive(0, piece)

    @torch.no_grad()
    def close(self) -> Iterator[torch.Tensor]:
        """The clip has ended: the remaining pixel chunks (each stage's last frames, in order)."""
        self.closed = True
        for i, st in enumerate(self.stages):
            y = st.close()
            if y is not None:
                for piece in y.split(self.chunk, dim=2):
                    yield from self._drive(i + 1, piece)
