"""`cadence bench serve`: N WebRTC clients (aiortc) against a live ``cadence serve``.

    cadence bench serve --sessions 1 --seconds 10                        # starts its own server (CPU)
    cadence bench serve --preset w1.3 --device cuda --sessions 1 --seconds 20 --speak-every 3   # one H200
    cadence bench serve --url http://127.0.0.1:8000 --sessions 4 --seconds 30   # a running server
    cadence bench serve --ray local --sessions 2 --seconds 20   # the same through a Ray fleet (cadence.fleet)
    cadence bench serve --device cuda --sessions 1,2,4,8 --seconds 20   # a sweep: each N a fresh server
    cadence bench serve --device cuda --find-capacity --max-n 16 --one-server   # the most sessions one GPU holds

Each client offers what the page offers (recvonly video, sendrecv audio with a silent microphone),
receives the character for ``--seconds`` after its first frame, pushes 1 s of synthetic speech after
``--speak-after`` seconds (POST /sessions/{id}/audio; the agent's first audio -> first speaking frame
is timed by the server), then closes its session and reads the report. Per session: fps, time to first
frame (client: POST -> first decoded frame), A/V offset (server: video minus audio pacing lag),
underruns. The fps figures, each session's (``sessions_fresh_fps``) and the share of sessions at the target
(``share_sessions_ge_target``; ``--target-fps``, default the stream's fps - 0.5: 24.5 at 25 fps, 23.5 at 24)
are *fresh* frames at the client (``fps_mean``: frames whose pixels differ from the one before, per second of stream:
``ClientResult.fresh``), beside the frames decoded (``decoded_fps_mean``) and the server's own count
(``server_fps_mean``). Results per docs/benchmarks.md (bench "serve"). Without ``--url`` the server runs
in this process (its worker groups in their own processes): ``--sessions`` CPU slots, or one per GPU
with ``--device cuda``; on CUDA the workers run the engine's fast path (TAEHV decoder, ring cache
with FP8 K/V, FP8 linears, CUDA graphs) and warm up before the server accepts sessions (the warm-up
time and the worker's steady chunk time are recorded under ``workers``). The stream geometry recorded
in ``shape`` (frames and audio samples per chunk, size, fps) is the server's, from ``GET /config``.
Loopback only. Each client reads its own session with the token the server returned (the progress
lines too); a ``--url`` server that needs its operator key gets it from ``CADENCE_API_KEY``.

Several sessions on one GPU: ``--sessions N --device cuda`` places the N sessions' worker groups on as few GPUs
as hold them evenly (``--sessions-per-gpu K`` to say how many per GPU; ``cadence serve``'s words, with
``--capacity report`` by default here: the server measures its capacity and reports it, and admits one session
per group, so that what N sessions really get is measured). A run *holds the target* when no session failed,
every session's fresh fps is >= the target and no underrun was counted. ``--sessions 1,2,4``: one run per N,
each against a fresh server (``--one-server``: one server with groups for the largest N, left idle when fewer
stream); ``--find-capacity``: the largest N (<= ``--max-n``) that holds the target, searched from 1 (or from
the capacity the one server measured) up by doubling, then halving the interval (``search_capacity``). A
sweep records each N's JSON and a summary (variant ``sweep`` / ``capacity``: ``capacity``, ``rows``). A
sweep's server runs in a process of its own (``--server-process``; ``ServerProcess``): with many sessions
the server encodes every stream and the clients decode them, and in one interpreter the clients' work
would count against the server.

``--ray local|auto|ADDRESS``: the self-started server is a fleet front end (``cadence serve --ray``) with
``--sessions`` groups; ``local`` starts a Ray head and ``--sessions - 1`` more Ray "nodes" on this machine
(``ray start``, loopback, 1 CPU each: one group per node) and removes them afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Callable

from cadence.bench.common import add_size_flags, size_overrides
from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_engine_flags, spec_from_args
from cadence.serve.config import add_serve_flags


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench serve", description=__doc__.split("\n\n")[0])
    _add_session_flags(p)
    p.add_argument(
        "--seconds", type=float, default=10.0, help="seconds to stream per session after its first frame"
    )
    p.add_argument("--url", default=None, help="a running server (default: start one here on loopback)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="self-started server's groups")
    p.add_argument(
        "--speak-after", type=float, default=1.0, help="push speech this long after the first frame"
    )
    p.add_argument(
        "--speak-every",
        type=float,
        default=0.0,
        help="push it again every this many seconds (0: once); each push is one agent latency sample",
    )
    p.add_argument(
        "--speak-jitter",
        type=float,
        default=0.5,
        help="add a seeded uniform 0..this many seconds to each repeat, so samples see every phase of "
        "the chunk clock (default 0.5)",
    )
    p.add_argument(
        "--lead-ms",
        type=float,
        default=None,
        help="self-started server: least planning lead (default: the server's; raised to the "
        "worker's measured chunk time on CUDA)",
    )
    p.add_argument(
        "--ray",
        default=None,
        metavar="local|auto|ADDRESS",
        help="the self-started server is a Ray fleet front end with --sessions groups ('local': a Ray head "
        "and --sessions - 1 more nodes on this machine, 1 CPU each, removed afterwards)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds the self-started server waits for its workers (build + warm-up; default "
        "120 on the CPU, 600 on CUDA)",
    )
    p.add_argument(
        "--video-codec",
        default=None,
        choices=["VP8", "H264"],
        help="the clients offer only this video codec (default: aiortc's order, VP8 first)",
    )
    p.add_argument(
        "--window-s",
        type=float,
        default=60.0,
        help="self-started server: the report's timeline window (fps, chunk latency, underruns, "
        "worker memory per window; default 60)",
    )
    add_size_flags(p)  # the self-started server's frame size
    p.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        help="print each session's live status this often, in seconds (0: never)",
    )
    add_engine_flags(
        p
    )  # the self-started server's engine: the words `cadence serve` takes (--tp: GPUs per group)
    add_serve_flags(p, sharing=True, capacity_default="report")
    add_record_flags(p)
    a = p.parse_args(argv)
    if not 1.0 <= a.seconds <= 3600:
        p.error(f"--seconds must be within 1..3600, got {a.seconds}")
    if a.find_capacity and len(a.sessions) > 1:
        p.error("give --sessions N,N,... or --find-capacity, not both")
    if a.max_n < 1:
        p.error(f"--max-n must be >= 1, got {a.max_n}")
    if a.ray and (a.find_capacity or len(a.sessions) > 1):
        p.error("a sweep (--sessions N,N,... / --find-capacity) runs on this machine's groups, not --ray")
    return a


def _add_session_flags(p) -> None:
    """How many sessions: ``--sessions N[,N...]``, ``--find-capacity``, ``--max-n``, ``--one-server``,
    ``--target-fps``."""
    p.add_argument(
        "--sessions",
        type=_counts,
        default=[1],
        metavar="N[,N...]",
        help="concurrent sessions (clients); a list (1,2,4,8) runs one sweep, each N a fresh server",
    )
    p.add_argument(
        "--find-capacity",
        action="store_true",
        help="search the largest N (<= --max-n) at which every session holds the target fps",
    )
    p.add_argument("--max-n", type=int, default=16, help="--find-capacity's largest N (default 16)")
    p.add_argument(
        "--one-server",
        action="store_true",
        help="a sweep's runs share one server with groups for the largest N (fewer, if its GPU's memory "
        "holds fewer) instead of a fresh server per N",
    )
    p.add_argument(
        "--server-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the self-started server in a process of its own, apart from the clients (default: for a "
        "sweep)",
    )
    p.add_argument(
        "--viewer-procs",
        type=_procs,
        default=None,
        metavar="K",
        help="run the viewers in K processes of their own (default: up to 4 viewers a process, at most a "
        "quarter of the cores; 1: in this process)",
    )
    p.add_argument(
        "--target-fps",
        type=float,
        default=None,
        help="the fresh fps every session must hold (default: the stream's fps - 0.5)",
    )


def _procs(text: str) -> int:
    """``--viewer-procs``: a count >= 1."""
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"must be a count >= 1, got {text!r}")
    return k


def _counts(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,..., got {text!r}") from None
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"session counts must be >= 1, got {text!r}")
    return ns


def _p50(xs):
    xs = [x for x in xs if x is not None]
    return round(float(statistics.median(xs)), 1) if xs else None


async def _drive(
    url: str,
    n: int,
    seconds: float,
    speak_after: float,
    speak_every: float = 0.0,
    speak_jitter: float = 0.0,
    progress_every: float = 0.0,
    video_codec: str | None = None,
):
    import httpx

    from cadence.devtools.client import run_client
    from cadence.media import synthetic_speech
    from cadence.serve.agent import wav_bytes

    speech = wav_bytes(synthetic_speech(1.0, seed=1).numpy())
    api_key = os.environ.get("CADENCE_API_KEY") or None  # a --url server that needs its operator key
    created: list[dict] = [{} for _ in range(n)]  # each client's session id and token, once it has them
    async with httpx.AsyncClient(timeout=60.0) as http:
        cfg = (await http.get(f"{url}/config")).json()
        progress = (
            asyncio.create_task(_progress(http, url, progress_every, created)) if progress_every > 0 else None
        )
        viewers = [await _viewer(url) for _ in created]  # each its own browser: its own cookie
        try:
            results = await asyncio.gather(
                *(
                    run_client(
                        url,
                        seconds,
                        http=viewer,
                        speak_wav=speech,
                        speak_after_s=speak_after,
                        speak_every_s=speak_every,
                        speak_jitter_s=speak_jitter,
                        video_codec=video_codec,
                        api_key=api_key,
                        created=c,
                    )
                    for c, viewer in zip(created, viewers)
                )
            )
        finally:
            if progress is not None:
                progress.cancel()
            for viewer in viewers:
                await viewer.aclose()
    return cfg, results


async def _viewer(url: str):
    """One viewer's HTTP client, as a browser that opened the page: the page's answer sets its client
    cookie (``cadence.serve.guard.CLIENT_COOKIE``), so N viewers on one machine are N clients to the
    server's per-client limits (one shared cookie jar, or none, would make them one client, whose pending
    offers the server caps at two)."""
    import httpx

    viewer = httpx.AsyncClient(timeout=60.0)
    try:
        await viewer.get(f"{url}/")
    except httpx.HTTPError:  # a server without the page (a --url elsewhere): the first answer sets it
        pass
    return viewer


async def _progress(http, url: str, every: float, created: list[dict]) -> None:
    """One line per live session every ``every`` seconds (stderr): age, fps, chunk latency, underruns,
    worker memory; a long soak shows it is alive and whether it holds up. Each session is read with its
    own token (``GET /sessions/{id}``: the session list needs the operator key)."""
    while True:
        await asyncio.sleep(every)
        sessions = []
        for c in created:
            if not c.get("token"):
                continue
            try:
                r = await http.get(
                    f"{url}/sessions/{c['session_id']}", headers={"authorization": f"Bearer {c['token']}"}
                )
                st = r.json()
            except Exception as e:  # progress only: the clients report the real errors
                print(
                    f"  progress: GET /sessions/{c['session_id'][:8]} failed ({type(e).__name__})",
                    file=sys.stderr,
                )
                continue
            if r.status_code == 200 and st.get("state") != "closed":
                sessions.append(st)
        for st in sessions:
            mem = st.get("worker_memory_mb") or {}
            print(
                f"  [{st.get('age_s', 0):7.1f} s] {st['session_id'][:8]} {st.get('state')}: "
                f"{st.get('fps')} fps, chunk {st.get('chunk_latency_ms_p50')} ms p50, "
                f"underruns {st.get('underruns', {}).get('video')}, worker rss {mem.get('rss_mb')} MB"
                + (f", cuda {mem['cuda_mb']} MB" if mem.get("cuda_mb") is not None else ""),
                file=sys.stderr,
                flush=True,
            )


def _timeline_summary(reports: list[dict]) -> dict:
    """Across sessions, from their reports' timelines: the worst full window's fps, the largest chunk
    latency p50 of any full window against the first one's, and the worker memory growth."""
    full = [[w for w in r.get("timeline") or [] if not w.get("partial")] for r in reports]
    fps = [w["fps"] for ws in full for w in ws if w.get("fps") is not None]
    first = [
        ws[0]["chunk_latency_ms_p50"] for ws in full if ws and ws[0].get("chunk_latency_ms_p50") is not None
    ]
    worst = [
        max(w["chunk_latency_ms_p50"] for w in ws if w.get("chunk_latency_ms_p50") is not None)
        for ws in full
        if any(w.get("chunk_latency_ms_p50") is not None for w in ws)
    ]
    growth = [r.get("worker_memory_growth_mb") or {} for r in reports]
    rss = [g["rss_mb"] for g in growth if g.get("rss_mb") is not None]
    cuda = [g["cuda_mb"] for g in growth if g.get("cuda_mb") is not None]
    return {
        "full_windows": sum(len(ws) for ws in full),
        "fps_min_window": round(min(fps), 2) if fps else None,
        "chunk_latency_ms_p50_first_window": _p50(first),
        "chunk_latency_ms_p50_worst_window": max(worst) if worst else None,
        "worker_rss_growth_mb_max": max(rss) if rss else None,
        "worker_cuda_growth_mb_max": max(cuda) if cuda else None,
    }


