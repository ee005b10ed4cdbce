"""Model families: the open real-time checkpoints Cadence serves, each as a named configuration.

A family is everything needed to run its authors' checkpoint exactly as their code does: the geometry
(overrides on top of one of Cadence's presets), the sampler (denoising step list, ``warp_denoising_step``,
timestep shift, the 1000-step table the noise levels come from, the re-noising rule, the timestep of
the clean commit pass), the chunk size (latent frames per block), the attention window and sinks, the
checkpoint's file format (file kinds, the top-level keys that hold the generator, key prefixes, key
names, a LoRA to merge) and the encoders it needs.

    cfg = family_config("self-forcing", weights="self_forcing_dmd.pt", text_encoder="umt5-xxl/",
                        vae_weights="Wan2.1-T2V-1.3B/vae/")
    model = build_model(cfg, "cuda", torch.bfloat16, seed=None)
    load_family_weights(model, cfg.model.weights, "self-forcing")   # cadence.model.weights

Families (their reference code: docs/references.md; parity fixtures: ``tests/fixtures/<family>/``):

* ``self-forcing`` (guandeh17/Self-Forcing): Wan2.1-T2V-1.3B made block-causal, 3 latent frames per
  block, 4 passes at 1000/750/500/250 warped through the shift-5 table, x0 re-noised between passes,
  the denoised block run once more at ``context_noise`` (0) to write the cache; global attention over
  its 21-frame horizon (7 blocks). ``.pt`` with ``generator`` and ``generator_ema`` state dicts whose
  keys are Wan's names under ``model.``.
* ``causvid`` (tianweiy/CausVid): the same architecture and file format; 3 passes at 1000/757/522, not
  warped, shift 8 (the released ``autoregressive_checkpoint``).
* ``longlive`` (NVlabs/LongLive 1.0): Self-Forcing's model with a local window of 12 frames whose first
  block (3 frames) is a frame sink kept for the whole stream, and a LoRA (rank 256, alpha 256) over
  every linear of the attention blocks, merged at load; base ``.pt`` as Self-Forcing (or ``model``). A
  prompt switch re-computes the recent chunks' K/V under the new prompt (its interactive mode,
  ``global_sink`` true: the frame sink kept).
* ``flashtalk`` (Soul-AILab/SoulX-FlashTalk): InfiniteTalk's model (Wan2.1-I2V-14B: CLIP-H image tokens, the
  reference latent + mask on the input channels, an audio cross-attention in every block fed by
  ``AudioProjModel`` from wav2vec2 windows: ``cadence.model.multitalk``) distilled to 4 steps, streamed as
  33-frame clips at 25 fps whose first 5 frames are the last clip's (``cadence.model.flashtalk``). A diffusers
  folder (config.json + safetensors) with Wan's names, Wan's CLIP ``.pth`` beside it and a wav2vec2 folder.
  Streamed clip by clip (``ClipStream``: ``cadence.engine.flashtalk``), each clip decoded and re-encoded
  by the Wan VAE before the next.
* ``flashhead-pro`` (Soul-AILab/SoulX-FlashHead, ``Model_Pro``): a Wan2.1-1.3B-style DiT that talks from audio
  alone (prompt-free: no text encoder), the reference image's VAE latent on its input channels and a
  per-latent-frame audio cross-attention fed by wav2vec2-base-960h windows (``cadence.model.flashhead``),
  4-step 33-frame clips at 25 fps on the Wan 2.1 VAE (5 motion frames). The released folder (the diffusers
  ``Model_Pro/`` folder, ``VAE_Wan/``) is read by the family's builder (``ModelFamily.builder``:
  ``cadence.model.flashhead_files.FlashHeadLayout``), every size from its files; streamed clip by clip
  (``cadence.engine.flashhead``), CUDA graphs of the model pass and the decoder's fast paths applied by its
  session.
* ``flashhead-lite`` (``Model_Lite``): the same on the LTX-Video VAE (``VAE_LTX/``: 8 x 32 x 32, z = 128;
  ``cadence.model.ltx_vae``), 9 motion frames, 24 new frames a clip.
* ``krea-14b`` (krea-ai/realtime-video): Wan2.1-T2V-14B made block-causal, one safetensors file with
  Wan's names under ``model.``, 5 passes at 1000/750/500/250/0 warped through the shift-5 table.
  Before every block its server rebuilds the cache from a first frame and the last 2 clean frames
  (``kv_cache_num_frames`` = 3): ``Rebuild(frames=3)``, i.e. ``stream.kv_rebuild`` (``cadence.cache.rebuild``). The first frame is Krea's
  default (``stream.keep_first_frame`` False: from the third block on, an older decoded pixel frame
  re-encoded by the Wan VAE) or the stream's first latent frame (True); both equal to Krea's own code.

Each family declares what it changes in the engine with typed objects (data only; the engine recipe,
``cadence.engine.recipe``, is the one reader outside this file: it resolves a configuration to its entry once,
``entry_of``, and the builders and loaders read the recipe's entry, never the name again):

* ``streaming`` (the session kind): :class:`KVStream` (block-causal chunks over a K/V cache, the default,
  streamed by ``cadence.engine.session.Session``) or :class:`ClipStream` (FlashTalk: bidirectional clips
  decoded and re-encoded inside the step: no ring cache, no CUDA graphs), each naming the session class that
  streams it (``session``: ``"module:Class"``, a clip family's own);
* ``prompt_switch``: :class:`Swap` (the new prompt's cross-attention K/V from the next chunk on) or
  :class:`Recache` (LongLive: the recent chunks' K/V recomputed under the new prompt first);
* ``context``: None (the committed K/V stay) or :class:`Rebuild` (Krea: the cache rebuilt before every
  chunk from a short clean context; naive cache only);
* the front ends: ``audio_encoder`` (:class:`LogMelAudio`, Cadence's stand-in, or :class:`Wav2Vec2Audio`),
  ``image_encoder`` (:class:`VaeSinkImage`: the reference image as the cache's sink, or
  :class:`ClipVisionImage`), each built by ``cadence.model.encoders`` from the recipe and finding its files
  beside the weights (:class:`Beside`); ``decoder`` (:class:`DecoderRule`: the VAE variant, and a decoder the
  stream pins); ``checkpoint`` (:class:`CheckpointFormat`, read by ``cadence.model.weights``);
* ``builder`` (:class:`ModelBuilder`, optional): a transformer of the family's own read from a released folder
  of its own layout (FlashHead), its sizes folded into the configuration by the recipe.

A new family is an entry here and its own files (docs/architecture.md, "Adding a family").

Presets and families live in one registry (:data:`REGISTRY`, :func:`get_model`): ``--model NAME`` and its
alias ``--preset NAME`` take either; a preset is an entry of kind 'preset' with Cadence's own defaults
(``cadence.config.PRESETS``). ``get_family(name)``, ``list_families()`` and ``family_config(...)`` are the
families' half (``cadence models``). Pure configuration: no torch here.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, field, replace
from typing import Protocol

from cadence.config import PRESETS, CadenceConfig, get_preset
from cadence.errors import ConfigError
from cadence.model.flashhead_files import FlashHeadLayout, released_config

# ---- the rules a family declares (what it changes in the engine; read by cadence.engine.recipe) -------------


@dataclass(frozen=True)
class KVStream:
    """Block-causal chunks over a K/V cache (``cadence.engine.session.Session``): the engine's decode stage
    decodes each chunk's latent; the ring cache, FP8 K/V and CUDA graphs apply."""

    session: str = field(default="cadence.engine.session:Session", repr=False)
    """``"module:Class"`` of the session that streams it (``cadence.engine.session.session_type`` loads it)."""
    has_cache = True
    """Its steps read a K/V cache (CUDA graphs and FP8 K/V need the ring cache)."""

    def warm_chunks(self, window_chunks: int, graph_warmup: int) -> int:
        """Chunks of a warm-up stream that run every step shape once: W - 1 while the ring fills, the first
        steady step's ``graph_warmup`` eager run(s), the capture, one replay."""
        return window_chunks + graph_warmup + 1

    def fill_chunks(self, window_chunks: int) -> int:
        """Chunks before a stream's steady state (the window filling): the paced warm-up measures after."""
        return window_chunks - 1


