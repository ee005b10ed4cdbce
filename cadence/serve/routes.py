"""The routes: one small handler per route, each checking its request (``cadence.serve.guard``) and asking
the session manager (``cadence.serve.manager``); what each answers is documented in
``cadence.serve.openapi`` (by the handler's name) and in the route table of ``cadence.serve.app``.

(No ``from __future__ import annotations`` here: FastAPI reads the ``Request`` annotation at runtime.)
"""

import asyncio
import time

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response

from cadence.serve.agent import SayAgent, TTSUnavailable, espeak_binary, synthesize
from cadence.serve.agents import AGENTS
from cadence.serve.config import DEFAULT_PROMPT
from cadence.serve.guard import (
    MAX_PROMPT,
    ApiError,
    bearer,
    json_object,
    request_client,
    seed_field,
    str_field,
    type_name,
    with_client_cookie,
)
from cadence.serve.uploads import decode_speech, read_session_body
from cadence.telemetry.metrics import CONTENT_TYPE_LATEST

#: The HTTP + WebRTC API's version (``/config``'s ``api_version``): routes, fields and media as
#: ``cadence.serve.app`` documents them. Clients (``cadence.integrations.pipecat``'s remote mode) check it;
#: it changes only when one of them changes incompatibly.
API_VERSION = 1


class SessionApi:
    """The handlers of one server (its manager ``mgr``); :data:`ROUTES` says which path each one serves."""

    def __init__(self, mgr, static_dir):
        self.mgr, self.cfg, self.static = mgr, mgr.cfg, static_dir

    async def index(self, request: Request):
        return with_client_cookie(request, FileResponse(self.static / "index.html", media_type="text/html"))

    async def healthz(self):
        mgr = self.mgr
        return {
            "ok": mgr.started,
            "groups": len(mgr.groups),
            "free": sum(g.free for g in mgr.groups),
            "sessions": len(mgr.sessions),
        }

    async def config(self):
        mgr, cfg, e = self.mgr, self.cfg, self.mgr.engine_cfg
        return {
            "preset": e.name,
            "width": e.stream.width,
            "height": e.stream.height,
            "fps": e.stream.fps,
            "sample_rate": 48000,
            "frames_per_chunk": e.video_frames_per_chunk,
            "audio_samples_per_chunk": e.audio_samples_per_chunk,
            "chunk_ms": round(1e3 * e.chunk_seconds, 3),
            "api_version": API_VERSION,
            "agents": list(AGENTS),
            "say_available": espeak_binary() is not None,
            "talk_available": cfg.agent_url is not None,
            "api_key_required": cfg.api_key is not None,
            "groups": len(mgr.groups),
            "max_image_bytes": cfg.max_image_bytes,
            "max_image_pixels": cfg.max_image_pixels,
            "max_prompt_chars": MAX_PROMPT,
            "max_audio_bytes": cfg.max_audio_bytes,
            "idle_timeout_s": cfg.idle_timeout_s,
            "max_duration_s": cfg.max_duration_s,
            "connect_timeout_s": cfg.connect_timeout_s,
            "model_family": e.model.family,
            "weights_entry": e.model.weights_entry,  # the checkpoint entry served (None: one state dict)
            "weights": {
                "model": e.model.weights,
                "vae": e.vae.weights,
                "taehv": e.vae.taehv_weights,
                "text_encoder": e.model.text_encoder,
                "text_tokenizer": e.model.text_tokenizer,
            },
            "workers": [
                {
                    "index": g.index,
                    "device": g.device,
                    "ready": g.ready.is_set(),
                    "lead_ms": round(mgr.lead_ms(g), 1),
                    **g.info_dict(),
                }
                for g in mgr.groups
            ],
        }

    async def create_session(self, request: Request):
        t_request = time.monotonic()
        self.mgr.access.require_creator(bearer(request))
        body = await read_session_body(request, self.cfg.max_image_bytes)
        fields = body.fields
        created = await self.mgr.create(
            sdp=str_field(fields, "sdp", None),
            sdp_type=str_field(fields, "type", "offer"),
            prompt=str_field(fields, "prompt", "", MAX_PROMPT) or DEFAULT_PROMPT,
            agent=str_field(fields, "agent", "") or "mirror",
            seed=seed_field(fields, body.form),
            image_bytes=body.image,
            t_request=t_request,
            client=request_client(request),
        )
        return with_client_cookie(request, JSONResponse(created.as_json(), status_code=201))

    async def list_sessions(self, request: Request):
        self.mgr.access.require_operator(bearer(request), "the session list")
        return {"sessions": [s.status() for s in self.mgr.sessions.values()]}

    async def get_session(self, sid: str, request: Request):
        self.mgr.authorize(sid, bearer(request))
        s = self.mgr.sessions.get(sid)
        if s is not None:
            s.touch()
            return s.status()
        return {k: v for k, v in self.mgr.reports[sid].items() if k != "report"}

    async def get_report(self, sid: str, request: Request):
        self.mgr.authorize(sid, bearer(request))
        if sid in self.mgr.reports:  # the stored JSON as it is (no decode and re-encode)
            return Response(self.mgr.reports.json_bytes(sid), media_type="application/json")
        raise ApiError(409, f"session {sid} is still open; its report is written when it closes")

    async def delete_session(self, sid: str, request: Request):
        self.mgr.authorize(sid, bearer(request))
        return await self.mgr.get_open(sid).close("client")

    async def say(self, sid: str, request: Request):
        self.mgr.authorize(sid, bearer(request))
        body = json_object(await request.body(), '{"text": "..."}')
        text = str_field(body, "text", None)
        if text is None or not text.strip():
            raise ApiError(400, "missing 'text' (a non-empty string)")
        if len(text) > SayAgent.max_text:
            raise ApiError(400, f"'text' is too long ({len(text)} characters; limit {SayAgent.max_text})")
        interrupt = body.get("interrupt", False)
        if not isinstance(interrupt, bool):
            raise ApiError(400, f"'interrupt' must be a boolean, got {type_name(interrupt)}")
        self.mgr.get_open(sid).touch()  # a well-formed request on a closed session: 410
        try:
            audio = await asyncio.to_thread(synthesize, text)
        except TTSUnavailable as e:
            raise ApiError(503, str(e)) from None
        s = self.mgr.get_open(sid)
        if interrupt:
            s.agent.interrupt()
        return _speak(s, sid, audio)

    async def set_prompt(self, sid: str, request: Request):
        self.mgr.authorize(sid, bearer(request))
        body = json_object(await request.body(), '{"prompt": "..."}')
        prompt = str_field(body, "prompt", None, MAX_PROMPT)
        if prompt is None or not prompt.strip():
            raise ApiError(400, "missing 'prompt' (a non-empty string)")
        s = self.mgr.get_open(sid)
        s.touch()
        return {"session_id": sid, "from_chunk": await s.set_prompt(prompt)}

    async def push_audio(self, sid: str, request: Request):
        self.mgr.authorize(sid, bearer(request))
        self.mgr.get_open(sid).touch()
        audio = await decode_speech(await request.body(), self.cfg.max_audio_bytes)
        return _speak(self.mgr.get_open(sid), sid, audio)

    async def interrupt(self, sid: str, request: Request):
        self.mgr.authorize(sid, bearer(request))
        s = self.mgr.get_open(sid)
        s.touch()
        s.agent.interrupt()
        return {"session_id": sid, "interrupted": True}

    async def metrics(self, request: Request):
        sessions = self.mgr.access.is_operator(bearer(request))
        if sessions:
            for s in list(self.mgr.sessions.values()):
                s.update_metrics()
        return Response(self.mgr.metrics.render(sessions=sessions), media_type=CONTENT_TYPE_LATEST)


