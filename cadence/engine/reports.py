"""The engine's reports as dataclasses: :class:`StreamReport` (``Engine.last_run``: one stream) and the mixin
that lets a report be read like the dict it replaced (``WarmupReport`` in ``cadence.engine.warmup`` too).

A report is a dataclass with a documented field per figure; ``report["key"]``, ``report.get("key")`` and
``"key" in report`` keep working for the callers that index it, and ``as_dict()`` is what travels (JSON
records, the worker's ready info). Fields listed in ``OPTIONAL`` exist only when they apply: ``None`` there
reads as absent (``in`` is False, ``as_dict`` leaves them out).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ReportView:
    """Dict-style reading of a dataclass report."""

    OPTIONAL: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if not (k in self.OPTIONAL and v is None)}

    def __getitem__(self, key: str):
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key) if key in self else default

    def __contains__(self, key: str) -> bool:
        fields = self.__dataclass_fields__  # type: ignore[attr-defined]
        return key in fields and not (key in self.OPTIONAL and getattr(self, key) is None)


@dataclass
class StreamReport(ReportView):
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
