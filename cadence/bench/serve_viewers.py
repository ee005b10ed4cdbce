"""`cadence bench serve`'s viewers spread over several client processes, and each side's CPU use.

With many sessions the viewers are real work: each one receives its stream over UDP, decodes every VP8 frame
(aiortc: libvpx plus Python per frame) and hashes its pixels to count fresh frames. All viewers in one process
share one interpreter (one GIL, one event loop): when that process falls behind, its sockets' buffers
overflow, packets are lost, frames fail to decode ("failed to decode VP8 frame") and the viewers count fewer
frames than the server sent. A shortfall at the client is then the client's, not the server's. So:

* ``--viewer-procs K`` runs the N viewers in K spawned processes (viewer i in process i mod K), each its own
  interpreter and event loop (:func:`drive_spread`). The default (:func:`default_viewer_procs`) gives a
  process at most ``VIEWERS_PER_PROC`` viewers while a quarter of the machine's cores is enough to give each
  process a core (the rest are the server's and its workers'); on a 2-core machine that is one process, as
  before.
* The record names each side's CPU use over the run (:func:`cpu_s`, CPU seconds from ``/proc/<pid>/stat``
  per wall second; 1.0 is one core busy): the server's process (its event loop, its encoders) and each viewer
  process. A side near 1.0 per process (its interpreter saturated) is where frames are lost.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

#: A viewer process's viewers at most, by default (each decodes 25 fps of VP8 and hashes every frame).
VIEWERS_PER_PROC = 4


def default_viewer_procs(n: int, cores: int | None = None) -> int:
    """Viewer processes for ``n`` viewers: enough for ``VIEWERS_PER_PROC`` each, at most a quarter of the
    ``cores`` (default: this machine's), at least 1."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, min(n, -(-n // VIEWERS_PER_PROC), cores // 4))


def cpu_s(pid: int | None) -> float | None:
    """Process ``pid``'s CPU seconds so far (user + system, all its threads), or None where /proc does not
    say (another OS, a process gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuProbe:
    """CPU seconds per wall second of a process between :meth:`__init__` and :meth:`done`."""

    def __init__(self, pid: int | None):
        self.pid, self.t0, self.c0 = pid, time.monotonic(), cpu_s(pid)

    def done(self) -> float | None:
        c1 = cpu_s(self.pid)
        wall = time.monotonic() - self.t0
        if self.c0 is None or c1 is None or wall <= 0:
            return None
        return round((c1 - self.c0) / wall, 3)


def _viewer_main(drive, url: str, n: int, kw: dict, conn) -> None:  # pragma: no cover - the viewer process
    """One viewer process: ``n`` viewers (``drive``: ``cadence.bench.serve._drive``, passed by reference); sends
    back (cfg, results, its CPU seconds per wall second), or ("error", its one line)."""
    import logging
    import sys

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    probe = CpuProbe(os.getpid())
    try:
        cfg, results = asyncio.run(drive(url, n, **kw))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {' '.join(str(e).split())}"))
        return
    conn.send((cfg, results, probe.done()))


def drive_spread(drive, url: str, n: int, procs: int, kw: dict, timeout_s: float) -> tuple[dict, list, list]:
    """``drive``'s ``n`` viewers in ``procs`` spawned processes (process j runs viewers j, j + procs, ...): (the server's
    /config, each viewer's ``ClientResult`` in viewer order, each process's CPU seconds per wall second).
    RuntimeError (one line) when a process fails or does not answer within ``timeout_s``."""
    ctx = mp.get_context("spawn")
    counts = [len(range(j, n, procs)) for j in range(procs)]
    running = []
    for j, count in enumerate(counts):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_viewer_main, args=(drive, url, count, kw, child), name=f"cadence-bench-viewers-{j}"
        )
        p.start()
        child.close()
        running.append((p, parent))
    answers = []
    try:
        deadline = time.monotonic() + timeout_s
        for j, (p, conn) in enumerate(running):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"viewer process {j} did not answer within {timeout_s:.0f} s")
            try:
                answers.append(conn.recv())
            except EOFError:
                raise RuntimeError(f"viewer process {j} exited ({p.exitcode})") from None
            if answers[-1][0] == "error":
                raise RuntimeError(f"viewer process {j}: {answers[-1][1]}")
    finally:
        for p, conn in running:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
            conn.close()
    results = [None] * n
    for j, (_, res, _) in enumerate(answers):
        results[j::procs] = res
    return answers[0][0], results, [a[2] for a in answers]
