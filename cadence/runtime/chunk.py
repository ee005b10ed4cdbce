"""Denoise one chunk through the cache and commit its K/V: the body of the chunk step.

Everything here is device work launched from Python ints and pre-built device tensors: no
``.item()``, no host reads, so the step can later be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from cadence.model.dit import TextContext, WanDiT
from cadence.runtime.sampler import Schedule


def denoise_chunk(
    model: WanDiT,
    cache,
    schedule: Schedule,
    commit: str,
    noise: torch.Tensor,
    text: TextContext,
    audio: torch.Tensor | None,
    timesteps: torch.Tensor,
    renoise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the passes of one chunk whose position the cache already knows (``begin_chunk``).

    noise [C, F, h, w] float32 is the starting latent; timesteps a device tensor of model timesteps:
    the passes', then (index ``passes``) the clean commit pass's (``Schedule.device_timesteps``: the
    family's ``context_noise``, else 0); renoise [passes - 1, C, F, h, w] fresh noise for the 'renoise'
    rule. `commit` is 'last_pass' (K/V written during the last pass) or 'clean_pass' (an extra pass on
    the denoised result writes them, as the Self-Forcing family does). Returns the clean latent
    (float32).
    """
    x = noise
    last = schedule.passes - 1
    for i in range(schedule.passes):
        v = model.forward_chunk(
            x, timesteps[i : i + 1], text, audio, cache, commit=(commit == "last_pass" and i == last)
        )
        x = schedule.step(x, v, i, renoise[i] if renoise is not None and i < last else None)
    if commit == "clean_pass":
        n = schedule.passes
        model.forward_chunk(x, timesteps[n : n + 1], text, audio, cache, commit=True)
    return x
