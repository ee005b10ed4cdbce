"""Typed configuration and the named presets (tiny, w1.3, w14, w57).

Every shape the engine uses comes from here; nothing else hard-codes a token count. Each field is
documented in the docstring right below it. ``CadenceConfig.validate()`` runs on construction and
rejects impossible combinations with a message that names the numbers.

Geometry in one picture (W57 / W14, 704x1088)::

    video chunk   4 frames x 704 x 1088 x 3        (166.7 ms at 24 fps, 8,000 audio samples at 48 kHz)
      | VAE, stride 4x16x16, z=48
    latent chunk  48 x 1 x 44 x 68                 (one latent frame)
      | patch 1x2x2
    tokens        1 x 22 x 34 = 748 tokens of dim 8192 (W57)

Self-attention of a chunk sees: the sink (the reference image, encoded to ``sink_frames`` latent
frames), the previous ``window_chunks - 1`` chunks, and the whole current chunk. At W57 that is
(1 + 19 + 1) x 748 = 15,708 keys for 748 queries.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, replace

from cadence.errors import ConfigError

#: The media clock: audio samples per second. Every chunk's audio is frames * 48000 / fps samples.
AUDIO_SAMPLE_RATE = 48_000

_WAN_GEOMETRY = (((4, 8, 8), 16), ((4, 16, 16), 48))
#: The engine's decoders (``VAEConfig.decoder``): the latent geometries each decodes ((stride, z) pairs; None:
#: any, its own folder says) and the temporal strides it takes (the K/V families count 4 video frames per
#: latent frame; the LTX-Video VAE of a clip family compresses 2 per 2x stage: 8 at LTX-Video 0.9.0's three).
DECODER_GEOMETRY: dict[str, tuple[tuple | None, tuple[int, ...]]] = {
    "standin": (None, (4,)),
    "wan": (_WAN_GEOMETRY, (4,)),
    "taehv": (_WAN_GEOMETRY, (4,)),
    "ltx": (None, (2, 4, 8, 16)),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the diffusion transformer (Wan architecture)."""

    dim: int = 128
    """Hidden width of the transformer (= num_heads * head_dim)."""
    num_heads: int = 4
    """Attention heads in self-, cross- and audio attention."""
    head_dim: int = 32
    """Channels per head; must be even and split into RoPE (frame, height, width) parts."""
    ffn_dim: int = 256
    """Inner width of the GELU feed-forward network."""
    num_layers: int = 2
    """Number of transformer blocks."""
    patch: tuple[int, int, int] = (1, 2, 2)
    """Patch size (frames, height, width) in latent units."""
    in_channels: int = 16
    """Latent channels going in (the VAE's z)."""
    out_channels: int = 16
    """Latent channels coming out (the VAE's z)."""
    text_dim: int = 64
    """Width of the prompt embedding fed to the text projection (4096 for Wan's umT5)."""
    text_len: int = 16
    """Number of prompt-embedding tokens (512 for Wan); cross-attention K/V are computed once per session."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding."""
    audio_dim: int = 64
    """Width of one audio feature token (the audio front end's output)."""
    audio_tokens_per_frame: int = 4
    """Audio tokens aligned to one latent frame (its 4 video frames = 166.7 ms of audio)."""
    audio_every: int = 1
    """Audio cross-attention in every k-th block (block i has it when i % k == 0); 0 disables audio."""
    eps: float = 1e-6
    """Epsilon of the layer norms and q/k RMS norms."""
    rope_theta: float = 10_000.0
    """RoPE base."""
    cross_attn_norm: bool = True
    """Affine LayerNorm before text cross-attention (Wan: true)."""
    audio_pos: bool = False
    """A learned embedding per audio-token index added to the audio tokens, so the audio cross-attention
    can tell which of a latent frame's video frames a token belongs to (the trained default character
    has it; Wan checkpoints do not)."""
    weights: str | None = None
    """A safetensors file (or a folder of them) with the transformer's weights, loaded by
    ``build_generator``; ``package:<path>`` is relative to the installed ``cadence`` package. None =
    random weights (benchmarks). A model family's own file (a Self-Forcing ``.pt``, Krea's safetensors)
    loads through ``cadence.model.weights.load_family_weights`` (see ``family``)."""
    lora: tuple[str, ...] = ()
    """LoRA files merged into ``weights`` right after they load (``cadence.model.lora.merge_loras``), each
    ``PATH[:SCALE]`` (``--lora``); every file is checked before any weight changes. Needs ``weights``."""
    weights_entry: str | None = None
    """The entry of a family's multi-entry checkpoint to load (a Self-Forcing ``.pt`` holds 'generator' and
    'generator_ema'); None = the family's default, the one its authors' inference reads
    (``CheckpointFormat.default_entry``). ``cadence.engine.recipe.resolve`` writes the resolved name here.
    Unused for single-state-dict files (safetensors)."""
    family: str | None = None
    """The model family (``cadence.model.families``: 'self-forcing', 'causvid', 'longlive', 'krea-14b')
    this configuration was built for, or None for Cadence's own presets. Names the checkpoint format that
    ``weights`` is read in, and lets the loader refuse a checkpoint of another family."""
    time_embed_fp64: bool = False
    """Compute the sinusoidal timestep embedding in float64 before the timestep MLP, as the original Wan
    code (and every family built on it) does; False computes it in float32, as diffusers does (the
    angles t * freq at t ~ 1000 round differently: on the Self-Forcing fixture the output is 1.5e-7 from
    the reference with it, 4.6e-7 without)."""
    text_encoder: str | None = None
    """The prompt encoder's weights: a local folder holding a ``transformers`` ``UMT5EncoderModel``
    (config.json + safetensors, tokenizer files beside them or in ``text_tokenizer``), or Wan's original
    ``models_t5_umt5-xxl-enc-bf16.pth``. None = the byte-level stand-in (``cadence.model.text``)."""
    text_tokenizer: str | None = None
    """A local folder with the umT5 tokenizer (Wan ships it as ``google/umt5-xxl/``); None = the
    ``text_encoder`` folder itself."""

    cond_channels: int = 0
    """Channels concatenated to the latent before the patch embedding (image-to-video: a 4-channel mask of
    the reference frames + their 16-channel VAE latent = 20, Wan2.1-I2V's ``in_dim`` 36); 0 = none."""
    image_tokens: int = 0
    """CLIP image tokens a cross-attention beside the text's reads (Wan2.1-I2V: 257, the penultimate layer of
    CLIP ViT-H/14), projected by ``img_emb`` from ``image_dim``; 0 = none (text-to-video)."""
    image_dim: int = 1280
    """Width of one CLIP image token (ViT-H/14: 1280)."""
    audio_arch: str = "cadence"
    """The audio branch: 'cadence' (``audio_embed`` MLP per token, q/k-normed audio cross-attention) or
    'multitalk' (InfiniteTalk / SoulX-FlashTalk: ``AudioProjModel`` from per-video-frame wav2vec2 windows to
    ``audio_tokens_per_frame`` tokens of ``audio_context_dim`` per latent frame, read by a biased audio
    cross-attention without q/k norms; ``cadence.model.multitalk``)."""
    audio_window: int = 5
    """'multitalk': wav2vec2 frames around each video frame (t-2 .. t+2)."""
    audio_layers: int = 12
    """'multitalk': wav2vec2 hidden states stacked per frame (every encoder layer: 12)."""
    audio_hidden: int = 512
    """'multitalk': width of the projection's hidden layers (``intermediate_dim``)."""
    audio_context_dim: int = 768
    """'multitalk': width of one projected audio token (``output_dim``), the audio cross-attention's K/V input."""
    audio_norm_out: bool = True
    """'multitalk': LayerNorm on the projected audio tokens (``norm_output_audio``)."""

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Channels of each head given to the (frame, height, width) rotary parts, as Wan splits them."""
        hw = 2 * (self.head_dim // 6)
        return (self.head_dim - 2 * hw, hw, hw)

    def has_audio(self, block: int) -> bool:
        return self.audio_every > 0 and block % self.audio_every == 0


@dataclass(frozen=True)
class VAEConfig:
    """The video autoencoder's geometry (Wan 2.1: 4x8x8, z=16; Wan 2.2: 4x16x16, z=48)."""

    stride: tuple[int, int, int] = (4, 8, 8)
    """Compression (frames, height, width): one latent frame holds `stride[0]` video frames."""
    latent_channels: int = 16
    """Channels of the latent (z)."""
    decoder: str = "standin"
    """'standin' (weightless DCT stand-in), 'wan' (the streaming Wan VAE, cadence.model.vae; random
    weights unless `weights` is set), 'taehv' (the tiny streaming decoder, cadence.model.taehv; the
    encoder is then the Wan one) or 'ltx' (the LTX-Video VAE, cadence.model.ltx_vae: FlashHead Lite's
    clips; `weights` its diffusers folder)."""
    weights: str | None = None
    """A diffusers `vae/` folder (config.json + safetensors) for the Wan VAE; None = random weights.
    With decoder 'taehv' the folder may also hold ``taehv.safetensors`` (+ ``taehv.json``), the trained
    tiny decoder. ``package:<path>`` is relative to the installed ``cadence`` package."""
    base_dim: int | None = None
    """Width of a small Wan VAE (None = the released geometry's width: 96 for 2.1, 160 for 2.2)."""
    taehv_channels: tuple[int, ...] | None = None
    """Channels per stage of the tiny decoder (None = its defaults)."""
    taehv_shuffle: int = 1
    """The tiny decoder's last log2(k) spatial 2x steps as one pixel shuffle by k (cheap at full size)."""
    taehv_weights: str | None = None
    """A published TAEHV decoder file (madebyollin/taehv ``taew2_1.pth`` for 4x8x8 z=16 latents,
    ``taew2_2.pth`` for 4x16x16 z=48) for the 'taehv' decoder, read by
    ``cadence.model.taehv.load_published_taehv`` (it replaces the folder's ``taehv.safetensors``)."""


