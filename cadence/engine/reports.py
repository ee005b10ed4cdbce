"""The engine's reports as dataclasses: :class:`StreamReport` (``Engine.last_run``: one stream) and the base
every report shares (``WarmupReport`` in ``cadence.engine.warmup`` too).

A report is a dataclass with a documented field per figure, read by attribute (``report.ttff_ms``);
``as_dict()`` is what travels (JSON records, the worker's ready info). Fields listed in ``OPTIONAL`` exist only
when they apply: ``None`` there means absent (``as_dict`` leaves them out, so the JSON keeps the keys it always
had).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class Report:
    """The JSON of a dataclass report: ``as_dict()`` (the ``OPTIONAL`` fields left out while None)."""

    OPTIONAL: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if not (k in self.OPTIONAL and v is None)}


@dataclass
class StreamReport(Report):
    """One ``Engine.stream`` (``Engine.last_run``), filled in as it runs."""

    OPTIONAL = ("ttff_ms", "first_chunk", "graphs", "wall_s")

    placement: str
    """Where diffusion and decode ran (``Placement.describe``)."""
    session: str
    """How the stream's session was opened: 'new', 'reused' (the kept one reset in place) or 'preopened'."""
    open_ms: float
    """The open: prompt K/V, the reference image's encode (or its remembered latent), the sink pass."""
    graphs_at_start: int
    """CUDA graphs kept when the stream began."""
    warmed_up: bool
    """Whether the engine had been warmed up."""
    chunks: int = 0
    """Chunks delivered so far."""
    ttff_ms: float | None = None
    """From the ``stream`` call to the first chunk's frames in host memory."""
    first_chunk: dict | None = None
    """The first chunk's stage times and step kind."""
    graphs: dict | None = field(default=None)
    """The graph runner's counts during this stream (captures, replays, eager runs and why, evictions)."""
    wall_s: float | None = None
    """The whole stream, once it ended."""
