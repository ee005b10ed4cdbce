"""The LTX-Video VAE as an engine decoder ('ltx': ``cadence.engine.session.make_vae``), for the clip families that
decode with it (FlashHead Lite: ``cadence.engine.flashhead``).

:class:`LTXVAEAdapter` holds the VAE (``cadence.model.ltx_vae.LTXVideoVAE``) where the generator keeps its
autoencoder (``gen.vae``; ``vae_on`` copies it to another decode device): from ``vae.weights`` (the released
``VAE_LTX/`` folder) or random at the configuration's geometry (benchmarks at the released size: LTX-Video
0.9.0's config with the configuration's z and stride; ``vae.base_dim`` = b: widths b / 2b / 4b / 4b and one
residual block per stage, the tests' tiny one). The clip session encodes and decodes whole clips with it; the K/V
stream's streaming decoder (``stream()``) is not offered (the LTX decoder is not causal in time).

The decoder's fast path (``FastPath.decoder_fast``, applied by ``cadence.engine.build.apply_decoder_fast``
through :meth:`LTXVAEAdapter.accelerate`): ``cadence.runtime.ltx_fast.accelerate_ltx`` on the encoder and the
decoder ('cl', 'compile', 'fp8'; the Wan decoder's other modes run as 'compile', with a note).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from cadence.config import CadenceConfig, resolve_asset
from cadence.errors import ConfigError

#: The Wan decoder's fast-path modes the LTX VAE has no own form of: run as this mode instead.
SAME_AS = {"bench": "compile", "fold": "compile", "up": "compile"}


def random_config(cfg: CadenceConfig) -> dict:
    """LTX-Video 0.9.0's VAE config at ``cfg``'s latent channels and stride (``vae.base_dim``: the tiny widths)."""
    from cadence.model.ltx_vae import RELEASED_CONFIG

    v = cfg.vae
    stages = v.stride[0].bit_length() - 1
    patch, rest = divmod(v.stride[1], 2**stages)
    if 2**stages != v.stride[0] or rest or patch < 1 or v.stride[1] != v.stride[2] or stages > 3:
        raise ConfigError(
            f"an LTX-Video VAE compresses 2x per stage in time and space after a square patch (at most 3 "
            f"stages): stride {'x'.join(map(str, v.stride))} is not one"
        )
    out = dict(RELEASED_CONFIG, latent_channels=v.latent_channels, patch_size=patch)
    out["spatio_temporal_scaling"] = [i < stages for i in range(4)]
    if v.base_dim:
        b = v.base_dim
        out.update(block_out_channels=[b, 2 * b, 4 * b, 4 * b], layers_per_block=[1] * 5)
    return out


class LTXVAEAdapter:
    """The generator's autoencoder for the 'ltx' decoder: ``ltx`` is the :class:`LTXVideoVAE` (module docstring)."""

    def __init__(self, cfg: CadenceConfig, device, dtype: torch.dtype, seed: int = 5):
        from cadence.model.ltx_vae import LTXVideoVAE

        v = cfg.vae
        if v.weights:
            self.ltx = LTXVideoVAE.from_folder(Path(resolve_asset(v.weights)), device, dtype)
            got = (self.ltx.latent_channels, self.ltx.temporal_stride, self.ltx.spatial_stride)
            want = (v.latent_channels, v.stride[0], v.stride[1])
            if got != want:
                raise ConfigError(
                    f"the LTX-Video VAE {v.weights} makes {got[0]}-channel latents at stride {got[1]}x{got[2]}; "
                    f"the configuration takes {want[0]} at {want[1]}x{want[2]}"
                )
        else:  # made where it runs (the released size: 419M parameters), seeded
            dev = torch.device(device)
            with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                torch.manual_seed(seed)
                self.ltx = LTXVideoVAE.from_config(random_config(cfg), dev, dtype)
        self.ltx.requires_grad_(False)

    def to_device(self, device) -> LTXVAEAdapter:
        """A copy with the same weights on ``device``."""
        other = copy.copy(self)
        other.ltx = copy.deepcopy(self.ltx).to(device)
        return other

    def accelerate(self, mode: str, notes: list[str]) -> str:
        """``FastPath.decoder_fast`` on this VAE (encoder and decoder); returns what applied."""
        from cadence.runtime.ltx_fast import accelerate_ltx

        if mode in SAME_AS:
            notes.append(
                f"decoder_fast: {mode} is a Wan decoder mode; the LTX-Video VAE runs {SAME_AS[mode]}"
            )
            mode = SAME_AS[mode]
        return accelerate_ltx(self.ltx, mode).describe()

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """[3, T, H, W] in [-1, 1] -> the posterior mean's normalised latent (the clip session samples itself)."""
        return self.ltx.encode(video, sample=False).float()

    @staticmethod
    def to_uint8(frames: torch.Tensor) -> torch.Tensor:
        return ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)
