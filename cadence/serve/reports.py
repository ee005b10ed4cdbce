"""Closed sessions' reports, kept compressed for as long as their tokens may read them.

A report is the session's whole record (``LiveSession.report``: its worker's figures for up to 1,000 chunks,
its timeline, ...): as Python objects 20-50 KB for a few-second session (~1.3 MB at 1,000 chunks), as compact
JSON 4-14 KB, zlib-compressed ~1.5 KB. The server keeps every closed session's for ``report_ttl_s`` (15 min),
so on a busy server the kept dicts were the web process's slow RSS growth: 222 few-second reports (15 minutes
of the soak's sessions) held +6.6 MB, and +3.2 MB still after they were freed (pymalloc's arenas, fragmented
by them); compressed they take ~0.35 MB (docs/perf/soak/NOTES.md, finding 6).

:class:`ReportStore` is a read-only ``Mapping`` of session id -> report (``store[sid]`` decodes one);
``json_bytes`` gives the stored JSON as the route sends it, with no decode; ``put`` keeps one, and
``expire`` drops the oldest while there are more than ``max_reports``, their compressed bytes exceed
``max_bytes``, or they are older than ``ttl_s``, and returns the dropped ids (their tokens are forgotten).
"""

from __future__ import annotations

import collections
import json
import time
import zlib
from collections.abc import Callable, Iterator, Mapping

#: zlib level: 6 (the default) compresses a report ~4.7x in ~0.1 ms per KB; 9 gains ~2% for 3x the time.
ZLIB_LEVEL = 6


def report_json(report: dict) -> bytes:
    """The report as compact JSON (what is stored, logged and served). Values JSON cannot hold (a path, an
    exception) are written as their ``str``, as the log always wrote them."""
    return json.dumps(report, separators=(",", ":"), default=str).encode()


class ReportStore(Mapping):
    def __init__(
        self,
        ttl_s: float,
        max_reports: int,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ttl_s, self.max_reports, self.max_bytes = ttl_s, max_reports, max_bytes
        self.clock = clock
        self._kept: collections.OrderedDict[str, tuple[float, bytes]] = collections.OrderedDict()
        self.nbytes = 0  # compressed bytes kept

    def put(self, sid: str, data: bytes) -> list[str]:
        """Keep report ``sid`` (its JSON, :func:`report_json`); returns the ids this expired."""
        old = self._kept.pop(sid, None)
        if old is not None:
            self.nbytes -= len(old[1])
        z = zlib.compress(data, ZLIB_LEVEL)
        self._kept[sid] = (self.clock(), z)
        self.nbytes += len(z)
        return self.expire()

    def expire(self) -> list[str]:
        """Drop the oldest reports while over a bound (the newest is kept whatever its size, until its ttl)."""
        now, dropped = self.clock(), []
        while self._kept:
            sid, (t, z) = next(iter(self._kept.items()))
            over = len(self._kept) > self.max_reports or self.nbytes > self.max_bytes
            if not (over and len(self._kept) > 1) and now - t <= self.ttl_s:
                break
            del self._kept[sid]
            self.nbytes -= len(z)
            dropped.append(sid)
        return dropped

    def json_bytes(self, sid: str) -> bytes:
        return zlib.decompress(self._kept[sid][1])

    def __getitem__(self, sid: str) -> dict:
        return json.loads(self.json_bytes(sid))

    def __contains__(self, sid: object) -> bool:
        return sid in self._kept

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._kept))

    def __len__(self) -> int:
        return len(self._kept)