@dataclass(frozen=True)
class ClipStream:
    """Bidirectional clips (FlashTalk: ``cadence.engine.flashtalk.ClipSession``): each clip of ``clip_frames``
    video frames is generated whole, decoded by the family's pinned decoder (:class:`DecoderRule`) and its last
    ``motion_frames`` re-encoded before the next starts, inside the step. No K/V cache: no ring cache and no FP8
    K/V; CUDA graphs and the decoder's fast paths only where the family's session says it applies them
    (``graphs``, ``decoder_fast``; otherwise the recipe turns them off with one note)."""

    clip_frames: int
    """Video frames generated together per call (FlashTalk: 33)."""
    motion_frames: int
    """The last video frames of a clip carried into the next one as its first latents (FlashTalk: 5); a
    clip's new video is ``clip_frames - motion_frames`` frames."""
    session: str = field(default="", repr=False)
    """``"module:Class"`` of the family's clip session (its own file: a clip's sampler is the family's)."""
    graphs: bool = False
    """The session replays its model pass from a CUDA graph (a clip's shapes are fixed) when the recipe's
    ``graphs`` is on; False: graphs off, with a note."""
    decoder_fast: bool = False
    """The session decodes and encodes with the engine's decoder object, so the recipe's ``decoder_fast``
    (compile, channels-last) applies to its clips; False: off, with a note."""
    has_cache = False

    def warm_chunks(self, window_chunks: int, graph_warmup: int) -> int:
        """The first clip (its motion latents are the image's) and one more."""
        return 2

    def fill_chunks(self, window_chunks: int) -> int:
        return 0


@dataclass(frozen=True)
class Swap:
    """A prompt change mid-stream: the new prompt's cross-attention K/V from the next chunk on; the cached
    self-attention K/V stay as computed."""

    pad: bool = True
    """Pad the embedding with zeros to the model's text length (a Wan-family model pads its context: the step
    keeps its shape and its captured graph); False (Cadence's presets): the embedding as given (a trimmed
    prompt is another cross-attention length, so another step shape)."""


