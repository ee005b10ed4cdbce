"""What a front end needs to know about the fleet it joins (``cadence serve --ray ...``), as plain data: the
'ray' deployment of ``cadence serve`` (``cadence.serve.config.DEPLOYMENTS``; it implements the ``Deployment``
Protocol of ``cadence.serve.ports``).

Torch-free and Ray-free: the CLI builds it before anything is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cadence.engine.placement import Placement
from cadence.errors import ConfigError
from cadence.fleet.names import GROUP_PREFIX, NAMESPACE, REGISTRY_NAME  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class FleetConfig:
    name: ClassVar[str] = "ray"

    address: str = "auto"
    """Ray cluster: 'auto' (join the cluster this machine belongs to, else start a local one) or an address
    ('10.0.0.5:6379', 'ray://head:10001')."""
    groups: int = 0
    """Worker groups the fleet should have (created if missing, each in its own STRICT_PACK placement
    group; existing ones are reused, never rebuilt). 0 = join the groups that exist and create none."""
    placement: Placement = field(default_factory=lambda: Placement(("cpu",)))
    """Each group's devices inside its actor: 'cpu', 'cuda:0', or a tensor-parallel group 'cuda:0+cuda:1' (GPU
    indices relative to the GPUs Ray gives the actor: CUDA_VISIBLE_DEVICES); given as text, read into a
    :class:`~cadence.engine.placement.Placement`."""
    cpus_per_group: float = 1.0
    """CPUs reserved per group (its placement-group bundle); GPUs reserved = the devices in ``device``."""
    max_restarts: int = 10
    """How often Ray restarts a group actor that died (-1: always)."""
    lease_s: float = 10.0
    """A front end that has not been heard from for this long loses its claims (its sessions are closed on
    their groups): a front end that crashed frees its groups for the others."""
    heartbeat_s: float = 1.0
    """How often a front end reports its sessions to the registry and reads the fleet's state back."""
    ping_s: float = 1.0
    """How often the registry checks each group and each node."""
    hop_ms: float = 15.0
    """What the Ray hop adds to a chunk's latency, added to each group's measured chunk time when the
    planning lead is sized (``cadence.serve.session.worker_speed``): an allowance above the hop measured on
    one machine (worker frames ready -> front end, ``scripts/fleet_costs.py hop``; docs/fleet.md, "Measured");
    another node adds its network round trip. The planner raises the lead further if chunks come back later."""
    media: str = "frontend"
    """Where a session's WebRTC ends: 'frontend' (this process: the frames come to it through Ray) or 'group'
    (the group actor, on the group's node: the front end hands it the SDP offer and returns its answer; frames
    and audio never reach the front end; ``cadence.fleet.media``). Sessions a program opens in process
    (``SessionManager.create_local``: Pipecat in process) read the frames here in either mode."""
    media_ice: str = "node"
    """With ``media='group'``: the host addresses the group's ICE agent offers to browsers: 'node' (the group
    node's Ray address), 'auto' (every interface of the node but loopback) or 'ADDR[,ADDR...]'. A browser
    must reach them by UDP (docs/fleet.md)."""
    namespace: str = NAMESPACE

    # (the ``Deployment`` Protocol of cadence.serve.ports, what the serve layer calls: it holds a FleetConfig as
    # ``ServeConfig.deployment`` and never imports cadence.fleet, which imports serve: the layers stay one-way)
    def placements(self, device: str, tp: int, max_sessions: int | None, decode_gpu: int | None):
        """One placement: every group of the fleet is placed alike (its own node's GPUs)."""
        return (self.placement,)

    def group_source(self, cfg):
        """A front end's group source for this fleet (``FleetGroups``) serving ``cfg`` (a ``ServeConfig``)."""
        from cadence.fleet.frontend import FleetGroups

        return FleetGroups(cfg)

    def routes(self, source) -> list:
        """``GET /fleet``, ``POST|DELETE /fleet/groups/{name}/drain`` of a front end whose groups come from
        ``source`` (a ``FleetGroups``): ``[add(app, access)]``."""
        from cadence.fleet.routes import fleet_routes

        return [fleet_routes(source)]

    def __post_init__(self) -> None:
        if not self.address:
            raise ConfigError("--ray needs 'auto' or a cluster address")
        if self.groups < 0:
            raise ConfigError(f"fleet groups must be >= 0, got {self.groups}")
        if self.cpus_per_group <= 0:
            raise ConfigError(f"cpus_per_group must be > 0, got {self.cpus_per_group}")
        if self.max_restarts < -1:
            raise ConfigError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if min(self.lease_s, self.heartbeat_s, self.ping_s) <= 0 or self.lease_s <= 2 * self.heartbeat_s:
            raise ConfigError(
                f"lease_s ({self.lease_s}) must exceed two heartbeats ({self.heartbeat_s} s), all positive"
            )
        if self.media not in ("frontend", "group"):
            raise ConfigError(f"fleet media is 'frontend' or 'group', got {self.media!r}")
        if not self.media_ice.strip() or any(not a.strip() for a in self.media_ice.split(",")):
            raise ConfigError(
                f"fleet media ICE addresses: 'node', 'auto' or 'ADDR[,ADDR...]', got {self.media_ice!r}"
            )
        object.__setattr__(self, "placement", Placement.of(self.placement))  # checked there

    @property
    def gpus_per_group(self) -> int:
        return self.placement.gpus

    def bundle(self) -> dict:
        """One group's placement-group bundle (one bundle: STRICT_PACK keeps it on one node)."""
        out = {"CPU": float(self.cpus_per_group)}
        if self.gpus_per_group:
            out["GPU"] = float(self.gpus_per_group)
        return out


