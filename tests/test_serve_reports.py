"""Closed sessions' reports: kept compressed, read back whole, dropped by age, count and bytes
(``cadence.serve.reports``), and what the web process holds for them."""

import gc
import json
import random
import zlib
from pathlib import Path

from cadence.serve.reports import ReportStore, report_json


def _report(i: int, chunks: int = 30) -> dict:
    """A report shaped like a few-second session's (LiveSession.report): floats per chunk, a timeline."""
    rnd = random.Random(i)
    return {
        "session_id": f"s{i}",
        "close_reason": "client",
        "fps_mean": round(rnd.uniform(23, 24.2), 2),
        "worker_chunks": [
            {
                "i": c,
                "diffusion_ms": round(rnd.uniform(30, 60), 1),
                "decode_ms": round(rnd.uniform(20, 40), 1),
                "work_ms": round(rnd.uniform(50, 90), 1),
                "latency_ms": round(rnd.uniform(50, 150), 1),
                "budget_ms": round(rnd.uniform(140, 150), 1),
                "to_worker_ms": round(rnd.uniform(0.3, 3), 1),
                "back_ms": round(rnd.uniform(0.5, 3), 1),
                "step": None,
            }
            for c in range(chunks)
        ],
        "timeline": [{"t": 0.0, "fps": 24.0, "partial": True}],
    }


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_report_reads_back_as_it_was_stored_and_as_its_json():
    store = ReportStore(ttl_s=900, max_reports=256, max_bytes=8 << 20)
    r = _report(1)
    r["path"] = Path("/x")  # not JSON: stored as its str, as the log wrote it
    assert store.put("a", report_json(r)) == []
    assert "a" in store and len(store) == 1 and list(store) == ["a"]
    want = {**r, "path": "/x"}
    assert store["a"] == want
    assert json.loads(store.json_bytes("a")) == want
    # compressed: a few-second report's JSON (~5 KB here) is kept in well under a third of it
    assert store.nbytes < len(report_json(r)) / 3


def test_reports_expire_by_age_count_and_bytes_oldest_first():
    clock = Clock()
    store = ReportStore(ttl_s=10, max_reports=3, max_bytes=1 << 20, clock=clock)
    for i in range(5):
        clock.t = i
        dropped = store.put(f"s{i}", report_json(_report(i)))
        assert dropped == ([f"s{i - 3}"] if i >= 3 else [])
    assert list(store) == ["s2", "s3", "s4"]
    clock.t = 13.5  # s2 (t=2) and s3 (t=3) are older than 10 s
    assert store.expire() == ["s2", "s3"] and list(store) == ["s4"]
    clock.t = 14.5
    assert store.expire() == ["s4"] and len(store) == 0 and store.nbytes == 0
    # bytes: the oldest go until the rest fit; the newest stays whatever its size
    one = len(zlib.compress(report_json(_report(0, chunks=200))))
    store = ReportStore(ttl_s=900, max_reports=100, max_bytes=int(2.5 * one), clock=clock)
    for i in range(4):
        store.put(f"b{i}", report_json(_report(0, chunks=200)))
    assert list(store) == ["b2", "b3"] and store.nbytes == 2 * one
    store.max_bytes = 10
    assert store.expire() == ["b2"] and list(store) == ["b3"]
    store.put("b3", report_json(_report(3)))  # the same id again: replaced, its bytes counted once
    assert list(store) == ["b3"] and store.nbytes == len(zlib.compress(report_json(_report(3))))


def test_kept_reports_cost_the_web_process_a_fraction_of_the_dicts():
    """Why they are compressed: 200 few-second reports as dicts hold ~6 MB of the process's memory (measured
    with the soak's real reports: 222 held +6.6 MB); compressed ~0.3 MB. Counted by tracemalloc (Python's own
    allocations, not RSS, which other tests' leftovers move), with a wide margin: the dicts must cost at least
    4x what the store does."""
    import tracemalloc

    reports = [_report(i) for i in range(200)]
    data = [report_json(r) for r in reports]
    del reports
    gc.collect()
    tracemalloc.start()
    try:
        kept = [json.loads(d) for d in data]
        as_dicts = tracemalloc.get_traced_memory()[0]
        del kept
        gc.collect()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        store = ReportStore(ttl_s=900, max_reports=256, max_bytes=8 << 20)
        for i, d in enumerate(data):
            store.put(f"s{i}", d)
        as_store = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert as_dicts > 4 * as_store, (as_dicts, as_store)
    assert store.nbytes < 0.5e6


def test_the_web_process_caps_its_malloc_arenas_unless_the_environment_says(caplog):
    import logging

    from cadence.serve import heap

    with caplog.at_level(logging.INFO, logger="cadence.serve"):
        assert heap.cap_arenas(environ={"MALLOC_ARENA_MAX": "4"}) is False
    assert "MALLOC_ARENA_MAX=4 from the environment" in caplog.text
    # glibc (Linux, CI): mallopt(M_ARENA_MAX) is accepted; elsewhere one log line and False, never a crash
    assert heap.cap_arenas(heap.SERVER_ARENAS, environ={}) is (heap._glibc() is not None)
    assert heap.trim_memory() is (heap._glibc() is not None)