@dataclass(frozen=True)
class Recache:
    """LongLive's prompt switch: the recent chunks' K/V are recomputed under the new prompt in one extra model
    pass before the next chunk (``cadence.cache.recache``), the embedding padded as :class:`Swap` pads it."""

    keeps_sink: bool = True
    """Keep the frame sink's K/V once the window is full (LongLive's ``global_sink``: true in its shipped
    configs) or recompute them (the sink then moves to recent chunks)."""
    pad: bool = True
    """As :attr:`Swap.pad` (always true for the Wan families)."""


@dataclass(frozen=True)
class Rebuild:
    """Krea Realtime's context rebuild (``cadence.cache.rebuild``): before every chunk after the first the cache
    is cleared and refilled in one clean pass over a first frame and the last ``frames - 1`` clean latent
    frames (its ``kv_cache_num_frames``); naive cache only (the ring keeps fixed chunk slots at growing
    positions). Folded into ``StreamConfig.kv_rebuild`` / ``keep_first_frame`` by :func:`family_config`, so a
    configuration can override it."""

    frames: int
    """Latent frames of the rebuilt context (Krea: 3)."""
    keep_first_frame: bool = False
    """The context's first frame: False (Krea's default: from the third block on, an older decoded pixel frame
    re-encoded by the Wan VAE) or True (always the stream's first latent frame)."""
    caches: tuple[str, ...] = field(default=("naive",), repr=False)
    """The caches it runs on."""

    def stream_fields(self) -> dict:
        """The ``StreamConfig`` fields that carry it."""
        return {"kv_rebuild": self.frames, "keep_first_frame": self.keep_first_frame}


# ---- the front ends a family declares (built by cadence.model.encoders from the recipe) ----------------------


@dataclass(frozen=True)
class Beside:
    """A file or folder a front end reads from beside the transformer's weights (in their folder or its parent)."""

    pattern: str
    """A glob ('models_clip_*.pth', '*wav2vec2*')."""
    what: str
    """What it is, for the error when it is missing."""
    folder_with: str = ""
    """A folder holding this file ('config.json'); '' = a file."""

    def matches(self, path) -> bool:
        if self.folder_with:
            return path.is_dir() and (path / self.folder_with).is_file()
        return path.is_file()


class FrontEnd(Protocol):
    """An audio or image front end a family declares: plain data here, built by the engine from the recipe
    (``cadence.model.encoders.build_front_ends``). A family may bring a type of its own (its own module)."""

    about: str
    """What it is (logged; named in errors)."""
    beside: Beside | None
    """The file or folder it reads beside the weights (None: nothing)."""

    def build(self, cfg: CadenceConfig, device, dtype, path=None):
        """The built encoder (``path``: its file found beside the weights; None without weights)."""


@dataclass(frozen=True)
class LogMelAudio:
    """Cadence's own per-chunk audio front end (``cadence.model.audio.AudioFeatures``): log-mel tokens per latent
    frame, computed on the device; no weights."""

    about: str = "log-mel tokens (Cadence's stand-in, no weights)"
    beside = None

    def build(self, cfg, device, dtype, path=None):
        from cadence.model.audio import AudioFeatures

        return AudioFeatures(cfg, device)


@dataclass(frozen=True)
class Wav2Vec2Audio:
    """A wav2vec2 model's hidden states (``cadence.model.wav2vec2.Wav2Vec2Features``), its folder beside the
    weights (random without weights)."""

    about: str = "wav2vec2"
    beside: Beside = Beside("*wav2vec2*", "the wav2vec2 folder (with config.json)", folder_with="config.json")

    def build(self, cfg, device, dtype, path=None):
        from cadence.model.encoders import wav2vec2

        return wav2vec2(cfg, device, path)


@dataclass(frozen=True)
class VaeSinkImage:
    """The reference image enters as its VAE latent (the K/V cache's sink, ``StreamGenerator.encode_reference``):
    no image encoder of its own."""

    about: str = "the VAE latent of the reference image (the cache's sink)"
    beside = None

    def build(self, cfg, device, dtype, path=None):
        return None


@dataclass(frozen=True)
class ClipVisionImage:
    """A CLIP vision tower's tokens of the reference image (``cadence.model.clip_vision.ClipVision``), its
    ``.pth`` beside the weights (random without weights)."""

    about: str = "CLIP vision"
    beside: Beside = Beside("models_clip_*.pth", "the CLIP vision encoder (models_clip_*.pth)")

    def build(self, cfg, device, dtype, path=None):
        from cadence.model.encoders import clip_vision

        return clip_vision(cfg, device, dtype, path)


@dataclass(frozen=True)
class ReferenceLatentImage:
    """The reference image enters as its VAE latent on the model's input channels (repeated over a clip: FlashHead),
    encoded by the clip session with the family's decoder: no image encoder of its own."""

    about: str = "the VAE latent of the reference image on the input channels"
    beside = None

    def build(self, cfg, device, dtype, path=None):
        return None


