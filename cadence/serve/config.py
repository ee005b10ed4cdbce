"""Server configuration (``cadence serve`` flags map onto these fields).

The engine's fast path (bf16 is already the CUDA dtype; the TAEHV decoder, the ring cache with FP8
K/V, FP8 linears, CUDA graphs) is applied from outside to the built model by the worker process
(``cadence.engine.build.build_engine``). Each option is ``None`` = automatic (on for CUDA worker
groups, off on the CPU, so the CPU path is exactly the reference one), ``True`` or ``False``.
:func:`worker_spec` turns them into what one worker group builds (a ``cadence.engine.spec.WorkerSpec``
with the ``FastPath`` resolved for its device), with one note per option that cannot apply on that
device (the worker logs each note once and reports them in its ready info, ``GET /config`` -> ``workers``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from cadence.engine.shm import SHM_MIN_BYTES
from cadence.engine.spec import DECODER_FAST, DEFAULT_PROMPT, FastPath, WorkerSpec, base_config
from cadence.errors import ConfigError, InputError
from cadence.serve.ports import Fleet

__all__ = ["DEFAULT_PROMPT", "SHM_MIN_BYTES", "ServeConfig", "engine_config", "serve_groups", "worker_spec"]


@dataclass(frozen=True)
class ServeConfig:
    preset: str = "character"
    """Engine preset every worker builds."""
    model: str | None = None
    """A model family instead of the preset (``cadence models``: 'self-forcing', 'causvid', 'longlive',
    'krea-14b'): its geometry, sampler, cache policy and checkpoint format; its files come in ``overrides``
    (``weight_overrides``)."""
    host: str = "127.0.0.1"
    """Address the HTTP server listens on (loopback by default)."""
    port: int = 8000
    """HTTP port (0 = any free port)."""
    groups: tuple[str, ...] = ("cpu",)
    """One entry per GPU group: the device its worker process runs on ('cpu', 'cuda:0', ...), or the
    devices of a tensor-parallel group joined by '+' ('cuda:0+cuda:1': the model sharded over both, one
    worker process per device; 'cpu+cpu' runs the same on the CPU with gloo). The number of entries is
    the number of sessions admitted at once (``--max-sessions N`` on the CPU = N slots)."""
    worker_threads: int = 0
    """torch intra-op threads per worker process (CPU); 0 = chosen at the worker's warm-up (it times 1 and 2
    threads with decode overlapped on its own thread and keeps the faster sustained rate)."""
    idle_timeout_s: float = 120.0
    """Close a session after this long with no request and no media from its client."""
    max_duration_s: float = 600.0
    """Close a session this long after it started, whatever happens."""
    timeline_window_s: float = 60.0
    """A session's report cuts the stream into windows this long (``cadence.serve.timeline``): fps,
    chunk latency, underruns and worker memory per window, to see a long stream hold up (or not)."""
    connect_timeout_s: float = 10.0
    """Close a session whose peer connection is not connected this long after it started: an offer
    that never connects frees its slot this soon (loopback connects in well under a second)."""
    lead_ms: float = 100.0
    """Plan a chunk at least this long before its first frame is due (must cover worker time + transfers)."""
    lead_auto: bool = True
    """Raise the lead to what the worker's warm-up measured for one chunk (plan -> frames back) plus a
    margin (``lead_margin``); during a session the scheduler raises it further if chunks come back slower
    (``cadence.serve.pacing.ChunkPlanner``)."""
    lead_margin: float = 0.15
    """Auto lead = measured chunk time x (1 + lead_margin) + 20 ms."""
    max_in_flight: int = 2
    """Chunks at the worker at once, per session."""
    max_image_bytes: int = 10 * 1024 * 1024
    """Largest reference image upload accepted (bytes)."""
    max_audio_bytes: int = 5 * 1024 * 1024
    """Largest audio upload accepted (bytes)."""
    max_sdp_bytes: int = 64 * 1024
    """Largest SDP offer accepted (bytes)."""
    max_image_pixels: int = 4096 * 4096
    """Largest reference image accepted, in pixels (width x height, read from the image's header
    before any pixel is decoded: a 62 KB PNG can claim 64 megapixels = 192 MB of RGB)."""
    decode_concurrency: int = 1
    """Reference images decoded at once (on a thread pool of this many threads), whatever the number
    of requests: bounds the memory and threads that uploads can take."""
    api_key: str | None = field(default=None, repr=False)
    """The operator key (``cadence serve --api-key`` / ``--api-key-file`` / ``CADENCE_API_KEY``). When
    set, creating a session needs it (``Authorization: Bearer <key>``), and so do the session list and
    the per-session series on ``/metrics``; it also opens every session's routes. None = sessions can
    be created by anyone who reaches the server, the session list and per-session metrics are off.
    Each session's own routes always need the session's token (returned once, to its creator)."""
    insecure_no_auth: bool = False
    """Allow a non-loopback ``host`` without ``api_key`` (``--insecure-no-auth``: logged as a WARNING)."""
    max_pending_offers_per_client: int = 2
    """Sessions one client address (the TCP peer; behind a proxy, the proxy) may have created and not
    yet connected; one more is answered 429 with Retry-After."""
    report_ttl_s: float = 900.0
    """How long a closed session's report stays available at GET /sessions/{id}/report."""
    max_reports: int = 256
    """Most closed-session reports kept."""
    ice_addresses: tuple[str, ...] | None = None
    """Host ICE candidates to offer; None = ('127.0.0.1',) when serving on loopback, else aioice's own
    discovery (all non-loopback interfaces)."""
    worker_start_timeout_s: float = 120.0
    """How long startup waits for the worker processes to build the model."""
    seed: int = 0
    """Model weight seed (random weights) for the workers."""
    sync_marker_every: int = 0
    """Testing: every K-th chunk of every session carries an A/V sync marker (its first video frame
    solid white, its first 40 ms of audio a 1 kHz tone, at the same media time); 0 = off."""
    agent_url: str | None = None
    """The ``talk`` agent's OpenAI-compatible API base (``cadence serve --agent-url``), e.g.
    ``http://127.0.0.1:8080/v1`` (llama.cpp), vLLM, Ollama or a cloud API; its key comes from the
    environment variable ``CADENCE_AGENT_API_KEY``. None: the ``talk`` agent is not offered."""
    agent_model: str = "default"
    """The LLM model name sent to ``agent_url``."""
    agent_stt_model: str | None = None
    """Speech-to-text model at ``agent_url`` (``/audio/transcriptions``); None: the LLM hears only how
    long the user spoke."""
    agent_tts_model: str | None = None
    """Text-to-speech model at ``agent_url`` (``/audio/speech``); None: espeak-ng on the server."""
    agent_system_prompt: str | None = None
    """The ``talk`` agent's system prompt (None: a short default)."""
    overrides: dict = field(default_factory=dict)
    """Engine config overrides applied to the preset by the server and every worker, as
    ``CadenceConfig.with_overrides`` takes them, e.g. ``{"stream": {"latent_frames_per_chunk": 3}}``
    (tests: W1.3's 12-frame chunks at the tiny size)."""
    decoder: str | None = None
    """VAE decoder the workers use: None = 'taehv' (the tiny streaming decoder) on CUDA, the preset's
    own on the CPU; or 'standin' | 'wan' | 'taehv' everywhere."""
    decode_gpu: int | None = None
    """Decode on this GPU (``--decode-gpu K``): every single-GPU worker group diffuses on its own GPU and runs
    the decoder on GPU K, the latent handed GPU to GPU without a host trip (``PipelineConfig.decode_device``;
    the decode overlaps the next chunk's diffusion); :func:`serve_groups` leaves GPU K out of the session
    groups. None: each group decodes on its own GPU, on a stream of its own. Tensor-parallel groups always
    decode on their own GPUs (a note says so)."""
    decoder_fast: str | None = None
    """The full Wan decoder's fast path (``FastPath.decoder_fast``: 'off' | 'cl' | 'compile' | 'bench' | 'fold' | 'up' | 'fp8'); None =
    'compile' on CUDA (compiled during the warm-up), 'off' on the CPU."""
    kv_fp8: bool | None = None
    """Ring cache with FP8 K/V (the FP8 attention kernel). None = on for CUDA groups. CUDA only."""
    fp8_linears: bool | None = None
    """FP8 linears in the transformer blocks (``cadence.quant.fp8.apply_fp8``). None = on for CUDA. CUDA only."""
    graphs: bool | None = None
    """CUDA graphs for steady-state chunk steps (``cadence.runtime.graphs.GraphRunner``); the worker
    keeps one ring cache for all its sessions so a graph captured once (at warm-up) is replayed by
    every later session. None = on for CUDA. CUDA only."""
    capture_filling: bool = False
    """Opt-in (with graphs): also capture the ring-filling steps, one graph per fill stage
    (``GraphRunner(capture_filling=True)``), so a session's first ``window_chunks`` chunks replay graphs
    instead of running eagerly. The warm-up then runs a second throwaway session (each fill stage occurs
    once per session and is warmed eagerly before its capture); costs ``window_chunks`` more graphs of
    memory. Eager filling steps are launch-bound at 748 tokens (slower than real time at W14 TP=2 and W1.3:
    docs/perf/pipeline/NOTES.md), which means underruns in
    every session's first chunks whatever the lead. With FP8 K/V (``kv_fp8``, the CUDA default) the
    filling steps already replay the steady graph (``RingCache.length_on_device``) and this adds
    nothing; it matters for bf16 K/V. CUDA only; not measured on a GPU yet."""
    compile: bool = False
    """Opt-in: ``torch.compile`` of the per-block elementwise regions (``cadence.runtime.compile.
    apply_compile``, after the FP8 swap); it compiles each step shape on first use, i.e. during the
    warm-up. Where it cannot compile, the plain ops stay (its own one log line)."""
    warmup: bool | None = None
    """Before reporting ready, run the engine's warm-up (``Engine.warm_up``): every step shape (first chunk,
    ring filling, steady, graph capture) and the decoder run once (Triton compiles, autotuning, cuDNN setup,
    graph capture happen before any user), and the worker measures its chunk latency and sustained interval
    (which size the planning lead and tell the scheduler what it can ask for) and, on the CPU, its thread
    count. None = on."""
    warmup_chunks: int = 0
    """Chunks of the warm-up session; 0 = window_chunks + 2 (enough to reach a replayed graph)."""
    frame_transport: str = "auto"
    """How frames come back from a worker: 'pipe' (pickled through the multiprocessing pipe), 'shm'
    (a ring of shared-memory slots; only the chunk index crosses the pipe) or 'auto' (shm when a
    chunk's frames are >= 1 MiB: a W1.3 chunk is 14.4 MB, a tiny preset's 196 KB; ``cadence.engine.shm``)."""
    extra: dict = field(default_factory=dict)
    fleet: Fleet | None = None
    """``cadence serve --ray``: the sessions run on the worker groups of a Ray fleet, not on this machine's
    processes (``groups`` is then unused). A ``cadence.fleet.config.FleetConfig`` (the CLI builds it), typed
    by the ``Fleet`` Protocol of ``cadence.serve.ports``: the app takes its ``group_source(cfg)`` and
    ``routes(source)``, so this layer never imports ``cadence.fleet``. None (the default): one machine."""

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("at least one worker group is needed (--max-sessions >= 1)")
        for g in self.groups:
            parts = g.split("+")
            if len(parts) > 1:
                kinds = {
                    "cpu" if p == "cpu" else "cuda" if p.startswith("cuda:") and p[5:].isdigit() else "?"
                    for p in parts
                }
                if kinds not in ({"cpu"}, {"cuda"}):
                    raise ConfigError(
                        f"a tensor-parallel group is 'cpu+cpu+...' or 'cuda:I+cuda:J+...', got {g!r}"
                    )
                if kinds == {"cuda"} and len(set(parts)) != len(parts):
                    raise ConfigError(f"a tensor-parallel group needs distinct GPUs, got {g!r}")
        if self.decode_gpu is not None:
            if self.decode_gpu < 0:
                raise ConfigError(f"decode_gpu must be >= 0, got {self.decode_gpu}")
            if any(f"cuda:{self.decode_gpu}" in g.split("+") for g in self.groups):
                raise ConfigError(
                    f"decode GPU {self.decode_gpu} also runs a worker group ({', '.join(self.groups)}): "
                    "leave it out of the groups (serve_groups(..., decode_gpu=K) does)"
                )
        if self.idle_timeout_s <= 0 or self.max_duration_s <= 0:
            raise ConfigError(
                f"timeouts must be positive, got idle {self.idle_timeout_s} s, "
                f"max duration {self.max_duration_s} s"
            )
        if self.timeline_window_s <= 0:
            raise ConfigError(f"timeline_window_s must be positive, got {self.timeline_window_s}")
        if self.sync_marker_every < 0:
            raise ConfigError(f"sync_marker_every must be >= 0, got {self.sync_marker_every}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}")
        if self.lead_ms < 0 or self.lead_margin < 0:
            raise ConfigError(
                f"lead_ms and lead_margin must be >= 0, got {self.lead_ms} and {self.lead_margin}"
            )
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.decoder not in (None, "standin", "wan", "taehv"):
            raise ConfigError(f"decoder must be 'standin', 'wan' or 'taehv', got {self.decoder!r}")
        if self.warmup_chunks < 0:
            raise ConfigError(f"warmup_chunks must be >= 0, got {self.warmup_chunks}")
        if self.frame_transport not in ("auto", "pipe", "shm"):
            raise ConfigError(
                f"frame_transport must be 'auto', 'pipe' or 'shm', got {self.frame_transport!r}"
            )
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"connect_timeout_s must be positive, got {self.connect_timeout_s}")
        if self.max_image_pixels < 1 or self.decode_concurrency < 1 or self.max_pending_offers_per_client < 1:
            raise ConfigError(
                f"max_image_pixels, decode_concurrency and max_pending_offers_per_client must "
                f"be >= 1, got {self.max_image_pixels}, {self.decode_concurrency}, "
                f"{self.max_pending_offers_per_client}"
            )
        if self.agent_url is not None and not self.agent_url.startswith(("http://", "https://")):
            raise ConfigError(f"agent_url must be an http(s) URL, got {self.agent_url!r}")
        if self.api_key is not None:
            check_api_key(self.api_key)
        if not self.loopback and self.api_key is None and not self.insecure_no_auth:
            raise ConfigError(
                f"serving on {self.host} (not loopback) needs an API key: --api-key-file PATH, "
                "--api-key KEY or CADENCE_API_KEY (or --insecure-no-auth to serve without one)"
            )

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    @property
    def ice_host_addresses(self) -> tuple[str, ...] | None:
        if self.ice_addresses is not None:
            return self.ice_addresses
        return ("127.0.0.1",) if self.loopback else None