@dataclass(frozen=True)
class StreamConfig:
    """Chunk geometry, sampler and cache policy of a stream."""

    height: int = 128
    """Video height in pixels."""
    width: int = 128
    """Video width in pixels."""
    fps: int = 24
    """Video frames per second delivered to the viewer."""
    latent_frames_per_chunk: int = 1
    """Latent frames generated per chunk (1 = 4 video frames = 166.7 ms at 24 fps)."""
    passes: int = 4
    """Denoising network passes per chunk."""
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    """Timesteps (0..1000) of the passes before the shift is applied (Self-Forcing's 4-step list)."""
    shift: float = 5.0
    """Timestep shift: sigma' = shift*sigma / (1 + (shift-1)*sigma)."""
    sampler: str = "euler"
    """'euler' (flow-matching ODE step) or 'renoise' (predict x0, re-noise to the next sigma, Self-Forcing)."""
    commit: str = "last_pass"
    """When the chunk's K/V enter the cache: 'last_pass' (during the last denoising pass) or
    'clean_pass' (one extra pass at t=0 on the denoised latent)."""
    window_chunks: int = 4
    """Generated chunks a query sees, the current one included (W57: 20)."""
    sink_frames: int = 1
    """Latent frames of the reference image kept as a sink at the front of every window."""
    cache: str = "naive"
    """Self-attention cache: 'naive' (raw K/V, re-rotated and concatenated every call: the launch
    baseline) or 'ring' (RoPE, and FP8 with `kv_fp8`, applied once at write into preallocated slots)."""
    kv_fp8: bool = False
    """Keep K/V in FP8 e4m3 (per token and head scales) and attend with the FP8 kernel (ring), or
    re-quantise the window every call (naive, to measure that cost)."""
    attention: str = "auto"
    """Ring cache: the kernel that reads it (``cadence.kernels.attention_backends``; set from
    ``FastPath.attention``)."""
    sink_policy: str = "follow"
    """Where the sink sits as positions grow: 'follow' (kept `sink_distance` frames before the current
    chunk once the stream is long enough) or 'absolute' (at its own frames forever)."""
    sink_distance: int = 0
    """Follow policy: frames between the sink and the current chunk's first frame; 0 = sink_frames +
    (window_chunks - 1) * latent_frames_per_chunk, right before the window (the geometry of chunk
    window-1)."""
    warp_denoising_step: bool = True
    """True: pass i runs at the shifted timestep 1000 * shift(t_i / 1000) and that is its noise level
    (Self-Forcing's ``warp_denoising_step``; what Cadence always did). False: the model sees t_i as
    listed and its noise level is t_i / 1000, looked up on the shifted table when ``timestep_table`` is
    set (CausVid), so the shift only shapes that table."""
    timestep_table: int = 0
    """0: noise levels computed in closed form from ``timesteps`` and ``shift``. N > 0: taken from the
    N-step shifted flow-matching training table (float32, ``sigma = shift(1 - k/N)``, k = 0..N-1,
    zero-padded) by nearest timestep, exactly as the Self-Forcing family's scheduler does (N = 1000);
    a listed timestep of 0 then means one last pass at t=0."""
    context_noise: float = 0.0
    """Model timestep (0..1000) of the 'clean_pass' commit: the denoised chunk is run once more at this
    timestep to write its K/V (Self-Forcing's ``context_noise``; 0 = clean)."""
    frame_sink_chunks: int = 0
    """The first k generated chunks stay in the cache for the whole stream at their own positions, next
    to the last ``window_chunks`` chunks (LongLive's frame sink: ``sink_size`` = k x frames per chunk,
    ``local_attn_size`` = (k + window_chunks) x frames per chunk). 0 = none."""
    kv_rebuild: int = 0
    """Krea Realtime's K/V rebuild (its ``kv_cache_num_frames``; ``cadence.cache.rebuild``): n > 0 clears the
    cache before every chunk after the first and refills it in one clean pass (timestep 0, block-causal in
    chunks, positions 0..) over a first frame (``keep_first_frame``) and the last n - 1 clean latent frames;
    the chunk then runs right after them and writes nothing that outlives it. Naive cache only, no image or
    frame sink, n a multiple of the frames per chunk, ``window_chunks`` >= 1 + n / frames per chunk. 0 = off
    (the committed K/V are kept)."""
    keep_first_frame: bool = False
    """With ``kv_rebuild``: the first frame of the rebuilt context (Krea's
    ``GenerateParams.keep_first_frame``). False (Krea's default): the stream's first latent frame while
    ``frames made - latent_frames_per_chunk < kv_rebuild``, then the Wan VAE's re-encoding of the last decoded
    pixel frame of latent frame ``frames made - kv_rebuild`` (decoded as Krea decodes; the session decodes
    every chunk for it, on the step's thread, and needs the Wan VAE: ``vae.decoder`` 'wan' or 'taehv'). True:
    always the stream's first latent frame (no decode). Unused without ``kv_rebuild``."""