class ModelBuilder(Protocol):
    """A family whose transformer is a module of its own (not Cadence's ``WanDiT``), read from a released folder
    laid out its own way (FlashHead: ``cadence.model.flashhead_files.FlashHeadLayout``). The recipe folds what
    the folder says into the configuration (``configure``, torch-free: the web process resolves recipes); the
    engine builds the model with ``build``."""

    about: str
    build: str
    """``"module:function"`` ``(builder, cfg, device, dtype, seed) -> model`` on the device: loaded from
    ``cfg.model.weights``, random from ``seed`` without weights."""

    def configure(self, cfg: CadenceConfig) -> CadenceConfig:
        """``cfg`` with its weights folder's sizes and the files beside it folded in; one ConfigError naming
        what is missing."""


@dataclass(frozen=True)
class DecoderRule:
    """The VAE a family's latents belong to, and the decoder its stream needs."""

    variant: str = "2.1"
    """The VAE its latents belong to ('2.1': Wan 2.1's, 4x8x8, z=16; '2.2': Wan 2.2's, 4x16x16, z=48; 'ltx':
    LTX-Video 0.9.0's, 8x32x32, z=128)."""
    pinned: str | None = None
    """The engine decoder its stream needs whatever was asked ('wan': FlashTalk decodes and re-encodes every
    clip with it), or None: ``FastPath.decoder`` (automatic: ``cadence.engine.recipe.choose_decoder``). A
    clip family whose session decodes with a VAE of its own leaves it None."""


@dataclass(frozen=True)
class CheckpointFormat:
    """How a family stores its transformer."""

    kinds: tuple[str, ...]
    """File kinds the family ships, by suffix: '.pt' (a torch pickle of a dict of state dicts, read with
    ``weights_only=True``) and/or '.safetensors'."""
    state_keys: tuple[str, ...] = ()
    """Top-level keys of a '.pt' that may hold the generator's state dict, in order of preference for
    ``ema=False`` (e.g. 'generator', then 'model'); empty: the file is the state dict itself."""
    ema_key: str | None = None
    """The key of the EMA weights ('generator_ema'), read when asked for (``ema=True``)."""
    default_entry: str | None = None
    """The entry served when none is asked for (``--weights-entry``): the one the authors' own inference reads
    (None: the file is the state dict itself, or the family has no entries)."""
    default_entry_source: str = ""
    """Where the authors' code says so (repository, commit, file and the line followed), for the record."""
    prefixes: tuple[str, ...] = ()
    """Key prefixes stripped before the names are mapped, in order ('model.': the diffusion wrapper's
    attribute; '_fsdp_wrapped_module.' anywhere in a key: FSDP's wrapper)."""
    names: str = "wan"
    """Key names after the prefix: 'wan' (Wan-Video's original module names) or 'diffusers'; 'any' for a
    preset's safetensors (whatever ``cadence.model.weights.load_weights`` detects)."""
    lora_rank: int = 0
    """Rank of the LoRA shipped beside the base weights (0 = none); merged into the weights at load."""
    lora_alpha: float = 0.0
    """LoRA alpha: the merged update is (alpha / rank) * B @ A."""
    lora_keys: tuple[str, ...] = ()
    """Top-level keys of the LoRA file that may hold its state dict (else the file is the state dict)."""


@dataclass(frozen=True)
class ModelFamily:
    """One family of open checkpoints: its geometry, sampler, cache policy, file format and encoders."""

    name: str
    """The name ``--model`` takes."""
    title: str
    """Human-readable name."""
    reference: str
    """The reference code (repository and the file that defines the behaviour reproduced here)."""
    preset: str
    """Cadence preset the geometry starts from (``cadence.config.PRESETS``)."""
    model: dict = field(default_factory=dict)
    """``ModelConfig`` overrides on top of the preset."""
    stream: dict = field(default_factory=dict)
    """``StreamConfig`` overrides: resolution, latent frames per block, sampler, window and sinks."""
    vae: dict = field(default_factory=dict)
    """``VAEConfig`` overrides."""
    checkpoint: CheckpointFormat = field(default_factory=lambda: CheckpointFormat(("safetensors",)))
    """How the transformer's file is laid out."""
    text_encoder: str = "umt5-xxl"
    """The prompt encoder it needs ('umt5-xxl': Wan's umT5-XXL encoder, 512 tokens of 4096); '' for a family:
    prompt-free (audio and the reference image drive it; a prompt is ignored: :attr:`prompt_free`)."""
    audio_encoder: FrontEnd = field(default_factory=LogMelAudio)
    """Its audio front end (built by the engine from the recipe, whatever session streams it)."""
    image_encoder: FrontEnd = field(default_factory=VaeSinkImage)
    """Its reference-image front end."""
    decoder: DecoderRule = field(default_factory=DecoderRule)
    """The VAE its latents belong to and the decoder its stream needs."""
    reference_window: str = ""
    """The reference code's own attention settings, for the record (``local_attn_size`` / ``sink_size``
    in latent frames), from which ``stream``'s window and frame sink are derived."""
    status: str = "parity"
    """'parity': the model pass and the stream the engine runs are tested equal to the reference code
    (tests/fixtures/<name>/); 'model': the model pass and the family's own sampler (outside the engine) are
    tested equal, the engine does not stream it yet; 'config': configuration, key mapping and detection
    only; 'cadence': one of Cadence's own presets (kind 'preset')."""
    streaming: KVStream | ClipStream = field(default_factory=KVStream)
    """How the engine streams it, and the session class that does (see the module docstring)."""
    prompt_switch: Swap | Recache = field(default_factory=Swap)
    """What a prompt change mid-stream does."""
    context: Rebuild | None = None
    """Where a chunk's K/V context comes from: None (the K/V committed by earlier chunks) or a rebuild."""
    kind: str = "family"
    """'family' (an open checkpoint's family) or 'preset' (one of Cadence's presets, in the same registry)."""
    notes: str = ""
    """What is not reproduced, if anything."""
    builder: ModelBuilder | None = None
    """A transformer of its own and the folder it comes from (:class:`ModelBuilder`); None: Cadence's ``WanDiT``
    from a checkpoint file (``checkpoint``)."""

    @property
    def prompt_free(self) -> bool:
        """A family that takes no prompt (no text encoder): ``cadence models`` says so."""
        return self.kind == "family" and not self.text_encoder

    def configure(self, cfg: CadenceConfig) -> CadenceConfig:
        """``cfg`` with what its files say folded in (a builder's folder), else as it is."""
        return self.builder.configure(cfg) if self.builder is not None else cfg


