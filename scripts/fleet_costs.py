"""The Ray path's costs on this machine (docs/fleet.md, "Measured"): run from the repository root.

Where it belongs: a measurement run by hand on a CPU machine (not part of the package, not a device plan); its
figures and records: docs/fleet.md and docs/perf/fleet/.

    python3 scripts/fleet_costs.py hop plain|ray     # one session: worker frames ready -> front end (ms)
    python3 scripts/fleet_costs.py cpu plain|ray     # two sessions: CPU of each kind of process (/proc)
    python3 scripts/fleet_costs.py media frontend|group [--sessions N] [--seconds S] [--record]

``hop`` times each chunk from the worker's ``ChunkDone.timings.t_done`` to its arrival in the front end's
session (one machine: one monotonic clock). ``cpu`` reads the CPU time of this process and of every
process under the local cluster's nodes over 12 s while two aiortc clients (in this process) stream.

``media`` compares where WebRTC ends (``--fleet-media frontend|group``): a local cluster of N one-CPU
"nodes" with one character group each, a front end in this process, N aiortc clients in a process of their
own (so the front end's CPU is its own), the CPU of every kind of process over a window while all N stream
(from ``--sessions``-th first frame + 3 s, for ``--seconds`` - 6 s), and each session's fps (the server's
report and the client's received rate). JSON into ./cadence-results/fleet/ (``--record``: docs/perf/fleet/).
"""

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (this checkout's cadence, installed or not)

from cadence.devtools.testing import BackgroundClient
from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.fleet.cluster import LocalCluster
from cadence.fleet.config import FleetConfig
from cadence.serve.config import ServeConfig
from cadence.serve.server import ServerThread
from cadence.serve.session import LiveSession

TCK = os.sysconf("SC_CLK_TCK")
#: Every worker with one intra-op thread (the default model, the character).
ONE_THREAD = EngineSpec(fast=FastPath(threads=1))


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


def kind(cmd: str, pid: int, clients: int | None = None) -> str:
    if pid == os.getpid():
        return "front end (this process)" if clients is not None else "front end + clients (this process)"
    if pid == clients:
        return "aiortc clients (their process)"
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
        return ServeConfig(engine=ONE_THREAD, port=0, timeline_window_s=2.0, deployment=fleet), cluster
    return ServeConfig(engine=ONE_THREAD, port=0, timeline_window_s=2.0, groups=("cpu",) * groups), None


# ---- media: frontend vs group ------------------------------------------------------------------------------


def clients_main(url: str, n: int, seconds: float) -> None:
    """(In the clients' process.) ``n`` aiortc clients at once; one JSON line per session on stdout."""
    from cadence.devtools.client import run_client

    async def all_of():
        return await asyncio.gather(*(run_client(url, seconds, connect_timeout=60.0) for _ in range(n)))

    for r in asyncio.run(all_of()):
        rep = r.report or {}
        keep = (
            "fps_mean",
            "ttff_ms",
            "chunk_latency_ms_p50",
            "chunk_latency_ms_p99",
            "lead_ms",
            "underruns",
            "deadline_misses",
            "video_frames_sent",
            "audio_frames_sent",
            "close_reason",
            "errors",
        )
        row = {
            "error": r.error,
            "client_video_fps": round(r.video_fps(), 2),
            "client_audio_s": round(r.audio_seconds, 2),
            "client_ttff_ms": round(r.ttff_ms, 1) if r.ttff_ms else None,
            **{k: rep.get(k) for k in keep},
            "worker_work_ms_p50": (rep.get("worker") or {}).get("work_ms_p50"),
            "timeline_fps": [w["fps"] for w in rep.get("timeline") or [] if not w.get("partial")],
        }
        print("SESSION " + json.dumps(row), flush=True)


def media(argv: list[str]) -> None:
    import httpx

    p = argparse.ArgumentParser(prog="fleet_costs.py media")
    p.add_argument("mode", choices=["frontend", "group"])
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--seconds", type=float, default=20.0, help="each client streams this long")
    p.add_argument("--record", action="store_true", help="write into docs/perf/fleet/ (else cadence-results)")
    a = p.parse_args(argv)
    cluster = LocalCluster(num_cpus=1).start()
    for _ in range(a.sessions - 1):
        cluster.add_node(num_cpus=1)
    # loopback candidates in both modes (the front end offers 127.0.0.1 on loopback; so does the group here)
    fleet = FleetConfig(address=cluster.address, groups=a.sessions, media=a.mode, media_ice="127.0.0.1")
    cfg = ServeConfig(engine=ONE_THREAD, port=0, timeline_window_s=2.0, deployment=fleet)
    rows, cpu, window = [], {}, 0.0
    try:
        with ServerThread(cfg, log_level="error") as srv:
            proc = subprocess.Popen(
                [sys.executable, __file__, "_clients", srv.url, str(a.sessions), str(a.seconds)],
                stdout=subprocess.PIPE,
                text=True,
            )

            def streaming() -> int:
                h = httpx.get(f"{srv.url}/healthz", timeout=10).json()
                return h["sessions"] if h["free"] == 0 else 0

            deadline = time.monotonic() + 90
            while streaming() < a.sessions and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(3.0)  # past the first frames
            roots = [n.proc.pid for n in cluster.nodes] + [proc.pid]
            before = cpu_times(roots)
            t = time.monotonic()
            time.sleep(max(4.0, a.seconds - 6.0))
            after = cpu_times(roots)
            window = time.monotonic() - t
            out, _ = proc.communicate(timeout=a.seconds + 120)
            rows = [json.loads(line[8:]) for line in out.splitlines() if line.startswith("SESSION ")]
            agg: collections.Counter = collections.Counter()
            for pid, (c, cmd) in after.items():
                if pid in before:
                    agg[kind(cmd, pid, proc.pid)] += c - before[pid][0]
            cpu = {k: round(100 * v / window, 1) for k, v in agg.most_common()}
    finally:
        cluster.shutdown()
    serving = {k: v for k, v in cpu.items() if not k.startswith("aiortc clients")}
    res = {
        "media": a.mode,
        "sessions": a.sessions,
        "seconds": a.seconds,
        "cpu_window_s": round(window, 1),
        "cpu_percent_of_a_core": cpu,
        "cpu_serving_percent": round(sum(serving.values()), 1),  # everything but the clients
        "fps_mean": [r.get("fps_mean") for r in rows],
        "client_video_fps": [r.get("client_video_fps") for r in rows],
        "sessions_detail": rows,
    }
    for k, v in cpu.items():
        print(f"{v:6.1f}% of a core  {k}")
    print(f"{res['cpu_serving_percent']:6.1f}% serving (all but the clients) over {window:.1f} s")
    for r in rows:
        print(
            f"session: {r['fps_mean']} fps (server), {r['client_video_fps']} fps received, chunk p50 "
            f"{r['chunk_latency_ms_p50']} ms, underruns {r['underruns']}, errors {r['error'] or r['errors']}"
        )
    import torch

    from cadence.bench.common import REPO, device_name, git_commit  # (torch: after the measurement)
    from cadence.telemetry.devices import cpu_info

    base = REPO / "docs" / "perf" if a.record else Path.cwd() / "cadence-results"
    stem = f"{time.strftime('%Y-%m-%d')}-cpu-character-tp1-s{a.sessions}-media-{a.mode}"
    path, k = base / "fleet" / f"{stem}.json", 2
    while path.exists():  # (never overwritten: -2, -3, ...)
        path, k = base / "fleet" / f"{stem}-{k}.json", k + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": "fleet_costs media",
        "preset": "character",
        "device": device_name(torch.device("cpu")),
        "cpu": cpu_info(),
        "git": git_commit(),
        "command": "python3 scripts/fleet_costs.py media " + " ".join(argv),
        "results": res,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def main() -> None:
    if sys.argv[1] == "_clients":
        clients_main(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return
    if sys.argv[1] == "media":
        media(sys.argv[2:])
        return
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
