"""What the web process logs for a person to read: one short line each; the details stay at DEBUG and in
``GET /config`` (``workers``). A worker's ready line was its whole ready info, ~3,000 characters (issue 39)."""

from __future__ import annotations


def worker_ready_line(index: int, pid, info) -> str:
    """``worker 0 ready (pid 4242): character on cpu, built in 6.1 s, warm-up 48 ms per chunk (one at a time),
    2 threads; 1 note (GET /config)`` from a ``cadence.engine.messages.WorkerInfo``."""
    warm = info.warmup or {}
    parts = [f"{info.preset} on {info.device}" + (f" (TP {info.tp})" if info.tp > 1 else "")]
    parts.append(f"built in {info.build_ms / 1e3:.1f} s")
    if warm.get("steady_chunk_ms"):
        parts.append(f"warm-up {warm['steady_chunk_ms']:.0f} ms per chunk (one at a time)")
    if info.threads:
        parts.append(f"{info.threads} thread{'s' if info.threads != 1 else ''}")
    notes = len(info.notes)
    more = f"; {notes} note{'s' if notes != 1 else ''} below" if notes else ""
    return f"worker {index} ready (pid {pid}): {', '.join(parts)}{more} (details: GET /config)"
