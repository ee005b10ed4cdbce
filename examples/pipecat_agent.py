"""A whole local voice agent with Cadence's character as its face, on Pipecat. No cloud keys, no downloads.

    pip install -e '.[pipecat]'          # Pipecat (with Silero VAD and its small WebRTC transport)
    apt-get install espeak-ng             # the offline TTS
    python examples/pipecat_agent.py      # then open http://127.0.0.1:7860 and say something

The pipeline, one per browser connection::

    SmallWebRTC in (your microphone)
      -> Silero VAD (the model ships inside the pipecat package)
      -> ScriptedResponder   an OFFLINE STAND-IN for speech-to-text + LLM: it answers every finished
                             turn with the next line of a fixed script (it does not understand you);
                             replace it with any Pipecat STT + LLM services (see below)
      -> EspeakTTSService    text -> speech with espeak-ng (offline)
      -> CadenceVideoService the character: its frames and its voice, in sync, at 24 fps (in process,
                             one engine shared by every connection; or url=... for a cadence serve)
      -> SmallWebRTC out (video + audio to the page)

Barge-in: when you start speaking while the character talks, the responder broadcasts Pipecat's
interruption; the TTS stops and the character is back to listening within the chunks in flight.

A real agent swaps the stand-in for services, e.g. ``WhisperSTTService`` (local) or any cloud STT, then
``LLMContextAggregatorPair`` + ``OpenAILLMService(base_url="http://127.0.0.1:8080/v1")`` (llama.cpp,
vLLM, Ollama) in place of ``ScriptedResponder``; nothing else changes.

``--sync-markers K`` (testing): every K-th chunk carries an A/V marker (a white frame and a 1 kHz tone
at the same media instant) so a client can measure the A/V offset end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import time
from contextlib import asynccontextmanager

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    Frame,
    TTSSpeakFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.tts_service import TTSService
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.workers.runner import WorkerRunner

from cadence.engine.recipe import EngineSpec
from cadence.integrations.pipecat import CadenceVideoService, use_wall_clock_video_timestamps
from cadence.serve.agent import synthesize
from cadence.serve.config import ServeConfig
from cadence.serve.manager import SessionManager
from cadence.serve.rtc import use_ice_host_addresses

log = logging.getLogger("cadence.example")

SCRIPT = (
    "Hello! I am a live character made by Cadence. I can hear you.",
    "That is interesting. Tell me more.",
    "I am only a scripted stand-in for a language model, but my face is real time.",
    "Thanks for talking with me.",
)


class ScriptedResponder(FrameProcessor):
    """OFFLINE STAND-IN for speech-to-text + LLM: every finished user turn (Silero VAD's stop) is answered
    with the next line of ``lines``; the user's voice while the bot speaks interrupts it (barge-in).

    Timing (``turns``, wall-clock seconds): the user's end of speech (the VAD's stop minus its
    ``stop_secs`` hangover) and when the answer was handed to the TTS."""

    def __init__(self, lines=SCRIPT):
        super().__init__()
        self.lines = itertools.cycle(lines)
        self.bot_speaking = False
        self.turns: list[dict] = []
        self.barge_ins = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, VADUserStartedSpeakingFrame):
            if self.bot_speaking:
                self.barge_ins += 1
                await self.broadcast_interruption()
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            now = time.time()  # wall clock: a client on this machine times its hops against it
            line = next(self.lines)
            self.turns.append(
                {"user_end_at": now - (frame.stop_secs or 0.0), "answered_at": now, "text": line}
            )
            await self.push_frame(frame, direction)
            await self.push_frame(TTSSpeakFrame(line))
            return
        elif isinstance(frame, BotStartedSpeakingFrame):
            self.bot_speaking = True
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self.bot_speaking = False
        await self.push_frame(frame, direction)


class EspeakTTSService(TTSService):
    """Text -> speech with espeak-ng (a subprocess; offline), 48 kHz."""

    def __init__(self, voice: str = "en", speed: int = 160, **kwargs):
        super().__init__(push_start_frame=True, push_stop_frames=True, sample_rate=48_000, **kwargs)
        self.voice, self.speed = voice, speed

    def can_generate_metrics(self) -> bool:
        return True

    async def run_tts(self, text: str, context_id: str):
        audio = await asyncio.to_thread(synthesize, text, self.voice, self.speed)
        pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()

        async def pieces():
            for i in range(0, len(pcm), 9600):  # 100 ms
                yield pcm[i : i + 9600]

        async for f in self._stream_audio_frames_from_iterator(
            pieces(), in_sample_rate=48_000, context_id=context_id
        ):
            yield f


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Cadence + Pipecat</title>
<style>body{font:15px system-ui;margin:2em;background:#111;color:#eee}video{width:384px;height:384px;
background:#000;display:block;margin:1em 0}button{font-size:15px;padding:.4em 1em}</style></head>
<body><h1>Talk to the character</h1>
<p>Cadence's character on a local Pipecat agent (Silero VAD, a scripted stand-in for the LLM, espeak-ng).
Press start, allow the microphone and say something; stop talking to hear the answer.</p>
<button id="start">Start</button> <button id="stop" disabled>Stop</button> <span id="state">idle</span>
<video id="video" autoplay playsinline></video>
<script>
const $ = (id) => document.getElementById(id);
let pc = null;
async function start() {
  $("start").disabled = true;
  pc = new RTCPeerConnection({ iceServers: [] });
  const remote = new MediaStream();
  pc.ontrack = (ev) => { remote.addTrack(ev.track); $("video").srcObject = remote; };
  pc.onconnectionstatechange = () => { $("state").textContent = pc.connectionState;
                                       document.body.dataset.connection = pc.connectionState; };
  const mic = await navigator.mediaDevices.getUserMedia({ audio: true });
  pc.addTransceiver(mic.getAudioTracks()[0], { direction: "sendrecv" });  // 0: audio (Pipecat's order)
  pc.addTransceiver("video", { direction: "sendrecv" });                   // 1: video
  pc.createDataChannel("chat");
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((ok) => { if (pc.iceGatheringState === "complete") ok();
    else pc.onicegatheringstatechange = () => pc.iceGatheringState === "complete" && ok(); });
  const r = await fetch("/api/offer", { method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ sdp: pc.localDescription.sdp, type: pc.localDescription.type }) });
  if (!r.ok) { $("state").textContent = await r.text(); return; }
  await pc.setRemoteDescription(await r.json());
  $("stop").disabled = false;
}
async function stop() { if (pc) pc.close(); pc = null; $("stop").disabled = true; $("start").disabled = false; }
$("start").onclick = () => start().catch((e) => { $("state").textContent = String(e); });
$("stop").onclick = stop;
window.agent = { start, stop, pc: () => pc };
</script></body></html>
"""


