"""One log line per process per reason: :func:`warn_once`, the one helper every fallback logs through.

A fast path that cannot run falls back with one log line, never one per call or per session (a stream calls
an FP8 linear thousands of times a second). Each module passes its own logger and a key naming the reason;
the first call logs (with " (logged once per process)" appended), later ones only count, so a report can say
how often a fallback was hit (:func:`once_counts`). Tests :func:`forget` what was seen to see a line again.
"""

from __future__ import annotations

import logging
import threading

SUFFIX = " (logged once per process)"
_seen: dict[tuple[str, str], int] = {}
_lock = threading.Lock()


def warn_once(log: logging.Logger, key: str, msg: str, *args, level: int = logging.WARNING) -> bool:
    """Log ``msg % args`` at ``level`` on ``log`` the first time ``key`` is seen for that logger in this
    process; count every call. True when it logged."""
    with _lock:
        n = _seen.get((log.name, key), 0)
        _seen[(log.name, key)] = n + 1
    if n:
        return False
    log.log(level, msg + SUFFIX, *args)
    return True


def once_counts(log: logging.Logger) -> dict[str, int]:
    """Key -> how many times :func:`warn_once` was called with it on ``log`` (the line itself logged once)."""
    with _lock:
        return {k: n for (name, k), n in _seen.items() if name == log.name}


def forget(log: logging.Logger | None = None) -> None:
    """Forget the keys seen on ``log`` (all loggers' when None): their next call logs again."""
    with _lock:
        for name, k in [nk for nk in _seen if log is None or nk[0] == log.name]:
            del _seen[(name, k)]
