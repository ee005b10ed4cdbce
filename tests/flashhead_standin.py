"""A stand-in clip codec at the LTX-Video VAE's geometry (8 x 32 x 32, causal in time: the first frame alone,
then groups of 8), for the FlashHead Lite stream's parity test until the LTX VAE itself plugs in.

The same class feeds the authors' pipeline in ``scripts/fixtures/make_flashhead.py`` (through their
``LtxVAE``'s calling convention: batched video in, unbatched latent out) and Cadence's stream in
``tests/test_families_flashhead.py`` (the codec convention of ``cadence.model.flashhead_stream``), so both
sides decode and re-encode with the same numbers. encode: each latent frame's video frames averaged in time,
32 x 32 average pooled, a fixed channel mix to ``channels`` and tanh; decode: the transposed mix, tanh, a
per-frame ramp inside each group (so frames differ), nearest upsampling."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class StandInCodec:
    stride = (8, 32, 32)

    def __init__(self, channels: int, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.mix = torch.randn(channels, 3, generator=g, dtype=torch.float64).float() / 3**0.5

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """[3, 1 + 8k, H, W] -> [C, 1 + k, H / 32, W / 32]."""
        st, sh, sw = self.stride
        t = video.shape[1]
        if (t - 1) % st:
            raise ValueError(f"encode needs 1 + {st}k frames, got {t}")
        groups = [video[:, :1]] + [video[:, 1 + st * k : 1 + st * (k + 1)] for k in range((t - 1) // st)]
        pooled = torch.stack([g.float().mean(1) for g in groups], dim=1)  # [3, F, H, W]
        pooled = F.avg_pool2d(pooled, (sh, sw))
        return torch.tanh(torch.einsum("cr,rfhw->cfhw", self.mix.to(pooled), pooled) * 2)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """[C, F, h, w] -> [3, 1 + 8 (F - 1), 32h, 32w] in [-1, 1]."""
        st, sh, sw = self.stride
        rgb = torch.tanh(torch.einsum("cr,cfhw->rfhw", self.mix.to(latent), latent.float()))
        ramp = 1 - 0.05 * torch.arange(st, dtype=rgb.dtype)
        later = (rgb[:, 1:, None] * ramp[None, None, :, None, None]).flatten(1, 2)
        frames = torch.cat([rgb[:, :1], later], dim=1)
        return frames.repeat_interleave(sh, dim=2).repeat_interleave(sw, dim=3)


#: A tiny LTX-Video VAE at the Lite fixture model's geometry (8 latent channels, stride 8 x 32 x 32: patch 4 and
#: three 2x stages), 0.9.0's structure at widths 2 / 4 / 8 / 8 and one residual block per stage.
TINY_LTX = {
    "_class_name": "AutoencoderKLLTXVideo",
    "block_out_channels": [2, 4, 8, 8],
    "decoder_causal": False,
    "encoder_causal": True,
    "in_channels": 3,
    "latent_channels": 8,
    "layers_per_block": [1, 1, 1, 1, 1],
    "out_channels": 3,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-06,
    "scaling_factor": 1.0,
    "spatio_temporal_scaling": [True, True, True, False],
}


def write_tiny_ltx(folder, seed: int = 11):
    """A ``VAE_LTX/`` folder (diffusers' layout: config.json + diffusion_pytorch_model.safetensors) of random
    weights at :data:`TINY_LTX` (torch's default init under ``seed``; the latent statistics drawn so that the
    normalisation does something). Returns the folder."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from cadence.model.ltx_vae import LTXVideoVAE

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = LTXVideoVAE.from_config(TINY_LTX)
        vae.latents_mean.normal_(0, 0.1)
        vae.latents_std.uniform_(0.5, 1.5)
    save_file(
        {k: v.contiguous() for k, v in vae.state_dict().items()},
        str(folder / "diffusion_pytorch_model.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(TINY_LTX, indent=2))
    return folder
