"""SoulX-FlashTalk's streaming sampler (Soul-AILab/SoulX-FlashTalk ``FlashTalkPipeline.generate``), one clip a call.

FlashTalk streams a talking avatar as a run of short bidirectional clips, not a block-causal K/V stream:

* a clip is ``clip_frames`` video frames (33 = 9 latent frames) generated together, every token attending to
  every other (no cache); its first latent frames are pinned to the *motion latents*: the reference image's
  latent for the first clip, then the VAE latents of the last ``motion_frames`` (5) decoded frames of the
  clip before (2 latent frames); the clip's new video is its frames after those 5 (28 frames, 1.12 s at
  25 fps);
* every clip is conditioned the same way on the reference image (the I2V input: a mask that marks the first
  video frame + the VAE latent of [reference image, 32 black frames], concatenated to the noisy latent:
  :func:`i2v_condition`), its CLIP tokens and the prompt (cross-attention K/V computed once), and on the
  audio windows of its own 33 frames (``cadence.model.multitalk``);
* 4 passes at 1000 / 750 / 500 / 250 shifted by 5 (``t' = 5 t / (1 + 4 t)`` on t/1000: 1000, 937.5, 833.3,
  625); after each pass x0 = x - t * v and the latent is re-noised with *fresh* noise to the next level
  (zero after the last pass, but a draw is still made); the motion latents are written back after every
  pass; one generator draws the initial noise and every re-noising draw, in that order.

:func:`sample_clip` is that loop on a :class:`cadence.model.dit.WanDiT` built with the family's
configuration. Decoding the clip, FlashTalk's colour correction of the decoded frames towards the reference
image (Lab mean / std transfer) and re-encoding the last 5 frames into the next motion latents are the
caller's (not built here yet: docs/models.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cadence.model.multitalk import reference_mask


def shifted_timesteps(steps: Sequence[float], shift: float, num: int = 1000) -> torch.Tensor:
    """The passes' timesteps then 0, each shifted (``t' = shift t / (1 + (shift - 1) t)`` on t / num), float32:
    [len(steps) + 1]."""
    t = torch.tensor([*steps, 0.0], dtype=torch.float32) / num
    return shift * t / (1 + (shift - 1) * t) * num


def i2v_condition(reference_latent: torch.Tensor, reference_frames: int = 1) -> torch.Tensor:
    """[16, F, h, w] latent of the reference video (the image + black frames) -> the I2V condition
    [4 + 16, F, h, w] (mask first, as the reference concatenates them)."""
    _, f, h, w = reference_latent.shape
    mask = reference_mask(f, h, w, reference_frames, reference_latent.device, reference_latent.dtype)
    return torch.cat([mask, reference_latent])


@torch.no_grad()
def sample_clip(
    model,
    noise: torch.Generator | Sequence[torch.Tensor],
    motion: torch.Tensor,
    cond: torch.Tensor,
    context,
    audio: torch.Tensor,
    timesteps: torch.Tensor,
) -> torch.Tensor:
    """One FlashTalk clip: the denoised latent [16, F, h, w].

    model: a ``WanDiT`` with ``cond_channels`` 20, image tokens and the 'multitalk' audio branch; noise: a
    generator (the initial latent and every re-noising draw are taken from it, in FlashTalk's order, on its
    device) or those draws (len(timesteps) tensors of [16, F, h, w]); motion [16, M, h, w]: the latents the
    clip starts from (pinned); cond [20, F, h, w]: :func:`i2v_condition`; context: the prompt + CLIP image
    K/V (``model.prepare_text(text, image)``); audio [1 + 4 (F - 1), window, layers, C]: the clip's
    per-video-frame wav2vec2 windows; timesteps: :func:`shifted_timesteps` (the passes' then 0).
    """
    c, f, h, w = cond.shape[0] - 4, cond.shape[1], cond.shape[2], cond.shape[3]
    m = motion.shape[1]

    def draw(i: int) -> torch.Tensor:
        if isinstance(noise, torch.Generator):
            return torch.randn(c, f, h, w, generator=noise, device=noise.device, dtype=cond.dtype)
        return noise[i].to(cond)

    latent = draw(0)
    latent[:, :m] = motion
    audio = audio[None]
    for i in range(len(timesteps) - 1):
        t, t_next = timesteps[i : i + 1].to(cond.device), timesteps[i + 1].to(cond.device) / 1000
        v = model.forward_full(torch.cat([latent, cond])[None], t, context, audio=audio)[0].float()
        x0 = latent - v * (t / 1000)
        latent = (1 - t_next) * x0 + t_next * draw(i + 1)
        latent[:, :m] = motion
    return latent