# Wan 2.1 geometry as the Self-Forcing family runs it: 480x832 at 16 fps, 3 latent frames (12 video
# frames, 0.75 s) per block, no reference-image sink (text-to-video), no audio branch; the original
# Wan code computes the timestep embedding in float64.
_SF_MODEL = dict(audio_every=0, time_embed_fp64=True)
_SF_STREAM = dict(
    height=480,
    width=832,
    fps=16,
    latent_frames_per_chunk=3,
    sink_frames=0,
    passes=4,
    timesteps=(1000.0, 750.0, 500.0, 250.0),
    shift=5.0,
    sampler="renoise",
    commit="clean_pass",
    warp_denoising_step=True,
    timestep_table=1000,
    context_noise=0.0,
    sink_policy="absolute",
    window_chunks=7,
    frame_sink_chunks=0,
)
_SF_FORMAT = CheckpointFormat(
    kinds=(".pt",),
    state_keys=("generator", "model"),
    ema_key="generator_ema",
    prefixes=("model.", "_fsdp_wrapped_module."),
    names="wan",
    default_entry="generator_ema",
    default_entry_source="guandeh17/Self-Forcing 33593df: README.md runs `python inference.py --config_path "
    "configs/self_forcing_dmd.yaml ... --checkpoint_path checkpoints/self_forcing_dmd.pt ... --use_ema` "
    "(inference.py: `state_dict['generator' if not args.use_ema else 'generator_ema']`); demo.py: "
    "`transformer.load_state_dict(state_dict['generator_ema'])`",
)