def _speak(s, sid: str, audio) -> dict:
    """Queue 48 kHz speech for session ``s``'s character; the answer of /say and /audio."""
    s.agent.speak(audio, t_agent=time.monotonic())
    return {
        "session_id": sid,
        "seconds": round(audio.size / 48000, 3),
        "queued_s": round(s.agent.queued_samples / 48000, 3),
    }


#: (method, path, handler): the order is the OpenAPI document's; the static files mount after ``index``.
ROUTES = (
    ("GET", "/", "index"),
    ("GET", "/healthz", "healthz"),
    ("GET", "/config", "config"),
    ("POST", "/sessions", "create_session"),
    ("GET", "/sessions", "list_sessions"),
    ("GET", "/sessions/{sid}", "get_session"),
    ("GET", "/sessions/{sid}/report", "get_report"),
    ("DELETE", "/sessions/{sid}", "delete_session"),
    ("POST", "/sessions/{sid}/say", "say"),
    ("POST", "/sessions/{sid}/prompt", "set_prompt"),
    ("POST", "/sessions/{sid}/audio", "push_audio"),
    ("POST", "/sessions/{sid}/interrupt", "interrupt"),
    ("GET", "/metrics", "metrics"),
)


def add_routes(app, mgr, docs, static_dir) -> None:
    """Every route of :data:`ROUTES` on ``app``, documented by ``docs`` (``cadence.serve.openapi.RouteDocs``),
    and the page's static files under ``/static``."""
    from fastapi.staticfiles import StaticFiles

    api = SessionApi(mgr, static_dir)
    for method, path, name in ROUTES:
        app.add_api_route(path, getattr(api, name), methods=[method], **docs.for_route(name))
        if name == "index":
            app.mount("/static", StaticFiles(directory=static_dir), name="static")
