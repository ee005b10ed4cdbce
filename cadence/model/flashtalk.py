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
configuration. :func:`next_clip_frames` is what FlashTalk does between clips: the whole clip decoded by the Wan
2.1 VAE (``cadence.model.vae.WanVAE``, clamped to [-1, 1]), every frame colour-corrected towards the reference
image (:func:`match_colors`: per-frame CIELAB mean / std transfer, blended at ``strength``; FlashTalk ships 1.0),
the new frames returned and the last ``motion_frames`` re-encoded into the next clip's motion latents.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cadence.model.multitalk import reference_mask

_RGB_TO_XYZ = torch.tensor(  # linear sRGB -> CIE XYZ, D65 (IEC 61966-2-1)
    [[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750], [0.0193339, 0.1191920, 0.9503041]],
    dtype=torch.float64,
)
_XYZ_TO_RGB = torch.tensor(  # its inverse as published (not inverted here: the published 7 digits)
    [
        [3.2404542, -1.5371385, -0.4985314],
        [-0.9692660, 1.8760108, 0.0415560],
        [0.0556434, -0.2040259, 1.0572252],
    ],
    dtype=torch.float64,
)
_D65 = (0.95047, 1.0, 1.08883)
_LAB_EPS, _LAB_KAPPA = 0.008856, 903.3  # CIE's rounded constants


def _to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """sRGB [..., 3] in [0, 1] -> CIELAB [..., 3] (D65; XYZ clamped to [1e-8, 1] before the cube root)."""
    lin = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = lin @ _RGB_TO_XYZ.to(rgb).T / torch.tensor(_D65).to(rgb)
    xyz = xyz.clamp(1e-8, 1.0)
    f = torch.where(xyz > _LAB_EPS, xyz ** (1 / 3), (_LAB_KAPPA * xyz + 16) / 116)
    fx, fy, fz = f.unbind(-1)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], dim=-1)


def _from_lab(lab: torch.Tensor) -> torch.Tensor:
    """CIELAB [..., 3] -> sRGB [..., 3] clamped to [0, 1]."""
    light, a, b = lab.unbind(-1)
    fy = (light + 16) / 116
    fx, fz = fy + a / 500, fy - b / 200
    x = torch.where(fx**3 > _LAB_EPS, fx**3, (116 * fx - 16) / _LAB_KAPPA)
    y = torch.where(light > _LAB_KAPPA * _LAB_EPS, fy**3, light / _LAB_KAPPA)
    z = torch.where(fz**3 > _LAB_EPS, fz**3, (116 * fz - 16) / _LAB_KAPPA)
    lin = (torch.stack([x, y, z], dim=-1) * torch.tensor(_D65).to(lab)) @ _XYZ_TO_RGB.to(lab).T
    rgb = torch.where(lin > 0.0031308, 1.055 * lin ** (1 / 2.4) - 0.055, 12.92 * lin)
    return rgb.clamp(0.0, 1.0)


def match_colors(video: torch.Tensor, reference: torch.Tensor, strength: float) -> torch.Tensor:
    """Frames [3, T, H, W] in [-1, 1] moved towards the reference image's colours [3, 1, H, W]: per frame and
    CIELAB channel, (x - mean) * ref_std / std + ref_mean over the pixels (population std; a flat channel keeps
    std 1), converted back and blended ``(1 - strength) * frame + strength * corrected``."""
    if strength <= 0:
        return video.clone()
    src = ((video + 1) / 2).permute(1, 2, 3, 0)  # [T, H, W, 3] in [0, 1]
    ref = _to_lab(((reference.to(video) + 1) / 2).permute(1, 2, 3, 0))
    lab = _to_lab(src)
    mean, std = lab.mean(dim=(1, 2), keepdim=True), lab.std(dim=(1, 2), keepdim=True, unbiased=False)
    std = torch.where(std < 1e-8, torch.ones_like(std), std)
    r_mean, r_std = ref.mean(dim=(1, 2), keepdim=True), ref.std(dim=(1, 2), keepdim=True, unbiased=False)
    out = (1 - strength) * src + strength * _from_lab((lab - mean) * (r_std / std) + r_mean)
    return (out * 2 - 1).permute(3, 0, 1, 2).contiguous()


