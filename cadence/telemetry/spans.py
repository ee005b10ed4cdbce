"""Named timing regions for step breakdowns (attention, cache upkeep, linear, ...).

``region(name)`` is a no-op context manager unless a :class:`SpanRecorder` is active. On CUDA the
recorder places events on the current stream (no host sync while recording) and sums elapsed times
only in :meth:`SpanRecorder.totals`, after one synchronize, off the hot path. On CPU it uses a host
clock. Regions must not nest with each other (the sum of regions plus "other" is the step).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

_active: SpanRecorder | None = None


class SpanRecorder:
    """Collects (name, start, end) marks; use as ``with SpanRecorder(device) as rec: ...``."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._marks: list[tuple[str, object, object]] = []
        self._prev: SpanRecorder | None = None

    def __enter__(self) -> SpanRecorder:
        global _active
        self._prev, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._prev

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, name: str, start, end) -> None:
        self._marks.append((name, start, end))

    def totals(self) -> dict[str, float]:
        """Milliseconds per region name (synchronizes once on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, float] = defaultdict(float)
        for name, a, b in self._marks:
            out[name] += a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return dict(out)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, _, _ in self._marks:
            out[name] += 1
        return dict(out)


@contextlib.contextmanager
def _timed(rec: SpanRecorder, name: str):
    start = rec.mark()
    try:
        yield
    finally:
        rec.add(name, start, rec.mark())


def region(name: str):
    """Time the enclosed work under `name` when a recorder is active; otherwise do nothing."""
    rec = _active
    if rec is None:
        return contextlib.nullcontext()
    return _timed(rec, name)
