"""One engine-flag set for every entry point, generated from the fields of ``FastPath`` plus the spec's other
knobs, and :func:`spec_from_args` to turn the parsed words into an :class:`~cadence.engine.recipe.EngineSpec`.

    add_engine_flags(parser)                 # cadence serve | generate | eval, bench pipeline | serve | turn | ...
    spec = spec_from_args(parser.parse_args(argv))
    recipe = resolve(spec, "cuda:0")         # the same words give the same spec, hence the same recipe

* **The fast path**: one flag per ``FastPath`` field (``cadence.engine.spec``), named after it (``kv_fp8`` ->
  ``--kv-fp8``), its docstring as help; a bool field is ``--x / --no-x``, an int or str field takes a value
  (the values of ``spec.choices`` listed and checked by argparse); unset = the field's default (``None``:
  automatic for the device). A field added to ``FastPath`` becomes a flag everywhere by itself.
* **The spec's other knobs**: ``--model NAME`` (alias ``--preset``: a preset or a family, one registry),
  the files (``--weights``, ``--vae-weights``, ``--taehv-weights``, ``--text-encoder``, ``--text-tokenizer``,
  ``--lora``), ``--weights-entry NAME`` / ``--ema`` / ``--no-ema`` (a family's checkpoint entry), the decode
  placement (``--decode-device`` / ``--decode-gpu K``), ``--tp N``, ``--warmup / --no-warmup`` (alias
  ``--prewarm``) and ``--warmup-chunks N``.

Spellings users have in the README and docs stay: :data:`ALIASES` (``--fp8`` for ``--fp8-linears``,
``--worker-threads`` for ``--threads``, ``--fast`` for ``--decoder-fast``) and :data:`VALUE_ALIASES`
(``--dtype bf16``). Torch-free: parsing a command line never imports torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

from cadence.engine import spec as _spec
from cadence.engine.recipe import DEFAULT_MODEL, EngineSpec
from cadence.engine.spec import FastPath
from cadence.errors import InputError

#: Other spellings of a fast-path flag, kept for the commands users have (README, docs/perf).
ALIASES: dict[str, tuple[str, ...]] = {
    "fp8_linears": ("--fp8",),
    "threads": ("--worker-threads",),
    "decoder_fast": ("--fast",),
}
#: Other spellings of a value (``--dtype bf16`` = ``--dtype bfloat16``; bench vae's ``--dtype auto``).
VALUE_ALIASES: dict[str, dict[str, str | None]] = {
    "dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": None},
}
_PREFIX = "fast_"  # the argparse dest of a fast-path field (kept apart from an entry point's own flags)


@dataclasses.dataclass(frozen=True)
class FieldFlag:
    """One ``FastPath`` field as a flag."""

    name: str
    kind: str
    """'bool', 'int', 'float' or 'str'."""
    help: str
    choices: tuple[str, ...] | None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return _PREFIX + self.name


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass and of the dataclasses it extends (``ast`` over their
    source): the flags' help."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                out[node.target.id] = " ".join(nxt.value.value.split())
    return out


def fast_path_flags() -> list[FieldFlag]:
    """Every ``FastPath`` field as a :class:`FieldFlag`, in field order."""
    docs = field_docs(FastPath)
    out = []
    for f in dataclasses.fields(FastPath):
        t = str(f.type)
        kind = next((k for k in ("bool", "int", "float") if k in t.replace("|", " ").split()), "str")
        doc = docs.get(f.name, "")
        more = _spec.CHOICE_HELP.get(f.name)
        out.append(FieldFlag(f.name, kind, f"{doc} {more()}." if more else doc, _spec.choices(f.name)))
    return out


def _value(kind: str, aliases: dict):
    cast = {"int": int, "float": float}.get(kind, str)

    def convert(text: str):
        if text in aliases:
            return aliases[text]
        return cast(text)

    convert.__name__ = kind  # argparse names the type in its error message
    return convert


def add_fast_path_flags(parser, only: tuple[str, ...] | None = None) -> None:
    """The ``FastPath`` flags (``only``: these fields alone, for a benchmark of one part)."""
    g = parser.add_argument_group("fast path (unset: automatic for the device; cadence.engine.spec.FastPath)")
    for ff in fast_path_flags():
        if only is not None and ff.name not in only:
            continue
        names = [ff.option, *ALIASES.get(ff.name, ())]
        text = ff.help.replace("%", "%%")
        if ff.kind == "bool":
            g.add_argument(
                *names, dest=ff.dest, action=argparse.BooleanOptionalAction, default=None, help=text
            )
            continue
        aliases = VALUE_ALIASES.get(ff.name, {})
        choices = None
        if ff.choices:  # checked after the alias is turned into its value ('auto' -> None: automatic)
            choices = list(ff.choices) + ([None] if None in aliases.values() else [])
        g.add_argument(
            *names,
            dest=ff.dest,
            default=None,
            type=_value(ff.kind, aliases),
            choices=choices,
            metavar="{" + ",".join(ff.choices) + "}" if ff.choices else ff.name.upper(),
            help=text + (f" Also: {', '.join(aliases)}." if aliases else ""),
        )


def add_model_flags(parser, default: str | None = DEFAULT_MODEL, files: bool = True) -> None:
    """``--model`` / ``--preset``, the files, the weights entry (``files=False``: ``--model`` alone, for a
    benchmark of one part that builds random weights at the model's geometry)."""
    g = parser.add_argument_group(
        "model and weights (default: the model's shipped weights; random weights for those without any)"
        if files
        else "model (random weights at its geometry)"
    )
    g.add_argument(
        "--model",
        "--preset",
        dest="model",
        default=default,
        metavar="NAME",
        help="a preset (character, tiny, w1.3, w14, w57) or an open model family ('cadence models': "
        "self-forcing, causvid, longlive, krea-14b, flashtalk, flashhead-pro, flashhead-lite); one registry, "
        "--preset is the same flag" + (f" (default: {default})" if default else ""),
    )
    if not files:
        return
    g.add_argument(
        "--random-weights",
        action="store_true",
        help="run a model family without its checkpoint, on random weights (a benchmark of its shape: the "
        "frames are noise); without it a family refuses to start with no --weights",
    )
    g.add_argument(
        "--weights",
        default=None,
        help="the transformer's checkpoint: a safetensors file or a folder of them (diffusers, original "
        "Wan or Cadence key names), a model family's own file (e.g. Self-Forcing's .pt), or its released "
        "folder (FlashHead: the downloaded SoulX-FlashHead-1_3B/, its VAE and wav2vec2 found there)",
    )
    g.add_argument(
        "--weights-entry",
        default=None,
        metavar="NAME",
        help="the entry of a family's multi-entry checkpoint (default: the one its authors' inference reads, "
        "e.g. Self-Forcing's generator_ema; 'cadence models' names each)",
    )
    g.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the family's EMA entry (--ema) or its plain one (--no-ema), instead of --weights-entry",
    )
    g.add_argument(
        "--vae-weights",
        default=None,
        help="the Wan VAE: a diffusers vae/ folder (config.json + safetensors, optionally with Cadence's "
        "taehv.safetensors for the tiny decoder) or Wan 2.1's original Wan2.1_VAE.pth",
    )
    g.add_argument(
        "--taehv-weights",
        default=None,
        help="a published TAEHV decoder (taew2_1.pth / taew2_2.pth): the tiny streaming decoder",
    )
    g.add_argument(
        "--text-encoder",
        default=None,
        help="umT5: a transformers UMT5EncoderModel folder or Wan's models_t5_umt5-xxl-enc-bf16.pth",
    )
    g.add_argument(
        "--text-tokenizer", default=None, help="the umT5 tokenizer folder (Wan ships it as google/umt5-xxl/)"
    )
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="a LoRA merged into --weights at load (peft lora_A/lora_B or kohya lora_down/lora_up names, Wan "
        "or diffusers module names; SCALE multiplies alpha/rank, default 1); repeatable; a key that does "
        "not fit fails the load with nothing merged",
    )


