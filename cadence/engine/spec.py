"""The fast paths an engine is built with, as plain data: :class:`FastPath`.

Torch-free, so the web process (``cadence serve``) can decide what its workers run without importing
torch. ``cadence.engine.recipe.resolve`` turns a ``FastPath`` (inside an ``EngineSpec``) into what one device
builds, and ``cadence.engine.build.build_engine`` applies the resolved one to a built model. Every field is a
command-line flag of every entry point (``cadence.engine.flags`` generates them from the fields: each field's
docstring is its help, a bool field is ``--x/--no-x``, ``None`` = automatic).

Every fast path is applied from outside the plain model and keeps its reference beside it (FP8 linears:
``cadence.quant.fp8``; the ring cache with FP8 K/V: ``cadence.cache.ring``; CUDA graphs:
``cadence.runtime.graphs``; compiled elementwise math: ``cadence.runtime.compile``). ``None`` fields mean
"automatic for the device": on for CUDA, off on the CPU (where the CPU path is exactly the reference
one); :meth:`FastPath.resolve` turns them into what one device actually runs, with one note per option
asked for explicitly that cannot apply there (the recipe then applies the model family's rules).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cadence.errors import ConfigError
from cadence.kernels import attention_registry

#: The prompt of a session that names none (the page's default too): the worker opens it ahead.
DEFAULT_PROMPT = "a person talking to the camera"

#: Options that need a CUDA device (asked for on the CPU they are turned off with a note).
CUDA_ONLY = ("kv_fp8", "fp8_linears", "graphs")
#: The engine's decoders (``cadence.config.DECODER_GEOMETRY``; a clip family's session may pin one: 'ltx' for
#: FlashHead Lite's LTX-Video VAE).
DECODERS = ("standin", "wan", "taehv", "ltx")
#: The Wan decoder's fast paths (``cadence.runtime.vae_fast.MODES``; torch-free copy).
DECODER_FAST = ("off", "cl", "compile", "bench", "fold", "up", "fp8")
DTYPES = ("float32", "bfloat16", "float16")
#: The FP8 GEMM backends (``cadence.kernels.fp8_gemm.BACKENDS``; torch-free copy).
GEMMS = ("auto", "cublas", "triton")
#: More help for a field whose values are a registry's (the flags append it to the field's docstring).
CHOICE_HELP = {"attention": attention_registry.help_text}
#: The values a fixed string field takes, by field name (the flags list them in their help; validation is
#: ``FastPath.__post_init__``'s); :func:`choices` adds the registries' (``attention``).
CHOICES = {
    "dtype": DTYPES,
    "decoder": DECODERS,
    "decoder_fast": DECODER_FAST,
    "gemm": GEMMS,
}


def choices(name: str) -> tuple[str, ...] | None:
    """The values the string field ``name`` takes (a registry's are read now: a backend registered later counts)."""
    return attention_registry.choices() if name == "attention" else CHOICES.get(name)


@dataclass(frozen=True)
class FastPath:
    """The fast paths ``build_engine`` applies to a built model (``None`` = automatic, see the module)."""

    dtype: str | None = None
    """Model dtype: 'float32', 'bfloat16' or 'float16'. None: bfloat16 on CUDA, float32 on the CPU."""
    decoder: str | None = None
    """VAE decoder: 'standin', 'wan', 'taehv' or 'ltx' (FlashHead Lite's). None: automatic (``cadence.engine.recipe.choose_decoder``):
    the preset's own on the CPU; on CUDA the tiny streaming decoder ('taehv') when it has trained weights or
    nothing has (random-weight benchmarks), else the full Wan VAE the weights are for ('wan')."""
    kv_fp8: bool | None = None
    """Ring cache with FP8 K/V read by the FP8 attention kernel (``cadence.cache.ring``). CUDA only."""
    fp8_linears: bool | None = None
    """FP8 block linears (``cadence.quant.fp8.apply_fp8``). CUDA only."""
    graphs: bool | None = None
    """CUDA graphs for the steady-state chunk step (``cadence.runtime.graphs.GraphRunner``); forces the
    ring cache (fixed addresses). A clip family whose session captures its own model pass (FlashHead:
    ``cadence.runtime.call_graph``) needs no ring. CUDA only."""
    capture_filling: bool = False
    """With graphs: also capture each ring-filling step (one graph per fill stage). With FP8 K/V the filling
    steps replay the steady graph already; this matters for bf16 K/V."""
    compile: bool = False
    """``torch.compile`` of the per-block elementwise math (``cadence.runtime.compile.apply_compile``)."""
    decoder_fast: str | None = None
    """The full Wan decoder's fast path on its decode device (``cadence.runtime.vae_fast``): 'off', 'cl'
    (channels-last), 'compile' (cl + torch.compile of the decoder, compiled during the
    warm-up), 'bench' (compile + cudnn.benchmark, for throughput-only runs), 'fold' (compile + temporal convs as one conv2d) or 'up' (compile + the spatial
    upsamplers' convs at the low resolution, 2.25x fewer multiply-adds there) or 'fp8' (compile + the up blocks' big convs in FP8,
    with a larger image error; each mode's measurements: docs/perf/vae/NOTES.md). None: 'compile' on CUDA, 'off' on the CPU. Only the 'wan'
    decoder has one; a compile that fails falls back to eager with one log line."""
    comm: str = "auto"
    """Row-parallel communication mode under tensor parallelism ('auto' = the measured choice)."""
    attention: str = "auto"
    """The kernel that reads the ring cache, one of the registered backends (``cadence.kernels.attention_registry``,
    listed below) or 'auto' (the fastest measured at the shape that runs here,
    ``cadence/kernels/attention_table.json``). One that cannot run falls back with one log line."""
    gemm: str = "auto"
    """The FP8 linears' GEMM backend (``cadence.kernels.fp8_gemm``): 'auto' (per shape from the table measured
    on this GPU kind, docs/perf/fp8/gemm-<device>.json; cuBLAS where it has no entry), 'cublas'
    (``torch._scaled_mm``) or 'triton' (Cadence's Triton FP8 GEMM, with the table's config per shape). Only
    with fp8_linears; a backend that cannot run falls back to cuBLAS with one log line."""
    fused_quant: bool = False
    """With FP8 linears on CUDA: the norms / modulation / GELU that feed an FP8 linear emit its FP8 input and
    per-token scales in one launch (``cadence.runtime.compile.apply_fused_quant``) instead of a separate
    quantisation per linear. Off unless asked (its measurements: docs/perf/fp8/NOTES.md)."""
    sequence_parallel: bool = False
    """Under tensor parallelism (tp > 1), run the per-token work between the sharded linears (norms,
    modulation, gates, residual adds) on each rank's share of the tokens: an all-gather before each
    column-parallel linear (of the FP8 bytes with FP8 linears), a reduce-scatter after each row-parallel one
    (``cadence.parallel.sp``). With one rank it does not apply (a note says so)."""
    threads: int = 0
    """CPU: torch intra-op threads for the diffusion and decode threads. 0 = chosen at warm-up (the
    engine times 1 and 2 threads and keeps the faster sustained rate; ``Engine.warm_up``)."""

    def resolve(self, device: str) -> tuple[FastPath, list[str]]:
        """What a worker on ``device`` runs (no ``None`` left) and the notes for options that cannot
        apply there. Pure."""
        cuda = str(device).startswith("cuda")
        notes: list[str] = []
        kw: dict = {}
        for name in CUDA_ONLY:
            value = getattr(self, name)
            if value is None:
                kw[name] = cuda
            elif value and not cuda:
                notes.append(f"{name}: needs a CUDA worker (this one runs on {device}): off")
                kw[name] = False
            else:
                kw[name] = bool(value)
        kw["capture_filling"] = False
        if self.capture_filling:
            if not kw["graphs"]:
                why = f"this worker runs on {device}" if not cuda else "graphs are off"
                notes.append(f"capture_filling: needs CUDA graphs ({why}): off")
            else:
                kw["capture_filling"] = True
        if self.attention != "auto" and not attention_registry.get(self.attention).cpu and not cuda:
            notes.append(f"attention: {self.attention} needs a CUDA worker (this one runs on {device}): auto")
            kw["attention"] = "auto"
        if self.gemm != "auto" and not kw["fp8_linears"]:
            notes.append(f"gemm: {self.gemm} needs FP8 linears (off here): auto")
            kw["gemm"] = "auto"
        kw["dtype"] = self.dtype or ("bfloat16" if cuda else "float32")
        kw["decoder_fast"] = self.decoder_fast or ("compile" if cuda else "off")
        return dataclasses.replace(self, **kw), notes

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.decoder is not None and self.decoder not in DECODERS:
            raise ConfigError(f"decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}")
        if self.decoder_fast is not None and self.decoder_fast not in DECODER_FAST:
            raise ConfigError(
                f"decoder_fast must be one of {', '.join(DECODER_FAST)}, got {self.decoder_fast!r}"
            )
        if self.gemm not in GEMMS:
            raise ConfigError(f"gemm must be one of {', '.join(GEMMS)}, got {self.gemm!r}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if self.attention not in choices("attention"):
            raise ConfigError(
                f"attention must be one of {', '.join(choices('attention'))}, got {self.attention!r}"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")

    def describe(self) -> dict:
        return dataclasses.asdict(self)