def fleet_placement(device: str, tp: int) -> Placement:
    """A fleet group's placement from ``cadence serve --device cpu|cuda --tp N`` (no local GPU count: the front
    end's machine need not have any)."""
    return Placement(tuple(f"cuda:{r}" for r in range(tp)) if device == "cuda" else ("cpu",) * tp)


def add_fleet_flags(parser) -> None:
    """``cadence serve``'s fleet flags (``--ray`` and its options)."""
    g = parser.add_argument_group("fleet (Ray; pip install 'cadence[ray]'; docs/fleet.md)")
    g.add_argument(
        "--ray",
        default=None,
        metavar="auto|ADDRESS",
        help="run the sessions on a Ray fleet's worker groups instead of this machine's: 'auto' joins this "
        "machine's cluster (or starts one), or a cluster ADDRESS; this process is then a front end",
    )
    g.add_argument(
        "--fleet-groups",
        type=int,
        default=0,
        metavar="N",
        help="with --ray: groups the fleet should have (created if missing, one placement group each, "
        "--device/--tp per group); default 0: join the groups that exist",
    )
    g.add_argument(
        "--fleet-cpus-per-group",
        type=float,
        default=1.0,
        help="with --ray: CPUs reserved per group (default 1)",
    )
    g.add_argument(
        "--fleet-media",
        choices=["frontend", "group"],
        default="frontend",
        help="with --ray: where a session's WebRTC ends: 'frontend' (this process; frames come here through "
        "Ray; default) or 'group' (the group's own node: this process hands it the SDP offer; frames and audio "
        "never pass here; the browser must reach the group's node by UDP)",
    )
    g.add_argument(
        "--fleet-media-address",
        default="node",
        metavar="node|auto|ADDR[,ADDR]",
        help="with --fleet-media group: the addresses the group offers as ICE candidates ('node': the group "
        "node's Ray address, default; 'auto': its interfaces; or a list, e.g. its public address)",
    )
    g.add_argument(
        "--fleet-max-restarts",
        type=int,
        default=10,
        help="with --ray: Ray restarts a group actor that died this many times (-1: always; default 10)",
    )


def fleet_from_args(args) -> FleetConfig:
    """The :class:`FleetConfig` of ``cadence serve --deploy ray`` / ``--ray ADDRESS`` (address 'auto' when not
    given)."""
    return FleetConfig(
        address=getattr(args, "ray", None) or "auto",
        groups=args.fleet_groups,
        placement=fleet_placement(args.device, args.tp),
        cpus_per_group=args.fleet_cpus_per_group,
        max_restarts=args.fleet_max_restarts,
        media=args.fleet_media,
        media_ice=args.fleet_media_address,
    )
