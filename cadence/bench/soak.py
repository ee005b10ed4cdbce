"""`cadence bench soak`: sessions opened and closed one after another for minutes, with churn, against
`cadence serve`: the per-session reliability figure the published system reports.

    cadence bench soak --minutes 20 --record              # the CPU default, one session at a time
    cadence bench soak --minutes 5 --concurrency 2        # two at a time (the server gets 2 worker groups)
    cadence bench soak --url http://127.0.0.1:8000 --server-pid PID --minutes 5   # a running server

The published figure (docs/workloads.md): the worker averaged above 23.5 fps in 99.5% of the sessions that
streamed at least a second. Here each session is an aiortc client (``cadence.devtools.client``) offering what
the page offers; ``--concurrency`` of them run at once, each starting its next session as soon as its last
one ended, until ``--minutes`` are up (or ``--sessions`` were started). Every session draws, from a seeded
random generator, how long it watches (``--session-seconds``) and what kind of user it is (``--mix``):

* ``plain``: the default face and prompt (the worker has that session opened ahead);
* ``image``: uploads a random reference image (random size, PNG or JPEG): a fresh open in the worker;
* ``prompt``: a random prompt, and another one halfway (POST /prompt);
* ``say``: the ``say`` agent, typed text spoken by espeak-ng (POST /say; audio upload without espeak-ng);
* ``audio``: an audio upload (POST /audio, WAV speech);
* ``barge``: a long audio upload, interrupted (POST /interrupt) while it plays: barge-in;
* ``vanish``: leaves mid-session without DELETE (its peer connection closed): the server must notice;
* ``crash``: disappears mid-session without a word (its sockets closed: no DTLS close, no more packets, as a
  client whose process or network died): the server notices its silence (``PEER_SILENCE_S``, 8 s);
* ``ghost``: posts an offer and never connects: the server frees the slot after its connect timeout.

A session that finds the server full (503) waits, polling ``/healthz``, and tries again; the Retry-After it
was given is recorded beside the wait it really had. Per session, at the client: fresh fps (frames whose
pixels differ from the one before, per second of stream: ``ClientResult.fresh``), the fresh frames of every
whole second, time to first frame; from the server's report: underruns, deadline misses (each late chunk
with where its time went: plan -> worker, worker, back), chunks reduced to audio, the close reason. The
server process and its workers are sampled every ``--sample-every`` seconds from ``/proc``: RSS, threads,
open file descriptors, over time and as a slope, and after the first and the last session (no leak: RSS
within 10% of the first session's after the last).

Results per docs/benchmarks.md (bench "soak"); ``--record`` writes them under ``docs/perf/soak/``. The target
line: >= 99.5% of >= 200 sessions above 23.5 fresh fps, no leak (``docs/perf/soak/NOTES.md``). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass

from cadence.bench.results import add_record_flags, results_dir
from cadence.serve.pacing import STEAL_HEADROOM

KINDS = ("plain", "image", "prompt", "say", "audio", "barge", "vanish", "crash", "ghost")
DEFAULT_MIX = "plain=8,image=2,prompt=2,say=2,audio=2,barge=2,vanish=1,crash=0.5,ghost=0.5"
TARGET_FPS = 23.5
TARGET_SHARE = 0.995
TARGET_SESSIONS = 200
LEAK_PCT = 10.0
WORDS = "a person talking smiling calm bright face camera studio soft light warm portrait friendly".split()
SAYINGS = ("hello there", "nice to meet you", "the weather is fine today", "one two three four five")


def _mix(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, w = part.partition("=")
        name = name.strip()
        if name not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown session kind {name!r} (kinds: {', '.join(KINDS)})")
        try:
            out[name] = float(w) if w else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight of {name!r} is not a number: {w!r}") from None
        if out[name] < 0:
            raise argparse.ArgumentTypeError(f"weight of {name!r} must be >= 0, got {out[name]}")
    if sum(out.values()) <= 0:
        raise argparse.ArgumentTypeError("the mix needs at least one kind with a positive weight")
    return out


def _span(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(":")
    try:
        a, b = float(lo), float(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SECONDS or MIN:MAX, got {text!r}") from None
    if not 1.0 <= a <= b <= 3600:
        raise argparse.ArgumentTypeError(
            f"session seconds must satisfy 1 <= min <= max <= 3600, got {text!r}"
        )
    return a, b


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--minutes", type=float, default=5.0, help="how long to keep starting sessions (default 5)"
    )
    p.add_argument("--sessions", type=int, default=0, help="stop after this many sessions (0: no limit)")
    p.add_argument("--concurrency", type=int, default=1, help="sessions at once (default 1)")
    p.add_argument(
        "--session-seconds",
        type=_span,
        default=(2.0, 5.0),
        metavar="MIN:MAX",
        help="each session watches a uniform random time in this range after its first frame (default 2:5)",
    )
    p.add_argument(
        "--mix", type=_mix, default=_mix(DEFAULT_MIX), help=f"session kinds (default {DEFAULT_MIX})"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the session plan (default 0)")
    p.add_argument("--url", default=None, help="a running server (default: start `cadence serve` here)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: its process, to sample")
    p.add_argument("--preset", default="character", help="preset of the self-started server")
    p.add_argument("--serve-args", default="", help="extra arguments for the self-started `cadence serve`")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between /proc samples")
    p.add_argument("--start-timeout", type=float, default=240.0, help="seconds to wait for the server")
    p.add_argument("--progress-every", type=float, default=30.0, help="progress line every N s (0: none)")
    add_record_flags(p)
    a = p.parse_args(argv)
    if not 0 < a.minutes <= 24 * 60:
        p.error(f"--minutes must be within 0..1440, got {a.minutes}")
    if a.sessions < 0 or not 1 <= a.concurrency <= 64:
        p.error(f"--sessions must be >= 0 and --concurrency within 1..64, got {a.sessions}, {a.concurrency}")
    if a.sample_every <= 0:
        p.error(f"--sample-every must be positive, got {a.sample_every}")
    return a


# ---- what each session does ------------------------------------------------------------------------


@dataclass
class Plan:
    """One session's draw: its kind, how long it watches, and the seed of its random content."""

    index: int
    kind: str
    seconds: float
    seed: int


