"""The engine's session for SoulX-FlashHead's clip stream (``flashhead-pro`` / ``flashhead-lite``: the families'
``ClipStream`` rule names :class:`FlashHeadSession`).

FlashHead is FlashTalk's structure at 1/10 the size and prompt-free: a stream of bidirectional 33-frame clips,
each made whole from its audio and the motion latents of the clip before (``cadence.model.flashhead_stream``,
tested equal to the authors' pipeline). The session does a whole clip in its step and says so
(``yields_pixels``): the engine's decode stage only copies its frames to the host, overlapped with the next
clip's work (``cadence.engine.engine``); a server plans clips ahead of the media clock, so the next clip is made
while the current one plays.

Per generator (``prepare``, once): the clip codec of the engine's decoder object (``gen.vae``: Pro's Wan 2.1 VAE
as ``WanClipCodec``, Lite's LTX-Video VAE as ``LTXClipCodec``, so ``FastPath.decoder_fast`` applied by the
builder is what the clips run), and the per-image reference latents (:class:`ReferenceLatents`: the image
repeated over the clip and encoded, kept for the last few distinct images by a hash of the pixels; a sampled
codec draws with a fixed seed, so the latent is a pure function of the image).

Per stream (``open`` / ``reset``): a :class:`cadence.model.flashhead_stream.FlashHeadClips` (the reference image
and latent, the motion latents, the generators: the DiT's noise seeded ``seed``, a sampled codec's encodes
``seed + 1``), and a fresh :class:`cadence.model.flashhead_stream.FlashHeadAudio` (the 8 s rolling window of
16 kHz audio, wav2vec2 every layer, the 5-frame windows of the clip's 33 frames).

Per chunk (one clip's new frames: Pro 28 = 53,760 samples at 48 kHz; Lite 24 = 46,080): the chunk's samples
through the audio window, the clip's 4 passes (``sample_clip``), the whole-clip decode, the colour match to the
reference image (CIELAB, strength 1 as shipped) and the re-encode of the last 5 (Pro) / 9 (Lite) frames, then
uint8 frames [T, H, W, 3] on the model's device.

Audio look-ahead, as FlashTalk's session (``cadence.engine.flashtalk``): the 48 -> 16 kHz resampler holds a few
ms back, so the session runs the audio ``AUDIO_LAG`` samples (one video frame, 40 ms) behind the engine's clock:
its stream equals FlashHead's offline stream (``generate_offline``) of the same audio delayed by 40 ms (silence
first), each clip complete when its chunk's samples arrive; the mouth trails the voice by one frame.

Fast paths (the recipe's, each with its reference beside it): FP8 linears and the compiled elementwise ops are
applied to the built DiT by ``cadence.engine.build`` (its blocks are Wan blocks); CUDA graphs (``FastPath.graphs``,
the family's ``ClipStream(graphs=True)``): the model pass is captured once per session at the clip's fixed shape
and replayed for every pass (:class:`cadence.runtime.call_graph.GraphedCall`, fed through static buffers; the
sampler's arithmetic, the noise draws, the audio projection and the codec stay eager); the decoder's fast path
(``decoder_fast``: the Wan decoder's ``cadence.runtime.vae_fast``, the LTX VAE's ``cadence.runtime.ltx_fast``) on
the VAE object the codec wraps. The decode placement (``decode_device``) only receives the frames: a clip is
decoded where it is made (its motion latents are the next clip's input).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import torch

from cadence.config import AUDIO_SAMPLE_RATE
from cadence.engine.cut_in import AUDIO_LAG, ClipCutIn, cut_in_history
from cadence.errors import ConfigError

log = logging.getLogger("cadence.engine")

#: The colour match strength FlashHead ships (``infer_params.yaml``: ``color_correction_strength``).
COLOR_STRENGTH = 1.0


def clip_codec(vae):
    """The clip codec of the generator's autoencoder: Pro's Wan 2.1 VAE or Lite's LTX-Video VAE."""
    from cadence.model.flashhead_stream import LTXClipCodec, WanClipCodec

    if getattr(vae, "ltx", None) is not None:
        return LTXClipCodec(vae.ltx)
    if getattr(vae, "wan", None) is not None and getattr(vae, "taehv", None) is None:
        return WanClipCodec(vae.wan)
    return None


