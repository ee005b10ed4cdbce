"""`cadence bench turn`: the conversational turn, hop by hop: user end of speech -> first frame speaking.

    cadence bench turn --turns 5                                   # CPU, the shipped character
    cadence bench turn --preset w1.3 --device cuda --turns 5       # one GPU
    cadence bench turn --agent-url http://127.0.0.1:8080/v1 ...    # a real LLM endpoint instead

Starts ``cadence serve`` in this process with the ``talk`` agent (turn-taking: VAD end of turn, barge-in)
pointed at an OpenAI-compatible endpoint. By default that endpoint is a **scripted stand-in** served here
(it answers every turn at once with the next line of a script, and its "speech" is 1.5 s of a voiced
stand-in signal): the figures are then Cadence's share of a turn (plus two loopback HTTP calls), not an
LLM's or a TTS's. An aiortc client's microphone
plays, ``--turns`` times, 1 s of quiet, ``--speak`` s of a voiced stand-in, then quiet while the
character answers. Per turn, on one machine's monotonic clock (client and server share it):

* ``end_of_turn_ms``: the user's end of speech -> the server's end-of-turn decision (the VAD's hangover);
* ``agent_ms``: end of speech -> the agent's first audio (LLM + TTS, here the stand-in + espeak-ng);
* ``audio_to_frame_sent_ms``: the agent's first audio -> the first frame with it leaving the server;
* ``audio_to_heard_ms``: the agent's first audio -> its first sound arriving at the client (decoded),
  Cadence's share of the turn (the published system: 0.49 s to the first frame + 0.19 s browser);
* ``user_end_to_heard_ms``: the whole turn as the client hears it.

``--browser``: the client is the page in headless Chromium instead (its fake microphone plays the turns,
a real voice from espeak-ng when installed); the page's own clock times the first sound it plays and the
first frame it presents with the mouth open (``cadence.eval``'s mouth opening over half-way between the
page's idle and speaking levels: ``audio_to_frame_shown_ms``), against the server's wall-clock stamps.

Loopback only. Results per docs/benchmarks.md conventions (bench "turn"), with the machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time

import numpy as np

from cadence.bench.results import add_record_flags, results_dir
from cadence.engine.flags import add_engine_flags, spec_from_args
from cadence.serve.config import add_serve_flags

SCRIPT = ("Hello there, nice to meet you.", "That sounds interesting, tell me more.", "I see. And then?")
LOUD_RMS = 0.01  # a received 20 ms frame louder than this is the character speaking


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadence bench turn", description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=5, help="user turns (one every --period seconds)")
    p.add_argument("--speak", type=float, default=1.0, help="seconds of user speech per turn")
    p.add_argument("--period", type=float, default=7.0, help="seconds between the user's turns")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--agent-url", default=None, help="a real OpenAI-compatible endpoint (default: the scripted stand-in)"
    )
    p.add_argument("--agent-model", default="default")
    p.add_argument(
        "--agent-tts-model", default=None, help="with --agent-url: its TTS model (default: espeak-ng here)"
    )
    p.add_argument("--start-timeout", type=float, default=None, help="worker start timeout (s)")
    p.add_argument(
        "--browser",
        action="store_true",
        help="the client is the page in headless Chromium (fake microphone; times on the page's clock) "
        "instead of an aiortc client",
    )
    add_engine_flags(p)  # the server's engine: the words `cadence serve` takes (--tp: GPUs per worker group)
    add_serve_flags(p)
    add_record_flags(p)
    a = p.parse_args(argv)
    if not 1 <= a.turns <= 100 or a.period < a.speak + 3:
        p.error("--turns must be 1..100 and --period at least --speak + 3 s")
    return a


class ScriptedEndpoint:
    """A scripted stand-in for an OpenAI-compatible API: ``/v1/chat/completions`` answers every request
    with the next line of ``SCRIPT`` at once, ``/v1/audio/speech`` with 1.5 s of a voiced stand-in signal.
    Labelled as such in the results; it measures nothing of an LLM or a TTS."""

    def __init__(self):
        from fastapi import FastAPI

        from cadence.devtools.testing import AppThread

        lines = itertools.cycle(SCRIPT)
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat():
            return {"choices": [{"message": {"role": "assistant", "content": next(lines)}}]}

        from fastapi.responses import Response

        from cadence.serve.agent import wav_bytes

        speech = wav_bytes(voiced(1.5))

        @app.post("/v1/audio/speech")
        async def tts():  # a stand-in voice: 1.5 s of the voiced signal, whatever the text
            return Response(speech, media_type="audio/wav")

        self.app = AppThread(app)

    def __enter__(self) -> str:
        return self.app.__enter__() + "/v1"

    def __exit__(self, *exc) -> None:
        self.app.__exit__(*exc)


def _microphone(args) -> np.ndarray:
    """One turn of the user's microphone: 1 s of quiet, ``--speak`` s of speech, quiet until the next turn
    (the page's microphone runs noise suppression: with ``--browser`` a real voice, espeak-ng, if there is
    one; else the voiced stand-in)."""
    speech = voiced(args.speak)
    if args.browser:
        from cadence.serve.agent import espeak_binary, synthesize

        if espeak_binary() is not None:
            speech = synthesize("Hello there. Who are you?")[: int(args.speak * 48_000)]
    quiet = np.zeros(int((args.period - 1.0 - args.speak) * 48_000), np.float32)
    return np.concatenate([np.zeros(48_000, np.float32), speech, quiet])


def voiced(seconds: float) -> np.ndarray:
    """A voiced stand-in for the user's speech (harmonics of 140 Hz, a 4 Hz syllable envelope), 48 kHz."""
    t = np.arange(int(seconds * 48_000)) / 48_000
    x = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 6))
    return (0.08 * x * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t) ** 2)).astype(np.float32)