def _workers(cfg: dict) -> list[dict]:
    """The server's worker groups as recorded: device, fast path, warm-up, lead (GET /config)."""
    keep = (
        "index",
        "device",
        "lead_ms",
        "build_ms",
        "fast_path",
        "recipe",
        "notes",
        "warmup",
        "frame_transport",
        "frames_per_chunk",
        "audio_samples_per_chunk",
        "gpu_memory",
        "share",
        "mps",
    )
    return [{k: w.get(k) for k in keep} for w in cfg.get("workers") or []]


def _sharing(cfg: dict) -> dict:
    """What the server's groups share (GET /config's workers): per shared placement its groups, measured
    capacity and memory; the capacity in all (None: nothing measured); whether the workers ran under MPS."""
    shares = {}
    for w in cfg.get("workers") or []:
        if w.get("share"):
            shares[w["share"]["placement"]] = w["share"]
    caps = [s["capacity"] for s in shares.values()]
    return {
        "groups": len(cfg.get("workers") or []),
        "shares": list(shares.values()),
        "server_capacity": sum(caps) if caps and None not in caps else None,
        "mps": any(w.get("mps") for w in cfg.get("workers") or []),
    }


def _fleet(args, n: int):
    """``--ray``: (FleetConfig, LocalCluster or None) for ``n`` groups."""
    from cadence.fleet.config import FleetConfig, fleet_placement

    cluster = None
    address = args.ray
    if args.ray == "local":
        from cadence.fleet.cluster import LocalCluster

        cluster = LocalCluster(num_cpus=1).start()
        try:
            for _ in range(n - 1):
                cluster.add_node(num_cpus=1)
        except BaseException:
            cluster.stop()
            raise
        address = cluster.address
    return FleetConfig(address=address, groups=n, placement=fleet_placement(args.device, args.tp)), cluster


