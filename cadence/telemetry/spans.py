"""Named timing regions for step breakdowns (attention, cache upkeep, linear, ...).

``region(name)`` is a no-op context manager unless a :class:`SpanRecorder` is active. On CUDA the
recorder places events on the current stream (no host sync while recording) and sums elapsed times
only in :meth:`SpanRecorder.totals`, after one synchronize, off the hot path. On CPU it uses a host
clock.

Regions may nest (the FP8 activation quantisation, "quant", inside a linear layer's "linear"): a region's
time is exclusive, its own minus that of the regions opened inside it, so the regions plus "other" still
add up to the step.

``SpanRecorder(device, in_graph=True)``: the regions of work being captured into a CUDA graph. Its events
are external (``torch.cuda.Event(external=True)``: event-record nodes in the graph, re-recorded at every
replay), so that after a replay :meth:`totals` is the split of that replay: GPU time per region with no
launch gaps, what a graph-replayed step pays. Activate it around the capture only; read ``totals()``
after a replay.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

_active: SpanRecorder | None = None


class SpanRecorder:
    """Collects (name, start, end) marks; use as ``with SpanRecorder(device) as rec: ...``."""

    def __init__(self, device: torch.device | str, in_graph: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.in_graph = bool(in_graph and self.cuda)
        self._marks: list[list] = []  # [name, start, end, parent index or -1]
        self._open: list[int] = []  # indices of the regions open now (innermost last)
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
            ev = (
                torch.cuda.Event(enable_timing=True, external=True)
                if self.in_graph
                else torch.cuda.Event(enable_timing=True)
            )
            ev.record()
            return ev
        return time.perf_counter()

    def open(self, name: str) -> int:
        self._marks.append([name, self.mark(), None, self._open[-1] if self._open else -1])
        self._open.append(len(self._marks) - 1)
        return self._open[-1]

    def close(self, i: int) -> None:
        self._marks[i][2] = self.mark()
        self._open.remove(i)

    def add(self, name: str, start, end) -> None:
        self._marks.append([name, start, end, -1])

    def _elapsed(self) -> list[float]:
        return [(a.elapsed_time(b) if self.cuda else (b - a) * 1e3) for _, a, b, _ in self._marks]

    def totals(self) -> dict[str, float]:
        """Milliseconds per region name, exclusive of nested regions (synchronizes once on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        incl = self._elapsed()
        excl = list(incl)
        for i, (_, _, _, parent) in enumerate(self._marks):
            if parent >= 0:
                excl[parent] -= incl[i]
        out: dict[str, float] = defaultdict(float)
        for (name, *_), t in zip(self._marks, excl):
            out[name] += t
        return dict(out)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, *_ in self._marks:
            out[name] += 1
        return dict(out)


@contextlib.contextmanager
def _timed(rec: SpanRecorder, name: str):
    i = rec.open(name)
    try:
        yield
    finally:
        rec.close(i)


def region(name: str):
    """Time the enclosed work under `name` when a recorder is active; otherwise do nothing."""
    rec = _active
    if rec is None:
        return contextlib.nullcontext()
    return _timed(rec, name)
