"""Server configuration (``cadence serve`` flags map onto these fields).

What every worker group builds is one :class:`~cadence.engine.recipe.EngineSpec` (``ServeConfig.engine``: the
model, its files, the fast path, the decode placement, the warm-up), the same object ``cadence bench
pipeline`` and every other entry point build from the same words (``cadence.engine.flags``). Each fast-path
option is ``None`` = automatic (on for CUDA worker groups, off on the CPU, so the CPU path is exactly the
reference one). :func:`worker_spec` resolves the spec once per group, for its devices
(``cadence.engine.recipe.resolve``: the family's rules applied, one note per option that cannot apply there;
the worker logs each note once and reports them in its ready info, ``GET /config`` -> ``workers``); the web
side reads the group's geometry (frame shape, fps, image size) from that same recipe.

The rest of the fields are the server's own: listening, sessions, limits, access, the ``talk`` agent.
"""

from __future__ import annotations

import dataclasses
import importlib
import ipaddress
from dataclasses import dataclass, field
from typing import ClassVar

from cadence.config import CadenceConfig
from cadence.engine.placement import Placement, Sharing, cpu_groups, gpu_groups
from cadence.engine.recipe import EngineSpec, WorkerSpec, resolve
from cadence.engine.shm import SHM_MIN_BYTES
from cadence.engine.spec import DEFAULT_PROMPT
from cadence.errors import ConfigError, InputError
from cadence.serve.ports import Deployment
from cadence.serve.sharing import CAPACITY_MODES, ShareRules

__all__ = ["DEFAULT_PROMPT", "SHM_MIN_BYTES", "ServeConfig", "frame_shape", "serve_groups", "worker_spec"]


