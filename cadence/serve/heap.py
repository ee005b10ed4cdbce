"""The web process's C heap (glibc malloc): freed memory given back, and few arenas for it to scatter over.

The web process allocates natively on several threads: the codecs' encoder threads, the image decode pool,
the worker pipes' reader and writer, asyncio's executor. glibc gives each thread that allocates an arena of
its own (up to 8 per core) and keeps what is freed there for reuse, so a churn of sessions leaves free,
fragmented memory spread over many arenas. Measured over 10-minute soaks of ~150 sessions (the soak's
default mix, one at a time, 2 cores; docs/perf/soak/NOTES.md, finding 6): the web process ended idle at
+13.1 MB RSS over its start, 15.0 MB of it free memory glibc held, with the default arenas; with at most
``SERVER_ARENAS`` arenas, +6.8 MB, 7.0 MB held. The web side's threads do little at once (one GIL, one
encoder at a time per session), so sharing two arenas costs no measurable contention.

``cap_arenas`` must run before the threads start (``cadence.serve.server.run``: the ``cadence serve``
process only; a server started in a test's process leaves that process's heap alone). ``trim_memory``
runs after image decodes and after each session's close (``ImageDecoder.trim_soon``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("cadence.serve")

#: Most glibc arenas of the web process (``mallopt(M_ARENA_MAX)``); the environment's MALLOC_ARENA_MAX, when
#: set, is the operator's and wins.
SERVER_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes, _libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
            _libc.mallopt.argtypes, _libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
            _libc = False
    return _libc or None


def trim_memory() -> bool:
    """Give freed heap memory back to the OS (glibc ``malloc_trim(0)``, all arenas); False where unavailable.

    A decoded image lives in a few large allocations, freed right after; glibc keeps what was freed in
    each thread's arena for reuse, so without this a process that decoded large images once holds that
    memory for ever (issue 20: rounds of 8 parallel 64 MP uploads left 2 GB behind)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def cap_arenas(n: int = SERVER_ARENAS, environ: dict | None = None) -> bool:
    """At most ``n`` malloc arenas in this process from now on; False (and one log line) where it cannot be
    set, or not set because the environment names its own ``MALLOC_ARENA_MAX``."""
    env = os.environ if environ is None else environ
    if env.get("MALLOC_ARENA_MAX"):
        log.info("malloc arenas: MALLOC_ARENA_MAX=%s from the environment", env["MALLOC_ARENA_MAX"])
        return False
    libc = _glibc()
    if libc is None or libc.mallopt(_M_ARENA_MAX, n) != 1:
        log.info("malloc arenas: left as they are (no glibc mallopt here)")
        return False
    return True