def main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    args = parse(argv)
    if args.find_capacity or len(args.sessions) > 1:
        return _sweep(args)
    n = args.sessions[0]
    try:
        out = _run(args, n, None)
    except _StartFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if not out["errors"] else 1


class _StartFailed(Exception):
    """The self-started server could not be built or started (its one line)."""


def _run(args, n: int, url: str | None, groups_note: str = "", server_pid: int | None = None) -> dict:
    """``n`` clients against ``url`` (None: a server started here for them, stopped after; else
    ``server_pid``, when known, is its process): printed and recorded; ``{"results", "errors", "cfg"}``.
    ``_StartFailed`` when the server cannot start."""
    from cadence.errors import CadenceError

    srv = cluster = None
    if url is None:
        try:
            srv, cluster = _start_server(args, n)
        except (CadenceError, RuntimeError) as e:
            raise _StartFailed(" ".join(str(e).split())) from None
        url = srv.url
        server_pid = srv.proc.pid if isinstance(srv, ServerProcess) else os.getpid()
    try:
        cfg, results, cpu = _watch(args, n, url, server_pid)
    finally:
        if srv is not None:
            srv.stop()
        if cluster is not None:
            cluster.shutdown()  # its fleet's groups removed, then the cluster
    res, ok, errors = _results(args, n, cfg, results, srv is not None or args.url is None, url)
    res["cpu"] = cpu
    _print_results(args, n, cfg, res, ok, errors)
    if not args.no_record:
        _record(args, n, cfg, res, ok, groups_note)
    return {"results": res, "errors": errors, "cfg": cfg}