def add_engine_flags(
    parser,
    *,
    model_default: str | None = DEFAULT_MODEL,
    tp: bool = True,
    decode: bool = True,
    warmup: bool = True,
) -> None:
    """The whole engine-flag set (each part can be left out where an entry point has no use for it)."""
    add_model_flags(parser, model_default)
    add_fast_path_flags(parser)
    g = parser.add_argument_group("placement and start-up")
    if decode:
        d = g.add_mutually_exclusive_group()
        d.add_argument(
            "--decode-device",
            default=None,
            metavar="DEV",
            help="where the decode runs: same (the diffusion GPU, on its own stream; the default), cuda:N "
            "(a GPU of its own), cpu, or auto (a GPU not used for diffusion, if any)",
        )
        d.add_argument(
            "--decode-gpu",
            type=int,
            default=None,
            metavar="K",
            help="decode on GPU K (= --decode-device cuda:K; cadence serve leaves it out of the worker groups)",
        )
    if tp:
        g.add_argument(
            "--tp", type=int, default=1, help="GPUs per engine: the model sharded over N (tensor parallel)"
        )
    if warmup:
        g.add_argument(
            "--warmup",
            "--prewarm",
            dest="warmup",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="warm the engine up before the first stream: every step shape, graph captures, the decoder "
            "(default: on)",
        )
        g.add_argument(
            "--warmup-chunks", type=int, default=0, help="warm-up chunks (default 0: every step shape once)"
        )