FAMILIES: dict[str, ModelFamily] = {
    "self-forcing": ModelFamily(
        name="self-forcing",
        title="Self-Forcing (Wan2.1-T2V-1.3B, block-causal)",
        reference="guandeh17/Self-Forcing: pipeline/causal_inference.py, wan/modules/causal_model.py",
        preset="w1.3",
        model=dict(_SF_MODEL),
        stream=dict(_SF_STREAM),
        checkpoint=_SF_FORMAT,
        reference_window="local_attn_size=-1 (global; its cache holds 21 frames), sink_size=0",
    ),
    "causvid": ModelFamily(
        name="causvid",
        title="CausVid (Wan2.1-T2V-1.3B, block-causal, DMD)",
        reference="tianweiy/CausVid: causvid/models/wan/causal_inference.py",
        preset="w1.3",
        model=dict(_SF_MODEL),
        stream=dict(
            _SF_STREAM, passes=3, timesteps=(1000.0, 757.0, 522.0), shift=8.0, warp_denoising_step=False
        ),
        checkpoint=replace(
            _SF_FORMAT,
            ema_key=None,
            default_entry="generator",
            default_entry_source="tianweiy/CausVid ca21150: README.md runs `python "
            "minimal_inference/autoregressive_inference.py --config_path configs/wan_causal_dmd.yaml "
            "--checkpoint_folder XXX ...`, which reads `torch.load(os.path.join(args.checkpoint_folder, "
            '"model.pt"), map_location="cpu")[\'generator\']`',
        ),
        reference_window="global attention over 21 frames (configs/wan_causal_dmd.yaml)",
        status="config",
        notes="Shares Self-Forcing's model and sampler code paths (tested there); no CausVid fixture of its own.",
    ),
    "longlive": ModelFamily(
        name="longlive",
        title="LongLive 1.0 (Wan2.1-T2V-1.3B, frame sink + short window, LoRA)",
        reference="NVlabs/LongLive (1.0): wan/modules/causal_model.py, pipeline/causal_inference.py",
        preset="w1.3",
        model=dict(_SF_MODEL),
        stream=dict(_SF_STREAM, window_chunks=3, frame_sink_chunks=1),
        checkpoint=replace(
            _SF_FORMAT,
            lora_rank=256,
            lora_alpha=256.0,
            lora_keys=("generator_lora",),
            default_entry="generator",
            default_entry_source="NVlabs/LongLive 2462895 (1.0): inference.sh and interactive_inference.sh run "
            "configs/longlive_inference.yaml / longlive_interactive_inference.yaml, both `use_ema: false`; "
            'inference.py: `state_dict["generator_ema" if config.use_ema else "generator"]`',
        ),
        reference_window="local_attn_size=12, sink_size=3 (configs/longlive_inference.yaml)",
        prompt_switch=Recache(keeps_sink=True),
    ),
    "krea-14b": ModelFamily(
        name="krea-14b",
        title="Krea Realtime 14B (Wan2.1-T2V-14B, block-causal)",
        reference="krea-ai/realtime-video: release_server.py, configs/self_forcing_server_14b.yaml",
        preset="w1.3",
        model=dict(_SF_MODEL, dim=5120, num_heads=40, head_dim=128, ffn_dim=13824, num_layers=40),
        stream=dict(
            _SF_STREAM,
            passes=5,
            timesteps=(1000.0, 750.0, 500.0, 250.0, 0.0),
            window_chunks=2,
            commit="last_pass",  # no clean pass: the next rebuild replaces whatever the block wrote
        ),
        # kv_cache_num_frames = 3: the cache rebuilt before every block; Krea's default first frame (from the
        # third block on, an older frame re-encoded)
        context=Rebuild(frames=3, keep_first_frame=False),
        checkpoint=CheckpointFormat(
            kinds=(".safetensors",),
            prefixes=("model.",),
            names="wan",
            default_entry_source="krea-ai/realtime-video acf4b7b: release_server.py `state_dict = "
            'load_file(checkpoint_path, device="cuda")` then `transformer.load_state_dict(state_dict)`: '
            "the file is the state dict (no entries)",
        ),
        reference_window="kv_cache_num_frames=3: the cache is recomputed every block from the first frame "
        "and the last clean frames",
        notes="The per-block K/V rebuild with Krea's default first context frame (keep_first_frame=False: "
        "from the third block on, the Wan VAE re-encoding of an older pixel frame decoded as Krea's "
        "VAEDecoderWrapper decodes; needs the Wan VAE) or, with stream.keep_first_frame=True, the stream's "
        "first latent frame. Krea runs its VAE in float16 and the re-encode only at 480x832 (hard-coded); "
        "with the default, the frames shown are Krea's decode (the first chunk holds the first of the 6 frames "
        "Krea's first block shows). Naive cache only (the ring is refused).",
    ),
}


FAMILIES["flashtalk"] = ModelFamily(
    name="flashtalk",
    title="SoulX-FlashTalk (Wan2.1-I2V-14B + InfiniteTalk audio; 4-step 33-frame clips, 5 motion frames)",
    reference="Soul-AILab/SoulX-FlashTalk: flash_talk/src/pipeline/flash_talk_pipeline.py, "
    "flash_talk/infinite_talk/modules/multitalk_model.py",
    preset="w1.3",
    model=dict(
        _SF_MODEL,
        dim=5120,
        num_heads=40,
        head_dim=128,
        ffn_dim=13824,
        num_layers=40,
        cond_channels=20,
        image_tokens=257,
        image_dim=1280,
        audio_every=1,
        audio_arch="multitalk",
        audio_dim=768,
        audio_layers=12,
        audio_window=5,
        audio_hidden=512,
        audio_context_dim=768,
        audio_tokens_per_frame=32,
        audio_norm_out=True,
    ),
    stream=dict(
        height=768,
        width=448,
        fps=25,
        latent_frames_per_chunk=7,  # the 28 new video frames of a 33-frame clip
        sink_frames=0,
        passes=4,
        timesteps=(1000.0, 750.0, 500.0, 250.0),
        shift=5.0,
        sampler="renoise",
        warp_denoising_step=True,
        timestep_table=0,
    ),
    vae=dict(decoder="wan"),  # every clip is decoded and its last frames re-encoded by the Wan 2.1 VAE
    checkpoint=CheckpointFormat(
        kinds=(".safetensors",),
        names="wan",
        default_entry_source="Soul-AILab/SoulX-FlashTalk 688982e: flash_talk/src/pipeline/flash_talk_pipeline.py "
        "`self.model = WanModel.from_pretrained(checkpoint_dir, ...)`: the diffusers folder is the state dict "
        "(no entries)",
    ),
    audio_encoder=Wav2Vec2Audio("wav2vec2 (chinese-wav2vec2-base, every layer's hidden state at 25 fps)"),
    image_encoder=ClipVisionImage(
        "CLIP ViT-H/14 (Wan's open-clip xlm-roberta-large-vit-huge-14, penultimate layer)"
    ),
    decoder=DecoderRule("2.1", pinned="wan"),
    reference_window="bidirectional within a 33-frame clip (frame_num 33, motion_frames_num 5: "
    "flash_talk/configs/infer_params.yaml)",
    status="parity",
    streaming=ClipStream(clip_frames=33, motion_frames=5, session="cadence.engine.flashtalk:ClipSession"),
    notes="Streamed by the engine as clips (cadence.engine.flashtalk.ClipSession): per chunk its wav2vec2 audio "
    "windows, the 4-pass clip, the whole-clip Wan VAE decode, colour match and re-encode of the motion frames; "
    "tested equal to FlashTalk's offline stream (generate_offline, itself tested against the reference's "
    "generate_video) on the audio delayed by one frame (40 ms: the live resampler's look-ahead), so the mouth "
    "trails the voice by 40 ms. No K/V cache: no ring cache, no CUDA graphs. The encoders come from the "
    "weights folder (models_clip_*.pth; a *wav2vec2* folder in or beside it), random without weights. A 14B "
    "bidirectional clip model is not real time on one GPU: the engine streams it as fast as the hardware "
    "allows. One speaker only (InfiniteTalk's multi-speaker RoPE placement is not reproduced).",
)