def _watch(args, n: int, url: str, server_pid: int | None) -> tuple[dict, list, dict]:
    """The ``n`` viewers watch ``url`` (in this process, or spread over ``--viewer-procs`` processes:
    ``cadence.bench.serve_viewers``): (the server's /config, the viewers' results, each side's CPU seconds per
    wall second: ``server`` (None: not known), ``viewers`` (one per viewer process))."""
    from cadence.bench.serve_viewers import CpuProbe, default_viewer_procs, drive_spread

    procs = min(n, args.viewer_procs or default_viewer_procs(n))
    kw = {
        "seconds": args.seconds,
        "speak_after": args.speak_after,
        "speak_every": args.speak_every,
        "speak_jitter": args.speak_jitter,
        "progress_every": args.progress_every,
        "video_codec": args.video_codec,
    }
    server = CpuProbe(server_pid)
    if procs <= 1:
        mine = CpuProbe(os.getpid())
        cfg, results = asyncio.run(_drive(url, n, **kw))
        viewers = [mine.done()]
    else:
        cfg, results, viewers = drive_spread(_drive, url, n, procs, kw, timeout_s=args.seconds + 300)
    # (the server in the viewers' own process: one figure for both sides' work)
    shared = procs <= 1 and server_pid == os.getpid()
    return cfg, results, {"server": server.done(), "viewers": viewers, "server_with_viewers": shared}


def search_capacity(trial: Callable[[int], bool], max_n: int, start: int = 1) -> tuple[int, dict[int, bool]]:
    """The largest n in 1..``max_n`` for which ``trial(n)`` holds (0: not even 1), assuming it holds up to some
    n and not beyond: from ``start``, up by steps of 1, 2, 4, ... while it holds (down by 1, 2, 4, ... while it
    does not), then halving the interval between the last n that held and the first that did not. A good
    ``start`` (a measured capacity) costs two trials. Returns (n, every trial's outcome)."""
    seen: dict[int, bool] = {}

    def held(n: int) -> bool:
        if n not in seen:
            seen[n] = bool(trial(n))
        return seen[n]

    n = min(max(1, start), max_n)
    step, lo, hi = 1, 0, max_n + 1
    if held(n):
        lo = n
        while lo < max_n and hi == max_n + 1:
            m = min(max_n, lo + step)
            lo, hi = (m, hi) if held(m) else (lo, m)
            step *= 2
    else:
        hi = n
        while hi > 1 and lo == 0:
            m = max(1, hi - step)
            lo, hi = (m, hi) if held(m) else (lo, m)
            step *= 2
    while hi - lo > 1:
        m = (lo + hi) // 2
        lo, hi = (m, hi) if held(m) else (lo, m)
    return lo, seen


