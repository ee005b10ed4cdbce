"""Server configuration (``cadence serve`` flags map onto these fields)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from cadence.errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    preset: str = "character"
    """Engine preset every worker builds."""
    host: str = "127.0.0.1"
    """Address the HTTP server listens on (loopback by default)."""
    port: int = 8000
    """HTTP port (0 = any free port)."""
    groups: tuple[str, ...] = ("cpu",)
    """One entry per GPU group: the device its worker process runs on ('cpu', 'cuda:0', ...). The number
    of entries is the number of sessions admitted at once (``--max-sessions N`` on the CPU = N slots)."""
    worker_threads: int = 1
    """torch threads per worker process (CPU); 0 = torch's default."""
    idle_timeout_s: float = 120.0
    """Close a session after this long with no request and no media from its client."""
    max_duration_s: float = 600.0
    """Close a session this long after it started, whatever happens."""
    connect_timeout_s: float = 30.0
    """Close a session whose peer connection is not connected this long after it started."""
    lead_ms: float = 100.0
    """Plan a chunk this long before its first frame is due (must cover worker time + transfers)."""
    max_in_flight: int = 2
    """Chunks at the worker at once, per session."""
    max_image_bytes: int = 10 * 1024 * 1024
    """Largest reference image upload accepted (bytes)."""
    max_audio_bytes: int = 5 * 1024 * 1024
    """Largest audio upload accepted (bytes)."""
    max_sdp_bytes: int = 64 * 1024
    """Largest SDP offer accepted (bytes)."""
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
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("at least one worker group is needed (--max-sessions >= 1)")
        if self.idle_timeout_s <= 0 or self.max_duration_s <= 0:
            raise ConfigError(f"timeouts must be positive, got idle {self.idle_timeout_s} s, "
                              f"max duration {self.max_duration_s} s")
        if self.sync_marker_every < 0:
            raise ConfigError(f"sync_marker_every must be >= 0, got {self.sync_marker_every}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}")

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
