"""The HTTP API (FastAPI) and the session manager.

    POST   /sessions               SDP offer (+ reference image, prompt, agent) -> SDP answer + session id
    GET    /sessions               open sessions
    GET    /sessions/{id}          state, fps, latency, underruns ... (a closed one: its final state)
    DELETE /sessions/{id}          close -> the session's report
    POST   /sessions/{id}/say      {"text": "..."}: the character says it (espeak-ng)
    POST   /sessions/{id}/audio    any audio file (body): the character says it
    POST   /sessions/{id}/interrupt  stop speaking
    GET    /sessions/{id}/report   the JSON report (kept ``report_ttl_s`` after close)
    GET    /metrics                Prometheus
    GET    /config, /healthz       what the page needs; liveness
    GET    /                       the page (static/index.html + app.js)

Every error is ``{"error": "<one line>"}`` with a 4xx/5xx status; a full server answers 503 with
``Retry-After``. Admission: one session per worker group (``ServeConfig.groups``).
"""


import asyncio
import base64
import binascii
import collections
import json
import logging
import math
import os
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from aiortc.exceptions import InvalidAccessError, OperationError

from cadence.errors import CadenceError, InputError
from cadence.serve.agent import TTSUnavailable, decode_audio_bytes, espeak_binary, make_agent, synthesize
from cadence.serve.config import DEFAULT_PROMPT, ServeConfig, engine_config, resolve_engine_options
from cadence.serve.rtc import VIDEO_CODECS, use_ice_host_addresses
from cadence.serve.session import LiveSession
from cadence.serve.worker import WorkerGroup
from cadence.telemetry.metrics import CONTENT_TYPE_LATEST, ServeMetrics

log = logging.getLogger("cadence.serve")
STATIC = Path(__file__).parent / "static"
MAX_PROMPT = 1000


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, " ".join(str(message).split()), headers or {}