def plans(args: argparse.Namespace):
    """The session plan, drawn from ``--seed``: an endless sequence of :class:`Plan`."""
    rng = random.Random(args.seed)
    kinds, weights = zip(*[(k, w) for k, w in args.mix.items() if w > 0])
    lo, hi = args.session_seconds
    i = 0
    while True:
        yield Plan(i, rng.choices(kinds, weights)[0], round(rng.uniform(lo, hi), 2), rng.randrange(2**31))
        i += 1


def random_image(rng: random.Random) -> tuple[bytes, str]:
    """A random reference image: random size and aspect, random blocks, gradient and noise; PNG or JPEG."""
    import numpy as np
    from PIL import Image

    w, h = rng.randint(48, 640), rng.randint(48, 640)
    g = np.random.default_rng(rng.randrange(2**31))
    blocks = g.integers(0, 256, (rng.randint(2, 12), rng.randint(2, 12), 3), dtype=np.uint8)
    img = Image.fromarray(blocks).resize((w, h), Image.Resampling.BILINEAR)
    arr = np.asarray(img, np.float32) + g.normal(0, rng.uniform(0, 30), (h, w, 3))
    img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    buf = io.BytesIO()
    fmt = rng.choice(("PNG", "JPEG"))
    img.save(buf, format=fmt)
    return buf.getvalue(), "face.png" if fmt == "PNG" else "face.jpg"


def speech_wav(seconds: float, seed: int) -> bytes:
    from cadence.media import synthetic_speech
    from cadence.serve.agent import wav_bytes

    return wav_bytes(synthetic_speech(seconds, seed=seed).numpy())


# ---- the server's processes, sampled from /proc ------------------------------------------------------


def _proc_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc), parents first."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(kids.get(p, [])))
    return out


def _proc_figures(pid: int) -> dict | None:
    """RSS (MB), threads and open file descriptors of one process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        cpu_s = _cpu_seconds(pid)
    except OSError:
        return None
    return {
        "rss_mb": round(int(st["VmRSS"].split()[0]) / 1024, 1) if "VmRSS" in st else 0.0,
        "threads": int(st.get("Threads", "0").strip() or 0),
        "fds": fds,
        "cpu_s": cpu_s,
        "cmd": cmd,
    }


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of one process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / _TICK, 2)


def _machine_cpu() -> dict | None:
    """The machine's CPU seconds so far, all cores (/proc/stat): busy (user, nice, system, irq, softirq),
    idle (idle + iowait) and steal (time the hypervisor ran someone else while this VM wanted to run)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    v += [0] * (8 - len(v))
    return {
        "busy_s": round((v[0] + v[1] + v[2] + v[5] + v[6]) / _TICK, 2),
        "idle_s": round((v[3] + v[4]) / _TICK, 2),
        "steal_s": round(v[7] / _TICK, 2),
    }


def _proc_shares(a: dict, b: dict, dt: float) -> dict:
    """Cores each process used between samples a and b (1.0 = one core all the time)."""
    pa = {**a["procs"], "client": a.get("client") or {}}
    pb = {**b["procs"], "client": b.get("client") or {}}
    return {
        k: round((pb[k]["cpu_s"] - f["cpu_s"]) / dt, 3)
        for k, f in pa.items()
        if "cpu_s" in f and "cpu_s" in (pb.get(k) or {})
    }


def cpu_windows(samples: list[dict]) -> list[dict]:
    """Per interval between two samples: the machine's busy and steal share of all its cores' time and each
    process's CPU share (of one core), the soak's own client included: what a slow stretch can be told by."""
    out = []
    for a, b in zip(samples, samples[1:]):
        ma, mb = a.get("machine"), b.get("machine")
        dt = b["t"] - a["t"]
        if not ma or not mb or dt <= 0:
            continue
        total = sum(mb[k] - ma[k] for k in ("busy_s", "idle_s", "steal_s"))
        procs = _proc_shares(a, b, dt)
        out.append(
            {
                "t_from": a["t"],
                "t": b["t"],
                "busy": round((mb["busy_s"] - ma["busy_s"]) / total, 3) if total > 0 else None,
                "steal": round((mb["steal_s"] - ma["steal_s"]) / total, 3) if total > 0 else None,
                "cores_per_proc": procs,
            }
        )
    return out