@dataclass(frozen=True)
class CadenceConfig:
    """A whole engine configuration: model, VAE and stream geometry."""

    name: str = "custom"
    """Preset name (for logs and benchmark files)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The transformer."""
    vae: VAEConfig = field(default_factory=VAEConfig)
    """The autoencoder's geometry."""
    stream: StreamConfig = field(default_factory=StreamConfig)
    """Chunk geometry, sampler and cache."""

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.stream.height // self.vae.stride[1], self.stream.width // self.vae.stride[2]

    @property
    def token_grid(self) -> tuple[int, int]:
        """Tokens per latent frame along (height, width)."""
        lh, lw = self.latent_hw
        return lh // self.model.patch[1], lw // self.model.patch[2]

    @property
    def tokens_per_frame(self) -> int:
        gh, gw = self.token_grid
        return gh * gw

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.stream.latent_frames_per_chunk // self.model.patch[0]

    @property
    def sink_tokens(self) -> int:
        return self.tokens_per_frame * self.stream.sink_frames // self.model.patch[0]

    @property
    def video_frames_per_chunk(self) -> int:
        return self.stream.latent_frames_per_chunk * self.vae.stride[0]

    @property
    def audio_samples_per_chunk(self) -> int:
        return self.video_frames_per_chunk * AUDIO_SAMPLE_RATE // self.stream.fps

    @property
    def chunk_seconds(self) -> float:
        return self.video_frames_per_chunk / self.stream.fps

    @property
    def sink_distance(self) -> int:
        """Frames between the sink and the current chunk under the follow policy."""
        s = self.stream
        return s.sink_distance or s.sink_frames + (s.window_chunks - 1) * s.latent_frames_per_chunk

    @property
    def kv_tokens(self) -> int:
        """Keys a query sees in steady state: sink + frame sink + full window (current chunk included)."""
        return (
            self.sink_tokens
            + (self.stream.frame_sink_chunks + self.stream.window_chunks) * self.tokens_per_chunk
        )

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Every impossible combination at once, one ``ConfigError`` naming the numbers."""
        errs = _model_errors(self) + _vae_errors(self) + _chunk_errors(self) + _cache_errors(self)
        if errs:
            raise ConfigError(f"invalid configuration {self.name!r}: " + "; ".join(errs))

    # ---- helpers ----------------------------------------------------------------------------
    def with_overrides(self, **sections: dict) -> CadenceConfig:
        """Copy with fields replaced per section, e.g. ``with_overrides(model={"num_layers": 30})``."""
        kw = {}
        for sec, fields in sections.items():
            if sec == "name":
                kw["name"] = fields
                continue
            if sec not in ("model", "vae", "stream"):
                raise ConfigError(f"unknown config section {sec!r}; known: model, vae, stream, name")
            cur = getattr(self, sec)
            known = {f.name for f in dataclasses.fields(cur)}
            bad = set(fields) - known
            if bad:
                raise ConfigError(f"unknown {sec} field(s) {sorted(bad)}; known: {sorted(known)}")
            kw[sec] = replace(cur, **fields)
        return replace(self, **kw)

    def shape_summary(self) -> dict:
        """The `shape` block of benchmark JSON files (docs/benchmarks.md)."""
        return {
            "tokens_per_chunk": self.tokens_per_chunk,
            "window_chunks": self.stream.window_chunks,
            "sink_chunks": self.stream.sink_frames // self.stream.latent_frames_per_chunk
            if self.stream.sink_frames % self.stream.latent_frames_per_chunk == 0
            else None,
            "sink_tokens": self.sink_tokens,
            "passes_per_chunk": self.stream.passes,
            "kv_tokens": self.kv_tokens,
            "height": self.stream.height,
            "width": self.stream.width,
            "layers": self.model.num_layers,
        }


def _model_errors(c: CadenceConfig) -> list[str]:
    """The transformer's shapes and options."""
    m = c.model
    errs: list[str] = []
    if m.num_heads * m.head_dim != m.dim:
        errs.append(
            f"num_heads ({m.num_heads}) x head_dim ({m.head_dim}) = "
            f"{m.num_heads * m.head_dim} must equal dim ({m.dim})"
        )
    if m.head_dim % 2 or m.head_dim < 6:
        errs.append(f"head_dim ({m.head_dim}) must be even and >= 6 for 3D RoPE")
    elif any(p % 2 for p in m.rope_split) or min(m.rope_split) <= 0:
        errs.append(
            f"head_dim ({m.head_dim}) splits into RoPE parts {m.rope_split}; each must be even and positive"
        )
    for what, n in (
        ("dim", m.dim),
        ("ffn_dim", m.ffn_dim),
        ("num_layers", m.num_layers),
        ("text_len", m.text_len),
        ("text_dim", m.text_dim),
        ("freq_dim", m.freq_dim),
    ):
        if n <= 0:
            errs.append(f"{what} must be positive, got {n}")
    if m.freq_dim % 2:
        errs.append(f"freq_dim ({m.freq_dim}) must be even")
    if m.cond_channels < 0 or m.image_tokens < 0:
        errs.append(f"cond_channels ({m.cond_channels}) and image_tokens ({m.image_tokens}) must be >= 0")
    if m.audio_arch not in ("cadence", "multitalk"):
        errs.append(f"audio_arch must be 'cadence' or 'multitalk', got {m.audio_arch!r}")
    if m.audio_every < 0:
        errs.append(f"audio_every must be >= 0, got {m.audio_every}")
    if m.audio_every and (m.audio_dim <= 0 or m.audio_tokens_per_frame <= 0):
        errs.append(
            f"audio_dim ({m.audio_dim}) and audio_tokens_per_frame ({m.audio_tokens_per_frame}) "
            "must be positive when audio is on"
        )
    return errs


