"""A stream's state and its chunk step: :class:`StreamGenerator` (the built model and its front ends) and
:class:`Session` (one stream).

    gen = build_generator(get_preset("tiny"))
    sess = gen.session(image, "a person talking", seed=0)
    lat = sess.step(audio_window)          # [C, F, h, w] clean latent of the next chunk
    frames = sess.decode(lat)              # uint8 [T, H, W, 3]

A :class:`Session` owns one stream's state: its cache (the sink = the VAE-encoded reference image,
written once at t=0), the prompt's cross-attention K/V (computed once), a seeded device generator,
the position of the next chunk and its streaming decoder's state. ``Session.step`` is the chunk step:
device work only, no host syncs; the same seed gives the same output. The loop that steps and decodes
chunk after chunk (and overlaps the two) is :class:`cadence.engine.engine.Engine`, the only one.

The session follows its rules (``cadence.engine.recipe.SessionRules``, from the recipe or from the config):
:func:`session_type` loads the session class its stream kind names (a K/V stream: :class:`Session`; a clip
stream: the family's own clip session, e.g. ``cadence.engine.flashtalk.ClipSession``: no cache, its step makes
a whole clip and its frames, ``decode`` the identity); the generator builds the family's front ends (audio and
image encoders: ``cadence.model.encoders``) whatever the session class; and the K/V session takes its context
and prompt-switch policies (``cadence.engine.policies``: a rebuild, a re-cache, or neither) instead of branching
on the family. Every session class implements :class:`StreamSession`, the interface the engine drives.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections import OrderedDict
from typing import Protocol, runtime_checkable

import torch

from cadence.cache.naive import NaiveCache
from cadence.cache.ring import RingCache
from cadence.config import CadenceConfig
from cadence.engine.policies import policies_for
from cadence.engine.recipe import SessionRules, session_rules
from cadence.errors import ConfigError, InputError
from cadence.model.dit import WanDiT
from cadence.model.encoders import build_front_ends
from cadence.model.standin_vae import StandInVAE
from cadence.model.text import make_text_encoder
from cadence.model.vae import WanVAE, wan_vae_config
from cadence.model.weights import build_model
from cadence.runtime.chunk import denoise_chunk
from cadence.runtime.sampler import Schedule
from cadence.runtime.step import StepInputs, StepKey, step_key

log = logging.getLogger("cadence.engine")


@runtime_checkable
class StreamSession(Protocol):
    """One stream, as the engine drives it (:class:`Session` and ``cadence.engine.flashtalk.ClipSession``)."""

    yields_pixels: bool
    """``step`` returns finished uint8 frames (its latent then in ``last_latent``) rather than a latent for
    ``decode``; the engine's decode stage only copies them to the host."""
    step_label: str | None
    """What the engine records as the chunk's step kind when the session decides it ('clip'); None: the
    graph runner's ('replay', 'capture', 'eager:<reason>')."""
    cache: object | None
    """The K/V cache (captured graphs read its buffers), or None."""
    index: int
    """Chunks made in this stream."""
    next_frame: int
    last_latent: torch.Tensor | None
    streams: int

    @classmethod
    def prepare(cls, gen) -> None:
        """Set up the generator's front ends its sessions read (once, when the generator is built)."""

    def reset(self, image: torch.Tensor, prompt, seed: int = 0) -> None: ...
    def reseed(self, seed: int) -> None: ...
    def set_prompt(self, prompt) -> list[int]: ...
    def switch_prompt(self, prompt) -> list[int]: ...
    def step(self, audio: torch.Tensor, runner=None) -> torch.Tensor: ...
    def prime_decoder(self) -> bool: ...
    def decode(self, lat: torch.Tensor) -> torch.Tensor: ...


def session_type(rules: SessionRules) -> type:
    """The session class a stream of these rules runs: the one its stream kind names (``KVStream.session``:
    :class:`Session`; a family's ``ClipStream.session``: its own clip session, in its own module)."""
    where = rules.stream.session
    module, _, name = where.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"no session {where!r} for the stream kind {rules.stream!r} ({e})") from None