# ---- the words -> an EngineSpec ------------------------------------------------------------------------------


def fast_path_from_args(args) -> FastPath:
    """The ``FastPath`` of the parsed flags (only the fields given; the rest keep their defaults)."""
    given = {
        ff.name: getattr(args, ff.dest)
        for ff in fast_path_flags()
        if getattr(args, ff.dest, None) is not None
    }
    return FastPath(**given)


def spec_from_args(args, overrides: dict | None = None, **fixed) -> EngineSpec:
    """The :class:`EngineSpec` of the parsed flags of :func:`add_engine_flags` (files checked: one
    ``InputError`` for a path that holds no checkpoint). ``overrides``: an entry point's own config sections
    (a benchmark's window or layer count), merged over the files'; ``fixed``: spec fields it decides itself."""
    from cadence.model.families import get_model

    model = getattr(args, "model", None) or DEFAULT_MODEL
    over = weight_overrides(
        getattr(args, "weights", None),
        getattr(args, "vae_weights", None),
        getattr(args, "text_encoder", None),
        getattr(args, "text_tokenizer", None),
        getattr(args, "taehv_weights", None),
        folder="folder" in get_model(model).checkpoint.kinds,
    )
    over = _with_lora(over, getattr(args, "lora", None) or [])
    for sec, fields in (overrides or {}).items():
        over[sec] = dict(over.get(sec, {}), **fields)
    kw: dict = dict(model=model, overrides=over, fast=fast_path_from_args(args))
    kw["weights_entry"] = _weights_entry(
        model, getattr(args, "weights_entry", None), getattr(args, "ema", None)
    )
    decode_gpu = getattr(args, "decode_gpu", None)
    if decode_gpu is not None:
        if decode_gpu < 0:
            raise InputError(f"--decode-gpu must be >= 0, got {decode_gpu}")
        kw["decode_device"] = f"cuda:{decode_gpu}"
    elif getattr(args, "decode_device", None) is not None:
        kw["decode_device"] = args.decode_device
    if getattr(args, "tp", None) is not None:
        if args.tp < 1:
            raise InputError(f"--tp must be >= 1, got {args.tp}")
        kw["tp"] = args.tp
    if getattr(args, "warmup", None) is not None:
        kw["warmup"] = bool(args.warmup)
    if getattr(args, "warmup_chunks", None):
        if args.warmup_chunks < 0:
            raise InputError(f"--warmup-chunks must be >= 0, got {args.warmup_chunks}")
        kw["warmup_chunks"] = args.warmup_chunks
    kw.update(fixed)
    spec = EngineSpec(**kw)
    if get_model(model).builder is not None:  # its released folder read now: one error before anything starts
        spec.config()
    return spec


def _weights_entry(model: str, entry: str | None, ema: bool | None) -> str | None:
    """``--weights-entry`` as given, or the family's EMA / plain entry for ``--ema`` / ``--no-ema``."""
    if ema is None:
        return entry
    from cadence.model.families import get_model

    ck = get_model(model).checkpoint
    if entry is not None:
        raise InputError("give --weights-entry or --ema / --no-ema, not both")
    if ema and not ck.ema_key:
        raise InputError(f"--ema: model {model!r} has no EMA weights entry")
    if not ema and not ck.state_keys:
        raise InputError(f"--no-ema: model {model!r}'s checkpoint is one state dict (no entries)")
    return ck.ema_key if ema else ck.state_keys[0]