def _vae_errors(c: CadenceConfig) -> list[str]:
    """The autoencoder, and where its geometry meets the model's and the frame size."""
    m, v, s = c.model, c.vae, c.stream
    errs: list[str] = []
    if m.in_channels != v.latent_channels or m.out_channels != v.latent_channels:
        errs.append(
            f"model in/out channels ({m.in_channels}/{m.out_channels}) must equal the VAE's "
            f"latent channels ({v.latent_channels})"
        )
    for axis, (px, st, pt) in enumerate(zip((s.height, s.width), v.stride[1:], m.patch[1:])):
        name = ("height", "width")[axis]
        if px <= 0 or px % (st * pt):
            errs.append(f"{name} {px} is not divisible by VAE stride x patch = {st} x {pt} = {st * pt}")
    if m.lora and not m.weights:
        errs.append("model.lora needs model.weights (a LoRA is merged into loaded weights, not random ones)")
    if v.decoder not in DECODER_GEOMETRY:
        errs.append(f"vae.decoder must be {_either(DECODER_GEOMETRY)}, got {v.decoder!r}")
    if v.taehv_shuffle < 1 or v.taehv_shuffle & (v.taehv_shuffle - 1) or v.taehv_shuffle > v.stride[1]:
        errs.append(
            f"vae.taehv_shuffle must be a power of two <= the spatial stride {v.stride[1]}, "
            f"got {v.taehv_shuffle}"
        )
    geometry, temporal = DECODER_GEOMETRY.get(v.decoder, (None, (4,)))
    if geometry is not None and (tuple(v.stride), v.latent_channels) not in geometry:
        errs.append(
            f"the Wan VAE has stride 4x8x8 with z=16 or 4x16x16 with z=48, got "
            f"{'x'.join(map(str, v.stride))} with z={v.latent_channels}"
        )
    if v.stride[0] not in temporal:
        errs.append(
            f"VAE temporal stride must be {_either(temporal)} ({_either(temporal)} video frames per latent "
            f"frame) for the {v.decoder!r} decoder, got {v.stride[0]}"
        )
    return errs


