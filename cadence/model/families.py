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

Families (their reference code: REFERENCES.md; parity fixtures: ``tests/fixtures/<family>/``):

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
  Streamed clip by clip (``stream_kind`` 'clip': ``cadence.engine.clip``), each clip decoded and re-encoded
  by the Wan VAE before the next.
* ``krea-14b`` (krea-ai/realtime-video): Wan2.1-T2V-14B made block-causal, one safetensors file with
  Wan's names under ``model.``, 5 passes at 1000/750/500/250/0 warped through the shift-5 table.
  Before every block its server rebuilds the cache from a first frame and the last 2 clean frames
  (``kv_cache_num_frames`` = 3): ``stream.kv_rebuild`` (``cadence.cache.rebuild``). The first frame is Krea's
  default (``stream.keep_first_frame`` False: from the third block on, an older decoded pixel frame
  re-encoded by the Wan VAE) or the stream's first latent frame (True); both equal to Krea's own code.

``get_family(name)``, ``list_families()`` and ``family_config(...)`` are what ``--model NAME`` and
``cadence models`` call. Pure configuration: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cadence.config import CadenceConfig, get_preset
from cadence.errors import ConfigError


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
    prefixes: tuple[str, ...] = ()
    """Key prefixes stripped before the names are mapped, in order ('model.': the diffusion wrapper's
    attribute; '_fsdp_wrapped_module.' anywhere in a key: FSDP's wrapper)."""
    names: str = "wan"
    """Key names after the prefix: 'wan' (Wan-Video's original module names) or 'diffusers'."""
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
    """The prompt encoder it needs ('umt5-xxl': Wan's umT5-XXL encoder, 512 tokens of 4096)."""
    audio_encoder: str | None = None
    """The audio encoder it needs (None: not audio-driven)."""
    vision_encoder: str | None = None
    """The image encoder it needs (None: none)."""
    vae_variant: str = "2.1"
    """The Wan VAE its latents belong to ('2.1': 4x8x8, z=16; '2.2': 4x16x16, z=48)."""
    reference_window: str = ""
    """The reference code's own attention settings, for the record (``local_attn_size`` / ``sink_size``
    in latent frames), from which ``stream``'s window and frame sink are derived."""
    prompt_switch: str = "swap"
    """What a prompt change mid-stream does (``Session.switch_prompt``): 'swap' (the new prompt's
    cross-attention K/V from the next chunk on; the cached self-attention K/V stay as computed) or
    'recache' (LongLive: the recent chunks' K/V are recomputed under the new prompt first,
    ``cadence.cache.recache``)."""
    recache_keeps_sink: bool = True
    """With 'recache', whether the frame sink's K/V are kept once the window is full (LongLive's
    ``global_sink``: true in its shipped configs) or recomputed (the sink then moves to recent chunks)."""
    status: str = "parity"
    """'parity': the model pass and the stream the engine runs are tested equal to the reference code
    (tests/fixtures/<name>/); 'model': the model pass and the family's own sampler (outside the engine) are
    tested equal, the engine does not stream it yet; 'config': configuration, key mapping and detection
    only."""
    stream_kind: str = "kv"
    """How the engine streams it: 'kv' (block-causal chunks over a K/V cache: ``cadence.engine.session.Session``,
    the engine's decode stage decodes each chunk's latent) or 'clip' (bidirectional clips, each decoded and
    re-encoded before the next starts: ``cadence.engine.clip.ClipSession``, whose step yields the frames; no
    K/V cache, so no ring cache and no CUDA graphs)."""
    clip_frames: int = 0
    """Clip-based families (FlashTalk): video frames generated together per call (bidirectional; 0 = a
    block-causal K/V stream)."""
    motion_frames: int = 0
    """Clip-based families: the last video frames of a clip carried into the next one as its first latents
    (the clip's new video is ``clip_frames - motion_frames`` frames)."""
    notes: str = ""
    """What is not reproduced, if anything."""


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
        checkpoint=replace(_SF_FORMAT, ema_key=None),
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
        checkpoint=replace(_SF_FORMAT, lora_rank=256, lora_alpha=256.0, lora_keys=("generator_lora",)),
        reference_window="local_attn_size=12, sink_size=3 (configs/longlive_inference.yaml)",
        prompt_switch="recache",
        recache_keeps_sink=True,
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
            kv_rebuild=3,  # kv_cache_num_frames: the cache rebuilt before every block (cadence.cache.rebuild)
            keep_first_frame=False,  # Krea's default: from the third block on, an older frame re-encoded
            commit="last_pass",  # no clean pass: the next rebuild replaces whatever the block wrote
        ),
        checkpoint=CheckpointFormat(kinds=(".safetensors",), prefixes=("model.",), names="wan"),
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
    checkpoint=CheckpointFormat(kinds=(".safetensors",), names="wan"),
    audio_encoder="wav2vec2 (chinese-wav2vec2-base, every layer's hidden state at 25 fps)",
    vision_encoder="CLIP ViT-H/14 (Wan's open-clip xlm-roberta-large-vit-huge-14, penultimate layer)",
    reference_window="bidirectional within a 33-frame clip (frame_num 33, motion_frames_num 5: "
    "flash_talk/configs/infer_params.yaml)",
    status="parity",
    stream_kind="clip",
    clip_frames=33,
    motion_frames=5,
    notes="Streamed by the engine as clips (cadence.engine.clip.ClipSession): per chunk its wav2vec2 audio "
    "windows, the 4-pass clip, the whole-clip Wan VAE decode, colour match and re-encode of the motion frames; "
    "tested equal to FlashTalk's offline stream (generate_offline, itself tested against the reference's "
    "generate_video) on the audio delayed by one frame (40 ms: the live resampler's look-ahead), so the mouth "
    "trails the voice by 40 ms. No K/V cache: no ring cache, no CUDA graphs. The encoders come from the "
    "weights folder (models_clip_*.pth; a *wav2vec2* folder in or beside it), random without weights. A 14B "
    "bidirectional clip model is not real time on one GPU: the engine streams it as fast as the hardware "
    "allows. One speaker only (InfiniteTalk's multi-speaker RoPE placement is not reproduced).",
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


def family_config(
    name: str,
    weights: str | None = None,
    text_encoder: str | None = None,
    vae_weights: str | None = None,
    text_tokenizer: str | None = None,
    **sections: dict,
) -> CadenceConfig:
    """The family's whole engine configuration: its preset with the family's overrides, the given files,
    then any further per-section overrides (``model={...}``, ``vae={...}``, ``stream={...}``; e.g. a
    smaller ``num_layers`` for a benchmark). With ``vae_weights`` the decoder is the Wan VAE ('wan')
    unless ``vae={'decoder': ...}`` says otherwise."""
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
    stream = dict(fam.stream, **sections.pop("stream", {}))
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