def _sweep(args) -> int:
    """``--sessions N,N,...`` / ``--find-capacity``: one run per N (a fresh server each, or one server for
    all: ``--one-server`` or ``--url``), then a summary: every N's figures and the largest N that held the
    target (printed, and recorded unless ``--no-record``). A run whose server cannot start did not hold."""
    rows: list[dict] = []
    srv, url, note, max_n, start = None, args.url, "", args.max_n, 1
    if args.one_server and url is None:
        top = args.max_n if args.find_capacity else max(args.sessions)
        try:
            srv, _ = _start_server(args, top, memory_fit="trim")
        except Exception as e:  # (CadenceError, RuntimeError: its one line)
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        url = srv.url
    pid = srv.proc.pid if isinstance(srv, ServerProcess) else (os.getpid() if srv is not None else None)
    try:
        if url is not None:  # what the one server holds: its groups, the capacity it measured
            sh = _sharing(_get_config(url))
            max_n, note = min(max_n, sh["groups"]), f"-of{sh['groups']}"
            start = sh["server_capacity"] or 1

        def trial(n: int) -> bool:
            if url is not None and n > max_n:
                rows.append({"sessions": n, "holds_target": False, "error": f"the server has {max_n} groups"})
                return False
            try:
                if url is not None:
                    _wait_idle(url)
                r = _run(args, n, url, note, pid)["results"]
            except _StartFailed as e:
                print(f"  {n} session(s): the server did not start ({e})", file=sys.stderr)
                rows.append({"sessions": n, "holds_target": False, "error": str(e)})
                return False
            rows.append(_row(r))
            return r["holds_target"]

        if args.find_capacity:
            best, _ = search_capacity(trial, max_n, start)
        else:
            best = max([n for n in args.sessions if trial(n)], default=0)
    finally:
        if srv is not None:
            srv.stop()
    _summary(args, rows, best, note, srv is not None)
    return 0


def _row(r: dict) -> dict:
    keys = (
        "sessions",
        "holds_target",
        "target_fps",
        "fps_min",
        "fps_mean",
        "share_sessions_ge_target",
        "sessions_fresh_fps",
        "underruns",
        "chunks_audio_only",
        "chunk_latency_ms_p50",
        "ttff_ms_p50",
        "errors",
        "groups",
        "server_capacity",
        "mps",
    )
    return {k: r.get(k) for k in keys}


def _summary(args, rows: list[dict], best: int, note: str, one_server: bool) -> None:
    """The sweep's table and its record (bench ``serve``, variant ``capacity`` or ``sweep``)."""
    import torch

    from cadence.bench.common import print_table, record

    rows = sorted(rows, key=lambda r: r["sessions"])
    target = next((r.get("target_fps") for r in rows if r.get("target_fps")), args.target_fps)
    print_table(
        [
            (
                str(r["sessions"]),
                ("holds" if r["holds_target"] else "no")
                + f", fps min {r.get('fps_min')}, underruns {r.get('underruns')}, errors {r.get('errors')}"
                + (f": {r['error']}" if r.get("error") else ""),
            )
            for r in rows
        ],
        f"bench serve sweep: the largest N at which every session holds the target: {best}",
    )
    if args.no_record:
        return
    res = {
        "capacity": best,
        "target_fps": target,
        "seconds": args.seconds,
        "find_capacity": bool(args.find_capacity),
        "one_server": one_server or args.url is not None,
        "max_n": args.max_n,
        "server_capacity": next((r.get("server_capacity") for r in rows if r.get("server_capacity")), None),
        "mps": bool(args.mps),
        "rows": rows,
    }
    path = record(
        "serve",
        args.model,
        args.tp,
        torch.device("cuda:0" if args.device == "cuda" else "cpu"),
        {},
        res,
        variant=("capacity" if args.find_capacity else "sweep") + note + ("-mps" if args.mps else ""),
        out_dir=results_dir(args),
        headline=f"capacity {best} session(s) at >= {target} fresh fps each ({len(rows)} runs)",
    )
    print(f"wrote {path}")


def _get_config(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/config", timeout=30.0).json()


def _wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until the server's every group is free again (the last run's sessions closed and released)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = httpx.get(f"{url}/healthz", timeout=10.0).json()
        if h.get("sessions") == 0 and h.get("free") == h.get("groups"):
            return
        time.sleep(0.2)


