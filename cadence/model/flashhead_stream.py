"""SoulX-FlashHead's clip stream (Soul-AILab/SoulX-FlashHead ``FlashHeadPipeline`` + its streaming audio loop).

FlashHead streams a talking head as a run of bidirectional clips of ``clip_frames`` (33) video frames, each
generated whole by :class:`cadence.model.flashhead.FlashHeadDiT`:

* per stream (``prepare_params``): the reference image resized and centre-cropped (``resize_and_centercrop``:
  ``cadence.model.flashtalk.reference_image``), repeated over the clip's 33 frames and encoded: the
  *reference latent* [C, F, h, w] every pass reads on its input channels; its first latent frame is the first
  clip's motion latents; one generator seeded once draws every noise of the stream;
* per clip (``generate``): the initial noise [C, F, h, w] drawn, then 4 passes at 1000 / 750 / 500 / 250
  shifted by 5 (1000, 937.5, 833.3, 625): before each pass the motion latents overwrite the latent's first
  frames; after it x0 = x - t v and the latent is re-noised to the next level with a fresh draw (zero after
  the last pass, but the draw is made); the motion latents written once more; the whole clip decoded, every
  frame colour-matched to the reference image (CIELAB mean / std, strength 1:
  ``cadence.model.flashtalk.match_colors``), the last ``motion_frames`` (5 Pro, 9 Lite) frames re-encoded: the
  next clip's motion latents (2 latent frames); the clip's frames after its first ``motion_frames`` are new
  (28 Pro, 24 Lite).
* audio (``generate_video.py --audio_encode_mode stream`` / ``gradio_app_streaming.py``): 16 kHz samples cut
  into slices of ``clip_frames - motion_frames`` frames (640 samples a frame at 25 fps); each slice appended to
  a rolling window of the last 8 s (zeros before the stream starts), the whole window encoded by wav2vec2
  (``preprocess_audio``: every layer's hidden state, the CNN features interpolated to the window's 200 video
  frames), and the windows of its last 33 frames taken (5 frames around each, clamped at the window's end:
  ``get_audio_embedding``). No loudness normalisation (their call is commented out). The stream's audio is
  padded with silence to whole slices.

Precision: their pipeline runs in bf16 and casts the timesteps to the model's dtype before embedding them and
before the x0 / re-noise arithmetic (bf16: 833.3 -> 832, 0.8333 -> 0.832); :func:`sample_clip` does the same
casts (exact no-ops in float32) but keeps the latent in float32 between passes (theirs is bf16).

A codec is the clip's decoder and encoder: ``encode(video [3, T, H, W] in [-1, 1]) -> latent [C, F, h, w]``
(the model's normalised space) and ``decode(latent) -> video [3, T, H, W]`` (a fresh decoder state per
clip). :class:`WanClipCodec` is Pro's (Cadence's Wan 2.1 VAE, clamped to [-1, 1] as their ``WanVAE.decode``);
:class:`LTXClipCodec` is Lite's (the LTX-Video VAE, ``cadence.model.ltx_vae``); any object with those two
methods is one (the tests' stand-in).

A *sampled* codec (``sampled`` true: Lite's; their ``LtxVAE.encode`` takes ``latent_dist.sample()``) draws
posterior noise at every encode, from torch's global RNG in their code. Here it comes from generators the
stream owns, so a stream is a function of its inputs and seed: the reference latent's draw from a generator
seeded :data:`REFERENCE_SEED` (the latent is then a pure function of the image, cached per image by the
engine, and a seed chosen after the image was encoded changes nothing there), the motion encodes' draws from
the stream's ``encode_generator`` (seeded ``seed + 1``: not the DiT's noise sequence). Pro's Wan VAE encodes
the posterior mean, as their ``WanVAE.encode``: nothing is drawn.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from cadence.model.flashtalk import FlashTalkAudio, match_colors, reference_image, shifted_timesteps

NUM_TIMESTEPS = 1000
#: The seed of the reference latent's posterior draw under a sampled codec (module docstring).
REFERENCE_SEED = 0


class ClipSplit:
    """Where one clip's time goes: the step marks the end of each phase in order (:meth:`begin`, :meth:`mark`,
    :meth:`end`), so the phases are contiguous and add up to the time from ``begin`` to ``end``.

    On CUDA each mark is an event recorded on the current stream (no host sync: the events are read by
    :meth:`take` after the device has finished them), so a phase is the device's time between two marks,
    including any idle gap while the host prepared the next launches; on the CPU it is the host clock
    (``time.perf_counter``). A phase marked more than once in a clip adds up. Phases of the FlashHead step
    (``cadence.engine.flashhead``): ``audio`` (the chunk's samples to the clip's wav2vec2 windows),
    ``audio_proj`` (the audio projection and its K/V), ``pass_1`` .. ``pass_n`` (each DiT pass with the
    sampler's draw and arithmetic before the next), ``decode``, ``colour`` (the CIELAB match), ``encode``
    (the motion frames' re-encode), ``frames`` (uint8 frames, kept for a cut-in)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._open: list | None = None
        self._done: list[list] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self) -> None:
        """A clip starts (a clip begun and not ended is dropped)."""
        self._open = [("", self._now())]

    def mark(self, phase: str) -> None:
        """The phase ``phase`` ends here (nothing outside a clip)."""
        if self._open is not None:
            self._open.append((phase, self._now()))

    def end(self, phase: str) -> None:
        """The clip's last phase ends here; the clip is kept for :meth:`take`."""
        self.mark(phase)
        if self._open is not None:
            self._done.append(self._open)
        self._open = None

    def take(self) -> list[dict[str, float]]:
        """The clips ended since the last call, each {phase: ms} in the phases' order, then forgotten (on
        CUDA this waits for each clip's last event)."""
        out = []
        for marks in self._done:
            if self.cuda:
                marks[-1][1].synchronize()
            phases: dict[str, float] = {}
            for (_, a), (name, b) in zip(marks, marks[1:]):
                ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
                phases[name] = phases.get(name, 0.0) + ms
            out.append(phases)
        self._done = []
        return out


def _mark(split: ClipSplit | None, phase: str) -> None:
    if split is not None:
        split.mark(phase)


def flashhead_timesteps(steps: int = 4, shift: float = 5.0) -> torch.Tensor:
    """Their ``prepare_params`` table: 2 passes at 1000 / 500, 4 at 1000 / 750 / 500 / 250, otherwise
    ``linspace(1000, 1, steps)`` (float32), then 0, each shifted: [steps + 1] float32."""
    if steps == 2:
        table = [1000.0, 500.0]
    elif steps == 4:
        table = [1000.0, 750.0, 500.0, 250.0]
    else:
        table = torch.linspace(NUM_TIMESTEPS, 1, steps, dtype=torch.float32).tolist()
    return shifted_timesteps(table, shift, NUM_TIMESTEPS)


class WanClipCodec:
    """Cadence's Wan 2.1 VAE (``cadence.model.vae.WanVAE``) as FlashHead Pro's codec."""

    def __init__(self, vae):
        self.vae = vae

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """[3, 1 + 4k, H, W] in [-1, 1] -> normalised latent [16, 1 + k, H / 8, W / 8] float32."""
        vae = self.vae
        return vae.normalize_latents(vae.encode(video.to(vae.param_dtype())).float())

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Normalised latent [16, F, h, w] -> [3, 1 + 4 (F - 1), 8h, 8w] in [-1, 1] float32 (whole clip), decoded
        one latent frame at a time through a fresh causal stream, as Wan's own ``decode`` loops over latent
        frames with its feature cache: the same frames (the decoder is causal in time) with the activations of
        one latent frame alive instead of the whole clip's (the likely cause of the 27.2 GiB peak of a Pro stream on
        the H200, 2026-12-03, against 6.2 GiB for the authors' per-frame decode; not re-measured yet)."""
        vae = self.vae
        z = vae.denormalize_latents(latent.to(vae.param_dtype()))
        stream = vae.stream()
        return torch.cat([stream.decode_chunk(z[:, i : i + 1]) for i in range(z.shape[1])], dim=1).float()


class LTXClipCodec:
    """The LTX-Video VAE (``cadence.model.ltx_vae.LTXVideoVAE``) as FlashHead Lite's codec: a sampled encode (their
    ``LtxVAE.encode``), a whole-clip decode not clamped (their ``LtxVAE.decode``; the pixels are clipped when
    they become frames)."""

    sampled = True

    def __init__(self, vae):
        self.vae = vae

    @torch.no_grad()
    def encode(self, video: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """[3, 1 + 8k, H, W] in [-1, 1] -> normalised latent [C, 1 + k, H / 32, W / 32] float32, the posterior
        sampled with ``generator`` (None: torch's global RNG, as theirs)."""
        return self.vae.encode(video, sample=True, generator=generator).float()

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Normalised latent [C, F, h, w] -> [3, 1 + 8 (F - 1), H, W] float32 (whole clip)."""
        return self.vae.decode(latent).float()


def encode(codec, video: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``codec.encode(video)``, the posterior drawn from ``generator`` when the codec samples."""
    if getattr(codec, "sampled", False):
        return codec.encode(video, generator=generator)
    return codec.encode(video)


def reference_latent(codec, ref: torch.Tensor, clip_frames: int) -> torch.Tensor:
    """The reference latent [C, F, h, w] float32: ``ref`` [3, 1, H, W] repeated over the clip and encoded (their
    ``prepare_params``), a sampled codec's draw from a generator seeded :data:`REFERENCE_SEED`."""
    gen = torch.Generator(device=ref.device).manual_seed(REFERENCE_SEED)
    return encode(codec, ref.repeat(1, clip_frames, 1, 1), gen).float()


@torch.no_grad()
def sample_clip(
    model,
    noise: torch.Generator | Sequence[torch.Tensor],
    motion: torch.Tensor,
    ref_latent: torch.Tensor,
    audio,
    timesteps: torch.Tensor,
    split: ClipSplit | None = None,
) -> torch.Tensor:
    """One clip's denoised latent [C, F, h, w] float32.

    model: :class:`cadence.model.flashhead.FlashHeadDiT`; noise: a generator (the initial latent and every
    re-noising draw, float32, in their order, on its device) or those draws (len(timesteps) tensors);
    motion [C, M, h, w]: the latents the clip starts from (pinned); ref_latent [C, F, h, w]; audio: the clip's
    ``model.audio_context(windows)`` (or the windows [1, frames, W, layers, dim]); timesteps:
    :func:`flashhead_timesteps` (the passes', then 0); split: marks ``pass_1`` .. ``pass_n`` (:class:`ClipSplit`)."""
    c, f, h, w = ref_latent.shape
    m, dev, dt = motion.shape[1], ref_latent.device, model.dtype

    def draw(i: int) -> torch.Tensor:
        if isinstance(noise, torch.Generator):
            return torch.randn(c, f, h, w, generator=noise, device=noise.device, dtype=torch.float32).to(dev)
        return noise[i].to(dev, torch.float32)

    ctx = model.audio_context(audio.to(dev)) if isinstance(audio, torch.Tensor) else audio
    ref = ref_latent[None]
    latent = draw(0)
    for i in range(len(timesteps) - 1):
        latent[:, :m] = motion
        t = timesteps[i : i + 1].to(dev)
        v = model(latent[None], t.to(dt), ctx, ref)[0].float()
        t_i = (t / NUM_TIMESTEPS).to(dt).float()
        t_next = (timesteps[i + 1 : i + 2].to(dev) / NUM_TIMESTEPS).to(dt).float()
        x0 = latent - v * t_i
        latent = (1 - t_next) * x0 + t_next * draw(i + 1)
        _mark(split, f"pass_{i + 1}")
    latent[:, :m] = motion
    return latent


@torch.no_grad()
def next_clip(
    codec,
    latent: torch.Tensor,
    reference: torch.Tensor,
    motion_frames: int,
    strength: float = 1.0,
    generator: torch.Generator | None = None,
    split: ClipSplit | None = None,
):
    """A denoised clip -> (its whole video [3, T, H, W] float32 after the colour match, the next clip's motion
    latents from its last ``motion_frames`` frames, a sampled codec's draw from ``generator``). ``reference``
    [3, 1, H, W] in [-1, 1]; split: marks ``decode``, ``colour``, ``encode`` (:class:`ClipSplit`)."""
    video = codec.decode(latent).float()
    _mark(split, "decode")
    video = match_colors(video, reference, strength)
    _mark(split, "colour")
    motion = encode(codec, video[:, -motion_frames:], generator).float()
    _mark(split, "encode")
    return video, motion


def to_pixels(video: torch.Tensor) -> torch.Tensor:
    """[3, T, H, W] in [-1, 1] -> [T, H, W, 3] float32 in 0..255, as their ``run_pipeline`` returns frames."""
    return (((video + 1) / 2).permute(1, 2, 3, 0).clip(0, 1) * 255).contiguous()


class FlashHeadAudio(FlashTalkAudio):
    """Live audio -> each clip's audio windows, as FlashHead's streaming loop makes them (module docstring).

    ``FlashTalkAudio``'s rolling window (``rate_in`` resampled to 16 kHz by soxr, as ``librosa.load``) without
    its loudness normalisation, the window ``window`` frames wide (the model's ``audio_window``: 5), and the
    stream's end padded with silence to a whole slice (their loop pads; FlashTalk's drops). ``push`` / ``flush``
    return one [clip_frames, window, layers, dim] float32 tensor per completed slice."""

    def __init__(
        self,
        features,
        rate_in: int = 16000,
        clip_frames: int = 33,
        motion_frames: int = 5,
        cached_seconds: int = 8,
        window: int = 5,
    ):
        super().__init__(features, rate_in, clip_frames, motion_frames, cached_seconds)
        self.half = window // 2

    def flush(self) -> list[torch.Tensor]:
        self.pending = torch.cat([self.pending, self.resampler.flush()])
        rest = self.pending.numel() % self.slice
        if rest:
            self.pending = torch.cat([self.pending, self.pending.new_zeros(self.slice - rest)])
        return self._take()

    def clip_windows(self) -> torch.Tensor:
        """The current 8 s window's clip: [clip_frames, window, layers, dim]."""
        emb = self.f.encode(self.window.float(), self.window_frames)
        end = self.window_frames
        idx = torch.arange(end - self.n, end)[:, None] + torch.arange(-self.half, self.half + 1)[None, :]
        return emb[idx.clamp(0, end - 1).to(emb.device)]


class FlashHeadClips:
    """One stream's clip state (their pipeline after ``prepare_params``): the reference image and latent, the
    motion latents, the generators (the DiT's noise; a sampled codec's encodes: module docstring). :meth:`next`
    makes one clip from its audio windows.

    ``ref_latent``: the reference latent already made (:func:`reference_latent` of this image: the engine keeps
    it per image); ``denoiser``: what runs the model pass (default the model; the engine's CUDA graph of it:
    anything with the model's ``dtype`` and call)."""

    def __init__(
        self,
        model,
        codec,
        image: torch.Tensor,
        seed: int,
        clip_frames: int = 33,
        motion_latents: int = 2,
        steps: int = 4,
        shift: float = 5.0,
        color_strength: float = 1.0,
        ref_latent: torch.Tensor | None = None,
        denoiser=None,
    ):
        dev = model.device
        self.model, self.codec, self.strength = model, codec, color_strength
        self.denoiser = denoiser if denoiser is not None else model
        self.clip_frames = clip_frames
        self.motion_frames = model.fcfg.motion_frames(motion_latents)
        self.timesteps = flashhead_timesteps(steps, shift)
        self.ref = image.to(dev, torch.float32)  # [3, 1, H, W] in [-1, 1]
        if ref_latent is None:
            ref_latent = reference_latent(codec, self.ref, clip_frames)
        self.ref_latent = ref_latent
        self.motion = self.ref_latent[:, :1].clone()
        self.generator = torch.Generator(device=dev)
        self.encode_generator = torch.Generator(device=dev)
        self.reseed(seed)
        self.last_latent: torch.Tensor | None = None

    def reseed(self, seed: int) -> None:
        """The stream's noise from ``seed`` (before its first clip: what opening it with that seed gives)."""
        self.generator.manual_seed(seed)
        self.encode_generator.manual_seed(seed + 1)

    @torch.no_grad()
    def next(self, windows: torch.Tensor, split: ClipSplit | None = None) -> torch.Tensor:
        """The clip of ``windows`` [clip_frames, W, layers, dim]: its new frames [3, clip_frames -
        motion_frames, H, W] in [-1, 1] (float32); the motion latents move on. ``split``: the phases marked
        (``audio_proj``, the passes, ``decode``, ``colour``, ``encode``: :class:`ClipSplit`)."""
        ctx = self.model.audio_context(windows[None].to(self.model.device))
        _mark(split, "audio_proj")
        latent = sample_clip(
            self.denoiser, self.generator, self.motion, self.ref_latent, ctx, self.timesteps, split
        )
        video, self.motion = next_clip(
            self.codec, latent, self.ref, self.motion_frames, self.strength, self.encode_generator, split
        )
        self.last_latent = latent
        return video[:, self.motion_frames :]


@torch.no_grad()
def generate_offline(
    model,
    codec,
    audio: FlashHeadAudio,
    image,
    samples,
    size: tuple[int, int],
    seed: int,
    steps: int = 4,
    shift: float = 5.0,
    color_strength: float = 1.0,
) -> list[torch.Tensor]:
    """FlashHead's streaming run, offline: (reference image, audio) -> each clip's new frames
    [clip_frames - motion_frames, H, W, 3] float32 in 0..255 (their ``run_pipeline`` output after
    ``video[motion_frames_num:]``).

    model: :class:`cadence.model.flashhead.FlashHeadDiT`; codec: :class:`WanClipCodec` (Pro) or the LTX VAE
    (Lite); audio: a fresh :class:`FlashHeadAudio` (its wav2vec2, input rate, clip and motion frames); image:
    a PIL image or [H, W, 3] uint8; samples: the audio at ``audio``'s input rate; size: (H, W)."""
    motion_frames = audio.n - audio.slice * audio.f.fps // audio.rate
    motion_latents = (motion_frames - 1) // model.fcfg.vae_scale + 1
    if model.fcfg.motion_frames(motion_latents) != motion_frames:
        raise ValueError(f"{motion_frames} motion frames are not 1 + {model.fcfg.vae_scale} k")
    ref = reference_image(image, size)
    clips = FlashHeadClips(model, codec, ref, seed, audio.n, motion_latents, steps, shift, color_strength)
    return [to_pixels(clips.next(w)) for w in audio.push(samples) + audio.flush()]