class ReferenceLatents:
    """Per reference image (kept for the last ``keep`` distinct images, by a hash of the pixels): the image
    [3, 1, H, W] in [-1, 1] and its reference latent (``cadence.model.flashhead_stream.reference_latent``)."""

    def __init__(self, codec, device, clip_frames: int, keep: int = 4):
        self.codec, self.device, self.clip_frames, self.keep = codec, device, clip_frames, keep
        self._kept: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @torch.no_grad()
    def __call__(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from cadence.model.flashhead_stream import reference_latent

        host = image.detach().to("cpu", torch.float32).contiguous()
        key = f"{tuple(host.shape)}:{hashlib.blake2b(host.numpy().tobytes(), digest_size=16).hexdigest()}"
        got = self._kept.get(key)
        if got is not None:
            self._kept.move_to_end(key)
            return got
        ref = host[:, None].to(self.device)
        got = (ref, reference_latent(self.codec, ref, self.clip_frames))
        self._kept[key] = got
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        return got


class GraphedPass:
    """The DiT's pass as ``sample_clip`` calls it (``dtype``, ``(x, t, audio context, ref) -> v``), replayed from a
    CUDA graph (:class:`cadence.runtime.call_graph.GraphedCall`): the latent and the timestep copied in every
    pass, the reference latent and the audio K/V only when they are other tensors (once per clip)."""

    def __init__(self, model, runner):
        from cadence.model.flashhead import AudioContext
        from cadence.runtime.call_graph import GraphedCall

        self.model, self.dtype = model, model.dtype
        self.frames = 0

        def run(x, t, ref, *kv):
            pairs = [(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)]
            return model(x, t, AudioContext(pairs, self.frames), ref)

        self.call = GraphedCall(
            run,
            enabled=runner.enabled,
            warmup=runner.warmup,
            capture=runner.capture_fn,
            sticky=range(2, 3 + 2 * len(model.blocks)),
            stats=runner.stats,
            name="flashhead model pass",
        )

    def __call__(self, x: torch.Tensor, t: torch.Tensor, ctx, ref: torch.Tensor) -> torch.Tensor:
        self.frames = ctx.frames  # fixed for a clip shape (part of the K/V tensors' shapes, hence the key)
        return self.call(x, t, ref, *(a for kv in ctx.kv for a in kv))


class FlashHeadSession(ClipCutIn):
    """One FlashHead stream (module docstring), driven through the engine's session interface
    (``cadence.engine.session.StreamSession``)."""

    yields_pixels = True
    step_label = "clip"
    cache = None  # no K/V stream

    @classmethod
    def prepare(cls, gen) -> None:
        """The generator's clip codec and reference latents; its model must be FlashHead's DiT and its audio
        front end wav2vec2's."""
        name = gen.cfg.model.family or gen.cfg.name
        if not hasattr(gen.model, "audio_context") or not hasattr(gen.audio, "encode"):
            raise ConfigError(f"a FlashHead clip session needs FlashHead's DiT and wav2vec2 audio ({name})")
        codec = clip_codec(gen.vae)
        if codec is None:
            raise ConfigError(
                f"model family {name!r} decodes and re-encodes every clip with its VAE: vae.decoder must be "
                f"'{gen.rules.decoder.pinned}', got {gen.cfg.vae.decoder!r}"
            )
        gen.clip_codec = codec
        gen.clip_reference = ReferenceLatents(codec, gen.model.device, gen.rules.stream.clip_frames)
        # a ``cadence.model.flashhead_stream.ClipSplit`` a benchmark sets: every clip's phases timed (None: off)
        gen.clip_split = None

    def __init__(self, gen, image: torch.Tensor, prompt, seed: int, decode_device=None):
        cfg, model = gen.cfg, gen.model
        self.gen, self.cfg, self.model = gen, cfg, model
        clip = gen.rules.stream
        self.clip_frames, self.motion_frames = clip.clip_frames, clip.motion_frames
        scale = model.fcfg.vae_scale
        self.motion_latents = (self.motion_frames - 1) // scale + 1
        if model.fcfg.motion_frames(self.motion_latents) != self.motion_frames:
            raise ConfigError(
                f"{self.motion_frames} motion frames are not 1 + {scale} k (vae_stride {scale})"
            )
        self.decode_device = torch.device(decode_device) if decode_device is not None else model.device
        self.last_latent: torch.Tensor | None = None
        self.streams = 0
        self._pass: GraphedPass | None = None
        self._start(image, seed)

    # ---- stream lifetime -----------------------------------------------------------------------------
    def reset(self, image: torch.Tensor, prompt, seed: int = 0) -> None:
        self._check_image(image)
        self._start(image, seed)

    def reseed(self, seed: int) -> None:
        if self.index:
            raise RuntimeError(f"reseed() before the first chunk only (this session made {self.index})")
        self.clips.reseed(seed)

    def _start(self, image: torch.Tensor, seed: int) -> None:
        from cadence.model.flashhead_stream import FlashHeadClips

        gen, s = self.gen, self.cfg.stream
        ref, ref_latent = gen.clip_reference(image)
        self.clips = FlashHeadClips(
            self.model,
            gen.clip_codec,
            ref,
            seed,
            self.clip_frames,
            self.motion_latents,
            s.passes,
            s.shift,
            COLOR_STRENGTH,
            ref_latent=ref_latent,
        )
        self.audio = self._new_audio()
        self.audio.push(torch.zeros(AUDIO_LAG))
        self.heard = cut_in_history(self.audio)
        self.heard.push(torch.zeros(AUDIO_LAG))
        self.index = 0
        self.next_frame = 0
        self.last_latent = None
        self.cut_ins = 0
        self.streams += 1

    def _new_audio(self):
        from cadence.model.flashhead_stream import FlashHeadAudio

        return FlashHeadAudio(
            self.gen.audio,
            rate_in=AUDIO_SAMPLE_RATE,
            clip_frames=self.clip_frames,
            motion_frames=self.motion_frames,
            window=self.model.fcfg.audio_window,
        )

    def _encode_motion(self, video: torch.Tensor) -> torch.Tensor:
        """A cut-in's motion latents from its frames [3, N, H, W] in [-1, 1] (``ClipCutIn.rewind``)."""
        from cadence.model.flashhead_stream import encode

        return encode(self.clips.codec, video, self.clips.encode_generator).float()

    def _set_motion(self, motion: torch.Tensor) -> None:
        self.clips.motion = motion

    def set_prompt(self, prompt) -> list[int]:
        """Prompt-free: nothing to change (audio and the reference image drive it)."""
        return []

    switch_prompt = set_prompt

    # ---- the chunk step ------------------------------------------------------------------------------
    def _denoiser(self, runner):
        """The model pass: replayed from a CUDA graph when the engine's graphs are on, else the model."""
        if runner is None or not runner.enabled:
            return self.model
        if self._pass is None:
            self._pass = GraphedPass(self.model, runner)
        return self._pass

    @torch.no_grad()
    def step(self, audio: torch.Tensor, runner=None) -> torch.Tensor:
        """One clip from its chunk's 48 kHz samples: uint8 frames [T, H, W, 3] on the model's device (its
        denoised latent in ``last_latent``). ``runner``: the engine's graph runner (its switch, warm-up count,
        capture function and counters; the model pass is captured here, not by the runner). With the
        generator's ``clip_split`` set, the clip's phases are marked (``audio`` ... ``frames``)."""
        split = self.gen.clip_split
        if split is not None:
            split.begin()
        samples = audio.detach().to("cpu", torch.float32)
        windows = self._clip_audio(samples)
        if split is not None:
            split.mark("audio")
        self.clips.denoiser = self._denoiser(runner)
        video = self.clips.next(windows, split)
        self.last_latent = self.clips.last_latent
        out = self._clip_out(samples, video)
        if split is not None:
            split.end("frames")
        return out