def create_app(cfg: ServeConfig | None = None, loopback: bool = True) -> FastAPI:
    """The example's web app: the page, ``POST /api/offer`` (one Pipecat pipeline per connection) and
    ``GET /api/stats`` (the last connection's figures: tests and the curious). One Cadence engine
    (``SessionManager``) is started with the app and shared by the connections (one at a time per worker
    group)."""
    cfg = cfg or ServeConfig()
    state: dict = {"workers": set(), "last": None}

    @asynccontextmanager
    async def lifespan(app):
        if loopback:
            use_ice_host_addresses(["127.0.0.1"])  # aioice drops 127.0.0.1 from its own discovery
        use_wall_clock_video_timestamps()  # Pipecat's video track would stamp 24 fps on a 30 fps clock
        mgr = state["mgr"] = SessionManager(cfg)
        await mgr.start()
        try:
            yield
        finally:
            for w in list(state["workers"]):
                await w.cancel()
            await mgr.stop()
            use_ice_host_addresses(None)

    app = FastAPI(lifespan=lifespan)

    @app.get("/")
    async def index():
        return HTMLResponse(PAGE)

    @app.post("/api/offer")
    async def offer(request: Request):
        body = await request.json()
        conn = SmallWebRTCConnection(ice_servers=[])
        await conn.initialize(sdp=body["sdp"], type=body["type"])
        e = state["mgr"].engine_cfg
        transport = SmallWebRTCTransport(
            webrtc_connection=conn,
            params=TransportParams(
                audio_in_enabled=True,
                audio_out_enabled=True,
                audio_out_sample_rate=48_000,
                video_out_enabled=True,
                video_out_is_live=False,  # frames go with the audio (sync_with_audio), sent at 24 fps
                video_out_width=e.stream.width,
                video_out_height=e.stream.height,
                video_out_framerate=e.stream.fps,
            ),
        )
        responder = ScriptedResponder()
        cadence = CadenceVideoService(session_manager=state["mgr"], sync_with_audio=True)
        pipeline = Pipeline(
            [
                transport.input(),
                VADProcessor(vad_analyzer=SileroVADAnalyzer(params=VADParams(stop_secs=0.5))),
                responder,
                EspeakTTSService(),
                cadence,
                transport.output(),
            ]
        )
        worker = PipelineWorker(
            pipeline,
            params=PipelineParams(audio_in_sample_rate=16_000, audio_out_sample_rate=48_000),
            cancel_on_idle_timeout=False,
        )
        state["last"] = {"responder": responder, "cadence": cadence, "t_offer": time.monotonic()}

        @transport.event_handler("on_client_disconnected")
        async def _gone(transport, client):
            await worker.cancel()

        async def run():
            state["workers"].add(worker)
            try:
                runner = WorkerRunner(handle_sigint=False)
                await runner.add_workers(worker)
                await runner.run()
            finally:
                state["workers"].discard(worker)

        asyncio.get_running_loop().create_task(run())
        answer = conn.get_answer()
        return JSONResponse({"sdp": answer["sdp"], "type": answer["type"]})

    @app.get("/api/stats")
    async def stats():
        last = state["last"]
        if last is None:
            return JSONResponse({"error": "no connection yet"}, status_code=404)
        r, c = last["responder"], last["cadence"]
        return {
            "turns": r.turns,
            "barge_ins": r.barge_ins,
            "interruptions": c.interruptions,
            "frames_out": c.frames_out,
            "voiced_out_s": round(c.voiced_out_s, 3),
            "speech_in_at": [t + time.time() - time.monotonic() for t in c.segment_times],  # wall clock
            "voice_out_at": [t + time.time() - time.monotonic() for t in c.voice_out_times],
            "session": c.report(),
        }

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--preset", default="character", help="Cadence preset (default: the shipped character)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sync-markers", type=int, default=0, metavar="K", help="testing: A/V markers")
    args = ap.parse_args()
    import uvicorn

    cfg = ServeConfig(
        engine=EngineSpec(model=args.preset), groups=(args.device,), sync_marker_every=args.sync_markers
    )
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    uvicorn.run(create_app(cfg, loopback=loopback), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