def measure(res, args) -> list[dict]:
    """Per turn, from the client's received audio and the session's report (see the module doc)."""
    rep = res.report
    turns = rep.get("turns") or []
    sent = rep.get("agent_audio_to_frame_ms") or []
    times = np.array([a[0] for a in res.audio])
    loud = np.array(res.audio_rms) > LOUD_RMS
    out = []
    for k, turn in enumerate(turns):
        user_end = res.mic_t0 + 1.0 + args.speak + k * args.period
        row = {
            "turn": k,
            "user_s": turn.get("user_s"),
            "agent_ms": turn.get("first_audio_ms"),
            "llm_ms": turn.get("llm_ms"),
            "tts_ms": turn.get("tts_ms"),
            "error": turn.get("error"),
            "audio_to_frame_sent_ms": sent[k] if k < len(sent) else None,
        }
        heard = times[loud & (times > user_end)]
        if heard.size and turn.get("first_audio_ms") is not None:
            t_heard = float(heard[0])
            row["user_end_to_heard_ms"] = round((t_heard - user_end) * 1e3, 1)
            row["audio_to_heard_ms"] = round(row["user_end_to_heard_ms"] - turn["first_audio_ms"], 1)
        out.append(row)
    return out


def run_browser(url: str, seconds: float, mic: np.ndarray) -> tuple[dict, list[dict]]:
    """The page as the client: Chromium's fake microphone plays ``mic`` (looped), the page starts a ``talk``
    session, and the page's own clock times what it presents and plays (``AV_TAP_JS``). Returns the
    session's report and, per turn, the page's hops against the server's wall-clock stamps."""
    import json
    import os
    import tempfile

    from cadence.devtools.browser import AV_TAP_JS, Chromium, get_json, open_page, read_av_tap
    from cadence.eval.metrics import mouth_opening, mouth_region
    from cadence.serve.agent import wav_bytes

    with tempfile.TemporaryDirectory() as tmp:
        wav = os.path.join(tmp, "user.wav")
        with open(wav, "wb") as f:
            f.write(wav_bytes(mic))
        with Chromium(extra_flags=[f"--use-file-for-fake-audio-capture={wav}"]) as cdp:
            open_page(cdp, url)
            cdp.eval("document.getElementById('use-mic').checked = true")
            cdp.eval("document.getElementById('agent').value = 'talk'")
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
            deadline = time.monotonic() + 30
            while cdp.eval("document.body.dataset.connection || ''") != "connected":
                if time.monotonic() > deadline:
                    raise RuntimeError("the page did not connect within 30 s")
                time.sleep(0.1)
            time.sleep(0.5)  # the received stream is on the <video> once the tracks arrive
            conf = get_json(url + "/config")
            h, w = conf["height"], conf["width"]
            region = mouth_region(h, w)
            cdp.eval(AV_TAP_JS % json.dumps(list(region)))
            time.sleep(seconds)
            ft, crops, audio = read_av_tap(cdp, region)
            cdp.eval("window.cadence.stop().then(() => true)", timeout_s=30)
        report = get_json(f"{url}/sessions/{sid}/report", token)
    y0, y1, x0, x1 = region
    full = np.zeros((len(ft), h, w, 3), np.uint8)
    full[:, y0:y1, x0:x1] = crops
    mouth = mouth_opening(full) if len(ft) else np.zeros(0)
    hi, lo = (np.percentile(mouth, 90), np.percentile(mouth, 10)) if len(ft) else (0.0, 0.0)
    rows = []
    for k, turn in enumerate(report.get("turns") or []):
        row = {
            "turn": k,
            "user_s": turn.get("user_s"),
            "agent_ms": turn.get("first_audio_ms"),
            "llm_ms": turn.get("llm_ms"),
            "tts_ms": turn.get("tts_ms"),
            "error": turn.get("error"),
        }
        at = turn.get("first_audio_at")
        if at:
            t = at * 1e3
            loud = audio[(audio[:, 1] > LOUD_RMS) & (audio[:, 0] > t)]
            if loud.size:
                row["audio_to_heard_ms"] = round(float(loud[0, 0] - t), 1)
                row["user_end_to_heard_ms"] = round(float(loud[0, 0] - turn["user_end_at"] * 1e3), 1)
            moving = ft[(ft > t) & (mouth > (hi + lo) / 2)]
            if moving.size:
                row["audio_to_frame_shown_ms"] = round(float(moving[0] - t), 1)
        rows.append(row)
    fps = (len(ft) - 1) / ((ft[-1] - ft[0]) / 1e3) if len(ft) > 1 else 0.0
    report["_page_fps"] = round(fps, 2)
    return report, rows