def _either(xs) -> str:
    xs = [repr(x) if isinstance(x, str) else str(x) for x in xs]
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " or " + xs[-1]


def _chunk_errors(c: CadenceConfig) -> list[str]:
    """A chunk's frames and sink, and the sampler's passes and timesteps."""
    m, s = c.model, c.stream
    errs: list[str] = []
    if m.patch[0] != 1:
        errs.append(
            f"temporal patch must be 1 (every Wan model uses 1; the cache and audio alignment "
            f"count latent frames), got patch {m.patch}"
        )
    if s.latent_frames_per_chunk <= 0 or s.latent_frames_per_chunk % m.patch[0]:
        errs.append(
            f"latent_frames_per_chunk ({s.latent_frames_per_chunk}) must be a positive multiple of "
            f"the temporal patch ({m.patch[0]})"
        )
    if s.sink_frames < 0 or s.sink_frames % m.patch[0]:
        errs.append(
            f"sink_frames ({s.sink_frames}) must be a non-negative multiple of the temporal patch "
            f"({m.patch[0]})"
        )
    if s.passes <= 0 or len(s.timesteps) != s.passes:
        errs.append(f"passes ({s.passes}) must be positive and equal len(timesteps) ({len(s.timesteps)})")
    lo_ok = (lambda t: t >= 0.0) if s.timestep_table else (lambda t: t > 0.0)
    if any(not (lo_ok(t) and t <= 1000.0) for t in s.timesteps) or list(s.timesteps) != sorted(
        set(s.timesteps), reverse=True
    ):
        errs.append(
            f"timesteps {s.timesteps} must be decreasing values in "
            f"{'[0' if s.timestep_table else '(0'}, 1000]"
        )
    if s.timestep_table < 0:
        errs.append(f"timestep_table must be >= 0, got {s.timestep_table}")
    elif (
        s.timestep_table
        and s.warp_denoising_step
        and any(float(t) != int(t) or int(t) > s.timestep_table for t in s.timesteps)
    ):
        errs.append(
            f"warped timesteps {s.timesteps} index the {s.timestep_table}-step table: they must be "
            f"whole numbers <= {s.timestep_table}"
        )
    if not (0.0 <= s.context_noise <= 1000.0):
        errs.append(f"context_noise must be in [0, 1000], got {s.context_noise}")
    return errs


