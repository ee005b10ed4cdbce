"""The routes: one small handler per route, each asking the session manager (``cadence.serve.manager``).

What a route takes and answers is its handler's signature and the pydantic models of
``cadence.serve.schemas`` (FastAPI validates the bodies and generates ``/openapi.json`` from both); the table
:data:`ROUTES` adds, per route, its summary, the refusals it can send (each an :class:`ErrorBody`) and the
credentials it takes (``cadence.serve.guard``: a session's token, the operator key), as the document says them.

(No ``from __future__ import annotations`` here: FastAPI reads the annotations at runtime.)
"""

import asyncio
import time

from fastapi import Request, Security
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from pydantic import ValidationError

from cadence.serve.agent import TTSUnavailable, espeak_binary, synthesize
from cadence.serve.agents import AGENTS
from cadence.serve.config import DEFAULT_PROMPT
from cadence.serve.guard import SDP_PATTERN, ApiError, bearer, request_client, with_client_cookie
from cadence.serve.schemas import (
    MAX_PROMPT,
    MAX_SEED,
    ErrorBody,
    Health,
    Interrupted,
    PromptRequest,
    PromptSwitched,
    Queued,
    SayRequest,
    SessionCreated,
    session_models,
    validation_message,
)
from cadence.serve.uploads import base64_image, decode_speech, read_session_body
from cadence.telemetry.metrics import CONTENT_TYPE_LATEST

#: The HTTP + WebRTC API's version (``/config``'s ``api_version``): routes, fields and media as
#: ``cadence.serve.app`` documents them. Clients (``cadence.integrations.pipecat``'s remote mode) check it;
#: it changes only when one of them changes incompatibly.
API_VERSION = 1

SESSION_TOKEN = HTTPBearer(
    auto_error=False,
    scheme_name="sessionToken",
    description="the token POST /sessions returned for this session",
)
API_KEY = HTTPBearer(
    auto_error=False,
    scheme_name="apiKey",
    description="the operator key (cadence serve --api-key-file / --api-key)",
)


class SessionApi:
    """The handlers of one server (its manager ``mgr``); :data:`ROUTES` says which path each one serves."""

    def __init__(self, mgr, static_dir):
        self.mgr, self.cfg, self.static = mgr, mgr.cfg, static_dir
        offered = tuple(a for a in AGENTS if a != "talk" or self.cfg.agent_url is not None)
        self.session_json, self.session_form = session_models(
            offered, SDP_PATTERN, self.cfg.max_image_bytes, self.cfg.max_image_pixels
        )

    async def authorize(self, request: Request) -> None:
        """Before every ``/sessions/{id}`` route (:class:`AuthorizedFirst`): 404, 401, 403 before its body is
        read or anything else is looked at."""
        self.mgr.authorize(request.path_params["sid"], bearer(request))

    async def index(self, request: Request):
        return with_client_cookie(request, FileResponse(self.static / "index.html", media_type="text/html"))

    async def healthz(self) -> Health:
        mgr = self.mgr
        return Health(
            ok=mgr.started,
            groups=len(mgr.groups),
            free=sum(g.free for g in mgr.groups),
            sessions=len(mgr.sessions),
        )

    async def config(self) -> dict:
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
        model = self.session_form if body.form else self.session_json
        try:
            req = model.model_validate(body.fields)
        except ValidationError as e:
            raise ApiError(400, validation_message(e.errors(include_url=False))) from None
        image = body.image if body.form else base64_image(req.image_base64)
        created = await self.mgr.create(
            sdp=req.sdp,
            sdp_type=req.type,
            prompt=req.prompt or DEFAULT_PROMPT,
            agent=req.agent,
            seed=req.seed,
            image_bytes=image,
            t_request=t_request,
            client=request_client(request),
        )
        return with_client_cookie(request, JSONResponse(created.as_json(), status_code=201))

    async def list_sessions(self, request: Request) -> dict:
        self.mgr.access.require_operator(bearer(request), "the session list")
        return {"sessions": [s.status() for s in self.mgr.sessions.values()]}

    async def get_session(self, sid: str) -> dict:
        s = self.mgr.sessions.get(sid)
        if s is not None:
            s.touch()
            return s.status()
        return {k: v for k, v in self.mgr.reports[sid].items() if k != "report"}

    async def get_report(self, sid: str):
        if sid in self.mgr.reports:  # the stored JSON as it is (no decode and re-encode)
            return Response(self.mgr.reports.json_bytes(sid), media_type="application/json")
        raise ApiError(409, f"session {sid} is still open; its report is written when it closes")

    async def delete_session(self, sid: str) -> dict:
        return await self.mgr.get_open(sid).close("client")

    async def say(self, sid: str, body: SayRequest) -> Queued:
        self.mgr.get_open(sid).touch()  # a well-formed request on a closed session: 410
        try:
            audio = await asyncio.to_thread(synthesize, body.text)
        except TTSUnavailable as e:
            raise ApiError(503, str(e)) from None
        s = self.mgr.get_open(sid)
        if body.interrupt:
            s.agent.interrupt()
        return _speak(s, sid, audio)

    async def set_prompt(self, sid: str, body: PromptRequest) -> PromptSwitched:
        s = self.mgr.get_open(sid)
        s.touch()
        return PromptSwitched(session_id=sid, from_chunk=await s.set_prompt(body.prompt))

    async def push_audio(self, sid: str, request: Request) -> Queued:
        self.mgr.get_open(sid).touch()
        audio = await decode_speech(await request.body(), self.cfg.max_audio_bytes)
        return _speak(self.mgr.get_open(sid), sid, audio)

    async def interrupt(self, sid: str) -> Interrupted:
        s = self.mgr.get_open(sid)
        s.touch()
        s.agent.interrupt()
        return Interrupted(session_id=sid, interrupted=True)

    async def metrics(self, request: Request):
        sessions = self.mgr.access.is_operator(bearer(request))
        if sessions:
            for s in list(self.mgr.sessions.values()):
                s.update_metrics()
        return Response(self.mgr.metrics.render(sessions=sessions), media_type=CONTENT_TYPE_LATEST)