@torch.no_grad()
def next_clip_frames(
    vae, latent: torch.Tensor, reference: torch.Tensor, motion_frames: int = 5, strength: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A denoised clip [16, F, h, w] -> (its new frames [3, 1 + 4 (F - 1) - motion_frames, H, W] in [-1, 1],
    the next clip's motion latents [16, 1 + (motion_frames - 1) // 4, h, w]): decoded whole (a fresh decoder
    state per clip, as FlashTalk's ``WanVAE.decode``), colour-corrected towards ``reference`` [3, 1, H, W],
    the last ``motion_frames`` encoded and normalised. ``vae``: a ``cadence.model.vae.WanVAE``."""
    video = vae.stream().decode_chunk(vae.denormalize_latents(latent.to(vae.param_dtype())))
    video = match_colors(video.float(), reference, strength)
    motion = vae.normalize_latents(vae.encode(video[:, -motion_frames:]).float())
    return video[:, motion_frames:], motion


def reference_image(image, size: tuple[int, int]) -> torch.Tensor:
    """The reference image as FlashTalk prepares it (``prepare_params`` + ``resize_and_centercrop``): a PIL image
    (or an [H, W, 3] uint8 array) scaled by ``max(th / h, tw / w)`` to ``ceil`` of each side with PIL's bilinear
    filter, centre-cropped to ``size`` (th, tw) (the offsets Python-``round``ed, as torchvision's
    ``center_crop``), then x / 255 -> [-1, 1]: [3, 1, th, tw] float32."""
    import math

    import numpy as np
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image, dtype=np.uint8))
    image = image.convert("RGB")
    th, tw = size
    scale = max(th / image.height, tw / image.width)
    fh, fw = math.ceil(scale * image.height), math.ceil(scale * image.width)
    pixels = torch.from_numpy(np.array(image.resize((fw, fh), resample=Image.BILINEAR)))  # [fh, fw, 3] uint8
    top, left = int(round((fh - th) / 2.0)), int(round((fw - tw) / 2.0))
    crop = pixels[top : top + th, left : left + tw].permute(2, 0, 1)[:, None]
    return (crop.float() / 255 - 0.5) * 2


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


class FlashTalkAudio:
    """Live audio -> each clip's audio windows, as FlashTalk's streaming mode makes them (``generate_video.py``
    ``--audio_encode_mode stream`` + ``inference.get_audio_embedding``).

    Audio arrives at ``rate_in`` (Cadence's media clock: 48 kHz) in pieces of any length and is resampled to the
    encoder's 16 kHz (:class:`cadence.model.wav2vec2.Resampler`: ``librosa.load``'s soxr HQ, the same samples);
    every ``clip_frames - motion_frames`` (28) frames of it (17920 samples, 1.12 s) make one clip: they are
    appended to a rolling window of the last ``cached_seconds`` (8 s; zeros before the stream starts), the whole
    window is loudness-normalised to ``lufs`` (:func:`cadence.model.wav2vec2.loudness_normalize`, FlashTalk's
    pyloudnorm call), encoded by wav2vec2 (``Wav2Vec2Features.encode``: 200 frames at 25 fps) and the windows of
    its last ``clip_frames`` (33) frames taken, clamped at the window's end (no look-ahead): one
    [33, 5, layers, dim] tensor per clip, what :func:`sample_clip` reads as ``audio``. A clip is emitted once
    its last sample has left the resampler (soxr holds ~6 ms back); a piece shorter than a clip at the end is
    dropped, as the reference drops it.
    """

    def __init__(
        self,
        features,
        rate_in: int = 48000,
        clip_frames: int = 33,
        motion_frames: int = 5,
        cached_seconds: int = 8,
        lufs: float = -23.0,
    ):
        from cadence.model.wav2vec2 import Resampler

        self.f, self.lufs, self.n = features, lufs, clip_frames
        self.rate = features.sample_rate
        self.slice = (clip_frames - motion_frames) * self.rate // features.fps
        self.window_frames = cached_seconds * features.fps
        self.window = torch.zeros(cached_seconds * self.rate, dtype=torch.float64)
        self.resampler = Resampler(rate_in, self.rate)
        self.pending = torch.zeros(0, dtype=torch.float32)
        self.loudness: list[float] = []  # each clip's window, LUFS (before normalisation)

    def push(self, samples) -> list[torch.Tensor]:
        """Samples at ``rate_in`` -> the clips they completed (maybe none)."""
        self.pending = torch.cat([self.pending, self.resampler.push(samples)])
        return self._take()

    def flush(self) -> list[torch.Tensor]:
        """The end of the stream: the resampler's tail, and the clips it completes."""
        self.pending = torch.cat([self.pending, self.resampler.flush()])
        return self._take()

    def _take(self) -> list[torch.Tensor]:
        out = []
        while self.pending.numel() >= self.slice:
            piece, self.pending = self.pending[: self.slice], self.pending[self.slice :]
            self.window = torch.cat([self.window[self.slice :], piece.double()])
            out.append(self.clip_windows())
        return out

    def clip_windows(self) -> torch.Tensor:
        """The current window's clip: [clip_frames, 5, layers, dim]."""
        from cadence.model.wav2vec2 import frame_windows, integrated_loudness, loudness_normalize

        self.loudness.append(integrated_loudness(self.window, self.rate))
        audio = loudness_normalize(self.window, self.rate, self.lufs, self.loudness[-1])
        audio = audio.float()  # the feature extractor's float32
        emb = self.f.encode(audio, self.window_frames)
        end = self.window_frames
        return frame_windows(emb, end - self.n, self.n, last=end - 1)


@torch.no_grad()
def generate_offline(
    model,
    vae,
    clip,
    audio: FlashTalkAudio,
    image,
    samples,
    text: torch.Tensor,
    size: tuple[int, int],
    seed: int,
    steps: Sequence[float] = (1000.0, 750.0, 500.0, 250.0),
    shift: float = 5.0,
    color_strength: float = 1.0,
) -> list[torch.Tensor]:
    """FlashTalk's whole streaming run, offline: (reference image, audio) -> each clip's new frames
    [clip_frames - motion_frames, H, W, 3] in 0..255 (float32, as its ``run_pipeline`` returns them).

    model: the family's ``WanDiT``; vae: ``cadence.model.vae.WanVAE``; clip: ``cadence.model.clip_vision.ClipVision``;
    audio: a fresh :class:`FlashTalkAudio` (its wav2vec2 and input rate); image: a PIL image or [H, W, 3] uint8;
    samples: the audio at ``audio``'s input rate; text: the prompt embedding [1, text_len, text_dim] (padded);
    size: (H, W). As ``prepare_params`` then ``generate`` per clip: the I2V condition from [image, 32 black
    frames] encoded, the CLIP tokens of the image, one generator seeded ``seed`` for every noise draw, the image's
    latent as the first motion latents, then per clip :func:`sample_clip` and :func:`next_clip_frames`."""
    ref = reference_image(image, size)
    clip_frames = audio.n
    tokens = clip.encode(ref).to(text)
    video = torch.cat([ref, ref.new_zeros(3, clip_frames - 1, *size)], dim=1)
    cond = i2v_condition(vae.normalize_latents(vae.encode(video).float()))
    motion = vae.normalize_latents(vae.encode(ref).float())
    context = model.prepare_text(text, tokens)
    ts = shifted_timesteps(steps, shift)
    gen = torch.Generator(device=cond.device).manual_seed(seed)
    out = []
    windows = audio.push(samples) + audio.flush()
    motion_frames = clip_frames - audio.slice * audio.f.fps // audio.rate
    for w in windows:
        latent = sample_clip(model, gen, motion, cond, context, w.to(cond), ts)
        frames, motion = next_clip_frames(vae, latent, ref, motion_frames, strength=color_strength)
        out.append((((frames + 1) / 2).permute(1, 2, 3, 0).clip(0, 1) * 255).contiguous())
    return out