#: Shortest API key accepted (characters): long enough that guessing it is hopeless.
MIN_API_KEY_CHARS = 16


def check_api_key(key: str) -> str:
    """``key`` if it can be an operator key: printable ASCII without spaces (it travels in an HTTP header),
    at least ``MIN_API_KEY_CHARS`` long. Raises ConfigError (one line, never the key itself)."""
    if not isinstance(key, str) or not key:
        raise ConfigError("the API key is empty")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ConfigError("the API key must be printable ASCII without spaces (it is sent in an HTTP header)")
    if len(key) < MIN_API_KEY_CHARS:
        raise ConfigError(
            f"the API key is too short ({len(key)} characters; at least {MIN_API_KEY_CHARS}); "
            "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return key


def engine_config(cfg: ServeConfig):
    """The preset (or model family) with ``cfg.overrides`` applied: the geometry every session and worker follows."""
    return base_config(cfg.preset, cfg.model, cfg.overrides)


def worker_spec(cfg: ServeConfig, device: str, frame_bytes: int = 0) -> tuple[WorkerSpec, bool]:
    """What the worker group on ``device`` builds: ``(spec, shm)``. ``spec.fast`` is the fast path resolved
    for the device (automatic options on for CUDA groups, off on the CPU), ``spec.notes`` one line per option
    asked for explicitly that cannot apply there; ``shm``: frames come back through shared memory
    (``frame_transport`` 'shm', or 'auto' and a chunk of >= 1 MiB). Pure: no torch, no processes."""
    fast = FastPath(
        decoder=cfg.decoder,
        kv_fp8=cfg.kv_fp8,
        fp8_linears=cfg.fp8_linears,
        graphs=cfg.graphs,
        capture_filling=cfg.capture_filling,
        compile=cfg.compile,
        threads=cfg.worker_threads,
        decoder_fast=cfg.decoder_fast,
    )
    fast, notes = fast.resolve(device.split("+")[0])
    decode = "same"
    if cfg.decode_gpu is not None:
        if "+" in device:
            notes.append(f"decode_gpu {cfg.decode_gpu}: a tensor-parallel group decodes on its own GPUs")
        elif device.startswith("cuda"):
            decode = f"cuda:{cfg.decode_gpu}"
        else:
            notes.append(f"decode_gpu {cfg.decode_gpu}: this worker runs on {device}: decodes there")
    t = cfg.frame_transport
    shm = t == "shm" or (t == "auto" and frame_bytes >= SHM_MIN_BYTES)
    spec = WorkerSpec(
        preset=cfg.preset,
        device=device,
        fast=fast,
        overrides=dict(cfg.overrides),
        family=cfg.model,
        seed=cfg.seed,
        warmup=True if cfg.warmup is None else bool(cfg.warmup),
        warmup_chunks=cfg.warmup_chunks,
        notes=tuple(notes),
        decode_device=decode,
    )
    return spec, shm


def serve_groups(
    device: str, tp: int = 1, max_sessions: int | None = None, gpus: int = 0, decode_gpu: int | None = None
) -> tuple[str, ...]:
    """``cadence serve``'s worker groups: on CUDA, ``max_sessions`` groups (default: as many as fit) of
    ``tp`` consecutive GPUs each ('cuda:0+cuda:1', 'cuda:2+cuda:3', ...), GPU ``decode_gpu`` left out (it
    decodes for them); on the CPU, ``max_sessions`` (default 1) groups of ``tp`` gloo ranks. Raises
    InputError (one line) for what cannot be built."""
    from cadence.errors import InputError

    if tp < 1:
        raise InputError(f"--tp must be >= 1, got {tp}")
    if max_sessions is not None and max_sessions < 1:
        raise InputError(f"--max-sessions must be >= 1, got {max_sessions}")
    if device == "cuda":
        ids = list(range(gpus))
        if decode_gpu is not None:
            if not 0 <= decode_gpu < gpus:
                raise InputError(f"--decode-gpu {decode_gpu}: {gpus} GPU(s) visible (0..{gpus - 1})")
            ids.remove(decode_gpu)
        count = max_sessions or max(1, len(ids) // tp)
        if count * tp > len(ids):
            extra = f" besides decode GPU {decode_gpu}" if decode_gpu is not None else ""
            raise InputError(
                f"{count} worker group(s) of {tp} GPU(s) need {count * tp} GPUs{extra}; {gpus} visible"
            )
        return tuple("+".join(f"cuda:{ids[g * tp + r]}" for r in range(tp)) for g in range(count))
    return ("+".join(["cpu"] * tp),) * (max_sessions or 1)


def add_engine_flags(parser) -> None:
    """The worker fast-path flags (``cadence bench serve``; ``cadence serve`` can take the same):
    unset = automatic (on for CUDA groups, off on the CPU)."""
    import argparse

    g = parser.add_argument_group(
        "worker engine (default: the fast path on CUDA groups, the reference on CPU)"
    )
    g.add_argument(
        "--decoder",
        default=None,
        choices=["standin", "wan", "taehv"],
        help="VAE decoder (default: taehv on CUDA, the preset's on the CPU)",
    )
    for name, what in (
        ("kv-fp8", "ring cache with FP8 K/V"),
        ("fp8-linears", "FP8 linears (apply_fp8)"),
        ("graphs", "CUDA graphs for steady-state steps"),
        ("warmup", "a throwaway warm-up session before the worker reports ready"),
    ):
        g.add_argument(
            f"--{name}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{what} (default: on for CUDA groups, off on the CPU)",
        )
    g.add_argument(
        "--capture-filling",
        action="store_true",
        help="opt-in, with graphs and bf16 K/V: capture the ring-filling steps too (a second "
        "warm-up session; window_chunks more graphs); with FP8 K/V they replay the steady "
        "graph anyway",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="opt-in: torch.compile of the per-block elementwise math (compiles during the warm-up)",
    )
    g.add_argument("--warmup-chunks", type=int, default=0, help="warm-up chunks (default 0 = window + 2)")
    g.add_argument(
        "--decode-gpu",
        type=int,
        default=None,
        metavar="K",
        help="decode on GPU K for every single-GPU group (left out of the groups; latents go GPU to GPU)",
    )
    g.add_argument(
        "--decoder-fast",
        default=None,
        choices=list(DECODER_FAST),
        help="the Wan decoder's fast path (default: compile on CUDA, off on the CPU)",
    )
    g.add_argument(
        "--frame-transport",
        default="auto",
        choices=["auto", "pipe", "shm"],
        help="frames from the worker: pipe, shared memory, or auto (shm for chunks >= 1 MiB)",
    )


def add_weight_flags(parser) -> None:
    """The model and its checkpoints (``cadence serve``, ``cadence generate``, ``cadence bench serve|pipeline``)."""
    g = parser.add_argument_group(
        "model and weights (default: the preset's shipped weights; random weights for presets without any)"
    )
    g.add_argument(
        "--model",
        default=None,
        metavar="FAMILY",
        help="an open model family instead of --preset (see 'cadence models': self-forcing, causvid, "
        "longlive, krea-14b, flashtalk): its geometry, sampler, cache policy and checkpoint format",
    )
    g.add_argument(
        "--weights",
        default=None,
        help="the transformer's checkpoint: a safetensors file or a folder of them (diffusers, original "
        "Wan or Cadence key names), or a model family's own file (e.g. Self-Forcing's .pt)",
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


def weight_overrides(
    weights: str | None,
    vae_weights: str | None,
    text_encoder: str | None = None,
    text_tokenizer: str | None = None,
    taehv_weights: str | None = None,
) -> dict:
    """Engine-config overrides that load the given files; one clear error for a path that holds no checkpoint,
    before any worker starts."""
    from pathlib import Path

    def exists(path: str, what: str, folder_ok: bool = True, file_ok: bool = True) -> str:
        p = Path(path)
        if (file_ok and p.is_file()) or (folder_ok and p.is_dir() and any(p.iterdir())):
            return str(p.resolve())
        kinds = " or ".join(k for k, ok in (("a file", file_ok), ("a folder", folder_ok)) if ok)
        raise InputError(f"{what} not found: {path} ({kinds})")

    out: dict = {"model": {}, "vae": {}}
    if weights is not None:
        p = Path(weights)
        if not (p.is_file() or (p.is_dir() and any(p.glob("*.safetensors")))):
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


def model_kwargs(args) -> dict:
    """``ServeConfig(model=..., overrides=...)`` from the flags of :func:`add_weight_flags` (files checked)."""
    if args.model is not None:
        from cadence.model.families import get_family

        get_family(args.model)  # a clear error for an unknown family, before anything starts
    return {
        "model": args.model,
        "overrides": weight_overrides(
            args.weights, args.vae_weights, args.text_encoder, args.text_tokenizer, args.taehv_weights
        ),
    }


def engine_kwargs(args) -> dict:
    """ServeConfig keyword arguments from the flags of :func:`add_engine_flags`."""
    return {
        "decoder": args.decoder,
        "kv_fp8": args.kv_fp8,
        "fp8_linears": args.fp8_linears,
        "graphs": args.graphs,
        "capture_filling": args.capture_filling,
        "compile": args.compile,
        "warmup": args.warmup,
        "warmup_chunks": args.warmup_chunks,
        "frame_transport": args.frame_transport,
        "decode_gpu": getattr(args, "decode_gpu", None),
        "decoder_fast": getattr(args, "decoder_fast", None),
    }


def agent_endpoint(cfg: ServeConfig):
    """The ``talk`` agent's endpoint from the config (None without ``agent_url``)."""
    if cfg.agent_url is None:
        return None
    from cadence.serve.converse import AgentEndpoint

    kw = {"system_prompt": cfg.agent_system_prompt} if cfg.agent_system_prompt else {}
    return AgentEndpoint(
        cfg.agent_url,
        model=cfg.agent_model,
        stt_model=cfg.agent_stt_model,
        tts_model=cfg.agent_tts_model,
        **kw,
    )