def _speak(s, sid: str, audio) -> Queued:
    """Queue 48 kHz speech for session ``s``'s character; the answer of /say and /audio."""
    s.agent.speak(audio, t_agent=time.monotonic())
    return Queued(
        session_id=sid,
        seconds=round(audio.size / 48000, 3),
        queued_s=round(s.agent.queued_samples / 48000, 3),
    )


# ---- the route table -------------------------------------------------------------------------------------------

#: What each refusal means, as the document says it (every one is an :class:`ErrorBody`).
REFUSALS = {
    400: "Bad request: a field missing, of the wrong type, out of range, or text that is not valid Unicode or "
    "carries NUL; not JSON; a malformed SDP offer; an image that is not one; audio with NaN or infinite samples",
    401: "No credential, or an invalid API key (Authorization: Bearer ...)",
    403: "The credential does not open this resource (another session's token), or the route needs the "
    "operator key and this server has none",
    404: "No such session (or its report has expired), or no such route",
    408: "The request body arrived slower than the server's minimum rate",
    409: "The session is still open: its report is written when it closes",
    410: "The session is closed (its state and report stay readable for a while)",
    413: "Body, image (bytes or pixels), SDP offer or audio over its limit",
    415: "A content type this route does not take, or audio that cannot be decoded",
    429: "This client already has as many sessions waiting to connect as it may",
    500: "The session could not be started (the worker failed)",
    503: "No free session slot (all busy, or the free one held for a client refused before: its turn), or a "
    "server-side dependency missing (espeak-ng for 'say')",
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    }
}
#: What every ``/sessions/{id}`` route may refuse besides its own codes.
SESSION_ROUTE = (400, 401, 403, 404, 408, 413)
BINARY = {"schema": {"type": "string", "format": "binary"}}

#: (method, path, handler, summary, the refusals it can send, who may call it: "anyone", "creator" (anyone, or
#: the operator key on a server with one), "operator", "session" (its token or the operator key)).
ROUTES = (
    ("GET", "/", "index", "The page", (), "anyone"),
    ("GET", "/healthz", "healthz", "Liveness", (), "anyone"),
    ("GET", "/config", "config", "What the page needs: geometry, agents, limits, the workers", (), "anyone"),
    (
        "POST",
        "/sessions",
        "create_session",
        "Start a session: SDP offer in, SDP answer (+ token) out",
        (400, 408, 413, 415, 429, 500, 503),
        "creator",
    ),
    ("GET", "/sessions", "list_sessions", "Open sessions (needs the operator key)", (403,), "operator"),
    (
        "GET",
        "/sessions/{sid}",
        "get_session",
        "A session's state (a closed one: its final state)",
        (),
        "session",
    ),
    ("GET", "/sessions/{sid}/report", "get_report", "A closed session's report", (409,), "session"),
    ("DELETE", "/sessions/{sid}", "delete_session", "Close a session; its report", (410,), "session"),
    (
        "POST",
        "/sessions/{sid}/say",
        "say",
        "The character says a line of text (espeak-ng)",
        (410, 503),
        "session",
    ),
    (
        "POST",
        "/sessions/{sid}/prompt",
        "set_prompt",
        "Change the prompt from the next chunk on (the stream goes on)",
        (410,),
        "session",
    ),
    (
        "POST",
        "/sessions/{sid}/audio",
        "push_audio",
        "Queue speech audio (any format FFmpeg decodes) for the character",
        (410, 415),
        "session",
    ),
    ("POST", "/sessions/{sid}/interrupt", "interrupt", "Stop speaking", (410,), "session"),
    (
        "GET",
        "/metrics",
        "metrics",
        "Prometheus text (per-session series with the operator key)",
        (),
        "anyone",
    ),
)


