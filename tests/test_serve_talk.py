"""Turn-taking in ``cadence serve``: voice activity, end of turn, barge-in, and the ``talk`` agent against
an OpenAI-compatible endpoint (a small fake one, served here on loopback: it answers the three routes
the agent uses and records what it was sent). Every session is a real one: the tiny CPU worker, WebRTC
on loopback, an aiortc client whose microphone plays the user's turn."""

import asyncio

import numpy as np
import pytest

for _mod in ("fastapi", "uvicorn", "aiortc", "httpx"):
    pytest.importorskip(_mod, reason=f"the serve extra is not installed ({_mod})")

from cadence.bench.turn import voiced  # the voiced stand-in for a user's (or a TTS's) speech
from cadence.devtools.client import run_client
from cadence.devtools.testing import AppThread
from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.serve.agent import SAMPLE_RATE, VoiceActivity, wav_bytes
from cadence.serve.config import ServeConfig
from cadence.serve.server import ServerThread

pytestmark = pytest.mark.timeout(180)


def quiet(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SAMPLE_RATE), np.float32)


# ---- voice activity (no server) ------------------------------------------------------------------


def test_vad_finds_the_turn_and_its_end_at_the_last_voiced_block():
    vad = VoiceActivity(threshold=0.01, start_s=0.08, stop_s=0.5)
    audio = np.concatenate([quiet(0.3), voiced(1.0), quiet(1.0)])
    events = []
    for i in range(0, audio.size, 960):  # 20 ms pieces, as WebRTC delivers them
        events += vad.push(audio[i : i + 960])
    assert [k for k, _ in events] == ["start", "stop"]
    assert events[0][1] == pytest.approx(0.3, abs=0.021)  # the voiced run's first block
    assert events[1][1] == pytest.approx(1.3, abs=0.021)  # the last voiced block's end, not +0.5 s
    # pieces of any size give the same events
    vad2 = VoiceActivity(threshold=0.01, start_s=0.08, stop_s=0.5)
    events2 = []
    for i in range(0, audio.size, 1234):
        events2 += vad2.push(audio[i : i + 1234])
    assert events2 == events


def test_vad_ignores_a_click_and_a_short_pause():
    vad = VoiceActivity(threshold=0.01, start_s=0.08, stop_s=0.5)
    click = np.concatenate([quiet(0.2), voiced(0.04), quiet(0.5)])  # 40 ms: shorter than start_s
    assert vad.push(click) == []
    speech = np.concatenate([voiced(0.5), quiet(0.3), voiced(0.5), quiet(0.8)])  # a 0.3 s pause in it
    assert [k for k, _ in vad.push(speech)] == ["start", "stop"]


# ---- the fake OpenAI-compatible endpoint -------------------------------------------------------------


class FakeOpenAI:
    """``/v1/chat/completions``, ``/v1/audio/transcriptions``, ``/v1/audio/speech`` on a loopback port;
    ``requests`` records (route, body) of every call."""

    def __init__(self, reply: str = "Hello there, nice to meet you.", speech_s: float = 1.2):
        from fastapi import FastAPI, Request
        from fastapi.responses import Response

        self.requests: list[tuple[str, object]] = []
        app = FastAPI()
        speech = wav_bytes(voiced(speech_s))

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(("chat", body))
            return {"choices": [{"message": {"role": "assistant", "content": reply}}]}

        @app.post("/v1/audio/transcriptions")
        async def stt(request: Request):
            form = await request.form()
            data = await form["file"].read()
            self.requests.append(("stt", {"model": form.get("model"), "bytes": len(data)}))
            return {"text": "hi, who are you?"}

        @app.post("/v1/audio/speech")
        async def tts(request: Request):
            body = await request.json()
            self.requests.append(("tts", body))
            return Response(speech, media_type="audio/wav")

        self.app = AppThread(app)

    def __enter__(self):
        self.url = self.app.__enter__() + "/v1"
        return self

    def __exit__(self, *exc):
        self.app.__exit__(*exc)


def _serve(**kw) -> ServerThread:
    return ServerThread(ServeConfig(engine=EngineSpec(model="tiny", fast=FastPath(threads=1)), port=0, **kw))