def _flashhead(variant: str, decoder: str, title: str) -> ModelFamily:
    """SoulX-FlashHead Pro / Lite (module docstring): the released geometry (random weights); ``--weights DIR``
    (the downloaded folder) reads every size from it (``FlashHeadLayout.configure``)."""
    model_dir, vae_dir = (
        ("Model_Pro", "VAE_Wan/Wan2.1_VAE.pth") if variant == "pro" else ("Model_Lite", "VAE_LTX/")
    )
    layout = FlashHeadLayout(
        variant,
        about=f"SoulX-FlashHead-1_3B/ with {model_dir}/ and {vae_dir}, wav2vec2-base-960h/ beside or in it",
    )
    geometry = released_config(variant).engine_overrides(audio_layers=12)  # wav2vec2-base: 12 x 768
    scale = geometry["vae"]["stride"][0]
    motion = layout.clip_frames - layout.new_frames(scale)
    return ModelFamily(
        name=f"flashhead-{variant}",
        title=title,
        reference="Soul-AILab/SoulX-FlashHead: flash_head/src/pipeline/flash_head_pipeline.py, "
        "flash_head/src/modules/flash_head_model.py, gradio_app_streaming.py",
        preset="w1.3",
        model=geometry["model"],
        stream=dict(
            height=512,
            width=512,
            fps=25,
            sink_frames=0,
            passes=4,
            timesteps=(1000.0, 750.0, 500.0, 250.0),
            shift=5.0,
            sampler="renoise",
            warp_denoising_step=True,
            timestep_table=0,
            **layout.stream_overrides(scale, "released geometry"),
        ),
        vae=dict(geometry["vae"], decoder=decoder),
        checkpoint=CheckpointFormat(
            kinds=("folder",),
            names="wan",
            default_entry_source="Soul-AILab/SoulX-FlashHead 12467ce: flash_head/src/pipeline/"
            "flash_head_pipeline.py `WanModelAudioProject.from_pretrained(os.path.join(checkpoint_dir, "
            f"'{'Model_Pro' if variant == 'pro' else 'Model_Lite'}'))`: the diffusers folder is the state dict "
            "(no entries); its VAE and the wav2vec2 folder beside it",
        ),
        text_encoder="",
        audio_encoder=Wav2Vec2Audio("wav2vec2 (wav2vec2-base-960h, every layer's hidden state at 25 fps)"),
        image_encoder=ReferenceLatentImage(),
        decoder=DecoderRule("2.1" if decoder == "wan" else "ltx", pinned=decoder),
        reference_window=f"bidirectional within a {layout.clip_frames}-frame clip (frame_num 33, "
        f"motion_frames_latent_num {layout.motion_latents}: flash_head/configs/infer_params.yaml)",
        status="parity",
        streaming=ClipStream(
            clip_frames=layout.clip_frames,
            motion_frames=motion,
            session="cadence.engine.flashhead:FlashHeadSession",
            graphs=True,
            decoder_fast=True,
        ),
        builder=layout,
        notes=f"Streamed by the engine as {layout.clip_frames}-frame clips of {layout.new_frames(scale)} new frames "
        "(cadence.engine.flashhead.FlashHeadSession): per chunk its wav2vec2 windows (8 s rolling window), the "
        f"4-pass clip, the whole-clip {'Wan 2.1' if decoder == 'wan' else 'LTX-Video'} VAE decode, colour match "
        f"to the reference and re-encode of the last {motion} frames; tested equal to FlashHead's offline stream "
        "(generate_offline, itself tested against their pipeline) on the audio delayed by 40 ms (the live "
        "resampler's look-ahead). Every size from the folder's files. Not reproduced: their face crop "
        "on the served image (use_face_crop; its geometry is cadence.media.face_crop), multi-GPU sequence parallelism (xfuser), their global-RNG draws of the LTX "
        "posterior (here seeded generators).",
    )


FAMILIES["flashhead-pro"] = _flashhead(
    "pro",
    "wan",
    "SoulX-FlashHead Pro (1.3B Wan DiT + wav2vec2 audio; Wan 2.1 VAE; 33-frame clips, 5 motion frames)",
)
FAMILIES["flashhead-lite"] = _flashhead(
    "lite",
    "ltx",
    "SoulX-FlashHead Lite (1.3B Wan DiT + wav2vec2 audio; LTX-Video VAE; 33-frame clips, 9 motion frames)",
)


