"""What a worker runs, decided once: :class:`EngineSpec` (what was asked) -> :func:`resolve` -> :class:`EngineRecipe`
(what one device builds, nothing undecided, nothing in conflict with the family's rules).

    spec = EngineSpec(model="krea-14b", fast=FastPath(compile=True))       # words of a command line
    recipe = resolve(spec, "cuda:0")       # the cache Krea's rebuild needs, the decoder, the weights entry, ...
    print(recipe.describe().text())        # one block; recipe.describe().as_dict() goes into JSON records
    eng = build_engine(recipe)             # cadence.engine.build: builds exactly this

Every entry point (``cadence serve`` and its workers, ``generate``, ``eval``, the ``bench`` commands) builds its
engine from a recipe, so a benchmark and a server given the same words on the same device build the same
engine. This module is the only code outside ``cadence.model.families`` that reads a family's rules (its
:class:`~cadence.model.families.KVStream` / ``ClipStream``, ``Swap`` / ``Recache``, ``Rebuild``): the engine
gets them as :class:`SessionRules` and builds its session from them by one ``match``.

What ``resolve`` decides, in order (:func:`recipe_for`):

1. **The configuration**: the registry entry (a preset or a family: ``cadence.model.families.get_model``) with
   the spec's overrides.
2. **The fast path for the device** (``FastPath.resolve``: automatic options on for CUDA, off on the CPU, one
   note per option asked for that cannot apply), then **the family's rules**: a clip stream has no K/V cache
   (graphs, FP8 K/V, the decoder's fast path off; its own decoder), a context rebuild runs on the naive cache
   (graphs and FP8 K/V off). Options turned off that were on get one note each, never an error.
3. **What changes the shapes**, folded into the configuration: the ring cache (FP8 K/V, or CUDA graphs' fixed
   addresses), the decoder (automatic: the preset's own on the CPU; on CUDA the tiny streaming decoder when
   it has trained weights or nothing has, else the full Wan VAE the weights are for).
4. **Decode placement** ('same' GPU on its own stream, or another GPU; a tensor-parallel group and a CPU
   worker decode on their own device, with a note), **the weights entry** (a family's multi-entry file: the
   one asked for, else the one its authors' inference reads), **warm-up chunks** (enough for every step
   shape unless given).

Pure and torch-free (the web process resolves its workers' recipes): the one thing it reads from outside is
whether a trained tiny decoder sits beside the VAE weights, through ``exists`` (tests pass their own).

Kernel switches: the ``CADENCE_*`` environment variables that tune kernels outside ``FastPath`` are listed
once, in :data:`KERNEL_SWITCHES` (name, default, what it does); ``describe`` reports the values in effect.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cadence.config import CadenceConfig, PipelineConfig, resolve_asset
from cadence.engine.placement import Placement
from cadence.engine.spec import FastPath
from cadence.errors import ConfigError
from cadence.model.families import (
    ClipStream,
    DecoderRule,
    FrontEnd,
    KVStream,
    LogMelAudio,
    ModelFamily,
    Rebuild,
    Recache,
    Swap,
    VaeSinkImage,
    entry_of,
    get_model,
    model_config,
)

#: The model every entry point builds when none is named (the shipped, trained character).
DEFAULT_MODEL = "character"
_DECODE = re.compile(r"same|auto|cpu|cuda(:\d+)?")


# ---- the kernel switches (environment variables), listed once --------------------------------------------


@dataclass(frozen=True)
class EnvSwitch:
    """One ``CADENCE_*`` environment variable read by a kernel or a communication path."""

    name: str
    default: str
    """What applies when it is unset ('' = nothing set: the code's own choice)."""
    module: str
    """Where it is read."""
    what: str


KERNEL_SWITCHES: tuple[EnvSwitch, ...] = (
    EnvSwitch("CADENCE_COMPILE", "1", "cadence.runtime.compile", "0: apply_compile keeps the plain ops"),
    EnvSwitch(
        "CADENCE_COMPILE_PAIRS",
        "1",
        "cadence.runtime.compile",
        "1: each residual add + the norm after it one compiled kernel; 0: their two halves (the reference)",
    ),
    EnvSwitch(
        "CADENCE_FP8_COMM_BLOCK",
        "128",
        "cadence.parallel.comm_fp8",
        "columns per float32 scale of comm mode two_shot_fp8's e4m3 payloads (one per row where the width is not a multiple)",
    ),
    EnvSwitch(
        "CADENCE_COMPILE_ROPE",
        "1",
        "cadence.runtime.compile",
        "1: the whole-sequence RoPE compiled in one pass; 0: the complex float32 reference",
    ),
    EnvSwitch(
        "CADENCE_TIMESTEP_CACHE",
        "1",
        "cadence.runtime.chunk",
        "1: each pass's timestep embedding computed once and kept across chunks; 0: every pass (the reference)",
    ),
    EnvSwitch(
        "CADENCE_AUDIO_KV",
        "chunk",
        "cadence.runtime.chunk",
        "audio K/V: once per chunk, or every pass (pass)",
    ),
    EnvSwitch(
        "CADENCE_QK_NORM_IN_WRITE",
        "1",
        "cadence.cache.ring",
        "1: the self-attention's q/k norms applied in the ring's Triton write; 0: the separate norms (reference)",
    ),
    EnvSwitch(
        "CADENCE_FP8_QUANT",
        "auto",
        "cadence.quant.fp8",
        "activation quantiser of the FP8 linears: auto (Triton on CUDA), triton or torch",
    ),
    EnvSwitch(
        "CADENCE_CONV_FP8", "triton", "cadence.runtime.vae_fast", "FP8 conv backend of decoder_fast 'fp8'"
    ),
    EnvSwitch(
        "CADENCE_CONV_FP8_QUANT",
        "",
        "cadence.runtime.vae_fast",
        "FP8 conv activation quantiser (unset: conv3x3_fp8's default)",
    ),
    EnvSwitch(
        "CADENCE_CONV_FP8_SCALE",
        "delayed",
        "cadence.runtime.vae_fast",
        "FP8 conv activation scaling: delayed (last call's amax) or call",
    ),
    EnvSwitch(
        "CADENCE_TP_COMM",
        "auto",
        "cadence.parallel.fused",
        "process-wide override of the row-parallel comm mode 'auto' (FastPath.comm)",
    ),
    EnvSwitch(
        "CADENCE_FUSED_TABLE",
        "",
        "cadence.parallel.fused",
        "the measured comm-mode table (unset: the newest docs/perf/fused/chooser-*-tp<N>.json)",
    ),
    EnvSwitch(
        "CADENCE_SYMM_BACKEND", "CUDA", "cadence.parallel.fused", "symmetric-memory backend (set_backend)"
    ),
    EnvSwitch("CADENCE_SYMM_CACHE", "4", "cadence.parallel.fused", "symmetric buffers kept per process"),
    EnvSwitch("CADENCE_TILE_CACHE", "8", "cadence.parallel.fused", "'tiles' comm states kept per process"),
    EnvSwitch(
        "CADENCE_SYMM_SMALL_CACHE", "4", "cadence.parallel.fused", "symmetric buffers kept for the small sums"
    ),
    EnvSwitch(
        "CADENCE_TP_SMALL_COMM",
        "auto",
        "cadence.parallel.fused",
        "small all-reduces (the q/k norm sums): auto (one-shot symmetric memory up to SMALL_BYTES on CUDA) "
        "or nccl",
    ),
    EnvSwitch(
        "CADENCE_TP_BIAS",
        "epilogue",
        "cadence.parallel.fused",
        "row-parallel bias: epilogue (rank 0's GEMM adds it) or after (every rank after the sum, the reference)",
    ),
    EnvSwitch(
        "CADENCE_TP_QK_PAIR",
        "1",
        "cadence.parallel.tp",
        "1: the q and k norm sums of a self-attention in one all-reduce; 0: one each (the reference)",
    ),
    EnvSwitch(
        "CADENCE_TILES_PROTOCOL",
        "owner",
        "cadence.kernels.gemm_allreduce",
        "'tiles' exchange: owner (two hops, half the partials) or both (one hop)",
    ),
    EnvSwitch(
        "CADENCE_TILES_CONFIG",
        "",
        "cadence.kernels.gemm_allreduce",
        "'tiles' GEMM config BMxBNxBK[:GROUP_M:warps:stages] (unset: the tuned one)",
    ),
    EnvSwitch(
        "CADENCE_TILES_FLUSH",
        "2",
        "cadence.kernels.gemm_allreduce",
        "eighths of the next tile's K loop before a finished tile's flag is raised",
    ),
    EnvSwitch("CADENCE_TILES_TMA", "0", "cadence.kernels.gemm_allreduce", "1: tensor-descriptor loads"),
)


def kernel_switches(env: Mapping[str, str]) -> dict[str, dict]:
    """Each kernel switch's value in ``env`` (``os.environ`` for the running process) and its default."""
    return {
        s.name: {"value": env.get(s.name), "default": s.default, "set": s.name in env}
        for s in KERNEL_SWITCHES
    }


# ---- what was asked ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """What a command asked for (``cadence.engine.flags.spec_from_args`` makes it from the words): resolved
    per device by :func:`resolve`. Plain data, picklable."""

    model: str = DEFAULT_MODEL
    """A preset or a model family (one registry: ``cadence models``); ``--model`` / ``--preset``."""
    overrides: dict = field(default_factory=dict)
    """``CadenceConfig.with_overrides`` sections applied to the entry's configuration: the files to load
    (``model.weights``, ``vae.weights``, ...), geometry for tests and benchmarks."""
    fast: FastPath = field(default_factory=FastPath)
    """The fast paths (``None`` fields: automatic for the device)."""
    decode_device: str = "same"
    """Where the decode runs: 'same' (the diffusion GPU, on its own stream; the CPU on the CPU), 'cuda:N' (its
    own GPU), 'cpu', or 'auto' (a GPU not used for diffusion if there is one: benchmarks)."""
    weights_entry: str | None = None
    """The entry of a family's multi-entry checkpoint (None: the one its authors' inference reads)."""
    tp: int = 1
    """Tensor-parallel degree (a worker group's GPU count)."""
    seed: int = 0
    """Random-weight seed (no weights given)."""
    warmup: bool = True
    """Warm the engine up before the first stream (every step shape, graph captures, the decoder)."""
    warmup_chunks: int = 0
    """Chunks of the warm-up stream (0: enough for every step shape the stream kind has)."""

    def __post_init__(self) -> None:
        get_model(self.model)  # a clear error for an unknown name, before anything is built
        if not _DECODE.fullmatch(str(self.decode_device)):
            raise ConfigError(
                f"decode device must be 'same', 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.decode_device!r}"
            )
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.warmup_chunks < 0:
            raise ConfigError(f"warmup_chunks must be >= 0, got {self.warmup_chunks}")

    @property
    def decode_gpu(self) -> int | None:
        """The decode GPU's index when ``decode_device`` is 'cuda:N' (``cadence serve --decode-gpu N``)."""
        d = self.decode_device
        return int(d.split(":")[1]) if d.startswith("cuda:") else (0 if d == "cuda" else None)

    def config(self) -> CadenceConfig:
        """The registry entry's configuration with the overrides (before any device is known)."""
        return model_config(self.model, self.overrides)


# ---- what one device builds --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionRules:
    """The rules a stream is built from: its session class (the stream kind's, ``session_type``), its policies,
    and the front ends the generator builds for it (the family's, whatever session runs)."""

    stream: KVStream | ClipStream
    prompt_switch: Swap | Recache
    rebuild: Rebuild | None
    audio: FrontEnd = field(default_factory=LogMelAudio)
    image: FrontEnd = field(default_factory=VaeSinkImage)
    decoder: DecoderRule = field(default_factory=DecoderRule)
    prompt: bool = True
    """It takes a prompt (False: a prompt-free family, no text encoder is built)."""


@dataclass(frozen=True)
class EngineRecipe:
    """What one device (or tensor-parallel group) builds: every choice made. ``build_engine(recipe)`` builds it;
    ``describe()`` reports it."""

    model: str
    """The registry name it was made for (the configuration's name for a recipe of a ready configuration)."""
    config: CadenceConfig
    """The configuration with every shape-changing choice folded in (cache, FP8 K/V, decoder, weights entry)."""
    fast: FastPath
    """The fast path resolved for the device: no ``None`` left."""
    device: str
    """'cpu', 'cuda:N', or a tensor-parallel group 'cuda:0+cuda:1'."""
    tp: int
    decode_device: str
    """'same' or another device (``PipelineConfig.decode_device``)."""
    entry: ModelFamily
    """The registry entry it was resolved from: its stream kind and session, prompt switch, front ends
    (audio, image, decoder) and checkpoint format, read from here by the builders and loaders."""
    rebuild: Rebuild | None
    """The context rebuild (Krea), or None: the committed K/V stay."""
    weights_entry: str | None
    """The checkpoint entry served (None: random weights, or a file that is one state dict)."""
    seed: int
    warmup: bool
    warmup_chunks: int
    notes: tuple[str, ...] = ()
    """One line per option asked for (or on by default) that this device or the family's rules turned off."""

    @property
    def family(self) -> str | None:
        return self.config.model.family

    @property
    def stream(self) -> KVStream | ClipStream:
        return self.entry.streaming

    @property
    def prompt_switch(self) -> Swap | Recache:
        return self.entry.prompt_switch

    @property
    def rules(self) -> SessionRules:
        return rules_of(self.entry, self.rebuild)

    @property
    def placement(self) -> Placement:
        """The devices it runs on, typed (``device`` is its text, as recorded)."""
        return Placement.of(self.device)

    @property
    def devices(self) -> list[str]:
        return list(self.placement.devices)

    def describe(self, env: Mapping[str, str] | None = None) -> RecipeDescription:
        """The recipe as a report: one plain record for JSON (``as_dict``) and one printed block (``text``);
        ``env`` (default: this process's environment) gives the kernel switches' values in effect."""
        c = self.config
        return RecipeDescription(
            {
                "model": self.model,
                "family": self.family,
                "device": self.device,
                "tp": self.tp,
                "decode_device": self.decode_device,
                "fast": dataclasses.asdict(
                    self.fast
                ),  # every FastPath field, resolved (new ones by themselves)
                "cache": c.stream.cache,
                "kv_fp8": c.stream.kv_fp8,
                "decoder": c.vae.decoder,
                "stream": repr(self.stream),
                "prompt_switch": repr(self.prompt_switch),
                "rebuild": repr(self.rebuild) if self.rebuild is not None else None,
                "weights": c.model.weights,
                "weights_entry": self.weights_entry,
                "vae_weights": c.vae.weights,
                "seed": self.seed,
                "warmup": self.warmup,
                "warmup_chunks": self.warmup_chunks,
                "geometry": c.shape_summary(),
                "notes": list(self.notes),
                "env": kernel_switches(os.environ if env is None else env),  # each: value here, default, set
            }
        )


@dataclass(frozen=True)
class RecipeDescription:
    """What :meth:`EngineRecipe.describe` reports: the recipe's record (every value plain data, fit for JSON),
    written once there, and the block a terminal prints from it."""

    record: dict

    def as_dict(self) -> dict:
        return copy.deepcopy(self.record)

    def text(self) -> str:
        """One block for a terminal: the model, the fast path, the rules, the weights, the switches set."""
        r = self.record
        fast = ", ".join(f"{k} {_on(v)}" for k, v in r["fast"].items())
        g = r["geometry"]
        if r["weights"]:
            entry = f", entry {r['weights_entry']}" if r["weights_entry"] else ""
            weights = f"{r['weights']}{entry}"
        else:
            weights = f"random (seed {r['seed']}): no checkpoint given, the frames are noise"
        lines = [
            f"recipe: {r['model']}"
            + (f" (family {r['family']})" if r["family"] else "")
            + f" on {r['device']}, tp {r['tp']}, decode {r['decode_device']}",
            f"  geometry: {g['width']}x{g['height']}, {g['tokens_per_chunk']} tokens per chunk, "
            f"{g['layers']} layers, window {g['window_chunks']}",
            f"  fast path: {fast}",
            f"  stream: {r['stream']}, cache {r['cache']}{' (FP8 K/V)' if r['kv_fp8'] else ''}, decoder "
            f"{r['decoder']}; prompt switch {r['prompt_switch']}; context {r['rebuild'] or 'committed K/V'}",
            f"  weights: {weights}" + (f"; VAE {r['vae_weights']}" if r["vae_weights"] else ""),
            "  warm-up: " + (f"{r['warmup_chunks']} chunks" if r["warmup"] else "off"),
        ]
        env = [
            f"{k}={v['value']} (default {v['default'] or 'unset'})" for k, v in r["env"].items() if v["set"]
        ]
        if env:
            lines.append("  kernel switches set: " + ", ".join(env))
        lines += [f"  note: {n}" for n in r["notes"]]
        return "\n".join(lines)


def _on(v) -> str:
    return "on" if v is True else "off" if v is False else str(v)


# ---- resolve ------------------------------------------------------------------------------------------------


def resolve(
    spec: EngineSpec, device: str | Placement, exists: Callable[[str], bool] | None = None
) -> EngineRecipe:
    """What ``spec`` builds on ``device`` ('cpu', 'cuda:N', or a tensor-parallel group 'cuda:0+cuda:1').
    Pure but for ``exists`` (default ``os.path.isfile``: is a trained tiny decoder beside the VAE weights?)."""
    return recipe_for(
        spec.config(),
        device,
        spec.fast,
        model=spec.model,
        tp=spec.tp,
        decode_device=spec.decode_device,
        weights_entry=spec.weights_entry,
        seed=spec.seed,
        warmup=spec.warmup,
        warmup_chunks=spec.warmup_chunks,
        exists=exists,
    )


def recipe_for(
    cfg: CadenceConfig,
    device: str,
    fast: FastPath | None = None,
    *,
    model: str | None = None,
    tp: int = 1,
    decode_device: str = "same",
    weights_entry: str | None = None,
    seed: int = 0,
    warmup: bool = True,
    warmup_chunks: int = 0,
    exists: Callable[[str], bool] | None = None,
) -> EngineRecipe:
    """The recipe of a configuration already made (``resolve``'s steps 2-4; ``build_engine(cfg, ...)`` and the
    tests start here)."""
    device = str(device)
    devices = device.split("+")
    tp = len(devices) if len(devices) > 1 else tp
    family = entry_of(cfg)
    rules = rules_of(family, rebuild_of(cfg))
    fast, notes = fast_for(cfg, fast or FastPath(), devices[0], rules)
    cuda = devices[0].startswith("cuda")
    cfg, fast = fold_shapes(cfg, fast, cuda, exists or os.path.isfile, rules.stream.has_cache)
    if fast.attention != "auto" and cfg.stream.cache != "ring":  # only the ring has an attention backend
        notes.append(
            f"attention: {fast.attention} reads the ring cache (this one runs the naive cache): auto"
        )
        fast = dataclasses.replace(fast, attention="auto")
    decode, more = decode_for(decode_device, devices[0], tp)
    cfg, entry = entry_for(cfg, weights_entry)
    window = cfg.stream.window_chunks
    return EngineRecipe(
        model=model or cfg.name,
        config=cfg,
        fast=fast,
        device=device,
        tp=tp,
        decode_device=decode,
        entry=family,
        rebuild=rules.rebuild,
        weights_entry=entry,
        seed=seed,
        warmup=warmup,
        warmup_chunks=warmup_chunks or rules.stream.warm_chunks(window, PipelineConfig.graph_warmup),
        notes=tuple(notes + more),
    )


def session_rules(cfg: CadenceConfig) -> SessionRules:
    """The rules of ``cfg``'s session: its registry entry's (a preset: a K/V stream whose prompt is used as
    given), and the context rebuild its stream configuration carries."""
    return rules_of(entry_of(cfg), rebuild_of(cfg))


def rules_of(entry: ModelFamily, rebuild: Rebuild | None) -> SessionRules:
    """A registry entry's rules and front ends, with the configuration's context rebuild."""
    return SessionRules(
        entry.streaming,
        entry.prompt_switch,
        rebuild,
        entry.audio_encoder,
        entry.image_encoder,
        entry.decoder,
        prompt=not entry.prompt_free,
    )


def rebuild_of(cfg: CadenceConfig) -> Rebuild | None:
    """The context rebuild ``cfg``'s stream section carries (a family's ``Rebuild`` is folded in there)."""
    s = cfg.stream
    return Rebuild(frames=s.kv_rebuild, keep_first_frame=s.keep_first_frame) if s.kv_rebuild else None


def fast_for(
    cfg: CadenceConfig, fast: FastPath, device: str, rules: SessionRules
) -> tuple[FastPath, list[str]]:
    """The fast path for ``device`` (``FastPath.resolve``), then what the rules exclude, turned off with one note
    for those that were on."""
    fast, notes = fast.resolve(device)
    name = cfg.model.family or cfg.name
    off: list[str] = []
    decoder = rules.decoder.pinned
    match rules.stream:
        case ClipStream() as clip:
            refused = (
                ("kv_fp8", "capture_filling") if clip.graphs else ("graphs", "kv_fp8", "capture_filling")
            )
            off = [n for n in ("graphs", "kv_fp8", "capture_filling") if n in refused and getattr(fast, n)]
            if fast.decoder not in (None, decoder):
                off.append(f"decoder {fast.decoder}")
            if not clip.decoder_fast and fast.decoder_fast not in (None, "off"):
                off.append(f"decoder_fast {fast.decoder_fast}")
            why = (
                f"clips are bidirectional, no K/V cache; each clip is decoded and re-encoded by the {decoder} "
                "decoder inside its step"
            )
            fast = dataclasses.replace(
                fast,
                graphs=bool(fast.graphs and clip.graphs),
                kv_fp8=False,
                capture_filling=False,
                decoder=decoder,
                decoder_fast=fast.decoder_fast if clip.decoder_fast else "off",
            )
        case KVStream() if rules.rebuild is not None:
            off = [n for n in ("graphs", "kv_fp8", "capture_filling") if getattr(fast, n)]
            why = f"its context rebuild, {rules.rebuild!r}, runs on the naive cache"
            fast = dataclasses.replace(fast, graphs=False, kv_fp8=False, capture_filling=False)
        case _:
            why = ""
    if off:
        notes.append(f"{name}: {', '.join(off)} off ({why})")
    return fast, notes


def choose_decoder(cfg: CadenceConfig, cuda: bool, exists: Callable[[str], bool] = os.path.isfile) -> str:
    """The automatic decoder (``FastPath.decoder`` None): the configuration's own on the CPU; on CUDA the tiny
    streaming decoder when it has trained weights (``vae.taehv_weights``, or ``taehv.safetensors`` beside the
    VAE) or when nothing has weights (random-weight benchmarks: the fast one), else the Wan VAE the given
    weights are for (a random tiny decoder in front of real weights would draw noise)."""
    v = cfg.vae
    if not cuda:
        return v.decoder
    beside = os.path.join(resolve_asset(v.weights), "taehv.safetensors") if v.weights else None
    if v.taehv_weights or (beside and exists(beside)) or not v.weights:
        return "taehv"
    return "wan"


def fold_shapes(
    cfg: CadenceConfig, fast: FastPath, cuda: bool, exists: Callable[[str], bool], cache: bool = True
) -> tuple[CadenceConfig, FastPath]:
    """``cfg`` with the shape-changing choices of a resolved ``fast`` folded in (the ring cache for FP8 K/V or
    CUDA graphs, the decoder), and ``fast`` with its decoder decided. ``cache``: the stream reads a K/V cache
    (a clip stream's graphs hold its own model pass: no ring)."""
    stream: dict = {}
    if fast.kv_fp8:
        stream.update(cache="ring", kv_fp8=True)
    if fast.graphs and cache and cfg.stream.cache != "ring":
        stream["cache"] = "ring"  # graphs need the ring cache's fixed addresses
    if fast.attention != "auto" and stream.get("cache", cfg.stream.cache) == "ring":
        stream["attention"] = fast.attention  # the ring's kernel (cadence.kernels.attention_registry)
    decoder = fast.decoder or choose_decoder(cfg, cuda, exists)
    over: dict = {"stream": stream} if stream else {}
    if decoder != cfg.vae.decoder:
        over["vae"] = {"decoder": decoder}
    return (cfg.with_overrides(**over) if over else cfg), dataclasses.replace(fast, decoder=decoder)


def decode_for(decode_device: str, device: str, tp: int) -> tuple[str, list[str]]:
    """Where the decode runs for a worker on ``device``: a tensor-parallel group and a CPU worker decode on their
    own device (a note when another was asked for)."""
    d = "cuda:0" if decode_device == "cuda" else decode_device
    if d in ("same", "auto", "cpu"):
        return d, []
    if tp > 1:
        return "same", [f"decode on {d}: a tensor-parallel group decodes on its own GPUs"]
    if not device.startswith("cuda"):
        return "same", [
            f"decode on {d}: this worker runs on {device} ({d} mapped to {device}): decodes there"
        ]
    return d, []


def entry_for(cfg: CadenceConfig, asked: str | None) -> tuple[CadenceConfig, str | None]:
    """The checkpoint entry served: the one asked for, else the family's default (its authors' choice), for a
    family whose files hold several; None for random weights and single-state-dict files. Written into the
    configuration (``model.weights_entry``) so the loader reads exactly it."""
    entry = entry_of(cfg)
    ck = entry.checkpoint
    entries = bool(ck.state_keys)
    if asked is not None:
        if not entries:
            fam = entry.kind == "family"
            what = f"family {entry.name}'s checkpoint is" if fam else f"preset {cfg.name} loads"
            raise ConfigError(f"--weights-entry {asked}: {what} one state dict (no entries to choose from)")
        if not cfg.model.weights:
            raise ConfigError(f"--weights-entry {asked} needs --weights (random weights have no entries)")
    if not (entries and cfg.model.weights):
        return cfg, None
    entry = asked or ck.default_entry
    return cfg.with_overrides(model={"weights_entry": entry}), entry


# ---- a worker process's parameters -------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build its engine (pickled to the spawned process): its recipe,
    resolved on the web side for the group's devices, and how frames come back."""

    recipe: EngineRecipe
    """What the group builds (``resolve(spec, device)``)."""
    shm: dict | None = None
    """The frame ring to attach ({'name', 'shape', 'slots'}), or None: frames travel through the pipe."""
    tp_port: int | None = None
    """Rendezvous port of a tensor-parallel group."""
    cpu_share: int = 1
    """The worker processes on this machine whose GPUs are shared (``--sessions-per-gpu``): a CUDA worker
    without ``fast.threads`` keeps at most its fair share of the cores as torch threads
    (``cadence.engine.placement.gpu_worker_threads``); 1: torch's default."""
