"""The Ray path's costs on this machine (docs/fleet.md, "Measured"): run from the repository root.

    python3 scripts/fleet_costs.py hop plain|ray     # one session: worker frames ready -> front end (ms)
    python3 scripts/fleet_costs.py cpu plain|ray     # two sessions: CPU of each kind of process (/proc)

``hop`` times each chunk from the worker's ``ChunkDone.timings.t_done`` to its arrival in the front end's
session (one machine: one monotonic clock). ``cpu`` reads the CPU time of this process and of every
process under the local cluster's nodes over 12 s while two aiortc clients (in this process) stream.
"""

import collections
import os
import statistics
import sys
import time

from cadence.fleet.cluster import LocalCluster
from cadence.fleet.config import FleetConfig
from cadence.serve.config import ServeConfig
from cadence.serve.server import ServerThread
from cadence.serve.session import LiveSession
from cadence.serve.testing import BackgroundClient

TCK = os.sysconf("SC_CLK_TCK")


def cpu_times(roots: list[int]) -> dict[int, tuple[float, str]]:
    """{pid: (CPU s, command line)} of this process and every descendant of ``roots``."""
    info = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{p}/cmdline").read().replace("\0", " ")
            info[int(p)] = (int(f[1]), (int(f[11]) + int(f[12])) / TCK, cmd)
        except OSError:
            pass
    mine = set(roots) | {os.getpid()}
    grown = True
    while grown:
        grown = False
        for pid, (ppid, _, _) in info.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grown = True
    return {pid: info[pid][1:] for pid in mine if pid in info}


def kind(cmd: str, pid: int) -> str:
    if pid == os.getpid():
        return "front end + clients (this process)"
    for k in ("gcs_server", "raylet", "monitor.py", "log_monitor.py", "dashboard.py"):
        if k in cmd:
            return k
    if "spawn_main" in cmd:
        return "cadence worker processes"
    for k in ("GroupActor", "Registry", "DashboardAgent", "RuntimeEnvAgent"):
        if k in cmd:
            return k
    return cmd[:50]


def serve_config(mode: str, groups: int):
    if mode == "ray":
        cluster = LocalCluster(num_cpus=1).start()
        for _ in range(groups - 1):
            cluster.add_node(num_cpus=1)
        fleet = FleetConfig(address=cluster.address, groups=groups)
        return ServeConfig(port=0, worker_threads=1, timeline_window_s=2.0, fleet=fleet), cluster
    return ServeConfig(port=0, worker_threads=1, timeline_window_s=2.0, groups=("cpu",) * groups), None


def main() -> None:
    what, mode = sys.argv[1], sys.argv[2]
    hops: list[float] = []
    if what == "hop":
        orig = LiveSession.on_chunk

        def on_chunk(self, c, frames, timings):
            hops.append((time.monotonic() - timings.t_done) * 1e3)
            return orig(self, c, frames, timings)

        LiveSession.on_chunk = on_chunk
    cfg, cluster = serve_config(mode, 1 if what == "hop" else 2)
    try:
        with ServerThread(cfg) as srv:
            if what == "hop":
                r = BackgroundClient(srv.url, 15.0).join(90)
                h = sorted(hops[5:])
                print(
                    f"{mode}: {len(h)} chunks, frames ready -> front end ms p50 {statistics.median(h):.2f} "
                    f"p90 {h[int(0.9 * len(h))]:.2f} max {h[-1]:.2f}; fps {r.report.get('fps_mean')}"
                )
                return
            clients = [BackgroundClient(srv.url, 20.0) for _ in range(2)]
            time.sleep(6)
            roots = [n.proc.pid for n in cluster.nodes] if cluster else []
            a = cpu_times(roots)
            t = time.monotonic()
            time.sleep(12)
            b = cpu_times(roots)
            dt = time.monotonic() - t
            results = [c.join(90) for c in clients]
            agg: collections.Counter = collections.Counter()
            for pid, (cpu, cmd) in b.items():
                if pid in a:
                    agg[kind(cmd, pid)] += cpu - a[pid][0]
            for k, v in agg.most_common():
                print(f"{100 * v / dt:6.1f}% of a core  {k}")
            print(f"{100 * sum(agg.values()) / dt:6.1f}% in all over {dt:.1f} s ({mode}, 2 sessions)")
            for r in results:
                print(
                    "session fps", r.report.get("fps_mean"), "chunk p50", r.report.get("chunk_latency_ms_p50")
                )
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