def _gpu_sets(args) -> int:
    """The sets of ``--tp`` GPUs the self-started server's groups can go on (0 on the CPU)."""
    import torch

    if args.device != "cuda" or not torch.cuda.is_available():
        return 0
    gpus = torch.cuda.device_count() - (args.decode_gpu is not None)
    return max(1, gpus // max(1, args.tp))


def _start_server(args, n: int, memory_fit: str = "error"):
    """The self-started server for ``n`` sessions (its worker groups in their own processes; ``--ray``: a fleet
    front end): ``(ServerThread, LocalCluster or None)``. On CUDA the groups go on as few GPUs as hold them
    evenly (``--sessions-per-gpu`` to say how many per GPU). A ``CadenceError`` for what cannot be built."""
    import torch

    from cadence.engine.recipe import resolve
    from cadence.serve.config import ServeConfig, serve_groups, share_words
    from cadence.serve.server import ServerThread

    gpus = torch.cuda.device_count() if args.device == "cuda" and torch.cuda.is_available() else 0
    size = size_overrides(args)
    spec = spec_from_args(args, overrides={"stream": size} if size else None)
    sets = _gpu_sets(args)
    per_gpu = args.sessions_per_gpu or (-(-n // sets) if sets else 1)
    groups = serve_groups(
        args.device, spec.tp, n, gpus, spec.decode_gpu, per_gpu if args.device == "cuda" else 1
    )
    print(resolve(spec, groups[0]).describe().text(), file=sys.stderr)  # what group 0 builds
    extra = {"lead_ms": args.lead_ms} if args.lead_ms is not None else {}
    if not getattr(args, "cut_in", True):
        extra["cut_in"] = False
    cluster = None
    if args.ray:
        fleet, cluster = _fleet(args, n)
        extra["deployment"] = fleet
    start_timeout = args.start_timeout or (600.0 if args.device == "cuda" else 120.0)
    cfg = ServeConfig(
        engine=spec,
        port=0,
        groups=groups,
        max_duration_s=args.seconds + 120,
        worker_start_timeout_s=start_timeout,
        timeline_window_s=args.window_s,
        frame_transport=args.frame_transport,
        memory_fit=memory_fit,
        **share_words(args),
        **extra,
    )
    kind = ServerProcess if _own_process(args) else ServerThread
    srv = kind(cfg).start(
        timeout=2 * start_timeout + 120
    )  # (a shared GPU: two starts, the capacity measured)
    print(
        f"server: {srv.url} ({spec.model}, {len(groups)} group(s) on {args.device}"
        + (", its own process" if kind is ServerProcess else "")
        + (f", {per_gpu} per GPU" if args.device == "cuda" and per_gpu > 1 else "")
        + (f", a Ray fleet at {extra['deployment'].address}" if args.ray else "")
        + ")",
        file=sys.stderr,
    )
    return srv, cluster


def _own_process(args) -> bool:
    """Whether the self-started server runs in a process of its own: ``--server-process`` (default: for a
    sweep, where many sessions' video is encoded by the server and decoded by the clients; in one
    process they would share one interpreter, and the clients' work would count against the server)."""
    if args.server_process is not None:
        return args.server_process and not args.ray
    return (args.find_capacity or len(args.sessions) > 1) and not args.ray


class ServerProcess:
    """A :class:`~cadence.serve.server.ServerThread` in a spawned process of its own (``url``, ``start``,
    ``stop``, as the thread's): the server's event loop and encoders get their own interpreter, the clients
    theirs. Not daemonic (the server starts its worker processes)."""

    def __init__(self, cfg):
        self.cfg, self.url, self.proc, self.conn = cfg, "", None, None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve_here, args=(self.cfg, child, timeout), name="cadence-bench-server"
        )
        self.proc.start()
        child.close()
        if not self.conn.poll(timeout + 30):
            self.stop()
            raise RuntimeError(f"the server did not start within {timeout:.0f} s")
        try:
            what, text = self.conn.recv()
        except EOFError:
            what, text = "error", f"the server process exited ({self.proc.exitcode})"
        if what != "url":
            self.stop()
            raise RuntimeError(text)
        self.url = text
        return self

    def stop(self, timeout: float = 120.0) -> None:
        if self.proc is None:
            return
        try:
            self.conn.send("stop")
            self.conn.poll(timeout)
        except (OSError, EOFError, BrokenPipeError):
            pass
        self.proc.join(10.0)
        if self.proc.is_alive():  # pragma: no cover - a server that did not stop in time
            self.proc.kill()
            self.proc.join(5.0)
        self.conn.close()
        self.proc = None


def _serve_here(cfg, conn, timeout: float) -> None:  # pragma: no cover - the server's own process
    import logging

    from cadence.serve.server import ServerThread

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        srv = ServerThread(cfg).start(timeout=timeout)
    except Exception as e:
        conn.send(("error", " ".join(str(e).split())))
        return
    conn.send(("url", srv.url))
    try:
        conn.recv()  # "stop", or the bench gone (EOF)
    except (EOFError, OSError):
        pass
    srv.stop()
    try:
        conn.send(("stopped", ""))
    except (OSError, BrokenPipeError):
        pass
    # leave without the interpreter's teardown: the server is stopped and its workers gone; the native parts
    # of what it imported would only print leak reports at exit (as the workers leave: cadence.engine.worker)
    sys.stderr.flush()
    os._exit(0)


def _session_figures(cfg: dict, ok: list, results: list, target: float) -> dict:
    """Each session's fresh fps at the client and underruns (failed sessions: 0 fps, None underruns), the
    share at ``target``, and whether the run holds it (no failure, every session >= target, no underrun)."""
    step = 90_000 // int(cfg.get("fps") or 24)
    fps, under = [], []
    for r in results:
        good = not (r.error or r.status_code != 201)
        n, sec, _ = r.fresh(step) if good else (0, 0.0, [])
        fps.append(round(n / sec, 2) if sec > 0 else 0.0)
        u = r.report.get("underruns", {}) if good else None
        under.append(u.get("video", 0) + u.get("audio", 0) if u is not None else None)
    holds = len(ok) == len(results) and all(f >= target for f in fps) and not any(under)
    return {
        "target_fps": target,
        "sessions_fresh_fps": fps,
        "sessions_underruns": under,
        "share_sessions_ge_target": round(sum(f >= target for f in fps) / len(fps), 3) if fps else 0.0,
        "holds_target": holds,
    }


def _results(args, n: int, cfg: dict, results, started: bool, url: str) -> tuple[dict, list, list[str]]:
    """The docs/benchmarks.md ``serve`` keys (and more) over the sessions: ``(results, sessions ok, errors)``."""
    errors = [r.error or f"HTTP {r.status_code}" for r in results if r.error or r.status_code != 201]
    ok = [r for r in results if not (r.error or r.status_code != 201)]
    # what the viewer got: fresh frames (pixels differing from the frame before) per second of stream, at the
    # client; failed sessions count as 0. The server's own count (fps_mean of its report) is kept beside it.
    step = 90_000 // int(cfg.get("fps") or 24)
    fresh = [r.fresh(step) for r in ok]
    fps = [n_ / s if s > 0 else 0.0 for n_, s, _ in fresh] + [0.0] * (len(results) - len(ok))
    per_s = [x for _, _, per in fresh for x in per]
    agent = [x for r in ok for x in r.report.get("agent_audio_to_frame_ms", [])]
    target = args.target_fps if args.target_fps is not None else float(cfg.get("fps") or 24) - 0.5
    res = {
        "sessions": n,
        "seconds": args.seconds,
        "fps_mean": round(statistics.fmean(fps), 2),
        "fps_min": round(min(fps), 2),
        "share_sessions_ge_23_5fps": round(sum(f >= 23.5 for f in fps) / len(fps), 3),
        **_session_figures(cfg, ok, results, target),
        "fresh_fps_per_second_min": min(per_s) if per_s else None,
        "share_seconds_ge_23_5fps": round(sum(x >= 23.5 for x in per_s) / len(per_s), 3) if per_s else None,
        "decoded_fps_mean": round(statistics.fmean([r.video_fps() for r in ok]), 2) if ok else 0.0,
        "server_fps_mean": round(statistics.fmean([r.report.get("fps_mean", 0.0) for r in ok]), 2)
        if ok
        else 0.0,
        "ttff_ms_p50": _p50([r.ttff_ms for r in ok]),
        "server_ttff_ms_p50": _p50([r.report.get("ttff_ms") for r in ok]),
        "agent_audio_to_frame_ms_p50": _p50(agent),
        "av_offset_ms_p50": _p50([r.report.get("av_offset_ms") for r in ok]),
        "underruns": sum(
            r.report.get("underruns", {}).get("video", 0) + r.report.get("underruns", {}).get("audio", 0)
            for r in ok
        ),
        **_chunk_figures(ok),
        "decode_gpu": getattr(args, "decode_gpu", None),
        "agent_samples": len(agent),
        # what the worker sustains back to back (its warm-up): the capacity per chunk, decode overlapped
        "worker_interval_ms": _p50([((w.get("warmup") or {}).get("interval_ms")) for w in _workers(cfg)]),
        "video_codec": sorted({r.report.get("video_codec") or "?" for r in ok}),
        "timeline_window_s": ok[0].report.get("timeline_window_s") if ok else None,
        **_timeline_summary([r.report for r in ok]),
        **_sharing(cfg),
        "errors": len(errors),
        "error_messages": errors[:10],
        "server": "self-started" if started else url,
        "ray": args.ray,
    }
    return res, ok, errors


def _chunk_figures(ok: list) -> dict:
    """The chunks' figures over the sessions (from their reports): deadline misses, latencies, the worker's
    stage times, skipped and audio-only chunks."""
    rep = [r.report for r in ok]
    done = sum(r.get("chunks", {}).get("done", 0) for r in rep)
    misses = sum(r.get("deadline_misses", 0) for r in rep)
    return {
        "deadline_misses": misses,
        # a deadline miss = a chunk back after its playout time at the session's lead (not a latency above
        # one chunk of media); the rate is over the chunks that came back
        "chunks_done": done,
        "deadline_miss_rate": round(misses / max(1, done), 4),
        "chunk_latency_ms_p50": _p50([r.get("chunk_latency_ms_p50") for r in rep]),
        "chunk_latency_ms_p99": _p50([r.get("chunk_latency_ms_p99") for r in rep]),
        "diffusion_ms_p50": _p50([r.get("diffusion_ms_p50") for r in rep]),
        "decode_ms_p50": _p50([r.get("decode_ms_p50") for r in rep]),
        "lead_ms": _p50([r.get("lead_ms") for r in rep]),
        "worker_open_ms_p50": _p50([r.get("worker_open_ms") for r in rep]),
        "sessions_preopened": sum(bool(r.get("worker_preopened")) for r in rep),
        "chunks_skipped": sum(r.get("chunks", {}).get("skipped", 0) for r in rep),
        "chunks_audio_only": sum(r.get("chunks", {}).get("audio_only", 0) for r in rep),
        "cut_ins": sum(r.get("chunks", {}).get("cut_ins", 0) for r in rep),
        "cut_in_fallback_frames": sum(r.get("chunks", {}).get("cut_in_fallback_frames", 0) for r in rep),
        # the worker's own time per chunk (request -> frames), and what it would be serial (diffusion + decode)
        # or perfectly overlapped (the slower stage): the one engine overlaps decode with the next diffusion
        "worker_work_ms_p50": _p50([(r.get("worker") or {}).get("work_ms_p50") for r in rep]),
        "worker_serial_ms_p50": _p50([(r.get("worker") or {}).get("serial_ms_p50") for r in rep]),
        "worker_overlapped_ms_p50": _p50([(r.get("worker") or {}).get("overlapped_ms_p50") for r in rep]),
    }


def _print_results(args, n: int, cfg: dict, res: dict, ok: list, errors: list[str]) -> None:
    from cadence.bench.common import print_table

    print_table(
        [(k, str(v)) for k, v in res.items() if k not in ("error_messages", "shares")],
        f"bench serve: {n} session(s), {args.seconds:.0f} s, preset {cfg.get('preset')}",
    )
    print(
        f"  each session's fresh fps (target {res['target_fps']}): {res['sessions_fresh_fps']}; underruns "
        f"{res['sessions_underruns']}: {'holds' if res['holds_target'] else 'does not hold'} the target"
    )
    for sh in res.get("shares") or []:
        print(
            f"  {sh['placement']}: {sh['groups']} groups, capacity {sh['capacity']} "
            f"({'enforced' if sh['enforced'] else 'reported'}), measured {sh['measured']}, memory {sh['memory']}"
        )
    for w in _workers(cfg):
        warm = w.get("warmup") or {}
        print(
            f"  worker {w['index']} ({w['device']}): lead {w['lead_ms']} ms, frames via {w['frame_transport']}, "
            f"fast path {w['fast_path']}, warm-up {warm.get('ms')} ms / {warm.get('chunks')} chunks, "
            f"steady chunk {warm.get('steady_chunk_ms')} ms, slowest {warm.get('slowest_chunk_ms')} ms"
            + "".join(f"; {n_}" for n_ in w.get("notes") or ())
        )
    timeline = ok[0].report.get("timeline") or [] if ok else []
    if len(timeline) > 1:
        print(f"  session 1, window by window ({res['timeline_window_s']} s):")
        for w in timeline:
            print(
                f"    {w['t_s']:7.1f} s +{w['seconds']:5.1f}: {w['fps']} fps, {w['chunks']} chunks, chunk p50 "
                f"{w['chunk_latency_ms_p50']} max {w['chunk_latency_ms_max']} ms, underruns {w['underruns_video']}, "
                f"worker rss {w.get('worker_rss_mb')} MB" + (" (partial)" if w.get("partial") else "")
            )
    for e in errors[:10]:
        print(f"  error: {e}", file=sys.stderr)


def _shape(cfg: dict) -> dict:
    keys = ("width", "height", "fps", "frames_per_chunk", "audio_samples_per_chunk", "chunk_ms")
    return {k: cfg.get(k) for k in keys}


def _world(args, cfg: dict) -> int:
    """The GPUs the server's groups held (+ the decode GPU), for the record's machine size (1 on the CPU)."""
    if args.device != "cuda":
        return 1
    devices = {d for w in cfg.get("workers") or [] for d in str(w.get("device", "")).split("+")}
    return max(1, len(devices)) + (args.decode_gpu is not None)


def _record(args, n: int, cfg: dict, res: dict, ok: list, groups_note: str = "") -> None:
    import torch

    from cadence.bench.common import record

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    headline = (
        f"{n} session(s): fresh fps mean {res['fps_mean']} min {res['fps_min']} "
        f"(decoded {res['decoded_fps_mean']}), {res['share_sessions_ge_target']:.0%} >= {res['target_fps']}, "
        f"ttff p50 {res['ttff_ms_p50']} ms, speech->frame p50 {res['agent_audio_to_frame_ms_p50']} ms, "
        f"chunk latency p50/p99 {res['chunk_latency_ms_p50']}/{res['chunk_latency_ms_p99']} ms, "
        f"deadline misses {res['deadline_misses']}/{res['chunks_done']} at lead {res['lead_ms']} ms"
    )
    path = record(
        "serve",
        cfg.get("preset", args.model),
        args.tp,
        device,
        _shape(cfg),
        res,
        variant=f"s{n}"
        + groups_note
        + ("-compile" if args.fast_compile else "")
        + (f"-{args.seconds:.0f}s" if args.seconds >= 120 else "")  # a soak has a file of its own
        + (f"-{args.video_codec.lower()}" if args.video_codec else "")
        + ("-ray" if args.ray else "")
        + ("-mps" if args.mps else "")
        + (f"-{args.fast_decoder}" if args.fast_decoder else "")
        + (f"-dec{args.decode_gpu}" if args.decode_gpu is not None else "")
        + ("-no-cut-in" if not getattr(args, "cut_in", True) else ""),
        out_dir=results_dir(args),
        world=_world(args, cfg),
        headline=headline,
        extra={
            "workers": _workers(cfg),
            "recipe": (cfg.get("workers") or [{}])[0].get("recipe"),
            "timelines": [r.report.get("timeline") for r in ok],
            "worker_chunks": [r.report.get("worker_chunks") for r in ok],
        },
    )
    print(f"wrote {path}")
