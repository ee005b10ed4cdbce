"""`cadence bench serve`: N WebRTC clients (aiortc) against a live ``cadence serve``.

    cadence bench serve --sessions 1 --seconds 10                        # starts its own server (CPU)
    cadence bench serve --preset w1.3 --device cuda --sessions 1 --seconds 20 --speak-every 3   # one H200
    cadence bench serve --url http://127.0.0.1:8000 --sessions 4 --seconds 30   # a running server
    cadence bench serve --ray local --sessions 2 --seconds 20   # the same through a Ray fleet (cadence.fleet)

Each client offers what the page offers (recvonly video, sendrecv audio with a silent microphone),
receives the character for ``--seconds`` after its first frame, pushes 1 s of synthetic speech after
``--speak-after`` seconds (POST /sessions/{id}/audio; the agent's first audio -> first speaking frame
is timed by the server), then closes its session and reads the report. Per session: fps, time to first
frame (client: POST -> first decoded frame), A/V offset (server: video minus audio pacing lag),
underruns. The fps figures and the share of sessions at >= 23.5 fps are *fresh* frames at the
client (``fps_mean``: frames whose pixels differ from the one before, per second of stream:
``ClientResult.fresh``), beside the frames decoded (``decoded_fps_mean``) and the server's own count
(``server_fps_mean``). Results per docs/benchmarks.md (bench "serve"). Without ``--url`` the server runs
in this process (its worker groups in their own processes): ``--sessions`` CPU slots, or one per GPU
with ``--device cuda``; on CUDA the workers run the engine's fast path (TAEHV decoder, ring cache
with FP8 K/V, FP8 linears, CUDA graphs) and warm up before the server accepts sessions (the warm-up
time and the worker's steady chunk time are recorded under ``workers``). The stream geometry recorded
in ``shape`` (frames and audio samples per chunk, size, fps) is the server's, from ``GET /config``.
Loopback only. Each client reads its own session with the token the server returned (the progress
lines too); a ``--url`` server that needs its operator key gets it from ``CADENCE_API_KEY``.

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

from cadence.bench.common import add_size_flags, size_overrides
from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_engine_flags, spec_from_args
from cadence.serve.config import add_serve_flags


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1, help="concurrent sessions (clients)")
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
    add_serve_flags(p)
    add_record_flags(p)
    a = p.parse_args(argv)
    if a.sessions < 1:
        p.error(f"--sessions must be >= 1, got {a.sessions}")
    if not 1.0 <= a.seconds <= 3600:
        p.error(f"--seconds must be within 1..3600, got {a.seconds}")
    return a


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
        try:
            results = await asyncio.gather(
                *(
                    run_client(
                        url,
                        seconds,
                        http=http,
                        speak_wav=speech,
                        speak_after_s=speak_after,
                        speak_every_s=speak_every,
                        speak_jitter_s=speak_jitter,
                        video_codec=video_codec,
                        api_key=api_key,
                        created=c,
                    )
                    for c in created
                )
            )
        finally:
            if progress is not None:
                progress.cancel()
    return cfg, results


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
    )
    return [{k: w.get(k) for k in keep} for w in cfg.get("workers") or []]


def _fleet(args):
    """``--ray``: (FleetConfig, LocalCluster or None)."""
    from cadence.fleet.config import FleetConfig, fleet_placement

    cluster = None
    address = args.ray
    if args.ray == "local":
        from cadence.fleet.cluster import LocalCluster

        cluster = LocalCluster(num_cpus=1).start()
        try:
            for _ in range(args.sessions - 1):
                cluster.add_node(num_cpus=1)
        except BaseException:
            cluster.stop()
            raise
        address = cluster.address
    return FleetConfig(
        address=address, groups=args.sessions, placement=fleet_placement(args.device, args.tp)
    ), cluster


def main(argv: list[str]) -> int:
    import logging

    from cadence.errors import CadenceError

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    args = parse(argv)
    srv = cluster = None
    url = args.url
    if url is None:
        try:
            srv, cluster = _start_server(args)
        except CadenceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        url = srv.url
    try:
        cfg, results = asyncio.run(
            _drive(
                url,
                args.sessions,
                args.seconds,
                args.speak_after,
                args.speak_every,
                args.speak_jitter,
                args.progress_every,
                args.video_codec,
            )
        )
    finally:
        if srv is not None:
            srv.stop()
        if cluster is not None:
            cluster.shutdown()  # its fleet's groups removed, then the cluster
    res, ok, errors = _results(args, cfg, results, srv, url)
    _print_results(args, cfg, res, ok, errors)
    if not args.no_record:
        _record(args, cfg, res, ok)
    return 0 if not errors else 1


def _start_server(args):
    """The self-started server (its worker groups in their own processes; ``--ray``: a fleet front end):
    ``(ServerThread, LocalCluster or None)``. A ``CadenceError`` for what cannot be built."""
    import torch

    from cadence.engine.recipe import resolve
    from cadence.serve.config import ServeConfig, serve_groups
    from cadence.serve.server import ServerThread

    gpus = torch.cuda.device_count() if args.device == "cuda" and torch.cuda.is_available() else 0
    size = size_overrides(args)
    spec = spec_from_args(args, overrides={"stream": size} if size else None)
    groups = serve_groups(args.device, spec.tp, args.sessions, gpus, spec.decode_gpu)
    print(resolve(spec, groups[0]).describe().text(), file=sys.stderr)  # what group 0 builds
    extra = {"lead_ms": args.lead_ms} if args.lead_ms is not None else {}
    cluster = None
    if args.ray:
        fleet, cluster = _fleet(args)
        extra["deployment"] = fleet
    start_timeout = args.start_timeout or (600.0 if args.device == "cuda" else 120.0)
    srv = ServerThread(
        ServeConfig(
            engine=spec,
            port=0,
            groups=groups,
            max_duration_s=args.seconds + 120,
            worker_start_timeout_s=start_timeout,
            timeline_window_s=args.window_s,
            frame_transport=args.frame_transport,
            **extra,
        )
    ).start(timeout=start_timeout + 60)
    print(
        f"server: {srv.url} ({spec.model}, {len(groups)} group(s) on {args.device}"
        + (f", a Ray fleet at {extra['fleet'].address}" if args.ray else "")
        + ")",
        file=sys.stderr,
    )
    return srv, cluster


def _results(args, cfg: dict, results, srv, url: str) -> tuple[dict, list, list[str]]:
    """The docs/benchmarks.md ``serve`` keys (and more) over the sessions: ``(results, sessions ok, errors)``."""
    errors = [r.error or f"HTTP {r.status_code}" for r in results if r.error or r.status_code != 201]
    ok = [r for r in results if not (r.error or r.status_code != 201)]
    # what the viewer got: fresh frames (pixels differing from the frame before) per second of stream, at the
    # client; failed sessions count as 0. The server's own count (fps_mean of its report) is kept beside it.
    step = 90_000 // int(cfg.get("fps") or 24)
    fresh = [r.fresh(step) for r in ok]
    fps = [n / s if s > 0 else 0.0 for n, s, _ in fresh] + [0.0] * (len(results) - len(ok))
    per_s = [x for _, _, per in fresh for x in per]
    agent = [x for r in ok for x in r.report.get("agent_audio_to_frame_ms", [])]
    res = {
        "sessions": args.sessions,
        "seconds": args.seconds,
        "fps_mean": round(statistics.fmean(fps), 2),
        "fps_min": round(min(fps), 2),
        "share_sessions_ge_23_5fps": round(sum(f >= 23.5 for f in fps) / len(fps), 3),
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
        "deadline_misses": sum(r.report.get("deadline_misses", 0) for r in ok),
        # a deadline miss = a chunk back after its playout time at the session's lead (not a latency above
        # one chunk of media); the rate is over the chunks that came back
        "chunks_done": sum(r.report.get("chunks", {}).get("done", 0) for r in ok),
        "deadline_miss_rate": round(
            sum(r.report.get("deadline_misses", 0) for r in ok)
            / max(1, sum(r.report.get("chunks", {}).get("done", 0) for r in ok)),
            4,
        ),
        "decode_gpu": getattr(args, "decode_gpu", None),
        "chunk_latency_ms_p50": _p50([r.report.get("chunk_latency_ms_p50") for r in ok]),
        "chunk_latency_ms_p99": _p50([r.report.get("chunk_latency_ms_p99") for r in ok]),
        "diffusion_ms_p50": _p50([r.report.get("diffusion_ms_p50") for r in ok]),
        "decode_ms_p50": _p50([r.report.get("decode_ms_p50") for r in ok]),
        "lead_ms": _p50([r.report.get("lead_ms") for r in ok]),
        "agent_samples": len(agent),
        "worker_open_ms_p50": _p50([r.report.get("worker_open_ms") for r in ok]),
        "sessions_preopened": sum(bool(r.report.get("worker_preopened")) for r in ok),
        "chunks_skipped": sum(r.report.get("chunks", {}).get("skipped", 0) for r in ok),
        "chunks_audio_only": sum(r.report.get("chunks", {}).get("audio_only", 0) for r in ok),
        # the worker's own time per chunk (request -> frames), and what it would be serial (diffusion + decode)
        # or perfectly overlapped (the slower stage): the one engine overlaps decode with the next diffusion
        "worker_work_ms_p50": _p50([(r.report.get("worker") or {}).get("work_ms_p50") for r in ok]),
        "worker_serial_ms_p50": _p50([(r.report.get("worker") or {}).get("serial_ms_p50") for r in ok]),
        "worker_overlapped_ms_p50": _p50(
            [(r.report.get("worker") or {}).get("overlapped_ms_p50") for r in ok]
        ),
        # what the worker sustains back to back (its warm-up): the capacity per chunk, decode overlapped
        "worker_interval_ms": _p50([((w.get("warmup") or {}).get("interval_ms")) for w in _workers(cfg)]),
        "video_codec": sorted({r.report.get("video_codec") or "?" for r in ok}),
        "timeline_window_s": ok[0].report.get("timeline_window_s") if ok else None,
        **_timeline_summary([r.report for r in ok]),
        "errors": len(errors),
        "error_messages": errors[:10],
        "server": "self-started" if srv is not None else url,
        "ray": args.ray,
    }
    return res, ok, errors


def _print_results(args, cfg: dict, res: dict, ok: list, errors: list[str]) -> None:
    from cadence.bench.common import print_table

    print_table(
        [(k, str(v)) for k, v in res.items() if k != "error_messages"],
        f"bench serve: {args.sessions} session(s), {args.seconds:.0f} s, preset {cfg.get('preset')}",
    )
    for w in _workers(cfg):
        warm = w.get("warmup") or {}
        print(
            f"  worker {w['index']} ({w['device']}): lead {w['lead_ms']} ms, frames via {w['frame_transport']}, "
            f"fast path {w['fast_path']}, warm-up {warm.get('ms')} ms / {warm.get('chunks')} chunks, "
            f"steady chunk {warm.get('steady_chunk_ms')} ms, slowest {warm.get('slowest_chunk_ms')} ms"
            + "".join(f"; {n}" for n in w.get("notes") or ())
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


def _record(args, cfg: dict, res: dict, ok: list) -> None:
    import torch

    from cadence.bench.common import record

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    shape = {
        "width": cfg.get("width"),
        "height": cfg.get("height"),
        "fps": cfg.get("fps"),
        "frames_per_chunk": cfg.get("frames_per_chunk"),
        "audio_samples_per_chunk": cfg.get("audio_samples_per_chunk"),
        "chunk_ms": cfg.get("chunk_ms"),
    }
    headline = (
        f"{args.sessions} session(s): fresh fps mean {res['fps_mean']} min {res['fps_min']} "
        f"(decoded {res['decoded_fps_mean']}), "
        f"ttff p50 {res['ttff_ms_p50']} ms, agent audio->frame p50 {res['agent_audio_to_frame_ms_p50']} ms, "
        f"chunk latency p50/p99 {res['chunk_latency_ms_p50']}/{res['chunk_latency_ms_p99']} ms, "
        f"deadline misses {res['deadline_misses']}/{res['chunks_done']} at lead {res['lead_ms']} ms"
    )
    path = record(
        "serve",
        cfg.get("preset", args.model),
        args.tp,
        device,
        shape,
        res,
        variant=f"s{args.sessions}"
        + ("-compile" if args.fast_compile else "")
        + (f"-{args.seconds:.0f}s" if args.seconds >= 120 else "")  # a soak has a file of its own
        + (f"-{args.video_codec.lower()}" if args.video_codec else "")
        + ("-ray" if args.ray else "")
        + (f"-{args.fast_decoder}" if args.fast_decoder else "")
        + (f"-dec{args.decode_gpu}" if args.decode_gpu is not None else ""),
        out_dir=results_dir(args),
        # the decode GPU (shared by every single-GPU group) counts in the machine's size
        world=(max(1, args.sessions) * args.tp + (args.decode_gpu is not None))
        if args.device == "cuda"
        else 1,
        headline=headline,
        extra={
            "workers": _workers(cfg),
            "recipe": (cfg.get("workers") or [{}])[0].get("recipe"),
            "timelines": [r.report.get("timeline") for r in ok],
            "worker_chunks": [r.report.get("worker_chunks") for r in ok],
        },
    )
    print(f"wrote {path}")
