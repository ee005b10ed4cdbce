"""End to end: ``examples/pipecat_agent.py`` (Pipecat's small WebRTC transport, Silero VAD, the scripted
responder, espeak-ng, Cadence's character in process) in headless Chromium whose fake microphone plays
a spoken line (espeak-ng) then quiet, on a loop. The page receives the character's video and audio; we
measure in the page, with the page's own clock:

* the frames it presents (``requestVideoFrameCallback``): rate, and the mouth region's pixels, from
  which ``cadence.eval.mouth_opening`` gives the mouth opening per frame;
* the audio it plays (an AudioWorklet on the received stream): RMS per 128-sample block, stamped with
  ``AudioContext.getOutputTimestamp()`` in page time;
* lip sync: the mouth opening against the envelope of the audio played while each frame was shown,
  best Pearson correlation over lags of +-6 frames (>= 0.5), and that lag, refined between frames by
  the parabola through the peak (the A/V offset the viewer sees: within ITU-R BT.1359's acceptability
  window, and under 120 ms less the browser's own jitter-buffer difference; in process, before any
  transport, the best lag is 0 or 1 frame: tests/test_pipecat.py);
* the turn: the user's end of speech (the VAD's stop minus its hangover, server clock) -> the answer
  handed to the TTS -> its first TTS audio at the Cadence service -> its first sound and its first
  speaking frame at the page, all on the wall clock (same machine: the server's ``time.time()``, the
  page's ``performance.timeOrigin + now()``).

Loopback only. Skips when Chromium, espeak-ng, websocket-client or Pipecat is missing (CI installs
them), or with ``CADENCE_BROWSER_TESTS=0``.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pipecat", reason="the pipecat extra is not installed (pip install 'cadence[pipecat]')")
for _mod in ("fastapi", "uvicorn", "aiortc", "httpx", "onnxruntime"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed")

from cadence.devtools.browser import AV_TAP_JS, Chromium, chromium_path, get_json, read_av_tap
from cadence.devtools.testing import AppThread
from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.eval.metrics import lagged_corr, mouth_opening, mouth_region
from cadence.serve.agent import espeak_binary, synthesize, wav_bytes
from cadence.serve.config import ServeConfig

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
FRAME_MS = 1000 / 24


# the page's inbound streams: mean jitter-buffer delay per emitted frame / sample block (ms)
JITTER_JS = r"""
(async () => {
  const out = {};
  (await window.agent.pc().getStats()).forEach((r) => {
    if (r.type === "inbound-rtp" && r.jitterBufferEmittedCount)
      out[r.kind] = Math.round(1000 * r.jitterBufferDelay / r.jitterBufferEmittedCount * 10) / 10;
  });
  return out;
})()
"""


@pytest.fixture
def chromium() -> str:
    if os.environ.get("CADENCE_BROWSER_TESTS") == "0":
        pytest.skip("browser end-to-end test opted out (CADENCE_BROWSER_TESTS=0)")
    exe = chromium_path()
    if exe is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    if espeak_binary() is None:
        pytest.skip("espeak-ng is not installed (the example's TTS; .ci/run installs it)")
    pytest.importorskip("websocket", reason="websocket-client is not installed")
    return exe


def load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipecat_agent", ROOT / "examples" / "pipecat_agent.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mean_in(audio: np.ndarray, t0: float, t1: float) -> float:
    sel = (audio[:, 0] >= t0) & (audio[:, 0] < t1)
    return float(audio[sel, 1].mean()) if sel.any() else 0.0


def test_pipecat_agent_in_a_browser_mouth_follows_the_bot_voice(chromium, tmp_path):
    example = load_example()
    line = synthesize("Hello there. Who are you?")  # the user's turn, 48 kHz
    mic = np.concatenate([np.zeros(24_000, np.float32), line, np.zeros(6 * 48_000, np.float32)])
    wav = tmp_path / "user.wav"
    wav.write_bytes(wav_bytes(mic))
    cfg = ServeConfig(engine=EngineSpec(model="character", fast=FastPath(threads=2)))
    with (
        AppThread(example.create_app(cfg), start_timeout=180) as url,
        Chromium(chromium, [f"--use-file-for-fake-audio-capture={wav}"]) as cdp,
    ):
        cdp.call("Page.navigate", url=url + "/")
        deadline = time.monotonic() + 20
        while cdp.eval("typeof window.agent === 'object'") is not True:
            assert time.monotonic() < deadline, "the example page did not load"
            time.sleep(0.1)
        cdp.eval("window.agent.start().then(() => 'ok')")
        deadline = time.monotonic() + 60
        while cdp.eval("document.body.dataset.connection || ''") != "connected":
            assert time.monotonic() < deadline, "the page did not connect within 60 s"
            time.sleep(0.1)
        while (
            cdp.eval(
                "(() => { const v = document.getElementById('video'); return !!(v.srcObject && "
                "v.srcObject.getVideoTracks().length && v.srcObject.getAudioTracks().length); })()"
            )
            is not True
        ):
            assert time.monotonic() < deadline, "no video + audio tracks on the page"
            time.sleep(0.1)
        h, w = 128, 128
        region = mouth_region(h, w)
        assert cdp.eval(AV_TAP_JS % json.dumps(list(region))) == "running"
        # the user speaks at 0.5 s of each 7.5 s loop; the answer (~3 s of espeak) follows the turn
        time.sleep(14.0)
        ft, crops, audio = read_av_tap(cdp, region)
        stats = get_json(url + "/api/stats")
        jitter = cdp.eval(JITTER_JS)  # where the browser holds the media (diagnostics, in the summary)
        cdp.eval("window.agent.stop().then(() => 'ok')")

    assert len(ft) > 100, len(ft)
    fps = (len(ft) - 1) / ((ft[-1] - ft[0]) / 1000)
    y0, y1, x0, x1 = region
    full = np.zeros((len(ft), h, w, 3), np.uint8)
    full[:, y0:y1, x0:x1] = crops
    mouth = mouth_opening(full)
    # (audio: [wall ms, rms] per 128-sample block played)
    env = np.array([_mean_in(audio, t, t + FRAME_MS) for t in ft])
    corrs = {lag: lagged_corr(mouth, env, lag) for lag in range(-6, 7)}
    best = max(corrs, key=corrs.get)
    # the offset between a sub-frame resolution: the vertex of the parabola through the peak and its two
    # neighbours (whole frames are 41.7 ms: a true 105 ms offset would otherwise read 125 ms)
    frac = 0.0
    if -6 < best < 6:
        a, b, c = corrs[best - 1], corrs[best], corrs[best + 1]
        if a - 2 * b + c < 0:
            frac = 0.5 * (a - c) / (a - 2 * b + c)
    offset_ms = (best + frac) * FRAME_MS
    # the turn, timed: the server's clock for the VAD and the TTS hand-off, the page's for what it played
    turns = stats["turns"]
    assert turns, stats
    t_user_end, t_answer = turns[0]["user_end_at"] * 1e3, turns[0]["answered_at"] * 1e3  # wall ms
    t_speech_in = min(x * 1e3 for x in stats["speech_in_at"] if x * 1e3 >= t_answer)
    loud = audio[(audio[:, 1] > 0.02) & (audio[:, 0] > t_answer)]
    t_sound = loud[0, 0] if loud.size else None
    t_voice_out = min((x * 1e3 for x in stats["voice_out_at"] if x * 1e3 >= t_speech_in), default=None)
    speak_level, idle_level = np.percentile(mouth, 90), np.percentile(mouth, 10)
    moving = [t for t, mo in zip(ft, mouth) if t > t_answer and mo > (idle_level + speak_level) / 2]
    t_frame = moving[0] if moving else None
    summary = {
        "fps_presented": round(fps, 2),
        "lipsync_corr": {k: round(v, 3) for k, v in corrs.items()},
        "best_lag_frames": best,
        "av_offset_ms": round(offset_ms, 1),  # < 0: the voice after the mouth
        "av_offset_sent_ms": jitter and round(offset_ms + jitter.get("audio", 0) - jitter.get("video", 0), 1),
        "turns": len(turns),
        "user_end_to_tts_ms": round(t_answer - t_user_end, 1),
        "tts_to_speech_at_cadence_ms": round(t_speech_in - t_answer, 1),
        "speech_at_cadence_to_first_sound_ms": t_sound and round(t_sound - t_speech_in, 1),
        # of which: inside Cadence (the session's lead + the wait for a chunk boundary), then Pipecat's output
        # transport, WebRTC and the browser (its audio jitter buffer: browser_jitter_buffer_ms)
        "speech_at_cadence_to_voice_out_ms": t_voice_out and round(t_voice_out - t_speech_in, 1),
        "voice_out_to_first_sound_ms": t_voice_out and t_sound and round(t_sound - t_voice_out, 1),
        "speech_at_cadence_to_first_speaking_frame_ms": t_frame and round(t_frame - t_speech_in, 1),
        "user_end_to_first_speaking_frame_ms": t_frame and round(t_frame - t_user_end, 1),
        "voiced_out_s": stats["voiced_out_s"],
        "browser_jitter_buffer_ms": jitter,
        "session": {
            k: (stats["session"] or {}).get(k)
            for k in ("lead_ms", "fps", "agent_audio_to_frame_ms_p50", "underruns")
        },
    }
    print("pipecat browser:", json.dumps(summary))
    out = os.environ.get("CADENCE_PIPECAT_E2E_JSON")
    if out:
        Path(out).write_text(json.dumps(summary, indent=1))
    # a sanity floor: the video keeps flowing. The engine shares two cores with Chromium, Pipecat, Silero
    # and two VP8 encoders, and Pipecat's video task resamples the frames on its own 24 fps timer: the page
    # showed 20.1-23.4 fps in seven quiet runs here. The 24 fps stream itself: tests/test_e2e_browser.py
    assert 18.0 <= fps <= 26.0, summary
    assert corrs[best] >= 0.5, summary
    # the A/V offset the viewer sees, within ITU-R BT.1359's acceptability window (the voice at most 185 ms
    # after the mouth, 90 ms before it). What Cadence and Pipecat send: that offset less the difference the
    # browser's own jitter buffers add, within +-120 ms. On CI's loaded 2 cores Chromium once held audio
    # 89 ms and video 31 ms: -127.6 ms seen, -69.6 ms sent.
    assert -185.0 < offset_ms < 90.0, summary
    assert {"audio", "video"} <= set(jitter or {}), summary
    sent_ms = offset_ms + (jitter["audio"] - jitter["video"])
    assert abs(sent_ms) < 120.0, summary
    assert t_sound is not None and t_frame is not None, summary