def test_talk_agent_answers_a_turn_through_the_endpoint():
    """The user speaks 1 s then is quiet: one turn -> STT -> LLM -> TTS (all at the fake endpoint) -> the
    character says the answer; every hop timed from the user's end of speech."""
    mic = np.concatenate([quiet(0.5), voiced(1.0), quiet(6.0)])
    with (
        FakeOpenAI() as api,
        _serve(agent_url=api.url, agent_stt_model="whisper-1", agent_tts_model="tts-1") as srv,
    ):
        res = asyncio.run(run_client(srv.url, 4.5, agent="talk", mic=mic))
    assert res.error is None, res.error
    kinds = [k for k, _ in api.requests]
    assert kinds[:3] == ["stt", "chat", "tts"], kinds
    chat = api.requests[1][1]
    assert chat["messages"][0]["role"] == "system"
    assert chat["messages"][-1] == {"role": "user", "content": "hi, who are you?"}
    assert api.requests[2][1]["input"] == "Hello there, nice to meet you."
    rep = res.report
    assert rep["agent"] == "talk" and rep["agent_errors"] == []
    turn = rep["turns"][0]
    assert turn["transcript"] == "hi, who are you?" and turn["reply"] == "Hello there, nice to meet you."
    assert turn["user_s"] == pytest.approx(1.0, abs=0.25)
    # the hops add up: STT, LLM and TTS all happen before the first agent audio
    assert 0 < turn["stt_ms"] <= turn["first_audio_ms"] < 2000, turn
    assert turn["llm_ms"] > 0 and turn["tts_ms"] > 0
    # the answer reached the screen: one agent audio -> speaking frame sample, at the stream's rate
    assert len(rep["agent_audio_to_frame_ms"]) == 1, rep["agent_audio_to_frame_ms"]
    print(f"turn: {turn}; agent audio -> frame {rep['agent_audio_to_frame_ms']} ms")
    assert res.video_fps() > 22.0


def test_a_failing_endpoint_is_one_clear_error_and_the_stream_keeps_running():
    mic = np.concatenate([quiet(0.3), voiced(0.8), quiet(6.0)])
    with _serve(agent_url="http://127.0.0.1:9/v1") as srv:  # port 9 (discard): nothing listens
        res = asyncio.run(run_client(srv.url, 3.5, agent="talk", mic=mic))
    assert res.error is None, res.error
    assert "cannot reach http://127.0.0.1:9/v1/chat/completions" in res.status["agent_error"]
    assert res.report["agent_errors"] and res.report["turns"][0]["error"]
    assert res.video_fps() > 22.0  # the stream never stopped
    assert res.report["close_reason"] == "client"


def test_talk_without_an_endpoint_is_refused_with_400():
    with _serve() as srv:
        res = asyncio.run(run_client(srv.url, 0.5, agent="talk"))
    assert res.status_code == 400 and "--agent-url" in res.error


def test_barge_in_stops_the_character_within_one_chunk_and_100_ms():
    """The character is saying 4 s of speech; the user starts talking 1.5 s into the microphone stream:
    the queued speech is dropped and the audio of the chunks planned but not played is silenced. At the
    client, the character's audio goes quiet within one chunk + 100 ms of the barge-in (the VAD's
    detection: the user's voice onset + ``start_s``)."""
    speech = wav_bytes(voiced(4.0))
    onset_s = 1.5
    mic = np.concatenate([quiet(onset_s), voiced(0.8), quiet(8.0)])
    with FakeOpenAI() as api, _serve(agent_url=api.url) as srv:
        res = asyncio.run(
            run_client(srv.url, 4.0, agent="talk", mic=mic, speak_wav=speech, speak_after_s=0.0)
        )
    assert res.error is None, res.error
    rep = res.report
    assert rep["barge_ins"] == 1, rep
    assert rep["agent_queued_s"] == 0.0
    t_detect = res.mic_t0 + onset_s + VoiceActivity().start_s
    times = np.array([a[0] for a in res.audio])
    loud = np.array(res.audio_rms) > 0.01
    assert loud[times < t_detect].sum() > 10, "the character was not speaking when the user barged in"
    # the character's audio goes quiet (10 frames = 200 ms in a row) after the barge-in; it may speak
    # again later: the user's turn ends and the agent answers it
    idx = np.flatnonzero(times >= t_detect)
    quiet_at = next((times[i] for i in idx if i + 10 <= len(loud) and not loud[i : i + 10].any()), None)
    assert quiet_at is not None, "the character never went quiet after the barge-in"
    stop_ms = (quiet_at - t_detect) * 1e3
    chunk_ms = 1e3 * 4 / 24
    print(f"barge-in -> character silent at the client: {stop_ms:.0f} ms")
    assert stop_ms <= chunk_ms + 100.0, stop_ms
    assert api.requests and api.requests[0][0] == "chat"  # the barge-in was a turn, answered after it
