"""`cadence bench browser`: the main job as a user runs it, measured in a real browser.

    cadence bench browser --seconds 60                 # starts `cadence serve` (the default character) itself
    cadence bench browser --url http://127.0.0.1:8000 --seconds 60

Starts ``cadence serve`` exactly as the README says (a separate process: ``python -m cadence serve``), opens
its page in headless Chromium (``cadence.devtools.browser``), presses Start (the page's ``window.cadence.start``:
the fake microphone of Chromium drives the ``mirror`` agent), and every second reads what the page received:
video frames decoded (``getStats`` inbound-rtp), frames presented on screen (``requestVideoFrameCallback``),
audio samples received, and the fps and the "reduced" flag the page shows. After ``--seconds`` it stops
the session (the page's Stop: DELETE) and reads the server's report for that session. Results per
docs/benchmarks.md bench "serve" keys where they apply (``fps_mean``, ``fps_min``, ``share_seconds_ge_23_5fps``,
``underruns``, ...) plus the per-second series, and the machine's CPU (model, cores, AVX2 / AVX-512 / AMX)
so that a figure is read with the machine it came from. Loopback only.

The fps figures are *fresh* frames as the viewer sees them: each presented frame is drawn to a canvas and
compared with the one before (``PRESENT_JS``), and the fresh ones are counted per second of stream by their RTP
time (``fresh_per_second``), beside the frames decoded (``fps_decoded_*``, getStats per wall second) and
presented. Needs the ``browser`` extra (``websocket-client``) and Chromium: without them, one ``error:`` line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_engine_flags, spec_from_args
from cadence.telemetry.devices import cpu_info

#: Injected into the page: every frame the page presents (``requestVideoFrameCallback``) is drawn to a canvas and
#: compared with the one presented before it; a fresh frame (any pixel differs) is recorded with its RTP time
#: (90 kHz, the stream's own clock), so fresh frames can be counted per second of stream as the viewer saw them.
PRESENT_JS = r"""
(() => {
  const video = document.getElementById("video");
  const M = window.__bench = { presented: 0, fresh: 0, rtp: [] };
  const c = document.createElement("canvas");
  const g = c.getContext("2d", { willReadFrequently: true });
  let prev = null;
  const onFrame = (now, md) => {
    M.presented++;
    if (c.width !== md.width || c.height !== md.height) { c.width = md.width; c.height = md.height; prev = null; }
    g.drawImage(video, 0, 0, md.width, md.height);
    const px = g.getImageData(0, 0, md.width, md.height).data;
    let differs = prev === null;
    for (let i = 0; !differs && i < px.length; i++) differs = px[i] !== prev[i];
    if (differs) { M.fresh++; M.rtp.push(md.rtpTimestamp === undefined ? null : md.rtpTimestamp); }
    prev = px;
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
  return true;
})()
"""


def _own_flags(p) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="seconds to stream after the first frame")
    p.add_argument("--url", default=None, help="a running server (default: start `cadence serve` here)")
    p.add_argument("--serve-args", default="", help="extra arguments for the self-started `cadence serve`")
    p.add_argument(
        "--mic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Chromium's fake microphone drives the mirror agent (default: on)",
    )
    p.add_argument(
        "--start-timeout", type=float, default=240.0, help="seconds to wait for the server to be ready"
    )
    add_record_flags(p)


def parse(argv: list[str]) -> argparse.Namespace:
    """The benchmark's flags and the engine-flag set (``cadence.engine.flags``): the engine words are handed
    to the self-started ``cadence serve`` as they are (``engine_words``), after being parsed here once (a
    bad word is an error before any server starts)."""
    p = argparse.ArgumentParser(prog="cadence bench browser", description=__doc__.split("\n\n")[0])
    _own_flags(p)
    add_engine_flags(p)
    a = p.parse_args(argv)
    if not 5 <= a.seconds <= 3600:
        p.error(f"--seconds must be within 5..3600, got {a.seconds}")
    own = argparse.ArgumentParser(add_help=False)
    _own_flags(own)
    a.engine_words = own.parse_known_args(argv)[1]
    a.spec = spec_from_args(a)
    return a


def run(args: argparse.Namespace) -> dict:
    from cadence.devtools.browser import STATS_JS, Chromium, get_json, open_page
    from cadence.devtools.testing import ServeProcess, wait_ready

    server = ServeProcess([*args.engine_words, *args.serve_args.split()]) if args.url is None else None
    url = server.url if server is not None else args.url
    try:
        if server is not None:
            server.wait_ready(args.start_timeout)
        else:
            wait_ready(url, args.start_timeout)
        config = get_json(url + "/config")
        with Chromium() as cdp:
            open_page(cdp, url)
            cdp.eval(f"document.getElementById('use-mic').checked = {'true' if args.mic else 'false'}")
            t0 = time.monotonic()
            err = cdp.eval(
                "window.cadence.start().then(() => document.getElementById('error').textContent || '')",
                timeout_s=60,
            )
            if err:
                raise RuntimeError(f"the page could not start a session: {err}")
            sid, token = (
                cdp.eval("window.cadence.state().sessionId"),
                cdp.eval("window.cadence.state().token"),
            )
            cdp.eval(PRESENT_JS)
            while (cdp.eval(STATS_JS).get("framesDecoded") or 0) == 0:
                if time.monotonic() - t0 > 30:
                    raise RuntimeError("no video frame decoded within 30 s of Start")
                time.sleep(0.05)
            first_frame_s = time.monotonic() - t0
            samples = _sample(cdp, args.seconds, t0, args.progress)
            rtp = cdp.eval("window.__bench.rtp", timeout_s=30)
            cdp.eval("window.cadence.stop().then(() => true)", timeout_s=30)
        report = get_json(f"{url}/sessions/{sid}/report", token)
    finally:
        if server is not None:
            server.close()
    return summarize(samples, report, config, first_frame_s, rtp)


def _sample(cdp, seconds: float, t0: float, progress: bool) -> list[dict]:
    """Every second for ``seconds``: what the page received (STATS_JS), presented and shows."""
    from cadence.devtools.browser import STATS_JS

    samples = []
    end = time.monotonic() + seconds
    last = time.monotonic()
    while time.monotonic() < end:
        st = cdp.eval(STATS_JS)
        st["presented"] = cdp.eval("window.__bench.presented")
        st["fresh"] = cdp.eval("window.__bench.fresh")
        st["page_fps"] = float(cdp.eval("document.body.dataset.fps || 0"))
        st["degraded"] = cdp.eval("document.body.dataset.degraded || '0'") == "1"
        st["wall"] = time.monotonic()
        samples.append(st)
        if progress and st["wall"] - last >= 10:
            last = st["wall"]
            print(
                f"  [{st['wall'] - t0:6.1f} s] page shows {st['page_fps']:.1f} fps"
                + (" (reduced)" if st["degraded"] else ""),
                file=sys.stderr,
                flush=True,
            )
        time.sleep(max(0.0, 1.0 - (time.monotonic() - st["wall"])))
    return samples


def _rates(samples: list[dict], key: str, dt_key: str = "t") -> list[float]:
    out = []
    for a, b in zip(samples, samples[1:]):
        dt = (b[dt_key] - a[dt_key]) / (1e3 if dt_key == "t" else 1.0)
        if dt > 0:
            out.append((b[key] - a[key]) / dt)
    return out


def fresh_per_second(rtp: list, seconds: float, fps: int, guard_s: float = 0.5) -> list[int]:
    """Fresh frames presented in each whole second of stream (their RTP times, 90 kHz, from the first fresh
    frame's), over the ``seconds`` the page was watched less ``guard_s`` for the frames still on their way
    (the browser's jitter buffer holds them ~50-150 ms)."""
    ts = [t for t in rtp if t is not None]
    if not ts:
        return []
    out = [0] * max(0, int(seconds - guard_s))
    t0 = ts[0]
    for t in ts:
        k = round(((t - t0) % 2**32) * fps / 90_000)  # frame index in stream time (RTP wraps at 2^32)
        if k // fps < len(out):
            out[k // fps] += 1
    return out


def summarize(
    samples: list[dict], report: dict, config: dict, first_frame_s: float, rtp: list | None = None
) -> dict:
    """The run's figures: fresh frames (the page's pixels changed; per second of stream, by RTP time) beside
    the frames the browser decoded and presented (per wall second, from 1-s samples)."""
    decoded = _rates(samples, "framesDecoded")
    presented = _rates(samples, "presented")
    audio = _rates(samples, "samples")
    seconds = samples[-1]["wall"] - samples[0]["wall"] if len(samples) > 1 else 0.0
    fresh = fresh_per_second(rtp or [], seconds, int(config.get("fps") or 24))
    r = lambda x: None if x is None else round(float(x), 2)  # noqa: E731
    return {
        "seconds": round(seconds, 1),
        "fps_mean": r(statistics.fmean(fresh)) if fresh else None,
        "fps_min": r(min(fresh)) if fresh else None,
        "share_seconds_ge_23_5fps": r(sum(x >= 23.5 for x in fresh) / len(fresh)) if fresh else None,
        "fps_decoded_mean": r(statistics.fmean(decoded)) if decoded else None,
        "fps_decoded_min": r(min(decoded)) if decoded else None,
        "fps_presented_mean": r(statistics.fmean(presented)) if presented else None,
        "fps_presented_min": r(min(presented)) if presented else None,
        "audio_samples_per_s_mean": r(statistics.fmean(audio)) if audio else None,
        "page_fps_min": r(min(s["page_fps"] for s in samples[2:])) if len(samples) > 2 else None,
        "degraded_seconds": sum(1 for s in samples if s["degraded"]),
        "first_frame_s": r(first_frame_s),
        "fps_per_second": fresh,
        "fps_decoded_per_second": [round(x, 1) for x in decoded],
        "server": {
            k: report.get(k)
            for k in (
                "fps_mean",
                "ttff_ms",
                "underruns",
                "deadline_misses",
                "chunks",
                "chunk_latency_ms_p50",
                "chunk_latency_ms_p99",
                "lead_ms",
                "av_offset_ms",
                "worker",
                "video_codec",
                "errors",
            )
        },
        "worker": (config.get("workers") or [{}])[0].get("warmup"),
        "recipe": (config.get("workers") or [{}])[0].get("recipe"),  # what the server's worker built
    }


def main(argv: list[str]) -> int:
    import importlib.util

    from cadence.bench.common import print_table, record

    args = parse(argv)
    args.progress = True
    if importlib.util.find_spec("websocket") is None:  # the DevTools client (cadence.devtools.browser.CDP)
        print(
            "error: cadence bench browser needs the websocket-client package: pip install -e '.[browser]' "
            "(or pip install websocket-client), and Chromium (apt-get install chromium)",
            file=sys.stderr,
        )
        return 2
    from cadence.engine.recipe import resolve

    if args.url is None:  # what the self-started server's (CPU) group builds
        print(resolve(args.spec, "cpu").describe().text(), file=sys.stderr)
    try:
        res = run(args)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [
        (k, str(res[k]))
        for k in (
            "seconds",
            "fps_mean",
            "fps_min",
            "share_seconds_ge_23_5fps",
            "fps_decoded_mean",
            "fps_presented_mean",
            "fps_presented_min",
            "audio_samples_per_s_mean",
            "page_fps_min",
            "degraded_seconds",
            "first_frame_s",
        )
    ]
    s = res["server"]
    rows += [
        ("server fps_mean", str(s.get("fps_mean"))),
        ("server underruns", str(s.get("underruns"))),
        ("server chunks", str(s.get("chunks"))),
        ("chunk latency p50 / p99", f"{s.get('chunk_latency_ms_p50')} / {s.get('chunk_latency_ms_p99')} ms"),
    ]
    cpu = cpu_info()  # (record() writes it into the JSON too)
    rows.append(("cpu", f"{cpu.get('model')} ({cpu.get('cores')} cores, {cpu.get('torch_cpu_capability')})"))
    print_table(rows, f"bench browser: {args.spec.model}, {args.seconds:.0f} s in headless Chromium")
    if args.no_record:
        return 0
    import torch

    path = record(
        "browser",
        args.spec.model,
        1,
        torch.device("cpu"),
        {"seconds": args.seconds},
        res,
        out_dir=results_dir(args),
        extra={"recipe": res.pop("recipe", None)},
        headline=f"{res['fps_mean']} fresh fps in the page (slowest second {res['fps_min']}; "
        f"{res['fps_decoded_mean']} decoded)",
    )
    print(f"wrote {path}")
    return 0