class SessionManager:
    """Worker groups, open sessions, closed sessions' reports, metrics."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.engine_cfg = e = engine_config(cfg)
        self.metrics = ServeMetrics()
        self.metrics.groups.set(len(cfg.groups))
        frame_shape = (e.video_frames_per_chunk, e.stream.height, e.stream.width, 3)
        frame_bytes = frame_shape[0] * frame_shape[1] * frame_shape[2] * 3
        self.groups = []
        for i, dev in enumerate(cfg.groups):
            opts, notes = resolve_engine_options(cfg, dev, frame_bytes)
            opts["notes"] = notes
            self.groups.append(WorkerGroup(i, cfg.preset, dev, cfg.worker_threads, cfg.seed, options=opts,
                                           frame_shape=frame_shape, slots=cfg.max_in_flight + 1))
        self.sessions: dict[str, LiveSession] = {}
        self.reports: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._report_times: dict[str, float] = {}
        self.background: set[asyncio.Task] = set()
        self.started = False
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        use_ice_host_addresses(self.cfg.ice_host_addresses)
        for g in self.groups:
            g.on_message = (lambda msg, g=g: self._route(g, msg))
            g.start()
        deadline = self.loop.time() + self.cfg.worker_start_timeout_s
        while not all(g.ready.is_set() for g in self.groups):
            failed = [g for g in self.groups if g.start_error]
            if failed:
                raise RuntimeError("; ".join(f"worker {g.index} ({g.device}): {g.start_error}" for g in failed))
            if self.loop.time() > deadline:
                raise RuntimeError(f"worker processes not ready within {self.cfg.worker_start_timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        self.started = True
        log.info("cadence serve: preset %s, %d group(s) %s, lead %s ms", self.cfg.preset, len(self.groups),
                 list(self.cfg.groups), [round(self.lead_ms(g), 1) for g in self.groups])

    def lead_ms(self, g: WorkerGroup) -> float:
        """How long before a chunk is due the scheduler hands it to group ``g``'s worker: ``lead_ms``, raised
        (``lead_auto``) to the worker's measured steady chunk time x (1 + lead_margin) + 20 ms. The
        lower this is, the sooner speech reaches the screen; it cannot go below one chunk's work."""
        lead = self.cfg.lead_ms
        warm = (g.info or {}).get("warmup") or {}
        if self.cfg.lead_auto and warm.get("steady_chunk_ms"):
            lead = max(lead, warm["steady_chunk_ms"] * (1 + self.cfg.lead_margin) + 20.0)
        return lead

    async def stop(self, timeout: float = 20.0) -> None:
        """Close every session, wait for the background work (closes, worker restarts), stop the
        workers. Bounded: what still runs ``timeout`` seconds in is cancelled (and logged), and the
        worker processes are stopped whatever happened before."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for s in list(self.sessions.values()):
            s.close_soon("shutdown")  # each close is a background task (a no-op if one is running)
        while self.background:
            left = deadline - loop.time()
            if left <= 0:
                log.warning("shutdown: %d task(s) still running after %.0f s, cancelled: %s", len(self.background),
                            timeout, sorted(t.get_name() for t in self.background))
                for t in list(self.background):
                    t.cancel()
                await asyncio.wait(list(self.background), timeout=1.0)
                break
            await asyncio.wait(list(self.background), timeout=left)
        await asyncio.gather(*(g.stop() for g in self.groups), return_exceptions=True)
        use_ice_host_addresses(None)
        self.started = False

    def _route(self, g: WorkerGroup, msg: tuple) -> None:
        sess = self.sessions.get(g.session_id) if g.session_id else None
        if msg[0] == "died":
            log.error("worker %d died: %s", g.index, msg[2])
            if sess is None and g.start_error is None:  # a worker that cannot start is not restarted in a loop
                self._bg(g.restart())
        if sess is None:
            return
        if msg[0] in ("opened", "chunk", "closed", "error") and msg[1] is not None and msg[1] != sess.sid:
            return  # stale message of an earlier session
        sess.on_worker_message(msg)

    def _bg(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.background.add(t)
        t.add_done_callback(self.background.discard)

    # ---- admission ------------------------------------------------------------------------------
    def acquire(self) -> WorkerGroup | None:
        for g in self.groups:
            if g.free:
                return g
        return None

    def retry_after(self) -> int:
        """Seconds until a group is likely free: the soonest max-duration end, 1..60."""
        now = time.monotonic()
        left = [self.cfg.max_duration_s - (now - s.t_created) for s in self.sessions.values()]
        return int(min(60, max(1, math.ceil(min(left)) if left else 5)))

    async def release_group(self, sess: LiveSession) -> None:
        g = sess.group
        if g.session_id != sess.sid:
            return
        ok = False
        if g.ready.is_set():
            ack = sess._closed_ack = asyncio.get_running_loop().create_future()
            g.send(("close", sess.sid))
            await asyncio.wait({ack}, timeout=10.0)
            ok = ack.done() and not ack.cancelled() and ack.result() is True
        if not ok:
            log.warning("worker %d did not release session %s: restarting it", g.index, sess.sid)
            await g.restart()
        g.session_id = None

    def session_closed(self, sess: LiveSession, report: dict) -> None:
        self.sessions.pop(sess.sid, None)
        self.metrics.remove_session(sess.sid)
        self.metrics.sessions.labels(sess.close_reason or "unknown").inc()
        self.metrics.active.set(len(self.sessions))
        self.reports[sess.sid] = report
        self._report_times[sess.sid] = time.monotonic()
        self._expire_reports()
        log.info("session report %s", json.dumps(report, default=str))

    def _expire_reports(self) -> None:
        now = time.monotonic()
        while self.reports:
            sid, _ = next(iter(self.reports.items()))
            if len(self.reports) > self.cfg.max_reports or now - self._report_times[sid] > self.cfg.report_ttl_s:
                self.reports.popitem(last=False)
                self._report_times.pop(sid, None)
            else:
                break

    def get_open(self, sid: str) -> LiveSession:
        s = self.sessions.get(sid)
        if s is not None and s.state not in ("closing", "closed"):
            return s
        self._expire_reports()
        if s is not None or sid in self.reports:
            raise ApiError(410, f"session {sid} is closed")
        raise ApiError(404, f"unknown session {sid!r}")

    # ---- session creation -------------------------------------------------------------------------
    async def create(self, *, sdp: str, sdp_type: str, image_bytes: bytes | None, prompt: str, agent: str,
                     seed: int, t_request: float) -> dict:
        cfg = self.cfg
        try:
            ag = make_agent(agent, self.engine_cfg.chunk_seconds)
        except InputError as e:
            raise ApiError(400, str(e)) from None
        if agent == "say" and espeak_binary() is None:
            raise ApiError(503, "the 'say' agent needs espeak-ng, which is not installed on the server "
                                "(Debian: apt-get install espeak-ng); use agent 'mirror'")
        if len(prompt) > MAX_PROMPT:
            raise ApiError(400, f"prompt is too long ({len(prompt)} characters; limit {MAX_PROMPT})")
        _check_sdp(sdp, sdp_type, cfg.max_sdp_bytes)
        image = None
        if image_bytes is not None:
            image = await asyncio.to_thread(_decode_image, image_bytes, self.engine_cfg, cfg.max_image_bytes)
        g = self.acquire()
        if g is None:
            self.metrics.refused.inc()
            raise ApiError(503, f"no free session slot ({len(self.groups)} group(s), all busy); retry later",
                           {"Retry-After": str(self.retry_after())})
        sid = uuid.uuid4().hex
        g.session_id = sid
        sess = LiveSession(self, sid, g, ag, self.engine_cfg, prompt, seed)
        sess.t_created = t_request
        self.sessions[sid] = sess
        self.metrics.active.set(len(self.sessions))
        try:
            answer = await sess.start(image, sdp, sdp_type)
        except ValueError as e:  # aiortc's SDP parser and checks
            await sess.close("bad_offer")
            raise ApiError(400, f"malformed SDP offer: {e}") from None
        except (OperationError, InvalidAccessError) as e:  # a well-formed offer aiortc cannot answer
            await sess.close("bad_offer")
            raise ApiError(400, f"cannot answer the SDP offer ({e}): the server sends {' or '.join(VIDEO_CODECS)} "
                                "video and Opus audio") from None
        except Exception as e:
            await sess.close("start_failed")
            log.exception("session %s failed to start", sid)
            raise ApiError(500, f"session failed to start: {type(e).__name__}: {e}") from None
        return {"session_id": sid, "sdp": answer.sdp, "type": answer.type, "agent": ag.name,
                "preset": self.engine_cfg.name, "fps": self.engine_cfg.stream.fps,
                "width": self.engine_cfg.stream.width, "height": self.engine_cfg.stream.height}


def _check_sdp(sdp, sdp_type, limit: int) -> None:
    if not isinstance(sdp, str) or not sdp.strip():
        raise ApiError(400, "missing SDP offer ('sdp')")
    if sdp_type != "offer":
        raise ApiError(400, f"SDP type must be 'offer', got {sdp_type!r}")
    if len(sdp.encode()) > limit:
        raise ApiError(413, f"SDP offer is too large ({len(sdp.encode())} bytes; limit {limit})")
    lines = [ln.strip() for ln in sdp.strip().splitlines()]
    if not lines or lines[0] != "v=0":
        raise ApiError(400, "malformed SDP offer: it must start with 'v=0'")
    if not any(ln.startswith("m=video") for ln in lines):
        raise ApiError(400, "malformed SDP offer: no video section (m=video); offer a recvonly video transceiver")
    if not any(ln.startswith("a=fingerprint:") for ln in lines):
        raise ApiError(400, "malformed SDP offer: no DTLS fingerprint (a=fingerprint)")


def _decode_image(data: bytes, engine_cfg, limit: int) -> np.ndarray:
    from cadence.media.image import load_reference_image

    if len(data) > limit:
        raise ApiError(413, f"reference image is too large ({len(data)} bytes; limit {limit})")
    if not data:
        raise ApiError(400, "reference image is empty (0 bytes)")
    fd, path = tempfile.mkstemp(prefix="cadence-upload-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            img = load_reference_image(path, engine_cfg.stream.height, engine_cfg.stream.width)
        except InputError as e:
            msg = str(e).replace(path, "upload").replace(": upload", "")
            raise ApiError(413 if "too large" in msg else 400, msg) from None
    finally:
        os.unlink(path)
    return img.numpy()


# ---- the FastAPI app ------------------------------------------------------------------------------

def create_app(cfg: ServeConfig | None = None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException as StarletteHTTPException

    cfg = cfg or ServeConfig()
    mgr = SessionManager(cfg)

    @asynccontextmanager
    async def lifespan(app):
        try:  # a worker that cannot start still gets its process stopped and its shared memory unlinked
            await mgr.start()
            yield
        finally:
            await mgr.stop()

    app = FastAPI(title="cadence", version="0.1.0", lifespan=lifespan,
                  description="Live talking characters over WebRTC: chunk-causal video diffusion.")
    app.state.manager = mgr
    body_limit = max(cfg.max_image_bytes, cfg.max_audio_bytes) + cfg.max_sdp_bytes + 64 * 1024

    def err(status: int, message: str, headers: dict | None = None):
        if 400 <= status < 500:
            mgr.metrics.bad_requests.labels(str(status)).inc()
        return JSONResponse({"error": " ".join(str(message).split())}, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return err(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return err(exc.status_code, exc.detail if isinstance(exc.detail, str) else str(exc.detail),
                   getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return err(400, f"invalid request: {where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(CadenceError)
    async def _cadence_error(request, exc):
        return err(400, str(exc))

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        n = request.headers.get("content-length")
        if n is not None:
            try:
                size = int(n)
            except ValueError:
                return err(400, "invalid Content-Length")
            if size > body_limit:
                return err(413, f"request body is too large ({size} bytes; limit {body_limit})")
        return await call_next(request)

    # ---- routes ----
    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/healthz")
    async def healthz():
        return {"ok": mgr.started, "groups": len(mgr.groups), "free": sum(g.free for g in mgr.groups),
                "sessions": len(mgr.sessions)}

    @app.get("/config")
    async def config():
        e = mgr.engine_cfg
        return {"preset": e.name, "width": e.stream.width, "height": e.stream.height, "fps": e.stream.fps,
                "sample_rate": 48000, "frames_per_chunk": e.video_frames_per_chunk,
                "audio_samples_per_chunk": e.audio_samples_per_chunk, "chunk_ms": round(1e3 * e.chunk_seconds, 3),
                "agents": ["mirror", "say"], "say_available": espeak_binary() is not None,
                "groups": len(mgr.groups), "max_image_bytes": cfg.max_image_bytes,
                "max_audio_bytes": cfg.max_audio_bytes, "idle_timeout_s": cfg.idle_timeout_s,
                "max_duration_s": cfg.max_duration_s,
                "weights": {"model": e.model.weights, "vae": e.vae.weights},
                "workers": [{"index": g.index, "device": g.device, "ready": g.ready.is_set(),
                             "lead_ms": round(mgr.lead_ms(g), 1), **(g.info or {})} for g in mgr.groups]}

    @app.post("/sessions", status_code=201, summary="Start a session: SDP offer in, SDP answer out",
              openapi_extra={"requestBody": {"content": {
                  "application/json": {"schema": {"type": "object", "required": ["sdp"], "properties": {
                      "sdp": {"type": "string"}, "type": {"type": "string", "default": "offer"},
                      "prompt": {"type": "string"}, "agent": {"type": "string", "enum": ["mirror", "say"]},
                      "seed": {"type": "integer"}, "image_base64": {"type": "string"}}}},
                  "multipart/form-data": {"schema": {"type": "object", "required": ["sdp"], "properties": {
                      "sdp": {"type": "string"}, "type": {"type": "string"}, "prompt": {"type": "string"},
                      "agent": {"type": "string"}, "seed": {"type": "integer"},
                      "image": {"type": "string", "format": "binary"}}}}}}})
    async def create_session(request: Request):
        t_request = time.monotonic()
        ctype = request.headers.get("content-type", "")
        image_bytes = None
        if ctype.startswith("application/json"):
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ApiError(400, "request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object")
            fields = body
            if body.get("image_base64"):
                b64 = str(body["image_base64"])
                if b64.startswith("data:"):
                    b64 = b64.split(",", 1)[-1]
                try:
                    image_bytes = base64.b64decode(b64, validate=True)
                except (binascii.Error, ValueError):
                    raise ApiError(400, "image_base64 is not valid base64") from None
        elif ctype.startswith("multipart/form-data"):
            try:
                form = await request.form(max_files=1, max_fields=20)
            except Exception as e:
                raise ApiError(400, f"could not parse the multipart form: {e}") from None
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
            up = form.get("image")
            if up is not None and not isinstance(up, str):
                image_bytes = await up.read(cfg.max_image_bytes + 1)
                if len(image_bytes) > cfg.max_image_bytes:
                    raise ApiError(413, f"reference image is too large (over {cfg.max_image_bytes} bytes)")
                if not image_bytes:
                    image_bytes = None if not up.filename else b""
        else:
            raise ApiError(415, f"POST /sessions takes application/json or multipart/form-data, got {ctype or 'none'!r}")
        try:
            seed = int(fields.get("seed", 0) or 0)
        except (TypeError, ValueError):
            raise ApiError(400, f"seed must be an integer, got {fields.get('seed')!r}") from None
        return JSONResponse(await mgr.create(
            sdp=fields.get("sdp"), sdp_type=fields.get("type", "offer"), image_bytes=image_bytes,
            prompt=str(fields.get("prompt") or DEFAULT_PROMPT),
            agent=str(fields.get("agent") or "mirror"), seed=seed, t_request=t_request), status_code=201)

    @app.get("/sessions")
    async def list_sessions():
        return {"sessions": [s.status() for s in mgr.sessions.values()]}

    @app.get("/sessions/{sid}")
    async def get_session(sid: str):
        s = mgr.sessions.get(sid)
        if s is not None:
            s.touch()
            return s.status()
        if sid in mgr.reports:
            return {k: v for k, v in mgr.reports[sid].items() if k != "report"}
        raise ApiError(404, f"unknown session {sid!r}")

    @app.get("/sessions/{sid}/report")
    async def get_report(sid: str):
        mgr._expire_reports()
        if sid in mgr.reports:
            return mgr.reports[sid]
        if sid in mgr.sessions:
            raise ApiError(409, f"session {sid} is still open; its report is written when it closes")
        raise ApiError(404, f"no report for session {sid!r} (unknown, or expired after "
                            f"{cfg.report_ttl_s:.0f} s)")

    @app.delete("/sessions/{sid}")
    async def delete_session(sid: str):
        s = mgr.get_open(sid)
        return await s.close("client")

    @app.post("/sessions/{sid}/say")
    async def say(sid: str, request: Request):
        s = mgr.get_open(sid)
        s.touch()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body must be JSON: {\"text\": \"...\"}") from None
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "missing 'text' (a non-empty string)")
        try:
            audio = await asyncio.to_thread(synthesize, text)
        except TTSUnavailable as e:
            raise ApiError(503, str(e)) from None
        s = mgr.get_open(sid)
        if body.get("interrupt"):
            s.agent.interrupt()
        s.agent.speak(audio, t_agent=time.monotonic())
        return {"session_id": sid, "seconds": round(audio.size / 48000, 3),
                "queued_s": round(s.agent.queued_samples / 48000, 3)}

    @app.post("/sessions/{sid}/audio", summary="Queue speech audio (any format FFmpeg decodes) for the character")
    async def push_audio(sid: str, request: Request):
        s = mgr.get_open(sid)
        s.touch()
        data = await request.body()
        if len(data) > cfg.max_audio_bytes:
            raise ApiError(413, f"audio is too large ({len(data)} bytes; limit {cfg.max_audio_bytes})")
        try:
            audio = await asyncio.to_thread(decode_audio_bytes, data)
        except InputError as e:
            raise ApiError(415, f"unsupported audio: {e}") from None
        s = mgr.get_open(sid)
        s.agent.speak(audio, t_agent=time.monotonic())
        return {"session_id": sid, "seconds": round(audio.size / 48000, 3),
                "queued_s": round(s.agent.queued_samples / 48000, 3)}

    @app.post("/sessions/{sid}/interrupt")
    async def interrupt(sid: str):
        s = mgr.get_open(sid)
        s.touch()
        s.agent.interrupt()
        return {"session_id": sid, "interrupted": True}

    @app.get("/metrics")
    async def metrics():
        for s in list(mgr.sessions.values()):
            s.update_metrics()
        return Response(mgr.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