def list_families() -> list[ModelFamily]:
    """Every family, in a stable order (what ``cadence models`` prints)."""
    return list(FAMILIES.values())


def get_family(name: str) -> ModelFamily:
    """The named family; a clear error listing the known names otherwise."""
    try:
        return FAMILIES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}") from None


def preset_entry(name: str) -> ModelFamily:
    """A Cadence preset as a registry entry: its own geometry and defaults, safetensors weights with any of the
    loader's key names, a prompt switch that keeps the embedding as given."""
    return ModelFamily(
        name=name,
        title=f"Cadence preset {name!r}",
        reference="cadence.config.PRESETS",
        preset=name,
        checkpoint=CheckpointFormat(kinds=(".safetensors",), names="any"),
        text_encoder="",
        status="cadence",
        prompt_switch=Swap(pad=False),
        kind="preset",
    )


#: One registry of what ``--model NAME`` (alias ``--preset NAME``) takes: the families first, then Cadence's
#: presets (a ChainMap over both: a family registered at run time, or replaced in a test, is seen at once).
REGISTRY: ChainMap[str, ModelFamily] = ChainMap(FAMILIES, {n: preset_entry(n) for n in PRESETS})


def get_model(name: str) -> ModelFamily:
    """The registry entry for ``name`` (a family or a preset); one clear error listing both otherwise."""
    try:
        return REGISTRY[str(name).lower()]
    except KeyError:
        raise ConfigError(
            f"unknown preset or model family {name!r}; presets: {', '.join(PRESETS)}; families: "
            f"{', '.join(FAMILIES)}"
        ) from None


def entry_of(cfg: CadenceConfig) -> ModelFamily:
    """The registry entry a configuration is made from: its family's (``ModelConfig.family``), else a preset
    entry of its name (a configuration made in code is a preset for the engine). The engine recipe reads its
    rules and front ends through this, once (``cadence.engine.recipe``)."""
    return get_family(cfg.model.family) if cfg.model.family else preset_entry(cfg.name)


def model_config(name: str, overrides: dict | None = None) -> CadenceConfig:
    """The engine configuration of registry entry ``name``: a family's (:func:`family_config`) or a preset's,
    then ``overrides`` (``CadenceConfig.with_overrides`` sections: the files to load, geometry for tests)."""
    entry = get_model(name)
    cfg = get_preset(entry.name) if entry.kind == "preset" else _family_config(entry.name)
    cfg = cfg.with_overrides(**overrides) if overrides else cfg
    return entry.configure(cfg)


def family_config(
    name: str,
    weights: str | None = None,
    text_encoder: str | None = None,
    vae_weights: str | None = None,
    text_tokenizer: str | None = None,
    **sections: dict,
) -> CadenceConfig:
    """The family's whole engine configuration: its preset with the family's overrides (its :class:`Rebuild`
    rule folded into the stream section), the given files, then any further per-section overrides
    (``model={...}``, ``vae={...}``, ``stream={...}``; e.g. a smaller ``num_layers`` for a benchmark). With
    ``vae_weights`` the decoder is the Wan VAE ('wan') unless ``vae={'decoder': ...}`` says otherwise. A family
    with a builder of its own then reads its weights folder into it (:meth:`ModelFamily.configure`)."""
    cfg = _family_config(name, weights, text_encoder, vae_weights, text_tokenizer, **sections)
    return get_family(name).configure(cfg)


def _family_config(
    name: str,
    weights: str | None = None,
    text_encoder: str | None = None,
    vae_weights: str | None = None,
    text_tokenizer: str | None = None,
    **sections: dict,
) -> CadenceConfig:
    fam = get_family(name)
    base = get_preset(fam.preset)
    model = dict(
        fam.model, family=fam.name, weights=weights, text_encoder=text_encoder, text_tokenizer=text_tokenizer
    )
    vae = dict(fam.vae, weights=vae_weights)
    if vae_weights:
        vae.setdefault("decoder", "wan")
    model.update(sections.pop("model", {}))
    vae.update(sections.pop("vae", {}))
    rebuild = fam.context.stream_fields() if fam.context is not None else {}
    stream = dict(fam.stream, **rebuild)
    stream.update(sections.pop("stream", {}))
    if sections:
        raise ConfigError(f"family_config takes model=, vae=, stream= overrides, got {', '.join(sections)}")
    return CadenceConfig(
        name=fam.name,
        model=replace(base.model, **model),
        vae=replace(base.vae, **vae),
        stream=replace(base.stream, **stream),
    )


def reference_attention(cfg: CadenceConfig) -> tuple[int, int]:
    """The (local_attn_size, sink_size) in latent frames that the Self-Forcing family's code needs to see
    what ``cfg``'s cache shows a block (the fixture scripts build the reference with these)."""
    s = cfg.stream
    f = s.latent_frames_per_chunk
    return (s.frame_sink_chunks + s.window_chunks) * f, s.frame_sink_chunks * f