@dataclass(frozen=True)
class ServeConfig:
    """``ServeConfig(engine=EngineSpec(...), port=..., ...)``: the engine's knobs are the spec's (one spelling,
    the one every entry point and its flags use), the rest the server's own."""

    engine: EngineSpec = field(default_factory=EngineSpec)
    """What every worker group builds (the model, its files, the fast path, the decode placement, the
    warm-up), resolved per group by :func:`worker_spec`. ``engine.decode_device`` 'cuda:K' (``--decode-gpu
    K``): every single-GPU group diffuses on its own GPU and decodes on GPU K, the latent handed GPU to GPU
    (:func:`serve_groups` leaves GPU K out of the session groups); tensor-parallel groups decode on their
    own GPUs (a note says so)."""
    host: str = "127.0.0.1"
    """Address the HTTP server listens on (loopback by default)."""
    port: int = 8000
    """HTTP port (0 = any free port)."""
    groups: tuple[Placement, ...] = (Placement(("cpu",)),)
    """One :class:`~cadence.engine.placement.Placement` per worker group: the device its worker process runs on
    ('cpu', 'cuda:0', ...), or the devices of a tensor-parallel group ('cuda:0+cuda:1': the model sharded over
    both, one worker process per device; 'cpu+cpu' runs the same on the CPU with gloo); given as text, it is
    read into a Placement. The number of groups is the number of sessions admitted at once (``--max-sessions
    N`` on the CPU = N slots). The same placement may come several times (``--sessions-per-gpu N``: N groups
    on each GPU, each its own process and engine; :attr:`sharing`), and then the device's measured capacity
    may admit fewer (``capacity``)."""
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
    cut_in: bool = True
    """The speech cut-in of the clip streams (FlashHead, FlashTalk: ``WorkerInfo.cut_in``): speech that arrives
    while silent clips are queued starts a clip at the first frame still replaceable instead of after them
    (``cadence.serve.scheduler.ChunkScheduler``). False (``--no-cut-in``): the chunk grid only, as every other
    family."""
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
    max_report_bytes: int = 8 << 20
    """Most compressed bytes of closed-session reports kept (``cadence.serve.reports``: ~1.5 KB for a
    few-second session, ~40 KB at the 1,000 chunks a report holds at most): the oldest go first."""
    ice_addresses: tuple[str, ...] | None = None
    """Host ICE candidates to offer; None = ('127.0.0.1',) when serving on loopback, else aioice's own
    discovery (all non-loopback interfaces)."""
    worker_start_timeout_s: float = 120.0
    """How long startup waits for the worker processes to build the model (on a GPU shared by several groups,
    for each of its two starts: the first group alone, then the others)."""
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
    frame_transport: str = "auto"
    """How frames come back from a worker: 'pipe' (pickled through the multiprocessing pipe), 'shm'
    (a ring of shared-memory slots; only the chunk index crosses the pipe) or 'auto' (shm when a
    chunk's frames are >= 1 MiB: a W1.3 chunk is 14.4 MB, a tiny preset's 196 KB; ``cadence.engine.shm``)."""
    capacity: str = "auto"
    """How many sessions a device shared by several groups admits at once (``cadence.serve.sharing``):
    'measure' (at start its groups stream flat out together for ``capacity_s``; it admits as many sessions as
    that throughput holds at real time), 'auto' ('measure' on GPUs; CPU groups one session each, as ever),
    'report' (measured and shown in ``/config``, one session per group admitted: benchmark sweeps), 'groups'
    (one session per group, not measured)."""
    capacity_s: float = 5.0
    """Seconds of that measurement (0: none)."""
    memory_fit: str = "error"
    """More groups on a GPU than its memory holds (measured with the first one up): 'error' (one line, the
    server does not start) or 'trim' (only those that fit start)."""
    mps: bool = False
    """Run the worker processes under a private CUDA MPS control daemon (kernels of several processes on a GPU
    at once; ``cadence.serve.mps``): started by the server when ``nvidia-cuda-mps-control`` is there, one log
    line and plain time-sharing when it is not. The GPU's settings are never changed."""
    extra: dict = field(default_factory=dict)
    """Free-form settings of callers that embed the server (kept with the config, read by nobody here)."""
    deployment: Deployment = field(default_factory=lambda: LOCAL)
    """Where the worker groups run: :data:`LOCAL` (this machine's processes, the default) or another entry of
    :data:`DEPLOYMENTS` (``cadence serve --deploy ray`` / ``--ray ADDR``: a ``cadence.fleet.config.FleetConfig``,
    whose groups are a Ray fleet's; ``groups`` is then its one placement). Typed by the ``Deployment`` Protocol
    of ``cadence.serve.ports``: the app takes its ``group_source(cfg)`` and ``routes(source)``, so this layer
    never imports ``cadence.fleet``."""

    @property
    def preset(self) -> str:
        """The model every worker builds (``engine.model``: a preset or a family)."""
        return self.engine.model

    @property
    def decode_gpu(self) -> int | None:
        return self.engine.decode_gpu

    @property
    def sharing(self) -> Sharing:
        """Which groups share a placement (``--sessions-per-gpu``)."""
        return Sharing(self.groups)

    @property
    def share_rules(self) -> ShareRules:
        """What the server does about shared devices: capacity, memory, MPS (checked at construction)."""
        return ShareRules(self.capacity, self.capacity_s, self.memory_fit, self.mps)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("at least one worker group is needed (--max-sessions >= 1)")
        object.__setattr__(self, "groups", tuple(Placement.of(g) for g in self.groups))  # checked there
        self.share_rules  # noqa: B018 (its checks: one ConfigError)
        if self.engine.decode_device not in ("same",) and self.decode_gpu is None:
            raise ConfigError(
                f"cadence serve decodes on each group's GPU ('same') or on one decode GPU (--decode-gpu K), "
                f"got decode device {self.engine.decode_device!r}"
            )
        if self.decode_gpu is not None:
            if any(g.holds_gpu(self.decode_gpu) for g in self.groups):
                groups = ", ".join(map(str, self.groups))
                raise ConfigError(
                    f"decode GPU {self.decode_gpu} also runs a worker group ({groups}): "
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


def frame_shape(config: CadenceConfig) -> tuple[int, int, int, int]:
    """One chunk's frames [F, H, W, 3] (uint8) of a recipe's configuration."""
    return (config.video_frames_per_chunk, config.stream.height, config.stream.width, 3)


def worker_spec(
    cfg: ServeConfig, device: Placement | str, frame_bytes: int | None = None
) -> tuple[WorkerSpec, bool]:
    """What the worker group placed on ``device`` builds, resolved once for the group: ``(spec, shm)``. ``spec.recipe``
    is ``cfg.engine`` resolved for the group's devices (automatic options on for CUDA groups, off on the CPU;
    the family's rules; ``recipe.notes`` one line per option that cannot apply there): the web side reads the
    group's geometry from it too. ``shm``: frames come back through shared memory (``frame_transport`` 'shm',
    or 'auto' and a chunk of >= 1 MiB; ``frame_bytes`` None: the recipe's chunk). Pure: no torch, no processes."""
    recipe = resolve(cfg.engine, device)
    if frame_bytes is None:
        f, h, w, c = frame_shape(recipe.config)
        frame_bytes = f * h * w * c
    t = cfg.frame_transport
    shm = t == "shm" or (t == "auto" and frame_bytes >= SHM_MIN_BYTES)
    return WorkerSpec(recipe), shm


def serve_groups(
    device: str,
    tp: int = 1,
    max_sessions: int | None = None,
    gpus: int = 0,
    decode_gpu: int | None = None,
    sessions_per_gpu: int = 1,
) -> tuple[Placement, ...]:
    """``cadence serve``'s worker groups: on CUDA, ``sessions_per_gpu`` groups on each set of ``tp`` consecutive
    GPUs ('cuda:0+cuda:1', 'cuda:2+cuda:3', ...), interleaved so that the first groups land on distinct GPUs,
    ``max_sessions`` of them (default: all), GPU ``decode_gpu`` left out (it decodes for them); on the CPU,
    ``max_sessions`` groups of ``tp`` gloo ranks (default ``sessions_per_gpu``: the CPU is one device). Raises
    InputError (one line) for what cannot be built."""

    if tp < 1:
        raise InputError(f"--tp must be >= 1, got {tp}")
    if max_sessions is not None and max_sessions < 1:
        raise InputError(f"--max-sessions must be >= 1, got {max_sessions}")
    if sessions_per_gpu < 1:
        raise InputError(f"--sessions-per-gpu must be >= 1, got {sessions_per_gpu}")
    if device == "cuda":
        ids = list(range(gpus))
        if decode_gpu is not None:
            if not 0 <= decode_gpu < gpus:
                raise InputError(f"--decode-gpu {decode_gpu}: {gpus} GPU(s) visible (0..{gpus - 1})")
            ids.remove(decode_gpu)
        sets = len(ids) // tp
        count = max_sessions or max(1, sets) * sessions_per_gpu
        if count > sets * sessions_per_gpu:
            extra = f" besides decode GPU {decode_gpu}" if decode_gpu is not None else ""
            per = f" at {sessions_per_gpu} per GPU" if sessions_per_gpu > 1 else ""
            need = -(-count // sessions_per_gpu) * tp
            raise InputError(
                f"{count} worker group(s) of {tp} GPU(s){per} need {need} GPUs{extra}; {gpus} visible "
                "(--sessions-per-gpu N places N groups on each GPU)"
            )
        return gpu_groups(tp, count, ids, sessions_per_gpu)
    if max_sessions is not None and sessions_per_gpu > 1 and max_sessions > sessions_per_gpu:
        raise InputError(
            f"--max-sessions {max_sessions} groups on the CPU (one device) at --sessions-per-gpu "
            f"{sessions_per_gpu}: give one of them"
        )
    return cpu_groups(tp, max_sessions or sessions_per_gpu)


# ---- where the groups run: the deployments ---------------------------------------------------------------


@dataclass(frozen=True)
class Local:
    """This machine's worker groups: one process per device of each group (the default deployment)."""

    name: ClassVar[str] = "local"

    def placements(
        self,
        device: str,
        tp: int,
        max_sessions: int | None,
        decode_gpu: int | None,
        sessions_per_gpu: int = 1,
    ):
        """``cadence serve``'s groups here (:func:`serve_groups` over the GPUs this machine has)."""
        gpus = 0
        if device == "cuda":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if gpus == 0:
                raise InputError("--device cuda requested but CUDA is not available")
        return serve_groups(device, tp, max_sessions, gpus, decode_gpu, sessions_per_gpu)

    def group_source(self, cfg: ServeConfig):
        """One ``cadence.serve.workers.WorkerGroup`` per placement of ``cfg.groups``, each resolved once
        (:func:`worker_spec`), its frames' shape its recipe's; every session a ``LiveSession`` (media here)."""
        from cadence.serve.session import LiveSession
        from cadence.serve.workers import LocalGroups, WorkerGroup

        groups = []
        # workers of a shared GPU keep a fair share of the cores as torch threads (``WorkerSpec.cpu_share``)
        procs = sum(len(Placement.of(p).devices) for p in cfg.groups) if cfg.sharing.shared else 1
        for i, placement in enumerate(cfg.groups):
            spec, shm = worker_spec(cfg, placement)
            spec = dataclasses.replace(spec, cpu_share=procs)
            shape = frame_shape(spec.recipe.config)
            groups.append(WorkerGroup(i, spec, frame_shape=shape, slots=cfg.max_in_flight + 1, shm=shm))
        return LocalGroups(groups, LiveSession, sharing=cfg.sharing, rules=cfg.share_rules)

    def routes(self, source) -> list:
        return []


LOCAL = Local()


def local_from_args(args) -> Local:
    return LOCAL


@dataclass(frozen=True)
class DeploymentKind:
    """One entry of :data:`DEPLOYMENTS`: a named place for the worker groups, and how the command line makes it."""

    name: str
    about: str
    build: str
    """``"module:function"``: the parsed ``cadence serve`` words -> its ``Deployment``."""
    flags: str = ""
    """``"module:function"`` adding its own flags to ``cadence serve`` ('' = none)."""
    implied_by: str = ""
    """The dest of one of its flags that chooses it without ``--deploy`` (``--ray ADDR``)."""

    def _load(self, what: str):
        module, attr = what.split(":")
        return getattr(importlib.import_module(module), attr)

    def from_args(self, args) -> Deployment:
        return self._load(self.build)(args)

    def add_flags(self, parser) -> None:
        if self.flags:
            self._load(self.flags)(parser)


#: The deployments ``cadence serve --deploy NAME`` takes (the next orchestrator is one more entry: its module
#: implements the ``Deployment`` Protocol, ``cadence.serve.ports``; nothing else names it).
DEPLOYMENTS: dict[str, DeploymentKind] = {
    k.name: k
    for k in (
        DeploymentKind("local", "this machine's worker processes", "cadence.serve.config:local_from_args"),
        DeploymentKind(
            "ray",
            "the worker groups of a Ray fleet (pip install 'cadence[ray]'; docs/fleet.md)",
            "cadence.fleet.config:fleet_from_args",
            flags="cadence.fleet.config:add_fleet_flags",
            implied_by="ray",
        ),
    )
}


def add_deployment_flags(parser) -> None:
    """``--deploy NAME`` and every deployment's own flags."""
    parser.add_argument(
        "--deploy",
        choices=list(DEPLOYMENTS),
        default=None,
        help="where the worker groups run: "
        + "; ".join(f"{k.name}: {k.about}" for k in DEPLOYMENTS.values())
        + " (default: local, or the one a flag of its own names, e.g. --ray)",
    )
    for k in DEPLOYMENTS.values():
        k.add_flags(parser)


def deployment_from_args(args) -> Deployment:
    """The deployment the words name: ``--deploy NAME``, else the one whose own flag was given, else local."""
    name = getattr(args, "deploy", None) or next(
        (
            k.name
            for k in DEPLOYMENTS.values()
            if k.implied_by and getattr(args, k.implied_by, None) is not None
        ),
        "local",
    )
    return DEPLOYMENTS[name].from_args(args)


def add_serve_flags(parser, sharing: bool = False, capacity_default: str = "auto") -> None:
    """``cadence serve``'s own worker flags (the engine's come from ``cadence.engine.flags``): the frame
    transport, and with ``sharing`` where the groups go on a GPU (``--sessions-per-gpu``, ``--capacity``,
    ``--capacity-seconds``, ``--mps``: ``cadence serve`` and ``cadence bench serve``, whose
    ``capacity_default`` is 'report'; an entry point with one group takes none of them)."""
    parser.add_argument(
        "--frame-transport",
        default="auto",
        choices=["auto", "pipe", "shm"],
        help="frames from the worker: pipe, shared memory, or auto (shm for chunks >= 1 MiB)",
    )
    parser.add_argument(
        "--no-cut-in",
        dest="cut_in",
        action="store_false",
        help="the clip streams (flashhead-*, flashtalk) start speech at the next clip boundary instead of "
        "cutting in at the first frame still replaceable (ServeConfig.cut_in)",
    )
    if sharing:
        _add_sharing_flags(parser, capacity_default)


def _add_sharing_flags(parser, capacity_default: str) -> None:
    g = parser.add_argument_group("several sessions per GPU")
    g.add_argument(
        "--sessions-per-gpu",
        type=int,
        default=None,
        metavar="N",
        help="worker groups on each GPU (each its own process, engine and session; the GPU time-shared; "
        "the model's memory N times, checked at start); on the CPU, N groups (default 1)",
    )
    g.add_argument(
        "--capacity",
        default=capacity_default,
        choices=list(CAPACITY_MODES),
        help="sessions a shared device admits at once: measure (its groups streaming together at start), "
        "auto (measure on GPUs; CPU groups one session each), report (measured, not enforced), groups "
        f"(one per group; default {capacity_default})",
    )
    g.add_argument(
        "--capacity-seconds",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds of that measurement at start (default 5; 0: none)",
    )
    g.add_argument(
        "--mps",
        action="store_true",
        help="run the workers under a private CUDA MPS daemon (kernels of several processes at once on a "
        "GPU; needs nvidia-cuda-mps-control, else one log line and plain time-sharing)",
    )


def share_words(args) -> dict:
    """The :class:`ServeConfig` fields of :func:`add_serve_flags`' sharing words (``--capacity`` ...)."""
    return {
        "capacity": args.capacity,
        "capacity_s": args.capacity_seconds,
        "mps": bool(args.mps),
    }


def placements_from_args(
    deployment, device: str, tp: int, max_sessions, decode_gpu, sessions_per_gpu
) -> tuple[Placement, ...]:
    """The groups of ``cadence serve``'s words where ``deployment`` runs them. ``--sessions-per-gpu`` places
    this machine's groups: another deployment places its own (one line if it is given there)."""
    per = 1 if sessions_per_gpu is None else sessions_per_gpu
    if per < 1:
        raise InputError(f"--sessions-per-gpu must be >= 1, got {per}")
    if per != 1:
        if not isinstance(deployment, Local):
            raise InputError(
                f"--sessions-per-gpu places this machine's worker groups; the {deployment.name} deployment "
                "places its own (docs/fleet.md)"
            )
        return deployment.placements(device, tp, max_sessions, decode_gpu, per)
    return deployment.placements(device, tp, max_sessions, decode_gpu)


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