class AuthorizedFirst(APIRoute):
    """A route whose ``check(request)`` runs before FastAPI reads and validates the body (FastAPI reads a body
    before it runs any dependency): a request its credential does not allow is refused without its body read."""

    check = None  # async (request) -> None, raising ApiError

    def get_route_handler(self):
        handler, check = super().get_route_handler(), self.check

        async def checked_first(request):
            await check(request)
            return await handler(request)

        return checked_first


def refusals(codes) -> dict:
    """The documented refusals for ``codes``: each an :class:`ErrorBody` (429 with its Retry-After)."""
    return {
        c: {"model": ErrorBody, "description": REFUSALS[c], **({"headers": RETRY_AFTER} if c == 429 else {})}
        for c in codes
    }


def _route_kwargs(api: SessionApi, name: str, summary: str, codes: tuple, who: str) -> dict:
    """FastAPI's keywords for one route: its summary, refusals, credentials (and what the signature cannot
    say: the two bodies of ``POST /sessions``, the bytes of ``/audio``, the text of ``/metrics``)."""
    keyed = api.cfg.api_key is not None
    kw: dict = {"summary": summary, "dependencies": []}
    if who == "session":
        kw["dependencies"] = [Security(SESSION_TOKEN), *([Security(API_KEY)] if keyed else [])]
        kw["route_class_override"] = type(
            "SessionRoute", (AuthorizedFirst,), {"check": staticmethod(api.authorize)}
        )
        codes = SESSION_ROUTE + codes
    elif who in ("operator", "creator") and keyed:
        kw["dependencies"] = [Security(API_KEY)]
        codes = (401, *codes)
    kw["responses"] = refusals(sorted(codes))
    if name == "index":
        kw["include_in_schema"] = False
    elif name == "create_session":
        kw.update(status_code=201, response_model=SessionCreated)
        content = {
            "application/json": {"schema": api.session_json.model_json_schema()},
            "multipart/form-data": {"schema": api.session_form.model_json_schema()},
        }
        kw["openapi_extra"] = {"requestBody": {"required": True, "content": content}}
    elif name == "push_audio":
        content = {"application/octet-stream": BINARY, "audio/wav": BINARY}
        kw["openapi_extra"] = {"requestBody": {"required": True, "content": content}}
    elif name == "metrics":
        text = {"text/plain": {"schema": {"type": "string"}}}
        kw.update(
            response_class=Response, responses={200: {"description": "Prometheus text", "content": text}}
        )
        kw["openapi_extra"] = {"security": [{}, {"apiKey": []}] if keyed else []}
    return kw


def add_routes(app, mgr, static_dir) -> None:
    """Every route of :data:`ROUTES` on ``app``, and the page's static files under ``/static``."""
    from fastapi.staticfiles import StaticFiles

    api = SessionApi(mgr, static_dir)
    for method, path, name, summary, codes, who in ROUTES:
        kw = _route_kwargs(api, name, summary, codes, who)
        app.router.add_api_route(path, getattr(api, name), methods=[method], **kw)
        if name == "index":
            app.mount("/static", StaticFiles(directory=static_dir), name="static")


def install_openapi(app) -> None:
    """``app.openapi``: FastAPI's document of the routes and models, cached, with what FastAPI adds and this
    server never sends taken out (its 422: every refusal here is a 400 with an :class:`ErrorBody`) and the
    seed's bound exact (FastAPI's spec model turns 2^63 - 1 into a float)."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            for ops in spec.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                spec.get("components", {}).get("schemas", {}).pop(name, None)
            _exact_bounds(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


def _exact_bounds(node) -> None:
    if isinstance(node, dict):
        if node.get("maximum") == float(MAX_SEED):
            node["maximum"] = MAX_SEED
        for v in node.values():
            _exact_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _exact_bounds(v)


__all__ = ["API_VERSION", "MAX_PROMPT", "ROUTES", "SessionApi", "add_routes", "install_openapi"]