def main(argv: list[str]) -> int:
    import contextlib
    import logging

    import torch

    from cadence.devtools.client import run_client
    from cadence.engine.recipe import resolve
    from cadence.errors import CadenceError
    from cadence.serve.config import ServeConfig, serve_groups
    from cadence.serve.server import ServerThread

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    args = parse(argv)
    gpus = torch.cuda.device_count() if args.device == "cuda" and torch.cuda.is_available() else 0
    try:
        spec = spec_from_args(args)
        groups = serve_groups(args.device, spec.tp, 1, gpus, spec.decode_gpu)
    except CadenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start_timeout = args.start_timeout or (600.0 if args.device == "cuda" else 120.0)
    seconds = args.turns * args.period + 1.0
    mic = _microphone(args)
    stand_in = args.agent_url is None
    with contextlib.ExitStack() as stack:
        url = args.agent_url or stack.enter_context(ScriptedEndpoint())
        srv = ServerThread(
            ServeConfig(
                engine=spec,
                port=0,
                groups=groups,
                max_duration_s=seconds + 120,
                worker_start_timeout_s=start_timeout,
                agent_url=url,
                agent_model=args.agent_model,
                agent_tts_model="stand-in" if stand_in else args.agent_tts_model,
                frame_transport=args.frame_transport,
                cut_in=args.cut_in,
            )
        ).start(timeout=start_timeout + 60)
        stack.callback(srv.stop)
        print(f"server: {srv.url} ({spec.model} on {groups[0]}), agent endpoint {url}", file=sys.stderr)
        recipe = resolve(spec, groups[0])
        print(recipe.describe().text(), file=sys.stderr)
        if args.browser:
            try:
                report, rows = run_browser(srv.url, seconds, mic)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        else:
            res = asyncio.run(run_client(srv.url, seconds, agent="talk", mic=mic))
            if res.error:
                print(f"error: {res.error}", file=sys.stderr)
                return 2
            report, rows = res.report, measure(res, args)
    return _finish(args, rows, report, url, stand_in, spec, recipe)


def _finish(args, rows: list[dict], report: dict, url: str, stand_in: bool, spec, recipe) -> int:
    """The per-turn figures' medians: printed, and recorded with the recipe (bench "turn")."""
    import torch

    from cadence.bench.common import print_table, record
    from cadence.serve.agent import VoiceActivity

    stop_ms = VoiceActivity().stop_s * 1e3

    def p50(key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.median(xs), 1) if xs else None

    out = {
        "turns": len(rows),
        "endpoint": "scripted stand-in (no LLM, no TTS: a fixed voiced signal)" if stand_in else url,
        "end_of_turn_ms": stop_ms,
        "agent_ms_p50": p50("agent_ms"),
        "audio_to_frame_sent_ms_p50": p50("audio_to_frame_sent_ms"),
        "audio_to_heard_ms_p50": p50("audio_to_heard_ms"),
        "audio_to_heard_ms_max": max(
            (r["audio_to_heard_ms"] for r in rows if "audio_to_heard_ms" in r), default=None
        ),
        "user_end_to_heard_ms_p50": p50("user_end_to_heard_ms"),
        "audio_to_frame_shown_ms_p50": p50("audio_to_frame_shown_ms"),
        "client": "headless Chromium (page clock)" if args.browser else "aiortc (arrival of decoded audio)",
        "page_fps": report.get("_page_fps"),
        "fps": report.get("fps_mean"),
        "lead_ms": report.get("lead_ms"),
        "underruns": report.get("underruns"),
        "agent_errors": report.get("agent_errors"),
        "per_turn": rows,
    }
    print_table(
        [(k, str(v)) for k, v in out.items() if k != "per_turn"],
        f"bench turn: {spec.model} on {args.device}, {len(rows)} turn(s)",
    )
    if args.no_record:
        return 0
    dev = torch.device("cuda" if args.device == "cuda" else "cpu")
    path = record(
        "turn",
        spec.model,
        spec.tp,
        dev,
        {"turns": args.turns, "speak_s": args.speak, "period_s": args.period},
        out,
        variant="browser" if args.browser else None,
        out_dir=results_dir(args),
        world=spec.tp,
        extra={"recipe": recipe.describe().as_dict()},
        headline=f"agent audio -> heard {out['audio_to_heard_ms_p50']} ms p50; user end -> heard "
        f"{out['user_end_to_heard_ms_p50']} ms p50",
    )
    print(f"wrote {path}")
    return 0