class ProcSampler:
    """Samples the server process and its descendants every ``every`` seconds on a thread of its own (and
    at once with ``mark``): ``samples`` rows ``{"t": s, "mark": ..., "procs": {label: figures}}``. Labels:
    ``server``, ``worker-N`` (spawned worker processes, in the order first seen), ``other-PID``."""

    def __init__(self, pid: int | None, every: float):
        self.pid, self.every = pid, every
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self._labels: dict[int, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> ProcSampler:
        if self.pid is not None:
            self._thread.start()
        return self

    def _label(self, pid: int, cmd: str) -> str:
        if pid not in self._labels:
            if pid == self.pid:
                self._labels[pid] = "server"
            elif "spawn_main" in cmd:
                n = sum(v.startswith("worker-") for v in self._labels.values())
                self._labels[pid] = f"worker-{n}"
            else:
                self._labels[pid] = f"other-{pid}"
        return self._labels[pid]

    def mark(self, what: str | None = None) -> dict | None:
        if self.pid is None:
            return None
        procs = {}
        for p in _proc_tree(self.pid):
            f = _proc_figures(p)
            if f is not None and "resource_tracker" not in f["cmd"]:
                cmd = f.pop("cmd")
                procs[self._label(p, cmd)] = f
        row = {"t": round(time.monotonic() - self.t0, 2), "mark": what, "procs": procs}
        row["machine"] = _machine_cpu()
        try:
            row["client"] = {"cpu_s": _cpu_seconds("self")}  # the soak's own aiortc clients, same cores
        except OSError:
            pass
        with self._lock:
            self.samples.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.mark()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


# ---- one session -------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What every session of a run shares."""

    url: str
    http: object  # httpx.AsyncClient
    step: int  # the frame period in pts ticks
    say_ok: bool
    speech: dict[str, bytes]
    sampler: ProcSampler
    refusals: list[dict]


async def _post_session(ctx: Ctx, plan: Plan, rng: random.Random, sdp: str):
    """POST /sessions as the plan's kind asks (JSON, or a form with an image and a prompt)."""
    agent = "say" if plan.kind == "say" and ctx.say_ok else "mirror"
    fields = {"sdp": sdp, "type": "offer", "agent": agent}
    if plan.kind == "prompt":
        fields["prompt"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    if plan.kind == "image":
        data, name = random_image(rng)
        return await ctx.http.post(f"{ctx.url}/sessions", data=fields, files={"image": (name, data)})
    return await ctx.http.post(f"{ctx.url}/sessions", json=fields)


async def _actions(ctx: Ctx, plan: Plan, rng: random.Random, sid: str, auth: dict, t_end: float) -> list:
    """What the session's user does while it watches: speech, a prompt change, a barge-in. Returns the
    HTTP statuses of the requests that were not answered 200."""
    bad = []

    async def at(frac: float) -> None:
        await asyncio.sleep(max(0.0, t_end - time.monotonic()) * frac)

    async def req(path: str, **kw) -> None:
        headers = {**auth, **kw.pop("headers", {})}
        r = await ctx.http.post(f"{ctx.url}/sessions/{sid}{path}", headers=headers, **kw)
        if r.status_code != 200:
            bad.append(f"POST {path}: {r.status_code} {r.text[:200]}")

    wav = {"content-type": "audio/wav"}
    k = plan.kind
    if k == "say" and ctx.say_ok:
        await at(rng.uniform(0.05, 0.5))
        await req("/say", json={"text": rng.choice(SAYINGS)})
    elif k in ("say", "audio"):
        await at(rng.uniform(0.05, 0.5))
        await req("/audio", content=ctx.speech["short"], headers=wav)
    elif k == "prompt":
        await at(0.5)
        await req("/prompt", json={"prompt": " ".join(rng.choice(WORDS) for _ in range(6))})
    elif k == "barge":
        await at(rng.uniform(0.05, 0.3))
        await req("/audio", content=ctx.speech["long"], headers=wav)
        await asyncio.sleep(rng.uniform(0.4, 1.2))
        await req("/interrupt")
    return bad


async def _wait_free(ctx: Ctx, r) -> None:
    """The server said it is full (503) or this client has offers pending (429): record its Retry-After,
    then poll /healthz until a slot is free (at most 120 s), and record how long that really took."""
    t = time.monotonic()
    try:
        hint = int(r.headers.get("retry-after", "0"))
    except ValueError:
        hint = None
    while time.monotonic() - t < 120:
        await asyncio.sleep(0.25)
        h = (await ctx.http.get(f"{ctx.url}/healthz")).json()
        if h.get("free", 0) > 0:
            break
    ctx.refusals.append(
        {"status": r.status_code, "retry_after_s": hint, "waited_s": round(time.monotonic() - t, 2)}
    )


async def _report_when_closed(ctx: Ctx, sid: str, auth: dict, timeout: float) -> tuple[dict, float | None]:
    """A session the client left without DELETE: its report once the server has closed it, and how long
    that took (None: not within ``timeout``)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        r = await ctx.http.get(f"{ctx.url}/sessions/{sid}/report", headers=auth)
        if r.status_code == 200:
            return r.json(), round(time.monotonic() - t, 2)
        await asyncio.sleep(0.25)
    return {}, None


async def _poll_status(ctx: Ctx, sid: str, auth: dict, seen: dict) -> None:
    """What the page does while a session runs: GET its state every 0.5 s; counts the polls whose state
    said "reduced" (``degraded``)."""
    while True:
        await asyncio.sleep(0.5)
        r = await ctx.http.get(f"{ctx.url}/sessions/{sid}", headers=auth)
        if r.status_code == 200:
            seen["polls"] = seen.get("polls", 0) + 1
            seen["degraded"] = seen.get("degraded", 0) + bool(r.json().get("degraded"))


def _late_chunks(report: dict) -> list[dict]:
    """The chunks that came back after they were due, with where their time went."""
    keys = ("i", "budget_ms", "latency_ms", "to_worker_ms", "work_ms", "diffusion_ms", "decode_ms", "back_ms")
    return [
        {k: c.get(k) for k in keys}
        for c in report.get("worker_chunks") or []
        if c.get("budget_ms") is not None and (c.get("latency_ms") or 0) > c["budget_ms"]
    ]


def _figures(res, report: dict, step: int) -> dict:
    """A watched session's figures: the client's (fresh frames in stream time) and the server's report's."""
    n, secs, per = res.fresh(step)
    und = report.get("underruns") or {}
    chunks = report.get("chunks") or {}
    return {
        "watched_s": round(secs, 3),
        "fresh_frames": n,
        "frames_received": len(res.video),
        "fresh_fps": round(n / secs, 3) if secs > 0 else 0.0,
        "decoded_fps": round(res.video_fps(), 3),
        "per_second": per,
        "ttff_ms": round(res.ttff_ms, 1) if res.ttff_ms is not None else None,
        "server_fps": report.get("fps_mean"),
        "server_fresh_frames": report.get("video_frames_fresh"),
        "underruns": und.get("video"),
        "audio_underruns": und.get("audio"),
        "deadline_misses": report.get("deadline_misses"),
        "chunks_done": chunks.get("done"),
        "audio_only": chunks.get("audio_only"),
        "late_dropped": chunks.get("late_dropped"),
        "close_reason": report.get("close_reason"),
        "preopened": report.get("worker_preopened"),
        "lead_ms": report.get("lead_ms"),
        "chunk_latency_ms_p99": report.get("chunk_latency_ms_p99"),
        "late": _late_chunks(report),
        # every chunk: [index, latency, budget (plan -> due), worker time, plan -> worker, frames -> loop] ms
        "chunks": [
            [c.get(k) for k in ("i", "latency_ms", "budget_ms", "work_ms", "to_worker_ms", "back_ms")]
            for c in report.get("worker_chunks") or []
        ],
        "first_chunks": [
            {k: c.get(k) for k in ("i", "diffusion_ms", "decode_ms", "work_ms", "latency_ms")}
            for c in (report.get("worker_chunks") or [])[:3]
        ],
        "errors": report.get("errors") or [],
    }


def _drop_sockets(pc) -> None:
    """A client that dies: close its ICE sockets under aiortc (aioice's ``Connection._protocols``), so nothing
    more is sent or answered, not even a DTLS close (``pc.close()`` later finds them closed)."""
    for t in pc.getTransceivers():
        ice = getattr(t.sender.transport, "transport", None)
        for proto in getattr(getattr(ice, "_connection", None), "_protocols", []):
            if proto.transport is not None:
                proto.transport.close()


async def run_session(ctx: Ctx, plan: Plan) -> dict:
    """One session as its plan says (see the module docstring); returns its row."""
    from aiortc import RTCPeerConnection, RTCSessionDescription

    from cadence.devtools.client import ClientResult, MicTrack, read_track
    from cadence.serve.rtc import rtc_configuration

    rng = random.Random(plan.seed)
    row: dict = {"i": plan.index, "kind": plan.kind, "planned_s": plan.seconds}
    res, first, readers, tasks = ClientResult(), asyncio.Event(), [], []
    pc = RTCPeerConnection(rtc_configuration())
    pc.on("track", lambda tr: readers.append(asyncio.ensure_future(read_track(tr, res, first))))
    mic = MicTrack(None)
    try:
        pc.addTransceiver("video", direction="recvonly")
        pc.addTransceiver(mic, direction="sendrecv")
        await pc.setLocalDescription(await pc.createOffer())
        while True:
            res.t_post = time.monotonic()
            r = await _post_session(ctx, plan, rng, pc.localDescription.sdp)
            if r.status_code not in (429, 503):
                break
            await _wait_free(ctx, r)
        row["status"] = r.status_code
        if r.status_code != 201:
            row["error"] = f"POST /sessions: {r.status_code} {r.text[:300]}"
            return row
        body = r.json()
        sid, auth = body["session_id"], {"authorization": f"Bearer {body['token']}"}
        row["session_id"] = sid
        if plan.kind == "ghost":  # never connects: the peer connection is closed unanswered
            row["auth"] = auth
            return row
        await pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type=body["type"]))
        try:
            await asyncio.wait_for(first.wait(), timeout=30.0)
        except TimeoutError:
            row["error"] = f"no video within 30 s (connection {pc.connectionState})"
            await ctx.http.delete(f"{ctx.url}/sessions/{sid}", headers=auth)
            return row
        t_end = time.monotonic() + plan.seconds
        seen: dict = {}
        tasks.append(asyncio.ensure_future(_poll_status(ctx, sid, auth, seen)))
        bad = await _actions(ctx, plan, rng, sid, auth, t_end)
        await asyncio.sleep(max(0.0, t_end - time.monotonic()))
        res.t_end = time.monotonic()
        for t in tasks:
            t.cancel()
        if plan.kind in ("vanish", "crash"):  # leaves without DELETE: the server has to notice
            _drop_sockets(pc) if plan.kind == "crash" else await pc.close()
            report, row["vanish_detect_s"] = await _report_when_closed(ctx, sid, auth, 90.0)
        else:
            report = (await ctx.http.delete(f"{ctx.url}/sessions/{sid}", headers=auth)).json()
        row.update(_figures(res, report, ctx.step))
        row.update(degraded_polls=seen.get("degraded", 0), polls=seen.get("polls", 0))
        if bad:
            row["error"] = "; ".join(bad)
        return row
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    finally:
        for t in tasks:
            t.cancel()
        mic.stop()
        await pc.close()
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, *tasks, return_exceptions=True)


# ---- the run -----------------------------------------------------------------------------------------


async def drive(args: argparse.Namespace, url: str, sampler: ProcSampler) -> tuple[list[dict], dict, list]:
    """``--concurrency`` loops of sessions until the time (or the session count) is up. Returns the
    session rows (in the order they ended), the server's /config and the refusals met."""
    import httpx

    async with httpx.AsyncClient(timeout=60.0) as http:
        cfg = (await http.get(f"{url}/config")).json()
        ctx = Ctx(
            url=url,
            http=http,
            step=90_000 // int(cfg.get("fps") or 24),
            say_ok=bool(cfg.get("say_available")),
            speech={"short": speech_wav(1.5, 1), "long": speech_wav(4.0, 2)},
            sampler=sampler,
            refusals=[],
        )
        gen, rows, started = plans(args), [], [0]
        deadline = time.monotonic() + args.minutes * 60

        async def loop() -> None:
            while time.monotonic() < deadline and not (args.sessions and started[0] >= args.sessions):
                started[0] += 1
                t_start = round(
                    time.monotonic() - sampler.t0, 2
                )  # the samples' clock: cpu_windows per session
                row = await run_session(ctx, next(gen))
                row["t_span"] = [t_start, round(time.monotonic() - sampler.t0, 2)]
                rows.append(row)
                sampler.mark(f"after session {row['i']}")

        progress = asyncio.ensure_future(_progress(args.progress_every, rows, sampler))
        try:
            await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        finally:
            progress.cancel()
        for row in rows:  # the ghosts' reports, now that the server has closed them (connect timeout)
            auth = row.pop("auth", None)
            if auth is not None:
                rep, _ = await _report_when_closed(ctx, row["session_id"], auth, 30.0)
                row["close_reason"] = rep.get("close_reason")
    return rows, cfg, ctx.refusals


async def _progress(every: float, rows: list[dict], sampler: ProcSampler) -> None:
    if every <= 0:
        return
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(every)
        watched = [r for r in rows if (r.get("watched_s") or 0) >= 1.0]
        ok = sum(r["fresh_fps"] >= TARGET_FPS for r in watched)
        last = sampler.samples[-1]["procs"] if sampler.samples else {}
        rss = ", ".join(f"{k} {v['rss_mb']} MB" for k, v in last.items())
        recent = (
            [s for s in sampler.samples if s["t"] >= sampler.samples[-1]["t"] - every]
            if sampler.samples
            else []
        )
        win = cpu_windows(recent[:1] + recent[-1:]) if len(recent) > 1 else []
        cpu = ""
        if win:
            w = win[-1]
            cores = " ".join(f"{k} {v:.2f}" for k, v in w["cores_per_proc"].items())
            cpu = f"; machine busy {w['busy']:.0%} steal {w['steal']:.1%}, cores {cores}"
        print(
            f"  [{time.monotonic() - t0:6.0f} s] {len(rows)} sessions, {ok}/{len(watched)} >= {TARGET_FPS} fresh "
            f"fps, {sum(r.get('underruns') or 0 for r in watched)} underruns; {rss}{cpu}",
            file=sys.stderr,
            flush=True,
        )


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    return round(float(ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]), 2)


def _slope_per_h(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``ts`` (seconds), per hour."""
    if len(ts) < 3 or max(ts) - min(ts) <= 0:
        return None
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return round(sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den * 3600, 2)


def resources(samples: list[dict]) -> dict:
    """Per process of the server: its RSS, threads and fds after the first session and after the last, the
    growth between them, and their slope over the samples from the first session's end on."""
    marks = [s for s in samples if (s.get("mark") or "").startswith("after session")]
    if not marks:
        return {}
    first, last = marks[0], marks[-1]
    after = [s for s in samples if s["t"] >= first["t"]]
    out = {}
    for label, f0 in first["procs"].items():
        f1 = last["procs"].get(label)
        if f1 is None:
            continue
        series = [(s["t"], s["procs"][label]) for s in after if label in s["procs"]]
        ts = [t for t, _ in series]
        out[label] = {
            "rss_mb_first_session": f0["rss_mb"],
            "rss_mb_last_session": f1["rss_mb"],
            "rss_growth_pct": round((f1["rss_mb"] - f0["rss_mb"]) / f0["rss_mb"] * 100, 2)
            if f0["rss_mb"]
            else None,
            "rss_mb_max": max(f["rss_mb"] for _, f in series),
            "rss_slope_mb_per_h": _slope_per_h(ts, [f["rss_mb"] for _, f in series]),
            "threads_first_session": f0["threads"],
            "threads_last_session": f1["threads"],
            "threads_max": max(f["threads"] for _, f in series),
            "threads_slope_per_h": _slope_per_h(ts, [f["threads"] for _, f in series]),
            "fds_first_session": f0["fds"],
            "fds_last_session": f1["fds"],
            "fds_max": max(f["fds"] for _, f in series),
            "fds_slope_per_h": _slope_per_h(ts, [f["fds"] for _, f in series]),
        }
    return out


def _late_summary(rows: list[dict]) -> dict:
    late = [c for r in rows for c in r.get("late") or []]
    out = {"chunks": len(late)}
    for k in ("budget_ms", "latency_ms", "to_worker_ms", "work_ms", "back_ms"):
        xs = [c[k] for c in late if c.get(k) is not None]
        out[k] = {"p50": _q(xs, 0.5), "max": _q(xs, 1.0)} if xs else None
    return out


def _by_kind(rows: list[dict]) -> dict:
    out = {}
    for k in KINDS:
        rk = [r for r in rows if r["kind"] == k]
        wk = [r for r in rk if (r.get("watched_s") or 0) >= 1.0]
        if rk:
            out[k] = {
                "sessions": len(rk),
                "watched": len(wk),
                "ge_23_5": sum(r["fresh_fps"] >= TARGET_FPS for r in wk),
                "fresh_fps_min": _q([r["fresh_fps"] for r in wk], 0.0),
                "underruns": sum(r.get("underruns") or 0 for r in wk),
                "close_reasons": sorted({str(r.get("close_reason")) for r in rk}),
            }
    return out


def cpu_summary(rows: list[dict], samples: list[dict]) -> dict:
    """The machine's busy and steal share over the run and, per session below the target, over the sample
    windows that overlap it (with each process's cores there): is a slow session the VM, the client or the
    server?"""
    win = cpu_windows(samples)
    if not win:
        return {}

    def over(t0: float, t1: float) -> dict:
        sel = [w for w in win if w["t"] >= t0 and w["t_from"] <= t1]
        if not sel:
            return {}
        procs = sorted({k for w in sel for k in w["cores_per_proc"]})
        return {
            "steal_max": max(w["steal"] or 0 for w in sel),
            "busy_max": max(w["busy"] or 0 for w in sel),
            "cores_max": {k: max(w["cores_per_proc"].get(k, 0) for w in sel) for k in procs},
        }

    m0, m1 = samples[0].get("machine"), samples[-1].get("machine")
    total = sum(m1[k] - m0[k] for k in ("busy_s", "idle_s", "steal_s")) if m0 and m1 else 0
    watched = [r for r in rows if (r.get("watched_s") or 0) >= 1.0 and r.get("t_span")]
    below = [r for r in watched if r["fresh_fps"] < TARGET_FPS]
    # the sessions that ran while the hypervisor took what the CPU lead is sized for, or more (counted in the
    # share like every other: this says what the run put the headroom through, it excludes nothing)
    stolen = [r for r in watched if (over(*r["t_span"]).get("steal_max") or 0) >= STEAL_HEADROOM]
    return {
        "busy": round((m1["busy_s"] - m0["busy_s"]) / total, 3) if total > 0 else None,
        "steal": round((m1["steal_s"] - m0["steal_s"]) / total, 4) if total > 0 else None,
        "steal_window_max": max(w["steal"] or 0 for w in win),
        "steal_headroom": STEAL_HEADROOM,
        "sessions_in_steal_windows": len(stolen),
        "below_target_in_steal_windows": sum(r["fresh_fps"] < TARGET_FPS for r in stolen),
        "below_target": [{"i": r["i"], "fresh_fps": r["fresh_fps"], **over(*r["t_span"])} for r in below],
    }


def summarize(
    rows: list[dict],
    refusals: list[dict],
    res_by_proc: dict,
    minutes: float,
    samples: list[dict] | None = None,
) -> dict:
    """The run's figures (docs/benchmarks.md bench "soak"); the share is over the sessions watched >= 1 s."""
    watched = [r for r in rows if (r.get("watched_s") or 0) >= 1.0]
    fps = [r["fresh_fps"] for r in watched]
    per = [x for r in watched for x in r.get("per_second") or []]
    share = sum(f >= TARGET_FPS for f in fps) / len(fps) if fps else 0.0
    leak = [k for k, v in res_by_proc.items() if (v.get("rss_growth_pct") or 0) > LEAK_PCT]
    by_kind = _by_kind(rows)
    chunks = sum(r.get("chunks_done") or 0 for r in watched)
    misses = sum(r.get("deadline_misses") or 0 for r in watched)
    errors = [f"session {r['i']} ({r['kind']}): {r['error']}" for r in rows if r.get("error")]
    return {
        "minutes": minutes,
        "sessions": len(rows),
        "sessions_watched_ge_1s": len(watched),
        "share_sessions_ge_23_5fps": round(share, 4),
        "sessions_below_23_5fps": sum(f < TARGET_FPS for f in fps),
        "target": {
            "share": TARGET_SHARE,
            "sessions": TARGET_SESSIONS,
            "rss_growth_pct_max": LEAK_PCT,
            "met": share >= TARGET_SHARE and len(watched) >= TARGET_SESSIONS and not leak and not errors,
        },
        "fresh_fps": {
            "mean": round(statistics.fmean(fps), 3) if fps else None,
            "min": _q(fps, 0.0),
            "p1": _q(fps, 0.01),
            "p5": _q(fps, 0.05),
            "p50": _q(fps, 0.5),
        },
        "per_second_fresh_fps": {
            "seconds": len(per),
            "min": _q(per, 0.0),
            "p1": _q(per, 0.01),
            "p5": _q(per, 0.05),
            "p50": _q(per, 0.5),
            "share_ge_23_5": round(sum(x >= TARGET_FPS for x in per) / len(per), 4) if per else None,
            "histogram": {str(v): per.count(v) for v in sorted(set(per))},
        },
        "decoded_fps_mean": round(statistics.fmean([r["decoded_fps"] for r in watched]), 3)
        if watched
        else None,
        "server_fps_mean": round(statistics.fmean([r.get("server_fps") or 0 for r in watched]), 3)
        if watched
        else None,
        "ttff_ms": {
            q: _q([r["ttff_ms"] for r in watched if r.get("ttff_ms")], v)
            for q, v in (("p50", 0.5), ("p95", 0.95), ("max", 1.0))
        },
        "underruns": sum(r.get("underruns") or 0 for r in watched),
        "sessions_with_underruns": sum(bool(r.get("underruns")) for r in watched),
        "deadline_misses": misses,
        "chunks_done": chunks,
        "deadline_miss_rate": round(misses / chunks, 5) if chunks else None,
        "chunks_audio_only": sum(r.get("audio_only") or 0 for r in watched),
        "sessions_shown_reduced": sum(bool(r.get("degraded_polls")) for r in watched),
        "late_chunks": _late_summary(watched),
        "by_kind": by_kind,
        "refusals": {
            "count": len(refusals),
            "retry_after_s": [x["retry_after_s"] for x in refusals],
            "waited_s": [x["waited_s"] for x in refusals],
        },
        "vanish_detect_s": {
            k: [r.get("vanish_detect_s") for r in rows if r["kind"] == k] for k in ("vanish", "crash")
        },
        "resources": res_by_proc,
        "cpu": cpu_summary(rows, samples or []),
        "leaking": leak,
        "errors": len(errors),
        "error_messages": errors[:20],
    }


def _server(args: argparse.Namespace):
    """`cadence serve` as the README starts it (its own process), with ``--concurrency`` worker groups."""
    from cadence.devtools.testing import ServeProcess

    words = ["--preset", args.preset, "--max-sessions", str(args.concurrency), "--log-level", "warning"]
    return ServeProcess(words + args.serve_args.split())


def _print(res: dict, args: argparse.Namespace) -> None:
    from cadence.bench.common import print_table

    pf, ps = res["fresh_fps"], res["per_second_fresh_fps"]
    rows = [
        ("sessions (watched >= 1 s)", f"{res['sessions']} ({res['sessions_watched_ge_1s']})"),
        (
            "share >= 23.5 fresh fps",
            f"{res['share_sessions_ge_23_5fps']:.2%} ({res['sessions_below_23_5fps']} below)",
        ),
        ("fresh fps per session", f"mean {pf['mean']}, min {pf['min']}, p1 {pf['p1']}, p50 {pf['p50']}"),
        (
            "fresh fps per second",
            f"min {ps['min']}, p1 {ps['p1']}, p5 {ps['p5']}, >= 23.5: {ps['share_ge_23_5']}",
        ),
        ("decoded / server fps", f"{res['decoded_fps_mean']} / {res['server_fps_mean']}"),
        (
            "time to first frame",
            f"p50 {res['ttff_ms']['p50']} ms, p95 {res['ttff_ms']['p95']}, max {res['ttff_ms']['max']}",
        ),
        ("underruns (sessions)", f"{res['underruns']} ({res['sessions_with_underruns']})"),
        ("deadline misses", f"{res['deadline_misses']} of {res['chunks_done']} chunks"),
        (
            "audio-only chunks, 'reduced' shown",
            f"{res['chunks_audio_only']}, {res['sessions_shown_reduced']} sessions",
        ),
        ("refusals (503/429)", str(res["refusals"]["count"])),
        ("errors", str(res["errors"])),
    ]
    cpu = res.get("cpu") or {}
    if cpu.get("busy") is not None:
        slow = ", ".join(
            f"#{b['i']} steal {b.get('steal_max', 0):.1%} cores "
            + " ".join(f"{k} {v:.2f}" for k, v in (b.get("cores_max") or {}).items())
            for b in cpu["below_target"][:5]
        )
        rows.append(
            (
                "machine busy / steal",
                f"{cpu['busy']:.0%} / {cpu['steal']:.2%} (worst window {cpu['steal_window_max']:.1%})"
                + (f"; below target: {slow}" if slow else ""),
            )
        )
    for label, r in res["resources"].items():
        rows.append(
            (
                f"{label} rss / threads / fds",
                f"{r['rss_mb_first_session']} -> {r['rss_mb_last_session']} MB "
                f"({r['rss_growth_pct']}%, {r['rss_slope_mb_per_h']} MB/h), {r['threads_first_session']} -> "
                f"{r['threads_last_session']}, {r['fds_first_session']} -> {r['fds_last_session']}",
            )
        )
    print_table(
        rows, f"bench soak: {args.minutes:g} min, concurrency {args.concurrency}, preset {args.preset}"
    )
    t = res["target"]
    print(
        f"{'MET' if t['met'] else 'MISSED'}: {res['share_sessions_ge_23_5fps']:.2%} of "
        f"{res['sessions_watched_ge_1s']} sessions >= {TARGET_FPS} fresh fps (target {TARGET_SHARE:.1%} of >= "
        f"{TARGET_SESSIONS}), RSS growth "
        + ", ".join(f"{k} {v['rss_growth_pct']}%" for k, v in res["resources"].items())
        + f" (limit {LEAK_PCT:g}%), {res['errors']} errors"
        + steal_line(res)
    )
    for e in res["error_messages"][:10]:
        print(f"  error: {e}", file=sys.stderr)


def steal_line(res: dict) -> str:
    """The steal the run saw, for the verdict and the record's headline: over the run, its worst window, and
    the sessions that ran in windows at or over the CPU lead's design point (all of them counted)."""
    cpu = res.get("cpu") or {}
    if cpu.get("steal") is None:
        return ""
    return (
        f"; steal {cpu['steal']:.1%} over the run (worst window {cpu['steal_window_max']:.1%}), "
        f"{cpu['sessions_in_steal_windows']} sessions in windows >= {cpu['steal_headroom']:.0%} steal "
        f"({cpu['below_target_in_steal_windows']} below target; every session counted)"
    )


def main(argv: list[str]) -> int:
    args = parse(argv)
    server = _server(args) if args.url is None else None
    url, pid = (server.url, server.pid) if server is not None else (args.url, args.server_pid)
    sampler = ProcSampler(pid, args.sample_every)
    try:
        if server is not None:
            try:
                server.wait_ready(args.start_timeout)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        sampler.start().mark("start")
        rows, cfg, refusals = asyncio.run(drive(args, url, sampler))
        sampler.mark("end")
    finally:
        sampler.stop()
        if server is not None:
            server.close()
    res = summarize(rows, refusals, resources(sampler.samples), args.minutes, sampler.samples)
    _print(res, args)
    if not args.no_record:
        _record(args, res, rows, cfg, sampler.samples)
    return 0 if res["errors"] == 0 else 1


def _record(args, res: dict, rows: list[dict], cfg: dict, samples: list[dict]) -> None:
    import torch

    from cadence.bench.common import record

    shape = {k: cfg.get(k) for k in ("width", "height", "fps", "frames_per_chunk", "chunk_ms")}
    workers = [
        {k: w.get(k) for k in ("index", "device", "lead_ms", "warmup", "threads")}
        for w in cfg.get("workers") or []
    ]
    path = record(
        "soak",
        cfg.get("preset", args.preset),
        1,
        torch.device("cpu"),
        shape,
        res,
        variant=f"c{args.concurrency}-{args.minutes:g}min",
        out_dir=results_dir(args),
        headline=f"{res['share_sessions_ge_23_5fps']:.2%} of {res['sessions_watched_ge_1s']} sessions >= 23.5 fresh "
        f"fps; per-second p1 {res['per_second_fresh_fps']['p1']}; {res['underruns']} underruns"
        + steal_line(res),
        extra={
            "workers": workers,
            "session_rows": rows,
            "proc_samples": samples,
            "plan": {"seed": args.seed, "mix": args.mix, "session_seconds": list(args.session_seconds)},
        },
    )
    print(f"wrote {path}")