def make_cache(cfg: CadenceConfig, model: WanDiT) -> NaiveCache | RingCache:
    """The self-attention cache the config asks for (naive or ring; FP8 K/V with `kv_fp8`)."""
    s = cfg.stream
    if s.cache == "naive":
        return NaiveCache.from_config(cfg, model)
    if s.cache == "ring":
        return RingCache.from_config(
            cfg,
            model,
            dtype="fp8" if s.kv_fp8 else "bf16",
            sink_policy=s.sink_policy,
            sink_distance=cfg.sink_distance,
        )
    raise ValueError(f"unknown cache {s.cache!r}")


class Session:
    """One stream: cache, prompt K/V, noise generator, next chunk position.

    ``reset(image, prompt, seed)`` starts a new stream on the same object: the same cache buffers
    (cleared logically, not reallocated), the same decoder object (its causal state forgotten), the
    same device generator (re-seeded). A reset session produces exactly what a fresh session with the
    same image, prompt and seed produces, and any CUDA graph captured against this session's cache
    (``cadence.runtime.graphs``) stays valid for it: the one-session-per-GPU-group server reuses one
    session (and its graphs) stream after stream instead of paying allocation and captures again.
    """

    step_label = None  # the graph runner says how each step ran

    @classmethod
    def prepare(cls, gen: StreamGenerator) -> None:
        """Nothing beyond the generator's front ends (the audio encoder's tokens per chunk, the VAE's sink)."""

    def __init__(
        self,
        gen: StreamGenerator,
        image: torch.Tensor,
        prompt: str | torch.Tensor,
        seed: int,
        decode_device: str | torch.device | None = None,
    ):
        cfg, model = gen.cfg, gen.model
        self.gen, self.cfg, self.model = gen, cfg, model
        dev = model.device
        self.cache = make_cache(cfg, model)
        self.noise_gen = torch.Generator(device=dev)
        lh, lw = cfg.latent_hw
        self.latent_shape = (cfg.vae.latent_channels, cfg.stream.latent_frames_per_chunk, lh, lw)
        # Per-session decode state (None for the stateless stand-in), on the decode device (the model's
        # unless asked otherwise). The Wan decoders are primed with the sink latent (its one decoded frame
        # is dropped), so every chunk then decodes to 4F frames. Priming is deferred to the first
        # ``decode`` so that the decoder state is only ever touched by whoever decodes (the pipeline's
        # decode thread).
        self.decode_device = torch.device(decode_device) if decode_device is not None else dev
        self._decode_vae = gen.vae_on(self.decode_device)
        self.decoder = self._decode_vae.stream() if hasattr(self._decode_vae, "stream") else None
        self.streams = 0  # streams started on this object (1 after __init__, +1 per reset)
        # the rules' policies: where a chunk's K/V context comes from (kept, or Krea's rebuild) and what a
        # prompt switch does (a swap, or LongLive's re-cache, which keeps the recent chunks' clean latents)
        self.context, self.switch = policies_for(gen.rules, gen)
        self.last_latent: torch.Tensor | None = None
        self._start(image, prompt, seed)

    @property
    def yields_pixels(self) -> bool:
        """Whether ``step`` returns finished frames (Krea's default first frame decodes every chunk itself:
        the engine's decode stage then only copies them to the host) rather than a latent for ``decode``;
        the latent is then in ``last_latent``."""
        return self.context.yields_pixels

    def reset(self, image: torch.Tensor, prompt: str | torch.Tensor, seed: int = 0) -> None:
        """Start a new stream on this session's buffers (see the class docstring). Must not run while
        another thread decodes for this session (the pipeline calls it between streams)."""
        h, w = self.cfg.stream.height, self.cfg.stream.width
        if tuple(image.shape) != (3, h, w):
            raise InputError(
                f"reference image must be [3, {h}, {w}] for preset {self.cfg.name}, got {list(image.shape)}"
            )
        emb = self._embed(prompt)  # validated before anything of the running stream is touched
        self.cache.reset()
        if self.decoder is not None:
            self.decoder.reset()
        self._start(image, emb, seed)

    def reseed(self, seed: int) -> None:
        """Give a session that has not generated a chunk yet another noise seed: exactly what opening it
        with that seed gives (the open itself draws no noise: the sink pass runs the clean latent at
        t=0). What lets a server open the next session ahead of time (``Engine.preopen``)."""
        if self.index:
            raise RuntimeError(f"reseed() before the first chunk only (this session made {self.index})")
        self.noise_gen.manual_seed(seed)

    def _embed(self, prompt: str | torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        emb = self.gen.text_encoder(prompt) if isinstance(prompt, str) else prompt
        if self.switch.pad and emb.ndim == 2 and 1 <= emb.shape[0] < cfg.model.text_len:
            emb = self._padded(emb)  # a Wan family's model pads its context with zeros
        if tuple(emb.shape) != (cfg.model.text_len, cfg.model.text_dim):
            raise InputError(
                f"prompt embedding must be [{cfg.model.text_len}, {cfg.model.text_dim}], "
                f"got {list(emb.shape)}"
            )
        return emb

    def _start(self, image: torch.Tensor, prompt: str | torch.Tensor, seed: int) -> None:
        cfg, model, gen = self.cfg, self.model, self.gen
        dev = model.device
        emb = self._embed(prompt)  # (a fresh cache and decoder are already in their reset state)
        self.text = model.prepare_text(emb[None].to(dev))
        self.noise_gen.manual_seed(seed)
        self._prime: torch.Tensor | None = None
        self._primed_from: torch.Tensor | None = None
        self.next_frame = 0
        self.index = 0
        self.switch.clear()
        self.context.reset()
        # The sink: the reference image encoded once, run at t=0, its K/V kept for the whole stream.
        sf = cfg.stream.sink_frames
        if sf:
            lat = gen.encode_reference(image).repeat(1, sf, 1, 1)
            if self.decoder is not None:
                self._prime = lat[:, :1]
            silence = torch.zeros(gen.audio.samples_per_frame * sf, device=dev)
            self.cache.begin_chunk(0, sf, sink=True)
            model.forward_chunk(
                lat, gen.timesteps[-1:], self.text, self._audio_feats(silence), self.cache, commit=True
            )
            self.next_frame = sf
        self.streams += 1

    def prime_decoder(self) -> bool:
        """Feed the decoder the sink latent (its one frame is dropped), if not done yet: what the first
        ``decode`` would do first. The pipeline's decode thread calls it as soon as the stream opens, so
        that it overlaps the first chunk's diffusion instead of delaying the first frames. Returns
        whether it primed now. Same caller rule as ``decode`` (whoever decodes)."""
        if self.decoder is None or self._prime is None or self.yields_pixels:
            return False
        # keep the source alive on the session: on CUDA the copy may still read it from another stream
        self._primed_from, self._prime = self._prime, None
        self.decoder.decode_chunk(self._primed_from.to(self.decode_device))
        return True

    def decode(self, lat: torch.Tensor) -> torch.Tensor:
        """A chunk's clean latent -> uint8 frames [4F, H, W, 3] (this session's decoder state)."""
        lat = lat.to(self.decode_device)
        if self.decoder is None:
            return self._decode_vae.decode(lat)
        self.prime_decoder()
        if self.decoder.latent_frames == 0:  # no sink: decode a zero latent first so chunks map to 4F frames
            self.decoder.decode_chunk(torch.zeros_like(lat[:, :1]))
        return self.gen.vae.to_uint8(self.decoder.decode_chunk(lat))

    def _audio_feats(self, samples: torch.Tensor) -> torch.Tensor | None:
        return self.gen.audio(samples) if self.model.audio_embed is not None else None

    def _prompt_embedding(self, prompt: str | torch.Tensor) -> torch.Tensor:
        m = self.cfg.model
        emb = self.gen.text_encoder(prompt) if isinstance(prompt, str) else prompt
        if emb.ndim != 2 or emb.shape[1] != m.text_dim or not 1 <= emb.shape[0] <= m.text_len:
            raise InputError(
                f"prompt embedding must be [L, {m.text_dim}] with 1 <= L <= {m.text_len}, "
                f"got {list(emb.shape)}"
            )
        return emb

    def _padded(self, emb: torch.Tensor) -> torch.Tensor:
        m = self.cfg.model
        if emb.shape[0] == m.text_len:
            return emb
        return torch.cat([emb, emb.new_zeros(m.text_len - emb.shape[0], emb.shape[1])])

    def set_prompt(self, prompt: str | torch.Tensor) -> list[int]:
        """Change the conditioning mid-stream: a prompt string, or an embedding [L, text_dim] with
        1 <= L <= text_len. Takes effect from the next step. A model family's session switches as the
        family does (:meth:`switch_prompt`: padded to text_len, re-cached where the family re-caches);
        a preset's session (its rule ``Swap(pad=False)``) uses the embedding as given (a prompt trimmed of
        its padding: a different cross-attention length, so a different step shape). Returns the chunks
        re-cached."""
        if self.switch.pad:
            return self.switch_prompt(prompt)
        emb = self._prompt_embedding(prompt)
        self.text = self.model.prepare_text(emb[None].to(self.model.device))
        return []

    def switch_prompt(self, prompt: str | torch.Tensor, recache_kv: bool | None = None) -> list[int]:
        """Switch the prompt at the next chunk boundary without changing the step's shape: the embedding
        (a string through the text encoder, or [L, text_dim] with L <= text_len) is padded with zeros to
        text_len, as the Wan family's model pads its context, so the next step is the same shape (and the
        same captured graph) fed the new cross-attention K/V. With the family's ``Recache`` rule (LongLive;
        or ``recache_kv=True``), the cached K/V of the recent chunks are first recomputed under the new
        prompt in one extra model pass (``cadence.cache.recache``; the session's prompt-switch policy).
        Returns the indices of the chunks re-cached (empty when none)."""
        emb = self._padded(self._prompt_embedding(prompt))
        self.text = self.model.prepare_text(emb[None].to(self.model.device))
        if recache_kv is None:
            return self.switch.after_switch(self)
        return self.switch.recache(self, self.switch.keeps_sink) if recache_kv else []

    def prepare_step(self, audio: torch.Tensor) -> StepInputs:
        """The host bookkeeping and small device work before the passes: place the chunk in the cache
        (``begin_chunk``), draw its noise, turn its audio into feature tokens."""
        sched = self.gen.schedule
        self.context.place(self, self.cfg.stream.latent_frames_per_chunk)  # (Krea: the cache rebuilt first)
        noise = torch.randn(self.latent_shape, generator=self.noise_gen, device=self.model.device)
        renoise = None
        if sched.rule == "renoise" and sched.passes > 1:
            renoise = torch.randn(
                (sched.passes - 1, *self.latent_shape), generator=self.noise_gen, device=self.model.device
            )
        return StepInputs(noise, renoise, self._audio_feats(audio), self.text)

    def step_key(self, inp: StepInputs) -> StepKey:
        """The shape signature of the step ``prepare_step`` placed (which steps may share a CUDA graph)."""
        cfg = self.cfg
        return step_key(
            inp,
            self.cache.step_shape(),
            dtype=self.model.dtype,
            tokens_per_chunk=cfg.tokens_per_chunk,
            window_chunks=cfg.stream.window_chunks,
            commit=cfg.stream.commit,
            passes=self.gen.schedule.passes,
            sampler=self.gen.schedule.rule,
            cache_id=id(self.cache),
        )

    def denoise(self, inp: StepInputs) -> torch.Tensor:
        """The passes of the chunk ``prepare_step`` placed, from its inputs alone (what a CUDA graph captures)."""
        return denoise_chunk(
            self.model,
            self.cache,
            self.gen.schedule,
            self.cfg.stream.commit,
            inp.noise,
            inp.text,
            inp.audio,
            self.gen.timesteps,
            inp.renoise,
        )

    def step(self, audio: torch.Tensor, runner=None) -> torch.Tensor:
        """Generate the next chunk from its audio samples [audio_samples_per_chunk] (on the device).
        Returns its clean latent [C, F, h, w] float32. `runner` (a ``cadence.runtime.graphs.GraphRunner``)
        runs the passes, replaying a CUDA graph where the step shape allows; None runs them eagerly."""
        inp = self.prepare_step(audio)
        x = (
            self.denoise(inp)
            if runner is None
            else runner.run(self.step_key(inp), self.denoise, inp, keep=self.cache)
        )
        self.switch.remember(self.index, self.next_frame, x)
        self.context.push(x)
        if self.yields_pixels:
            self.last_latent = x
            x = self.context.frames(self, x)
        self.next_frame += self.cfg.stream.latent_frames_per_chunk
        self.index += 1
        return x


class StreamGenerator:
    """Model + stand-in VAE, text and audio front ends; makes sessions (of the type its rules say:
    :func:`session_type`) and streams chunks. ``rules``: the recipe's (default: ``session_rules(cfg)``)."""

    def __init__(self, cfg: CadenceConfig, model: WanDiT, rules: SessionRules | None = None):
        self.cfg, self.model = cfg, model
        self.rules = rules or session_rules(cfg)
        self.session_type = session_type(self.rules)
        dev = model.device
        self.vae = make_vae(cfg, dev, model.dtype)
        self._vaes = {dev: self.vae}  # the autoencoder per decode device (see vae_on)
        # the family's real encoders (umT5 through transformers, ...) or the byte / log-mel stand-ins of the
        # no-download presets; a prompt's embedding is padded to the model's fixed text length (one step shape);
        # none for a prompt-free family
        self.text_encoder = make_text_encoder(cfg, dev, model.dtype) if self.rules.prompt else None
        # the family's front ends (its recipe's: cadence.model.encoders), whatever session class streams it: the
        # audio encoder (log-mel tokens per chunk, or wav2vec2) and the image encoder (None: the VAE sink; CLIP)
        self.image_encoder, self.audio = build_front_ends(
            cfg, (self.rules.image, self.rules.audio), dev, model.dtype
        )
        self.session_type.prepare(self)
        self.schedule = Schedule.from_config(cfg.stream)
        # Model timesteps of every pass, the clean commit pass's (the family's context noise, else 0) and 0
        # (the sink pass, last), built once, on the device.
        self.timesteps = self.schedule.device_timesteps(dev)
        self._ref_latents: OrderedDict[str, torch.Tensor] = OrderedDict()  # see encode_reference

    REFERENCE_CACHE = 4  # distinct reference images whose latents are kept

    def encode_reference(self, image: torch.Tensor) -> torch.Tensor:
        """The reference image [3, H, W] -> its latent [z, 1, h, w] on the model's device, remembered for
        the last ``REFERENCE_CACHE`` distinct images (keyed by a hash of the pixels), so that a session
        opening with a character seen recently (a server's default face, the same user again) skips the
        VAE encode. The latent is a pure function of the pixels: a hit returns what the encode would."""
        host = image.detach().to("cpu", torch.float32).contiguous()
        key = f"{tuple(host.shape)}:{hashlib.blake2b(host.numpy().tobytes(), digest_size=16).hexdigest()}"
        lat = self._ref_latents.get(key)
        if lat is None:
            lat = self.vae.encode(image.to(self.model.device)[:, None])
            self._ref_latents[key] = lat
            while len(self._ref_latents) > self.REFERENCE_CACHE:
                self._ref_latents.popitem(last=False)
        else:
            self._ref_latents.move_to_end(key)
        return lat

    def vae_on(self, device: str | torch.device):
        """The autoencoder on `device` (decode may run on another GPU or the CPU): the model device's
        one, or a copy with the same weights moved there, built once per device."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._vaes:
            if isinstance(self.vae, StandInVAE):  # weightless: deterministic from the config
                self._vaes[device] = StandInVAE(self.cfg, device)
            else:
                self._vaes[device] = self.vae.to_device(device)
        return self._vaes[device]

    def session(
        self,
        image: torch.Tensor,
        prompt: str | torch.Tensor,
        seed: int = 0,
        decode_device: str | torch.device | None = None,
    ) -> StreamSession:
        h, w = self.cfg.stream.height, self.cfg.stream.width
        if tuple(image.shape) != (3, h, w):
            raise InputError(
                f"reference image must be [3, {h}, {w}] for preset {self.cfg.name}, got {list(image.shape)}"
            )
        return self.session_type(self, image, prompt, seed, decode_device=decode_device)


class WanVAEAdapter:
    """The streaming Wan VAE (or the TAEHV decoder with the Wan encoder) behind the stand-in's API:
    encode(video [3, 1, H, W]) -> normalised latent [z, 1, h, w]; stream() -> per-session decoder
    (fed normalised latents, see ``stream``); to_uint8(frames [3, T, H, W]) -> [T, H, W, 3]."""

    def __init__(self, cfg: CadenceConfig, device, dtype: torch.dtype):
        from pathlib import Path

        from cadence.config import resolve_asset
        from cadence.model.taehv import tiny_decoder_from_config
        from cadence.model.vae import load_wan_vae

        v = cfg.vae
        path = Path(resolve_asset(v.weights)) if v.weights else None
        # the tiny decoder: the published TAEHV file (vae.taehv_weights), or Cadence's own trained one beside
        # the VAE (taehv.safetensors), else random; the Wan VAE from a diffusers folder or Wan's .pth, else random
        taehv = tiny_decoder_from_config(cfg, device, dtype) if v.decoder == "taehv" else None
        wan, rand_taehv = build_vae_modules(
            cfg, wan=path is None, taehv=v.decoder == "taehv" and taehv is None
        )
        taehv = taehv if taehv is not None else rand_taehv
        if path is not None:
            wan = load_wan_vae(path, device, dtype)
        self.wan = wan.to(device=device, dtype=dtype).eval()
        self.taehv = taehv.to(device=device, dtype=dtype).eval() if taehv is not None else None

    def to_device(self, device) -> WanVAEAdapter:
        """A copy with the same weights on `device` (for decoding on another GPU)."""
        import copy

        other = copy.copy(self)
        other.wan = copy.deepcopy(self.wan).to(device)
        other.taehv = copy.deepcopy(self.taehv).to(device) if self.taehv is not None else None
        return other

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return self.wan.normalize_latents(self.wan.encode(video)).float()

    def stream(self):
        inner = (self.taehv or self.wan).stream()
        wan = self.wan

        class _Denormalised:  # the DiT's latents are normalised; the decoders read raw VAE latents
            latent_frames = property(lambda s: inner.latent_frames)

            def decode_chunk(self, lat: torch.Tensor) -> torch.Tensor:
                return inner.decode_chunk(wan.denormalize_latents(lat.float()))

            def reset(self) -> None:
                inner.reset()

        return _Denormalised()

    @staticmethod
    def to_uint8(frames: torch.Tensor) -> torch.Tensor:
        return ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)


def build_vae_modules(cfg: CadenceConfig, wan: bool = True, taehv: bool = True):
    """The configured Wan VAE (released geometry, or ``vae.base_dim`` wide) and the tiny
    decoder (``vae.taehv_channels`` / ``taehv_shuffle``), randomly initialised on the CPU (serving loads
    weights into them; ``cadence train`` trains them)."""
    from cadence.model.taehv import TAEHV

    v = cfg.vae
    over = {"base_dim": v.base_dim} if v.base_dim else {}
    big = WanVAE(wan_vae_config("2.1" if v.latent_channels == 16 else "2.2", **over)) if wan else None
    tiny = TAEHV(v.latent_channels, v.stride, v.taehv_channels, shuffle=v.taehv_shuffle) if taehv else None
    return big, tiny  # None for what was not asked


def _ltx_adapter(cfg: CadenceConfig, device, dtype: torch.dtype):
    from cadence.engine.ltx import LTXVAEAdapter

    return LTXVAEAdapter(cfg, device, dtype)


#: The autoencoder built for each decoder (``cadence.engine.spec.DECODERS``): ``(cfg, device, dtype) -> adapter``.
VAE_ADAPTERS = {"wan": WanVAEAdapter, "taehv": WanVAEAdapter, "ltx": _ltx_adapter}


def make_vae(cfg: CadenceConfig, device, dtype: torch.dtype):
    """The configured autoencoder: the stand-in, the streaming Wan VAE / TAEHV decoder, or the LTX-Video VAE."""
    if cfg.vae.decoder == "standin":
        if cfg.vae.weights:
            raise ConfigError(
                f"VAE weights {cfg.vae.weights} need the 'wan' or 'taehv' decoder; "
                "the stand-in decoder has no weights"
            )
        return StandInVAE(cfg, device)
    return VAE_ADAPTERS[cfg.vae.decoder](cfg, device, dtype)


def build_generator(
    cfg: CadenceConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    weights: str | None = None,
) -> StreamGenerator:
    """Model built on `device` (random weights from `seed`, or loaded from `weights`) + generator."""
    from cadence.config import resolve_asset
    from cadence.model.weights import load_weights

    weights = weights or (resolve_asset(cfg.model.weights) if cfg.model.weights else None)
    model = build_model(cfg, device, dtype, seed=None if weights else seed)
    if weights:
        load_weights(model, weights)
    return StreamGenerator(cfg, model)