def _cache_errors(c: CadenceConfig) -> list[str]:
    """The window, sinks, cache and context rebuild, and the media clock."""
    s = c.stream
    errs: list[str] = []
    if s.frame_sink_chunks < 0:
        errs.append(f"frame_sink_chunks must be >= 0, got {s.frame_sink_chunks}")
    if s.kv_rebuild < 0:
        errs.append(f"kv_rebuild must be >= 0, got {s.kv_rebuild}")
    elif s.kv_rebuild:
        need = 1 + -(-s.kv_rebuild // max(s.latent_frames_per_chunk, 1))
        if s.cache != "naive":
            errs.append(
                f"kv_rebuild (Krea's per-chunk K/V rebuild) runs on the naive cache only, got cache "
                f"{s.cache!r}: the ring keeps fixed chunk slots at growing positions, the rebuild "
                "re-fills the cache at positions 0.. every chunk"
            )
        if s.sink_frames or s.frame_sink_chunks:
            errs.append("kv_rebuild takes no image sink or frame sink (sink_frames, frame_sink_chunks = 0)")
        if s.kv_rebuild % max(s.latent_frames_per_chunk, 1):
            errs.append(
                f"kv_rebuild {s.kv_rebuild} must be a multiple of latent_frames_per_chunk "
                f"({s.latent_frames_per_chunk}): Krea's rebuild mask lets a partial last block see "
                "flex-attention's zero padding keys, which Cadence does not reproduce"
            )
        if s.window_chunks < need:
            errs.append(f"kv_rebuild {s.kv_rebuild} needs window_chunks >= {need}, got {s.window_chunks}")
    if s.shift <= 0:
        errs.append(f"shift must be positive, got {s.shift}")
    if s.sampler not in ("euler", "renoise"):
        errs.append(f"sampler must be 'euler' or 'renoise', got {s.sampler!r}")
    if s.commit not in ("last_pass", "clean_pass"):
        errs.append(f"commit must be 'last_pass' or 'clean_pass', got {s.commit!r}")
    if s.window_chunks < 1:
        errs.append(f"window_chunks must be >= 1 (the current chunk), got {s.window_chunks}")
    if s.cache not in ("naive", "ring"):
        errs.append(f"cache must be 'naive' or 'ring', got {s.cache!r}")
    if s.sink_policy not in ("absolute", "follow"):
        errs.append(f"sink_policy must be 'absolute' or 'follow', got {s.sink_policy!r}")
    if s.sink_distance < 0:
        errs.append(f"sink_distance must be >= 0, got {s.sink_distance}")
    if s.fps <= 0 or (c.video_frames_per_chunk * AUDIO_SAMPLE_RATE) % s.fps:
        errs.append(
            f"fps {s.fps} must divide {c.video_frames_per_chunk} frames x {AUDIO_SAMPLE_RATE} Hz "
            "into whole audio samples per chunk"
        )
    return errs


# ---- placement: which devices diffuse, which decodes (cadence.engine.engine) ----------------------

_DEVICE_SPEC = re.compile(r"cpu|auto|cuda(:\d+)?")


@dataclass(frozen=True)
class PipelineConfig:
    """How the chunk pipeline is laid out and buffered (deployment settings, not model shapes).

    Resolved against the machine by :func:`resolve_placement`; ``cadence.engine.engine.Engine`` runs it:
    diffusion in the caller's thread on ``diffusion_devices``, decode in a worker thread on
    ``decode_device``, overlapped (chunk k decodes while chunk k+1 diffuses)."""

    overlap: bool = True
    """Decode in a thread of its own (on CUDA: its own stream or GPU), overlapped with the next chunk's
    diffusion. False: decode right after each step in the caller's thread (the serial reference; the
    same code path otherwise, tests compare the two)."""

    diffusion_devices: tuple[str, ...] = ("auto",)
    """Devices that run the DiT: one entry (under tensor parallelism each rank runs its own pipeline
    with its own GPU here). 'auto' = where the generator's model lives when an Engine is built
    (in :func:`resolve_placement` alone: cuda:0 when CUDA is present, else cpu); 'cuda' = cuda:0;
    'cuda:N'; 'cpu'."""
    decode_device: str = "auto"
    """Device that runs the VAE decoder: 'same' (the first diffusion device, on its own CUDA stream),
    'cuda:N' (a separate GPU; latents are copied over, non-blocking), 'cpu', or 'auto' (the first GPU
    not used for diffusion if there is one, else 'same'). Without CUDA everything maps to the CPU
    (decode then runs in a CPU worker thread)."""
    queue_depth: int = 2
    """Latent chunks allowed in flight between diffusion and decode (bounded: backpressure on the
    diffusion loop when decode falls behind)."""
    steps_in_flight: int = 1
    """Diffusion steps the caller's thread may have launched but the device not yet finished when it
    plans the next chunk (CUDA). 1: chunk k+1 is planned when chunk k's step is done, so a chunk's
    latency (plan -> frames ready) is its own work, not time queued behind earlier launches; 2 lets
    the host launch one step ahead (hides eager launch overhead, adds up to a step of queueing)."""
    gil_switch_ms: float = 0.5
    """Python's thread switch interval (``sys.setswitchinterval``, process-wide) while a CUDA stream's
    decode runs in its own thread: the interval is lowered to this (never raised). The decode thread
    launches hundreds of kernels behind a stream wait; once the device's launch queue is full a launch
    blocks holding the GIL, and the diffusion thread, waking at the end of its step to launch the next,
    waits for it, up to the interval (5 ms by default). Measured with ``scripts/probe_gil_launch.py``: the
    figures are in docs/perf/pipeline/NOTES.md (the GIL switch interval). 0: leave it alone."""
    host_buffers: int = 4
    """Pinned host frame buffers in the ring the decoder writes uint8 frames into (CUDA decode only).
    A yielded chunk's frames stay valid until the consumer asks for the next chunk."""
    graphs: bool = True
    """Capture the steady-state chunk step as CUDA graphs (cadence.runtime.graphs); other shapes,
    the naive cache and the CPU run eagerly with one log line per reason."""
    max_graphs: int = 4
    """Captured graphs kept per session (LRU; evicted graphs are freed)."""
    graph_warmup: int = 1
    """Eager runs of a step shape before it is captured (the first run of a shape is its warm-up)."""
    max_captures_per_key: int = 8
    """Captures allowed per step shape (evictions cause recaptures); beyond this the shape runs eagerly
    for the rest of the session, so a thrashing stream never recaptures without bound."""
    reuse_session: bool = True
    """Keep the session (its cache buffers and decoder object), the graph runner (its captured graphs,
    which read that cache's buffers) and the pinned frame buffers between ``stream`` calls: the next
    stream resets the session in place (``Session.reset``) and replays the graphs captured by earlier
    streams, including ``Engine.warm_up``'s throwaway one. False: a new session, runner and
    buffers per stream, all freed at its end."""
    first_chunk_alone: bool = True
    """Wait for the first chunk's frames before diffusing the second, so that its decode and copy do not
    share the device with chunk 1's diffusion (lower time to first frame; chunk 1 starts one decode
    later, once per stream). False: every chunk overlaps from the start."""
    prewarm_chunks: int = 0
    """Chunks of ``Engine.warm_up``'s throwaway stream; 0: enough for every step shape a stream
    uses (the ring filling, ``graph_warmup`` eager runs, the capture, one replay)."""
    capture_filling: bool = False
    """Also capture the steps that run while the ring fills (one graph per fill stage: the first chunk,
    then each chunk until the window is full), so that a stream's first window is replayed too. Each
    stage occurs once per stream, so ``prewarm`` then runs ``graph_warmup + 1`` throwaway streams
    (eager warm-up of every stage, then its capture) and keeps ``window_chunks`` more graphs. Off by
    default: not yet measured on a GPU (where the eager filling steps are launch-bound under TP, the
    gain is the first seconds of every stream)."""

    def __post_init__(self) -> None:
        errs: list[str] = []
        if len(self.diffusion_devices) != 1:
            errs.append(
                f"diffusion_devices must list exactly one device (under tensor parallelism every rank "
                f"runs its own pipeline on its GPU: bench pipeline --tp N), got {list(self.diffusion_devices)}"
            )
        for d in self.diffusion_devices:
            if not _DEVICE_SPEC.fullmatch(str(d)):
                errs.append(f"diffusion device {d!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.decode_device != "same" and not _DEVICE_SPEC.fullmatch(str(self.decode_device)):
            errs.append(
                f"decode_device {self.decode_device!r} must be 'auto', 'same', 'cpu', 'cuda' or 'cuda:N'"
            )
        for what, n, lo in (
            ("queue_depth", self.queue_depth, 1),
            ("host_buffers", self.host_buffers, 2),
            ("steps_in_flight", self.steps_in_flight, 1),
            ("max_graphs", self.max_graphs, 1),
            ("graph_warmup", self.graph_warmup, 1),
            ("max_captures_per_key", self.max_captures_per_key, 1),
            ("prewarm_chunks", self.prewarm_chunks, 0),
        ):
            if n < lo:
                errs.append(f"{what} must be >= {lo}, got {n}")
        if not 0 <= self.gil_switch_ms <= 100:
            errs.append(f"gil_switch_ms must be in [0, 100], got {self.gil_switch_ms}")
        if errs:
            raise ConfigError("invalid pipeline configuration: " + "; ".join(errs))


@dataclass(frozen=True)
class Placement:
    """Where the pipeline's stages run, resolved for one machine (device strings, torch-free)."""

    diffusion_devices: tuple[str, ...]
    """Resolved diffusion devices ('cpu' or 'cuda:N')."""
    decode_device: str
    """Resolved decode device ('cpu' or 'cuda:N')."""
    separate_stream: bool
    """True when decode shares the (first) diffusion GPU and runs on its own CUDA stream."""
    notes: tuple[str, ...] = ()
    """Human-readable remarks on how the request was mapped (e.g. 'no CUDA: decode on cpu')."""

    @property
    def diffusion_device(self) -> str:
        return self.diffusion_devices[0]

    @property
    def cuda(self) -> bool:
        return self.diffusion_device.startswith("cuda")

    @property
    def cross_device(self) -> bool:
        """Latents change device between diffusion and decode."""
        return self.decode_device != self.diffusion_device

    def describe(self) -> str:
        how = " (separate stream)" if self.separate_stream else ""
        return f"diffusion {','.join(self.diffusion_devices)} -> decode {self.decode_device}{how}"


def _cuda_index(spec: str) -> int:
    return int(spec.split(":")[1]) if ":" in spec else 0


def resolve_placement(cfg: PipelineConfig, cuda_device_count: int) -> Placement:
    """Map a :class:`PipelineConfig` onto a machine with `cuda_device_count` GPUs (pure: pass a fake
    count in tests). Without CUDA every stage maps to the CPU (decode in a worker thread); with CUDA a
    device index out of range is a :class:`ConfigError` that names the visible devices."""
    notes: list[str] = []
    n = cuda_device_count
    if n < 0:
        raise ConfigError(f"cuda_device_count must be >= 0, got {n}")
    if n == 0:
        asked = [d for d in (*cfg.diffusion_devices, cfg.decode_device) if str(d).startswith("cuda")]
        if asked:
            notes.append(f"no CUDA device visible: {', '.join(asked)} mapped to cpu")
        return Placement(("cpu",) * len(cfg.diffusion_devices), "cpu", False, tuple(notes))
    visible = f"{n} CUDA device(s) visible (cuda:0..cuda:{n - 1})"
    diff: list[str] = []
    for d in cfg.diffusion_devices:
        if d == "cpu":
            diff.append("cpu")
            continue
        i = 0 if d == "auto" else _cuda_index(d)
        if i >= n:
            raise ConfigError(f"diffusion device {d} is out of range: {visible}")
        diff.append(f"cuda:{i}")
    if len(set(diff)) != len(diff):
        raise ConfigError(f"diffusion devices repeat a device: {diff}")
    first = diff[0]
    dec = cfg.decode_device
    if dec == "auto":
        free = [f"cuda:{i}" for i in range(n) if f"cuda:{i}" not in diff]
        if first == "cpu":
            dec = "cpu"
        elif free:
            dec = free[0]
            notes.append(f"decode on {dec}, a GPU not used for diffusion")
        else:
            dec = "same"
            notes.append(f"one GPU: decode shares {first} on a separate stream")
    if dec == "same":
        return Placement(tuple(diff), first, first != "cpu", tuple(notes))
    if dec == "cpu":
        if first != "cpu":
            notes.append("decode on the CPU: latents are copied to the host every chunk (slow)")
        return Placement(tuple(diff), "cpu", False, tuple(notes))
    i = _cuda_index(dec)
    if i >= n:
        raise ConfigError(f"decode_device {dec} is out of range: {visible}")
    dec = f"cuda:{i}"
    if first == "cpu":
        raise ConfigError(
            f"decode_device {dec} with diffusion on the CPU: put diffusion on a GPU, or decode on the CPU"
        )
    if dec in diff[1:]:
        raise ConfigError(
            f"decode_device {dec} is also a (non-first) diffusion device {diff}: decode may share "
            "only the first diffusion GPU ('same'), or use a GPU of its own"
        )
    return Placement(tuple(diff), dec, dec == first, tuple(notes))


def _wan(dim: int, heads: int, ffn: int, layers: int) -> dict:
    return dict(
        dim=dim,
        num_heads=heads,
        head_dim=dim // heads,
        ffn_dim=ffn,
        num_layers=layers,
        text_dim=4096,
        text_len=512,
        audio_dim=1024,
        audio_tokens_per_frame=8,
    )


PRESETS: dict[str, CadenceConfig] = {
    # Small enough to run the whole path on a 2-core CPU: 128x128 video, 64 tokens per chunk.
    "tiny": CadenceConfig(
        name="tiny",
        model=ModelConfig(
            dim=128,
            num_heads=4,
            head_dim=32,
            ffn_dim=256,
            num_layers=2,
            patch=(1, 2, 2),
            in_channels=16,
            out_channels=16,
            text_dim=64,
            text_len=16,
            audio_dim=64,
            audio_tokens_per_frame=4,
            audio_every=1,
        ),
        vae=VAEConfig(stride=(4, 8, 8), latent_channels=16),
        stream=StreamConfig(height=128, width=128, latent_frames_per_chunk=1, window_chunks=4, sink_frames=1),
    ),
    # Wan 2.1 1.3B geometry as the open Self-Forcing/CausVid models use it: 480x832, 3 latent frames
    # (12 video frames) per chunk, 1560 x 3 = 4680 tokens; 19 latent frames visible (sink 1 + 6 chunks x 3),
    # within the 21 of the open Self-Forcing geometry.
    "w1.3": CadenceConfig(
        name="w1.3",
        model=ModelConfig(
            in_channels=16, out_channels=16, audio_every=4, patch=(1, 2, 2), **_wan(1536, 12, 8960, 30)
        ),
        vae=VAEConfig(stride=(4, 8, 8), latent_channels=16),
        stream=StreamConfig(height=480, width=832, latent_frames_per_chunk=3, window_chunks=6, sink_frames=1),
    ),
    "w14": CadenceConfig(
        name="w14",
        model=ModelConfig(
            in_channels=48, out_channels=48, audio_every=4, patch=(1, 2, 2), **_wan(5120, 40, 13824, 40)
        ),
        vae=VAEConfig(stride=(4, 16, 16), latent_channels=48),
        stream=StreamConfig(
            height=704, width=1088, latent_frames_per_chunk=1, window_chunks=20, sink_frames=1
        ),
    ),
    # The shipped default character (issue 7): tiny's geometry (128x128, 64 tokens per chunk) with the
    # model trained by `cadence.train.character` (weights in cadence/assets/character, model card there).
    # A small Wan-architecture VAE (base width 16) encodes; a tiny streaming decoder with a 4x pixel
    # shuffle decodes (the Wan decoder is trained too, for GPUs, but is too slow for a 2-core CPU).
    # Window 1 (each chunk sees the sink and itself): trained with windows up to 4 (clean past chunks in the
    # cache), but over 60 s streams a window of 1 keeps the face at a constant distance from the reference
    # while 2 and 4 drift (docs/perf/eval/NOTES.md); window 1 is the first chunk of every training
    # sequence, so it is in distribution. With nothing read back from past chunks, the clean commit pass of
    # training has no effect here (tests/test_character.py checks both give equal streams): last_pass.
    "character": CadenceConfig(
        name="character",
        model=ModelConfig(
            dim=128,
            num_heads=4,
            head_dim=32,
            ffn_dim=384,
            num_layers=4,
            patch=(1, 2, 2),
            in_channels=16,
            out_channels=16,
            text_dim=64,
            text_len=16,
            audio_dim=64,
            audio_tokens_per_frame=4,
            audio_every=1,
            audio_pos=True,
            weights="package:assets/character/dit.safetensors",
        ),
        vae=VAEConfig(
            stride=(4, 8, 8),
            latent_channels=16,
            decoder="taehv",
            base_dim=16,
            taehv_channels=(96, 64),
            taehv_shuffle=4,
            weights="package:assets/character/vae",
        ),
        stream=StreamConfig(
            height=128,
            width=128,
            latent_frames_per_chunk=1,
            window_chunks=1,
            sink_frames=1,
            commit="last_pass",
            cache="ring",
        ),
    ),
    "w57": CadenceConfig(
        name="w57",
        model=ModelConfig(
            in_channels=48, out_channels=48, audio_every=4, patch=(1, 2, 2), **_wan(8192, 64, 24576, 60)
        ),
        vae=VAEConfig(stride=(4, 16, 16), latent_channels=48),
        stream=StreamConfig(
            height=704, width=1088, latent_frames_per_chunk=1, window_chunks=20, sink_frames=1
        ),
    ),
}


def resolve_asset(path: str) -> str:
    """``package:<rel>`` -> the absolute path of <rel> inside the installed ``cadence`` package."""
    if path.startswith("package:"):
        from pathlib import Path

        return str(Path(__file__).resolve().parent / path[len("package:") :])
    return path


def get_preset(name: str) -> CadenceConfig:
    """The named preset; a clear error for an unknown name."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