def weight_overrides(
    weights: str | None,
    vae_weights: str | None,
    text_encoder: str | None = None,
    text_tokenizer: str | None = None,
    taehv_weights: str | None = None,
    folder: bool = False,
) -> dict:
    """Engine-config overrides that load the given files; one clear error for a path that holds no checkpoint,
    before any worker starts. ``folder``: the model's checkpoint is a released folder of its own layout (its
    ``CheckpointFormat.kinds`` has 'folder': FlashHead's), any folder here, its layout checked by the family's
    builder when the configuration is made."""

    def exists(path: str, what: str, folder_ok: bool = True, file_ok: bool = True) -> str:
        p = Path(path)
        if (file_ok and p.is_file()) or (folder_ok and p.is_dir() and any(p.iterdir())):
            return str(p.resolve())
        kinds = " or ".join(k for k, ok in (("a file", file_ok), ("a folder", folder_ok)) if ok)
        raise InputError(f"{what} not found: {path} ({kinds})")

    out: dict = {"model": {}, "vae": {}}
    if weights is not None:
        p = Path(weights)
        if folder and not p.is_dir():
            raise InputError(f"weights not found: {weights} (the model's released folder)")
        if not (p.is_file() or p.is_dir() and (folder or any(p.glob("*.safetensors")))):
            raise InputError(f"weights not found: {weights} (a checkpoint file, or a folder of .safetensors)")
        out["model"]["weights"] = str(p.resolve())
    if vae_weights is not None:
        p = Path(vae_weights)
        if not (p.is_dir() or (p.is_file() and p.suffix == ".pth")):
            raise InputError(
                f"--vae-weights must be a folder (a diffusers vae/ folder) or Wan 2.1's .pth file, "
                f"got {vae_weights}"
            )
        out["vae"]["weights"] = str(p.resolve())
    if taehv_weights is not None:
        out["vae"]["taehv_weights"] = exists(taehv_weights, "--taehv-weights", folder_ok=False)
    if text_encoder is not None:
        out["model"]["text_encoder"] = exists(text_encoder, "--text-encoder")
    if text_tokenizer is not None:
        out["model"]["text_tokenizer"] = exists(text_tokenizer, "--text-tokenizer", file_ok=False)
    return {k: v for k, v in out.items() if v}


def _with_lora(over: dict, loras: list[str]) -> dict:
    """``over`` plus the ``--lora`` files (checked to exist, paths made absolute for the workers)."""
    if not loras:
        return over
    from cadence.model.lora import parse_lora_arg

    specs = []
    for arg in loras:
        spec = parse_lora_arg(arg)
        if not Path(spec.path).is_file():
            raise InputError(f"--lora {arg}: no such file {spec.path}")
        specs.append(f"{Path(spec.path).resolve()}:{spec.scale!r}")
    out = dict(over)
    out["model"] = dict(out.get("model", {}), lora=tuple(specs))
    return out


# ---- a model family's files (issue 39: fail fast and say why) -----------------------------------------------


def require_weights(spec: EngineSpec, random_weights: bool = False) -> None:
    """A model family (``cadence models``) runs from its checkpoint: without ``--weights`` it refuses at once,
    one ``InputError`` (a random family built a 1.3B model for two minutes, then timed out), unless
    ``random_weights`` asks for its shape on random weights. Cadence's presets run as they are."""
    from cadence.model.families import FAMILIES

    if spec.model in FAMILIES and spec.config().model.weights is None and not random_weights:
        raise InputError(
            f"--model {spec.model} needs its checkpoint: --weights PATH (docs/models.md says where to get it), "
            "or --random-weights to run its shape on random weights (the frames are noise)"
        )


def cpu_note(spec: EngineSpec, device: str) -> str | None:
    """One line when a model of GPU size is about to be built on the CPU (it will not be real time), else None."""
    if not str(device).startswith("cpu"):
        return None
    m = spec.config().model
    params = m.num_layers * (8 * m.dim * m.dim + 2 * m.dim * m.ffn_dim)  # self- and cross-attention, the MLP
    if params < 300e6:
        return None
    return (
        f"note: {spec.model} has ~{params / 1e9:.1f}B parameters: on the CPU it will not be real time "
        "(seconds per chunk, and its memory); use --device cuda"
    )
