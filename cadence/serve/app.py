"""The HTTP API (FastAPI) and the session manager.

    POST   /sessions               SDP offer (+ image, prompt, agent) -> SDP answer, session id, token
    GET    /sessions               open sessions (operator key)
    GET    /sessions/{id}          state, fps, latency, underruns ... (a closed one: its final state)
    DELETE /sessions/{id}          close -> the session's report
    POST   /sessions/{id}/say      {"text": "..."}: the character says it (espeak-ng)
    POST   /sessions/{id}/audio    any audio file (body): the character says it
    POST   /sessions/{id}/interrupt  stop speaking
    POST   /sessions/{id}/prompt   {"prompt": "..."}: the new prompt from the next chunk on
    GET    /sessions/{id}/report   the JSON report (kept ``report_ttl_s`` after close)
    GET    /metrics                Prometheus text (per-session series with the operator key)
    GET    /config, /healthz       what the page needs; liveness
    GET    /                       the page (static/index.html + app.js)

Who may do what. Credentials travel as ``Authorization: Bearer <secret>``, compared in constant time.

* Each session has a **token** (32 random bytes, URL-safe), returned once, in the answer to the POST that
  created it; the server keeps only its SHA-256. Every route under ``/sessions/{id}`` needs that token (or
  the operator key): none is 401, any other secret (another session's token included) is 403 and nothing
  happens to the session. An id the server does not know is 404 whatever the credential (ids are 128-bit
  random: knowing whether one exists gives nothing). A closed session's token keeps opening its state
  and report for as long as the report is kept.
* The **operator key** (``ServeConfig.api_key``: ``cadence serve --api-key-file PATH``, ``--api-key`` or
  ``CADENCE_API_KEY``), when set, is needed to create a session (401 without it) and to list the
  sessions (``GET /sessions``) or see the per-session series of ``/metrics`` (which otherwise carries
  only aggregates). Without one (the default loopback run), anyone who reaches the server may create a
  session, and the session list and per-session series are off (403). A non-loopback ``host`` refuses
  to start without a key unless ``insecure_no_auth`` is set (logged as a WARNING).

Input. Every request field is checked before anything is started, and every refusal is one line of
JSON, ``{"error": "..."}``, with a 4xx status (never a 500): strings must be UTF-8-encodable without
NUL, the seed an integer in 0..2^63-1 (no floats, booleans or strings in JSON), the prompt at most
``MAX_PROMPT`` characters, the agent a known one. Bodies are limited per route while they stream in
(``BodyLimit``: a chunked body with no Content-Length is cut at the limit, 413, connection closed). A
session request is checked for a free slot (503 + Retry-After: when the soonest group frees at the latest) and
for the client's pending offers (429 + Retry-After: at most ``max_pending_offers_per_client`` sessions not yet
connected per client: its ``cadence_client`` cookie, or its address off loopback, ``client_keys``) before its
image is looked at; the image's header is read before its pixels (over ``max_image_pixels``:
413, nothing decoded), decodes run one (``decode_concurrency``) at a time on a pool of their own and
give their memory back to the OS afterwards (glibc ``malloc_trim``). An offer that never connects is
closed after ``connect_timeout_s`` (10 s). Admission: one session per worker group (``ServeConfig.groups``).
"""

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import ctypes
import ctypes.util
import gc
import hashlib
import hmac
import inspect
import io
import json
import logging
import math
import os
import re
import secrets
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from aiortc.exceptions import InvalidAccessError, OperationError

from cadence.engine.messages import CloseSession, Died
from cadence.errors import CadenceError, InputError
from cadence.serve.agent import (
    SayAgent,
    TTSUnavailable,
    decode_audio_bytes,
    espeak_binary,
    synthesize,
)
from cadence.serve.agents import AGENTS, make_agent
from cadence.serve.config import DEFAULT_PROMPT, ServeConfig, agent_endpoint, engine_config, worker_spec
from cadence.serve.rtc import VIDEO_CODECS, use_ice_host_addresses
from cadence.serve.session import LiveSession
from cadence.serve.workers import LocalGroups, WorkerGroup
from cadence.telemetry.metrics import CONTENT_TYPE_LATEST, ServeMetrics

log = logging.getLogger("cadence.serve")
STATIC = Path(__file__).parent / "static"
MAX_PROMPT = 1000
MAX_SEED = 2**63 - 1
#: The HTTP + WebRTC API's version (``/config``'s ``api_version``): routes, fields and media as this module
#: documents them. Clients (``cadence.integrations.pipecat``'s remote mode) check it; it changes only when
#: one of them changes incompatibly.
API_VERSION = 1
#: Body limit of every route but POST /sessions and /audio (JSON with a line of text, or nothing).
SMALL_BODY = 64 * 1024
#: Formats a reference image may be in (Pillow plugin names); anything else is a 400 before any decoding.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO (phone photos)


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
        if cfg.fleet is not None:  # cadence serve --ray: the groups of a Ray fleet (FleetConfig.group_source)
            self.source = cfg.fleet.group_source(cfg, self.metrics)
        else:
            groups = []
            for i, dev in enumerate(cfg.groups):
                spec, shm = worker_spec(cfg, dev, frame_bytes)
                groups.append(
                    WorkerGroup(i, spec, frame_shape=frame_shape, slots=cfg.max_in_flight + 1, shm=shm)
                )
            self.source = LocalGroups(groups)
        self.groups = self.source.groups  # (a fleet's list is kept up to date in place)
        self.sessions: dict[str, LiveSession] = {}
        self.reports: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._report_times: dict[str, float] = {}
        self.background: set[asyncio.Task] = set()
        self.started = False
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        # auth and admission bookkeeping, by session id (kept here, not in LiveSession):
        self.tokens: dict[str, bytes] = {}  # SHA-256 of each token, while the session or its report is kept
        self.clients: dict[
            str, str
        ] = {}  # the creator's address, while its slot is reserved or its session open
        self._decode_sem = asyncio.Semaphore(cfg.decode_concurrency)
        self._decode_pool = concurrent.futures.ThreadPoolExecutor(
            cfg.decode_concurrency, thread_name_prefix="cadence-decode"
        )

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._decode_pool.submit(int).result()  # the decode thread exists from now on (a steady thread count)
        use_ice_host_addresses(self.cfg.ice_host_addresses)
        await self.source.start(self._route, self.cfg.worker_start_timeout_s)
        await self._warm_up_media()
        # what the server is made of (~100k objects: FastAPI, aiortc, ...) out of the cyclic collector's sight,
        # so that a full collection (automatic, or the one after each session: _collect_soon) stays short
        gc.collect()
        gc.freeze()
        self.started = True
        log.info(
            "cadence serve: preset %s, %d group(s) %s, lead %s ms",
            self.cfg.preset,
            len(self.groups),
            list(self.cfg.groups),
            [round(self.lead_ms(g), 1) for g in self.groups],
        )

    async def _warm_up_media(self) -> None:
        """What the web side does once per process, done before the first user: an image decoded (Pillow's
        plugins), an audio upload decoded (PyAV), a peer connection made (aiortc's first takes ~60 ms: its
        crypto), a VP8 frame encoded, on the threads that will do it for sessions. The first session's request
        no longer pays for it, and its memory (+5-8 MB, once) is in the server before any session, not
        counted as growth across sessions (docs/perf/soak/NOTES.md). Best effort: a failure is one log line."""
        import fractions

        import av
        from aiortc import RTCPeerConnection
        from aiortc.codecs import get_encoder
        from aiortc.rtcrtpparameters import RTCRtpCodecParameters
        from PIL import Image

        from cadence.serve.agent import decode_audio_bytes, wav_bytes

        try:
            buf = io.BytesIO()
            Image.new("RGB", (32, 24), (120, 90, 60)).save(buf, format="PNG")
            await self.decode_image(buf.getvalue())
            await asyncio.to_thread(decode_audio_bytes, wav_bytes(np.zeros(4800, np.float32)))
            await RTCPeerConnection().close()
            frame = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
            frame.pts, frame.time_base = 0, fractions.Fraction(1, 90_000)
            enc = get_encoder(RTCRtpCodecParameters(mimeType="video/VP8", clockRate=90_000, payloadType=96))
            await asyncio.get_running_loop().run_in_executor(None, enc.encode, frame, False)
        except Exception as e:  # only a head start
            log.warning("could not warm up the media path (%s: %s)", type(e).__name__, e)

    def lead_ms(self, g: WorkerGroup) -> float:
        """How long before a chunk is due the scheduler hands it to group ``g``'s worker (at a session's
        start): ``lead_ms``, raised (``lead_auto``) to the worker's measured chunk latency x (1 + lead_margin)
        + 20 ms. The lower this is, the sooner speech reaches the screen; it cannot go below one chunk's
        work (the session's planner raises it further if chunks come back slower)."""
        return self.worker_speed(g)[0] * 1e3

    def worker_speed(self, g: WorkerGroup) -> tuple[float, float, float]:
        """``(lead, latency, interval)`` in seconds for a new session on group ``g``: the lead (see
        ``lead_ms``), the latency of one chunk (plan -> frames back) and the sustained time per chunk, as the
        worker's warm-up measured them (``lead_ms`` and one chunk period when it measured nothing)."""
        chunk_s = self.engine_cfg.chunk_seconds
        warm = (g.info.warmup if g.info is not None else None) or {}
        latency = warm.get("steady_chunk_ms")
        interval = warm.get("interval_ms")
        lead = self.cfg.lead_ms
        if latency:
            # the web side's view: + the pipe and the event loop (+ a fleet group's Ray hop: transport_s)
            latency = latency / 1e3 + 0.01 + getattr(g, "transport_s", 0.0)
            if self.cfg.lead_auto:
                lead = max(lead, (latency * (1 + self.cfg.lead_margin) + 0.02) * 1e3)
        else:
            latency = min(self.cfg.lead_ms / 1e3, chunk_s)
        profile = getattr(g, "latency_profile", None)  # the tail of the group's recent sessions (pacing.py)
        tail = profile.lead() if profile is not None and self.cfg.lead_auto else None
        if tail is not None:
            lead = max(lead, tail * 1e3)
        return lead / 1e3, latency, (interval / 1e3 if interval else min(latency, chunk_s))

    async def stop(self, timeout: float = 20.0) -> None:
        """Close every session, wait for the background work (closes, worker restarts), stop the
        workers. Bounded: what still runs ``timeout`` seconds in is cancelled (and logged), and the
        worker processes are stopped whatever happened before."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for s in list(self.sessions.values()):
            s.close_soon("shutdown")  # each close is a background task (a no-op if one is running)
        while self.background:
            left = deadline - loop.time()
            if left <= 0:
                log.warning(
                    "shutdown: %d task(s) still running after %.0f s, cancelled: %s",
                    len(self.background),
                    timeout,
                    sorted(t.get_name() for t in self.background),
                )
                for t in list(self.background):
                    t.cancel()
                await asyncio.wait(list(self.background), timeout=1.0)
                break
            await asyncio.wait(list(self.background), timeout=left)
        await self.source.stop()
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        use_ice_host_addresses(None)
        self.started = False

    def _route(self, g: WorkerGroup, msg) -> None:
        sess = self.sessions.get(g.session_id) if g.session_id else None
        if isinstance(msg, Died):
            if self.stopping:  # the server is going down: nothing to restart
                return
            log.error("worker %d died: %s", g.index, msg.reason)
            if (
                sess is None and g.start_error is None
            ):  # a worker that cannot start is not restarted in a loop
                self._bg(g.restart())
        if sess is None:
            return
        sid = getattr(msg, "sid", None)
        if sid is not None and sid != sess.sid:
            return  # stale message of an earlier session
        sess.on_worker_message(msg)

    def _bg(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.background.add(t)
        t.add_done_callback(self.background.discard)

    # ---- admission ------------------------------------------------------------------------------
    def acquire(self) -> WorkerGroup | None:
        return self.source.acquire()

    def retry_after(self) -> int:
        """Seconds until a group will be free at the latest, for the soonest one (1..60): an offer that has not
        connected frees its group at its connect timeout, a session at its idle timeout or max duration
        (whichever comes first; most end sooner, when their client leaves), a session closing or a group held
        for an image being decoded within about a second."""
        hint = self.source.retry_after()  # a fleet's: the registry's, over every front end's sessions
        if hint is not None:
            return hint
        now, cfg = time.monotonic(), self.cfg
        left = []
        for s in self.sessions.values():
            if s.state in ("closing", "closed"):
                left.append(1.0)
            elif s.state in ("starting", "connecting") and s.ttff_ms is None:  # (+ the watchdog's tick)
                left.append(s.t_created + cfg.connect_timeout_s - now + 0.5)
            else:
                left.append(min(s.t_created + cfg.max_duration_s, s.last_activity + cfg.idle_timeout_s) - now)
        if any(g.session_id and g.session_id not in self.sessions for g in self.groups):
            left.append(1.0)  # a group reserved for a request whose image is being decoded
        return int(min(60, max(1, math.ceil(min(left)) if left else 5)))

    async def release_group(self, sess: LiveSession) -> None:
        g = sess.group
        if g.session_id != sess.sid:
            return
        ok = False
        if g.ready.is_set():
            ack = sess._closed_ack = asyncio.get_running_loop().create_future()
            g.send(CloseSession(sess.sid))
            await asyncio.wait({ack}, timeout=10.0)
            ok = ack.done() and not ack.cancelled() and ack.result() is True
        if not ok:
            log.warning("worker %d did not release session %s: restarting it", g.index, sess.sid)
            await g.restart()
        self.source.release(g, sess.sid)

    def session_closed(self, sess: LiveSession, report: dict) -> None:
        self.sessions.pop(sess.sid, None)
        self.clients.pop(sess.sid, None)
        self.metrics.remove_session(sess.sid)
        self.metrics.sessions.labels(sess.close_reason or "unknown").inc()
        self.metrics.active.set(len(self.sessions))
        self.reports[sess.sid] = report
        self._report_times[sess.sid] = time.monotonic()
        self._expire_reports()
        if log.isEnabledFor(logging.INFO):  # (not a JSON dump of every report on the loop when not logged)
            log.info("session report %s", json.dumps(report, default=str))
        asyncio.get_running_loop().call_later(1.0, self._collect_soon)

    def _collect_soon(self) -> None:
        """A closed session's objects freed, and their memory given back to the OS. Its peer connection is a
        graph of reference cycles (aiortc's transports, senders, receivers, rate counters: ~2,100 objects) that
        only a full collection frees, and with it the native memory they hold (DTLS/SRTP state, the codecs'
        buffers), which glibc then keeps in the encoder threads' arenas unless trimmed: without this the web
        process grew 112 -> 143 MB over 60 sessions, with it 112 -> 114 (docs/perf/soak/NOTES.md). The
        collection is short because the server's own objects are frozen (``start``)."""
        if self.stopping:
            return
        t = time.perf_counter()
        freed = gc.collect()
        log.debug("after a session: %d objects collected in %.1f ms", freed, (time.perf_counter() - t) * 1e3)
        self.loop.run_in_executor(self._decode_pool, trim_memory)  # on the image pool: the loop goes on

    def _expire_reports(self) -> None:
        now = time.monotonic()
        while self.reports:
            sid, _ = next(iter(self.reports.items()))
            if (
                len(self.reports) > self.cfg.max_reports
                or now - self._report_times[sid] > self.cfg.report_ttl_s
            ):
                self.reports.popitem(last=False)
                self._report_times.pop(sid, None)
                if sid not in self.sessions:
                    self.tokens.pop(sid, None)
            else:
                break

    def get_open(self, sid: str) -> LiveSession:
        s = self.sessions.get(sid)
        if s is not None and s.state not in ("closing", "closed"):
            return s
        self._expire_reports()
        if s is not None or sid in self.reports:
            raise ApiError(410, f"session {sid} is closed")
        raise ApiError(404, f"unknown session {_short(sid)!r}")

    # ---- auth -----------------------------------------------------------------------------------------
    def is_operator(self, credential: str | None) -> bool:
        """``credential`` is the operator key (constant-time compare; False when no key is configured)."""
        key = self.cfg.api_key
        return key is not None and credential is not None and hmac.compare_digest(_b(credential), _b(key))

    def authorize(self, sid: str, credential: str | None) -> None:
        """Let a request on session ``sid`` through, or raise: 404 for an id the server does not know (open
        or with its report kept), 401 without a credential, 403 for one that is neither this session's
        token nor the operator key."""
        self._expire_reports()
        if sid not in self.sessions and sid not in self.reports:
            raise ApiError(404, f"unknown session {_short(sid)!r}")
        if credential is None:
            raise ApiError(
                401,
                "this session's token is needed (Authorization: Bearer <token>, as returned "
                "by POST /sessions)",
                {"WWW-Authenticate": "Bearer"},
            )
        if self.is_operator(credential):
            return
        digest = self.tokens.get(sid)
        if digest is None or not hmac.compare_digest(hashlib.sha256(_b(credential)).digest(), digest):
            raise ApiError(403, f"the token given does not open session {sid}")

    def require_operator(self, credential: str | None, what: str) -> None:
        if self.cfg.api_key is None:
            raise ApiError(
                403,
                f"{what} needs the operator key, and this server has none (cadence serve "
                "--api-key-file PATH)",
            )
        if credential is None:
            raise ApiError(
                401,
                f"{what} needs the operator key (Authorization: Bearer <key>)",
                {"WWW-Authenticate": "Bearer"},
            )
        if not self.is_operator(credential):
            raise ApiError(401, "invalid API key", {"WWW-Authenticate": "Bearer"})

    # ---- admission ------------------------------------------------------------------------------------
    def pending_offers(self, client: tuple[str, ...]) -> int:
        """Sessions created (or being created) by a client with any of the keys ``client`` (see
        :func:`client_keys`) that are not connected yet."""
        n = 0
        for sid, keys in self.clients.items():
            if not set(keys) & set(client):
                continue
            s = self.sessions.get(sid)
            n += s is None or s.state in ("starting", "connecting")
        return n

    def reserve(self, client: tuple[str, ...]) -> tuple[WorkerGroup, str]:
        """Admit a new session from ``client`` (its keys: :func:`client_keys`) or raise: 429 (+ Retry-After)
        when the client already has ``max_pending_offers_per_client`` sessions waiting to connect, 503
        (+ Retry-After) when no group is free. The group is held for the new id at once (nothing awaits in
        between), so an image decoding meanwhile cannot lose its slot to a later request."""
        cfg = self.cfg
        pending = self.pending_offers(client)
        if pending >= cfg.max_pending_offers_per_client:
            self.metrics.refused.inc()
            raise ApiError(
                429,
                f"too many sessions waiting to connect from this client ({pending}; limit "
                f"{cfg.max_pending_offers_per_client}): connect them, DELETE them, or wait "
                f"{cfg.connect_timeout_s:.0f} s for them to time out",
                {"Retry-After": str(self.pending_free_in(client))},
            )
        g = self.acquire()
        if g is None:
            self.metrics.refused.inc()
            raise ApiError(
                503,
                f"no free session slot ({len(self.groups)} group(s), all busy); retry later",
                {"Retry-After": str(self.retry_after())},
            )
        sid = uuid.uuid4().hex
        g.session_id = sid
        self.clients[sid] = client
        return g, sid

    def pending_free_in(self, client: tuple[str, ...]) -> int:
        """Seconds until the client's oldest pending offer times out (1..connect timeout)."""
        now, mine = time.monotonic(), []
        for sid, keys in self.clients.items():
            s = self.sessions.get(sid)
            if set(keys) & set(client) and s is not None and s.state in ("starting", "connecting"):
                mine.append(s.t_created + self.cfg.connect_timeout_s - now + 0.5)
        return max(1, math.ceil(min(mine) if mine else self.cfg.connect_timeout_s))

    def unreserve(self, g: WorkerGroup, sid: str) -> None:
        self.source.release(g, sid)
        self.clients.pop(sid, None)

    async def decode_image(self, data: bytes) -> np.ndarray:
        """The reference image as the engine takes it; at most ``decode_concurrency`` at once, on a pool
        of that many threads (never the event loop's shared executor)."""
        async with self._decode_sem:
            return await asyncio.get_running_loop().run_in_executor(
                self._decode_pool,
                _decode_image,
                data,
                self.engine_cfg,
                self.cfg.max_image_bytes,
                self.cfg.max_image_pixels,
            )

    # ---- session creation -------------------------------------------------------------------------
    def new_agent(self, agent: str):
        """A new agent by name, or the request's refusal (400: unknown, or 'talk' on a server without an
        endpoint; 503: 'say' without espeak-ng installed)."""
        try:
            ag = make_agent(agent, self.engine_cfg.chunk_seconds, agent_endpoint(self.cfg))
        except InputError as e:
            raise ApiError(400, str(e)) from None
        if agent == "say" and espeak_binary() is None:
            raise ApiError(
                503,
                "the 'say' agent needs espeak-ng, which is not installed on the server "
                "(Debian: apt-get install espeak-ng); use agent 'mirror'",
            )
        if agent == "talk" and self.cfg.agent_url is None:  # not offered here (not in this server's schema)
            raise ApiError(
                400,
                "the 'talk' agent needs an OpenAI-compatible LLM endpoint, and this server has none "
                "(cadence serve --agent-url URL); use agent 'mirror' or 'say'",
            )
        return ag

    async def create_local(
        self, agent, image: np.ndarray | None = None, prompt: str = DEFAULT_PROMPT, seed: int = 0
    ):
        """A session in this process with no WebRTC: the caller reads its paced tracks
        (``sess.video.recv()``, ``sess.audio.recv()``) and drives its ``agent`` (an :class:`Agent` the
        caller made). What ``cadence.integrations.pipecat`` runs in process. 503 (ApiError) when full."""
        if not self.started:
            raise RuntimeError("the session manager is not started")
        g, sid = self.reserve(("local",))
        sess = LiveSession(self, sid, g, agent, self.engine_cfg, prompt, seed)
        self.sessions[sid] = sess
        self.metrics.active.set(len(self.sessions))
        try:
            await sess.start_local(image)
        except BaseException:
            await sess.close("start_failed")
            raise
        return sess

    async def create(
        self,
        *,
        sdp: str,
        sdp_type: str,
        image_bytes: bytes | None,
        prompt: str,
        agent: str,
        seed: int,
        t_request: float,
        client: tuple[str, ...] = (),
    ) -> dict:
        """Check the request, admit it (429 / 503), decode its image, start the session. The answer carries
        the session's token, which only this answer ever shows."""
        cfg = self.cfg
        ag = self.new_agent(agent)
        if len(prompt) > MAX_PROMPT:
            raise ApiError(400, f"prompt is too long ({len(prompt)} characters; limit {MAX_PROMPT})")
        _check_sdp(sdp, sdp_type, cfg.max_sdp_bytes)
        # a fleet: a group is claimed fleet-wide first (one machine: nothing to do)
        async with self.source.admission():
            g, sid = self.reserve(client)  # before the image is looked at: a full server decodes nothing
        image = None
        try:
            if image_bytes is not None:
                image = await self.decode_image(image_bytes)
        except BaseException:  # a bad image, or the client gone meanwhile: the slot is free again
            self.unreserve(g, sid)
            raise
        token = secrets.token_urlsafe(32)
        self.tokens[sid] = hashlib.sha256(token.encode()).digest()
        # (a fleet group whose own node terminates WebRTC gives its own session class: cadence.fleet.remote)
        sess = (getattr(g, "session_factory", None) or LiveSession)(
            self, sid, g, ag, self.engine_cfg, prompt, seed
        )
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
            raise ApiError(
                400,
                f"cannot answer the SDP offer ({e}): the server sends {' or '.join(VIDEO_CODECS)} "
                "video and Opus audio",
            ) from None
        except Exception as e:
            await sess.close("start_failed")
            log.exception("session %s failed to start", sid)
            raise ApiError(500, f"session failed to start: {type(e).__name__}: {e}") from None
        return {
            "session_id": sid,
            "token": token,
            "sdp": answer.sdp,
            "type": answer.type,
            "agent": ag.name,
            "preset": self.engine_cfg.name,
            "fps": self.engine_cfg.stream.fps,
            "width": self.engine_cfg.stream.width,
            "height": self.engine_cfg.stream.height,
        }


#: The cookie that tells one client (a browser, an HTTP client keeping cookies) from another for the
#: pending-offer limit: on loopback every local user has the same address (127.0.0.1, and so has everyone
#: behind a TLS proxy on the same host), so the address alone would let one user's pending offers lock out the
#: others. The server sets it (random, HttpOnly) on the page and on the answer to POST /sessions.
CLIENT_COOKIE = "cadence_client"
_COOKIE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def client_keys(address: str | None, cookie: str | None) -> tuple[str, ...]:
    """Who a request comes from, for the pending-offer limit: its ``CLIENT_COOKIE`` (when it carries a
    well-formed one) and its address, unless that is a loopback address (on loopback, one for every local
    user: not a client). A loopback request without the cookie is a client of its own (none of its keys
    matches another's): its offers are bounded by the groups they hold, not by the limit."""
    import ipaddress

    keys = []
    if cookie and 16 <= len(cookie) <= 64 and set(cookie) <= _COOKIE_CHARS:
        keys.append(f"cookie:{cookie}")
    try:
        local = address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        local = False
    if address and not local:
        keys.append(f"addr:{address}")
    return tuple(keys)


#: What POST /sessions checks of an SDP offer's text before anything else, and the ``pattern`` of its ``sdp``
#: field in the OpenAPI schema (one predicate, so that a string the schema allows passes these checks): a
#: first line ``v=0``, a video section (``m=video``) and a DTLS fingerprint (``a=fingerprint:``) at the start
#: of lines, no NUL. ECMA-262 and Python read it alike.
SDP_PATTERN = (
    r"^[ \t]*v=0[ \t]*\r?\n(?:[^\u0000]*\n)?[ \t]*"
    r"(?:m=video[^\u0000]*\n[ \t]*a=fingerprint:|a=fingerprint:[^\u0000]*\n[ \t]*m=video)[^\u0000]*$"
)
_SDP_RE = re.compile(SDP_PATTERN)


def _check_sdp(sdp, sdp_type, limit: int) -> None:
    if not isinstance(sdp, str) or not sdp.strip():
        raise ApiError(400, "missing SDP offer ('sdp')")
    _check_text(sdp, "sdp")
    if sdp_type != "offer":
        raise ApiError(400, f"SDP type must be 'offer', got {_short(str(sdp_type))!r}")
    if len(sdp.encode()) > limit:
        raise ApiError(413, f"SDP offer is too large ({len(sdp.encode())} bytes; limit {limit})")
    if _SDP_RE.match(sdp) is None:
        lines = [ln.strip() for ln in sdp.strip().splitlines()]
        if not lines or lines[0] != "v=0":
            raise ApiError(400, "malformed SDP offer: it must start with 'v=0'")
        if not any(ln.startswith("m=video") for ln in lines):
            raise ApiError(
                400, "malformed SDP offer: no video section (m=video); offer a recvonly video transceiver"
            )
        if not any(ln.startswith("a=fingerprint:") for ln in lines):
            raise ApiError(400, "malformed SDP offer: no DTLS fingerprint (a=fingerprint)")
        raise ApiError(400, "malformed SDP offer: 'v=0', m=video and a=fingerprint must each start a line")
    from aiortc.sdp import SessionDescription

    try:  # aiortc's own parser, before any session is made: it refuses some lines with AssertionError
        SessionDescription.parse(sdp)
    except Exception as e:
        raise ApiError(
            400, f"malformed SDP offer: {type(e).__name__} {_short(str(e), 200)}".strip()
        ) from None


def _b(text: str) -> bytes:
    """A credential as bytes for ``hmac.compare_digest`` (which takes ASCII-only str): any str encodes."""
    return text.encode("utf-8", "surrogatepass")


def _short(text: str, n: int = 64) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _check_text(value: str, name: str) -> str:
    """``value`` if it is text the server can pass on: encodable as UTF-8 (no lone surrogate, which JSON's
    ``\\ud800`` escapes can carry), without NUL. Else a 400 naming the field."""
    if "\0" in value:
        raise ApiError(400, f"'{name}' contains a NUL character (at {value.index(chr(0))})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"'{name}' is not valid Unicode text (a lone surrogate at {e.start})") from None
    return value


def _type_name(value) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _str_field(fields: dict, name: str, default: str | None, max_chars: int | None = None) -> str | None:
    """A string field: absent -> ``default``; anything but a string (null included) -> 400; checked text."""
    if name not in fields:
        return default
    value = fields[name]
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, got {_type_name(value)}")
    _check_text(value, name)
    if max_chars is not None and len(value) > max_chars:
        raise ApiError(400, f"'{name}' is too long ({len(value)} characters; limit {max_chars})")
    return value


def _seed_field(fields: dict, form: bool) -> int:
    """The seed: an integer in 0..2^63-1. JSON: a number without fraction or exponent (``1e999``, ``3.0``,
    ``true``, ``"5"`` are refused); a form field: decimal digits. Absent (or an empty form field) = 0."""
    if "seed" not in fields:
        return 0
    v = fields["seed"]
    if form:
        if v == "":
            return 0
        if not (v.isascii() and v.isdigit()) or len(v) > 19:
            raise ApiError(400, f"'seed' must be an integer in 0..{MAX_SEED}, got {_short(v)!r}")
        v = int(v)
    elif isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'seed' must be an integer in 0..{MAX_SEED}, got {_type_name(v)}")
    if not 0 <= v <= MAX_SEED:
        raise ApiError(400, f"'seed' is out of range (0..{MAX_SEED}), got {_short(str(v), 30)}")
    return v


def _parse_json(body: bytes, what: str):
    """JSON text -> a value, or a 400 for anything ``json`` cannot or should not take: not JSON, not UTF-8,
    nesting deep enough to exhaust the recursion limit, an integer literal over Python's 4,300 digits."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, f"{what} is nested too deeply") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise ApiError(400, f"{what} is not valid JSON") from None


def _bearer(request) -> str | None:
    """The secret of an ``Authorization: Bearer <secret>`` header; None when there is none."""
    h = request.headers.get("authorization")
    if h is None:
        return None
    scheme, _, value = h.strip().partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


_malloc_trim = None


def trim_memory() -> bool:
    """Give freed heap memory back to the OS (glibc ``malloc_trim(0)``, all arenas); False where unavailable.

    A decoded image lives in a few large allocations, freed right after; glibc keeps what was freed in
    each thread's arena for reuse, so without this a process that decoded large images once holds that
    memory for ever (issue 20: rounds of 8 parallel 64 MP uploads left 2 GB behind)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _malloc_trim = False
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """The image's (width, height) from its header alone (Pillow's ``open`` reads no pixel data), or an
    ApiError: 400 for data that is not an image in one of ``IMAGE_FORMATS``, 413 over ``max_pixels``."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
                w, h = im.size
    except Image.DecompressionBombError:
        raise ApiError(
            413, f"reference image is too large (over {max_pixels / 1e6:.1f} megapixels)"
        ) from None
    except UnidentifiedImageError:
        raise ApiError(
            400, f"reference image is not an image in a format the server takes ({', '.join(IMAGE_FORMATS)})"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ApiError(400, f"could not read the reference image's header: {_short(str(e), 200)}") from None
    if w < 1 or h < 1:
        raise ApiError(400, f"reference image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ApiError(
            413,
            f"reference image is {w}x{h} pixels ({w * h / 1e6:.1f} megapixels); the limit is "
            f"{max_pixels / 1e6:.1f} megapixels",
        )
    return w, h


def _decode_image(data: bytes, engine_cfg, limit: int, max_pixels: int) -> np.ndarray:
    """Bytes -> the engine's reference image (HxWx3 float in [-1, 1], covered and cropped). The header first
    (size, format: :func:`image_size`), the pixels only then; the memory goes back to the OS afterwards."""
    if len(data) > limit:
        raise ApiError(413, f"reference image is too large ({len(data)} bytes; limit {limit})")
    if not data:
        raise ApiError(400, "reference image is empty (0 bytes)")
    image_size(data, max_pixels)
    from cadence.media.image import load_reference_array  # (NumPy and Pillow: no torch in this process)

    fd, path = tempfile.mkstemp(prefix="cadence-upload-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            img = load_reference_array(path, engine_cfg.stream.height, engine_cfg.stream.width)
        except InputError as e:
            msg = str(e).replace(path, "upload").replace(": upload", "")
            raise ApiError(413 if "too large" in msg else 400, msg) from None
        return img
    finally:
        os.unlink(path)
        trim_memory()


def _speak(s, sid: str, audio: np.ndarray) -> dict:
    """Queue 48 kHz speech for session ``s``'s character; the answer of /say and /audio."""
    s.agent.speak(audio, t_agent=time.monotonic())
    return {
        "session_id": sid,
        "seconds": round(audio.size / 48000, 3),
        "queued_s": round(s.agent.queued_samples / 48000, 3),
    }


class BodyLimit:
    """ASGI middleware: a request body may not exceed ``limit_for(method, path)`` bytes, however it is sent.

    A declared Content-Length over the limit is refused before anything is read; a body without one
    (chunked) is counted as it streams in, and the first message past the limit ends it: the app's
    ``receive`` raises, whatever the handler then answers is replaced by one 413 (``on_refuse`` makes
    it), sent with ``Connection: close`` so the server stops reading the rest (at most ``limit`` bytes
    plus one read buffer are ever read). Any answer sent before the body was read to its end (a 401,
    404, 503 that needs no body) closes the connection too: otherwise the server would go on reading,
    and discarding, whatever the client still sends."""

    def __init__(self, app, limit_for, on_refuse):
        self.app, self.limit_for, self.on_refuse = app, limit_for, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["method"], scope["path"])
        headers = scope.get("headers", ())
        declared = [v for k, v in headers if k == b"content-length"]
        size = 0
        if declared:
            try:
                size = int(declared[0])
            except ValueError:
                return await self._refuse(send, 400, "invalid Content-Length")
            if size > limit:
                return await self._refuse(
                    send, 413, f"request body is too large ({size} bytes; limit {limit})"
                )
        body_left = size > 0 or any(k == b"transfer-encoding" for k, _ in headers)
        seen = 0
        over = False
        replaced = False
        started = False
        message = f"request body is too large (over {limit} bytes)"

        async def limited_receive():
            nonlocal seen, over, body_left
            if over:
                raise ApiError(413, message)
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    over = True
                    raise ApiError(413, message)
                body_left = body_left and msg.get("more_body", False)
            return msg

        async def guarded_send(msg):
            nonlocal replaced, started
            if replaced:
                return
            if msg["type"] == "http.response.start":
                if over:
                    replaced = True
                    return await self._refuse(send, 413, message)
                started = True
                if body_left:
                    msg = {**msg, "headers": [*msg.get("headers", ()), (b"connection", b"close")]}
            await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over or started or replaced:
                raise
            await self._refuse(send, 413, message)

    async def _refuse(self, send, status: int, message: str) -> None:
        resp = self.on_refuse(status, message)
        resp.headers["connection"] = "close"
        await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


# ---- OpenAPI: what every route answers --------------------------------------------------------------

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {"type": "string", "description": "one line, for a person"}},
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    }
}
_ERRORS = {
    400: (
        (
            "Bad request: a field missing, of the wrong type, out of range, or text that is not valid Unicode "
            "or carries NUL; not JSON; a malformed SDP offer; an image that is not one"
        ),
        None,
    ),
    401: (
        "No credential, or an invalid API key (Authorization: Bearer ...)",
        {"WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}},
    ),
    403: (
        (
            "The credential does not open this resource (another session's token), or the route needs the "
            "operator key and this server has none"
        ),
        None,
    ),
    404: ("No such session (or its report has expired), or no such route", None),
    409: ("The session is still open: its report is written when it closes", None),
    410: ("The session is closed (its state and report stay readable for a while)", None),
    413: ("Body, image (bytes or pixels), SDP offer or audio over its limit", None),
    415: ("A content type this route does not take, or audio that cannot be decoded", None),
    429: ("This client already has as many sessions waiting to connect as it may", _RETRY_AFTER),
    500: ("The session could not be started (the worker failed)", None),
    503: ("No free session slot, or a server-side dependency missing (espeak-ng for 'say')", _RETRY_AFTER),
}


def _errors(*codes: int) -> dict:
    out = {}
    for c in codes:
        desc, headers = _ERRORS[c]
        if c == 503:
            headers = None  # a 503 for a missing espeak-ng carries no Retry-After; a full server's does
        out[c] = {
            "description": desc,
            "content": {"application/json": {"schema": _ERROR_SCHEMA}},
            **({"headers": headers} if headers else {}),
        }
    return out


def _ok(description: str, schema: dict | None = None, status: int = 200) -> dict:
    return {
        status: {
            "description": description,
            "content": {"application/json": {"schema": schema or {"type": "object"}}},
        }
    }


_SESSION_ROUTE = (400, 401, 403, 404, 413)


# ---- the FastAPI app ------------------------------------------------------------------------------


def create_app(cfg: ServeConfig | None = None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import FileResponse, JSONResponse, Response
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException as StarletteHTTPException

    cfg = cfg or ServeConfig()
    if not cfg.loopback and cfg.api_key is None:  # ServeConfig allows it only with insecure_no_auth
        log.warning(
            "WARNING: serving on %s (not loopback) WITHOUT an API key (--insecure-no-auth): anyone "
            "who reaches this address can start sessions; use --api-key-file PATH",
            cfg.host,
        )
    mgr = SessionManager(cfg)

    @asynccontextmanager
    async def lifespan(app):
        try:  # a worker that cannot start still gets its process stopped and its shared memory unlinked
            await mgr.start()
            yield
        finally:
            await mgr.stop()

    app = FastAPI(
        title="cadence",
        version="0.1.0",
        lifespan=lifespan,
        description="Live talking characters over WebRTC: chunk-causal video diffusion. Each "
        "session's routes need the token POST /sessions returned (Authorization: Bearer "
        "<token>); with an operator key configured, creating sessions and listing them "
        "need it.",
    )
    app.state.manager = mgr
    if cfg.fleet is not None:  # GET /fleet, POST|DELETE /fleet/groups/{name}/drain (FleetConfig.add_routes)
        cfg.fleet.add_routes(app, mgr, ApiError, _bearer)
    session_body = math.ceil(cfg.max_image_bytes * 4 / 3) + cfg.max_sdp_bytes + SMALL_BODY  # (base64 image)
    audio_body = cfg.max_audio_bytes + SMALL_BODY

    def limit_for(method: str, path: str) -> int:
        if method == "POST" and path.rstrip("/") == "/sessions":
            return session_body
        if method == "POST" and path.startswith("/sessions/") and path.endswith("/audio"):
            return audio_body
        return SMALL_BODY

    def err(status: int, message: str, headers: dict | None = None):
        if 400 <= status < 500:
            mgr.metrics.bad_requests.labels(str(status)).inc()
        return JSONResponse({"error": " ".join(str(message).split())}, status_code=status, headers=headers)

    app.add_middleware(BodyLimit, limit_for=limit_for, on_refuse=err)

    def allowed_methods(path: str) -> list[str]:
        methods: set[str] = set()
        for r in app.router.routes:
            m = getattr(r, "methods", None)
            if m and r.path_regex.match(path):
                methods |= set(m)
        return sorted(methods)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return err(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of the path, not only those of the route that matched first
            allow = allowed_methods(request.url.path)
            if allow:
                headers["Allow"] = ", ".join(allow)
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return err(exc.status_code, detail, headers or None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return err(400, f"invalid request: {where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(CadenceError)
    async def _cadence_error(request, exc):
        return err(400, str(exc))

    def with_client_cookie(request, response):
        """Give a client without one its ``CLIENT_COOKIE`` (the pending-offer limit's key on loopback)."""
        if request.cookies.get(CLIENT_COOKIE) is None:
            response.set_cookie(
                CLIENT_COOKIE, secrets.token_urlsafe(16), httponly=True, samesite="strict", max_age=86400 * 30
            )
        return response

    # ---- routes ----
    @app.get("/", include_in_schema=False)
    async def index(request: Request):
        return with_client_cookie(request, FileResponse(STATIC / "index.html", media_type="text/html"))

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/healthz", summary="Liveness", responses=_ok("Liveness and free slots"))
    async def healthz():
        return {
            "ok": mgr.started,
            "groups": len(mgr.groups),
            "free": sum(g.free for g in mgr.groups),
            "sessions": len(mgr.sessions),
        }

    @app.get(
        "/config",
        summary="What the page needs: geometry, agents, limits, whether an API key is needed",
        responses=_ok("The server's configuration"),
    )
    async def config():
        e = mgr.engine_cfg
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

    # A server without an operator key has no credential to ask for on the operator routes (they are off,
    # 403), so its spec names none there; every session route takes the session's token (or the key).
    operator = [{"apiKey": []}] if cfg.api_key else []
    per_session = [{"sessionToken": []}, {"apiKey": []}] if cfg.api_key else [{"sessionToken": []}]

    text = {"type": "string", "pattern": "^[^\\u0000]*$"}
    session_fields = {
        "sdp": {
            "type": "string",
            "minLength": 1,
            "pattern": SDP_PATTERN,
            "description": "the client's SDP offer (a recvonly video "
            "transceiver; audio sendrecv for the microphone)",
        },
        "type": {"type": "string", "enum": ["offer"], "default": "offer"},
        "prompt": {**text, "maxLength": MAX_PROMPT, "description": f"default: {DEFAULT_PROMPT!r}"},
        "agent": {
            "type": "string",
            "enum": sorted(a for a in AGENTS if a != "talk" or cfg.agent_url is not None),
            "default": "mirror",
        },
    }
    created = {
        "type": "object",
        "required": ["session_id", "token", "sdp", "type"],
        "properties": {
            "session_id": {"type": "string"},
            "token": {
                "type": "string",
                "description": "this session's secret: send it as 'Authorization: Bearer "
                "<token>' on every /sessions/{id} route; shown only here",
            },
            "sdp": {"type": "string"},
            "type": {"type": "string", "enum": ["answer"]},
            "agent": {"type": "string"},
            "preset": {"type": "string"},
            "fps": {"type": "integer"},
            "width": {"type": "integer"},
            "height": {"type": "integer"},
        },
    }

    @app.post(
        "/sessions",
        status_code=201,
        summary="Start a session: SDP offer in, SDP answer (+ token) out",
        responses={
            **_ok("The SDP answer, the session id and its token", created, 201),
            **_errors(400, *((401,) if cfg.api_key else ()), 413, 415, 429, 500, 503),
        },
        openapi_extra={
            "security": operator,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["sdp"],
                            "properties": {
                                **session_fields,
                                "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED, "default": 0},
                                "image_base64": {
                                    "type": "string",
                                    "contentEncoding": "base64",
                                    "description": "the reference image (PNG, JPEG, WebP, ...), base64; "
                                    f"at most {cfg.max_image_bytes} bytes and "
                                    f"{cfg.max_image_pixels} pixels",
                                },
                            },
                        }
                    },
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "required": ["sdp"],
                            "properties": {
                                **session_fields,
                                "seed": {
                                    "type": "string",
                                    "pattern": "^[0-9]{0,19}$",
                                    "description": f"0..{MAX_SEED}",
                                },
                                "image": {"type": "string", "format": "binary"},
                            },
                        }
                    },
                },
            },
        },
    )
    async def create_session(request: Request):
        t_request = time.monotonic()
        if cfg.api_key is not None:
            cred = _bearer(request)
            if cred is None:
                raise ApiError(
                    401,
                    "creating a session needs the API key (Authorization: Bearer <key>)",
                    {"WWW-Authenticate": "Bearer"},
                )
            if not mgr.is_operator(cred):
                raise ApiError(401, "invalid API key", {"WWW-Authenticate": "Bearer"})
        ctype = request.headers.get("content-type", "")
        image_bytes = None
        form = ctype.startswith("multipart/form-data")
        if ctype.startswith("application/json"):
            body = _parse_json(await request.body(), "request body")
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object")
            fields = body
            b64 = _str_field(body, "image_base64", None)
            if b64:
                if b64.startswith("data:"):
                    b64 = b64.split(",", 1)[-1]
                try:
                    image_bytes = base64.b64decode(b64, validate=True)
                except (binascii.Error, ValueError):
                    raise ApiError(400, "image_base64 is not valid base64") from None
        elif form:
            try:
                parsed = await request.form(max_files=1, max_fields=20)
            except ApiError:
                raise
            except Exception as e:
                raise ApiError(400, f"could not parse the multipart form: {e}") from None
            fields = {k: v for k, v in parsed.items() if isinstance(v, str)}
            up = parsed.get("image")
            if up is not None and not isinstance(up, str):
                image_bytes = await up.read(cfg.max_image_bytes + 1)
                if len(image_bytes) > cfg.max_image_bytes:
                    raise ApiError(413, f"reference image is too large (over {cfg.max_image_bytes} bytes)")
                if not image_bytes:
                    image_bytes = None if not up.filename else b""
        else:
            raise ApiError(
                415,
                f"POST /sessions takes application/json or multipart/form-data, got "
                f"{_short(ctype) or 'none'!r}",
            )
        sdp = _str_field(fields, "sdp", None)
        sdp_type = _str_field(fields, "type", "offer")
        prompt = _str_field(fields, "prompt", "", MAX_PROMPT) or DEFAULT_PROMPT
        agent = _str_field(fields, "agent", "") or "mirror"
        seed = _seed_field(fields, form)
        client = client_keys(
            request.client.host if request.client else None, request.cookies.get(CLIENT_COOKIE)
        )
        answer = await mgr.create(
            sdp=sdp,
            sdp_type=sdp_type,
            image_bytes=image_bytes,
            prompt=prompt,
            agent=agent,
            seed=seed,
            t_request=t_request,
            client=client,
        )
        return with_client_cookie(request, JSONResponse(answer, status_code=201))

    @app.get(
        "/sessions",
        summary="Open sessions (needs the operator key; off on a server without one)",
        responses={**_ok("Every open session's state"), **_errors(*((401,) if cfg.api_key else ()), 403)},
        openapi_extra={"security": operator},
    )
    async def list_sessions(request: Request):
        mgr.require_operator(_bearer(request), "the session list")
        return {"sessions": [s.status() for s in mgr.sessions.values()]}

    @app.get(
        "/sessions/{sid}",
        summary="A session's state (a closed one: its final state)",
        responses={**_ok("The session's state"), **_errors(*_SESSION_ROUTE)},
        openapi_extra={"security": per_session},
    )
    async def get_session(sid: str, request: Request):
        mgr.authorize(sid, _bearer(request))
        s = mgr.sessions.get(sid)
        if s is not None:
            s.touch()
            return s.status()
        return {k: v for k, v in mgr.reports[sid].items() if k != "report"}

    @app.get(
        "/sessions/{sid}/report",
        summary="A closed session's report",
        responses={**_ok("The session's report"), **_errors(*_SESSION_ROUTE, 409)},
        openapi_extra={"security": per_session},
    )
    async def get_report(sid: str, request: Request):
        mgr.authorize(sid, _bearer(request))
        if sid in mgr.reports:
            return mgr.reports[sid]
        raise ApiError(409, f"session {sid} is still open; its report is written when it closes")

    @app.delete(
        "/sessions/{sid}",
        summary="Close a session; its report",
        responses={**_ok("The session's report"), **_errors(*_SESSION_ROUTE, 410)},
        openapi_extra={"security": per_session},
    )
    async def delete_session(sid: str, request: Request):
        mgr.authorize(sid, _bearer(request))
        s = mgr.get_open(sid)
        return await s.close("client")

    say_schema = {
        "type": "object",
        "required": ["text"],
        "properties": {
            "text": {
                "type": "string",
                "minLength": 1,
                "maxLength": SayAgent.max_text,
                "pattern": "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$",
                "description": "what to say (not only whitespace, no NUL)",
            },
            "interrupt": {"type": "boolean", "default": False, "description": "drop what is queued first"},
        },
    }

    @app.post(
        "/sessions/{sid}/say",
        summary="The character says a line of text (espeak-ng)",
        responses={**_ok("Seconds of speech queued"), **_errors(*_SESSION_ROUTE, 410, 503)},
        openapi_extra={
            "security": per_session,
            "requestBody": {"required": True, "content": {"application/json": {"schema": say_schema}}},
        },
    )
    async def say(sid: str, request: Request):
        mgr.authorize(sid, _bearer(request))
        body = _parse_json(await request.body(), 'request body (JSON: {"text": "..."})')
        if not isinstance(body, dict):
            raise ApiError(400, 'request body must be a JSON object: {"text": "..."}')
        text = _str_field(body, "text", None)
        if text is None or not text.strip():
            raise ApiError(400, "missing 'text' (a non-empty string)")
        if len(text) > SayAgent.max_text:
            raise ApiError(400, f"'text' is too long ({len(text)} characters; limit {SayAgent.max_text})")
        interrupt = body.get("interrupt", False)
        if not isinstance(interrupt, bool):
            raise ApiError(400, f"'interrupt' must be a boolean, got {_type_name(interrupt)}")
        mgr.get_open(sid).touch()  # a well-formed request on a closed session: 410
        try:
            audio = await asyncio.to_thread(synthesize, text)
        except TTSUnavailable as e:
            raise ApiError(503, str(e)) from None
        s = mgr.get_open(sid)
        if interrupt:
            s.agent.interrupt()
        return _speak(s, sid, audio)

    prompt_schema = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_PROMPT,
                "pattern": "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$",
                "description": "the new prompt (not only whitespace, no NUL)",
            }
        },
    }

    @app.post(
        "/sessions/{sid}/prompt",
        summary="Change the prompt from the next chunk on (the stream goes on)",
        responses={**_ok("The chunk the new prompt starts at"), **_errors(*_SESSION_ROUTE, 410)},
        openapi_extra={
            "security": per_session,
            "requestBody": {"required": True, "content": {"application/json": {"schema": prompt_schema}}},
        },
    )
    async def set_prompt(sid: str, request: Request):
        mgr.authorize(sid, _bearer(request))
        body = _parse_json(await request.body(), 'request body (JSON: {"prompt": "..."})')
        if not isinstance(body, dict):
            raise ApiError(400, 'request body must be a JSON object: {"prompt": "..."}')
        prompt = _str_field(body, "prompt", None, MAX_PROMPT)
        if prompt is None or not prompt.strip():
            raise ApiError(400, "missing 'prompt' (a non-empty string)")
        s = mgr.get_open(sid)
        s.touch()
        from_chunk = s.set_prompt(prompt)
        if inspect.isawaitable(from_chunk):  # (a session whose media runs on its fleet group: asked there)
            from_chunk = await from_chunk
        return {"session_id": sid, "from_chunk": from_chunk}

    @app.post(
        "/sessions/{sid}/audio",
        summary="Queue speech audio (any format FFmpeg decodes) for the character",
        responses={**_ok("Seconds of speech queued"), **_errors(*_SESSION_ROUTE, 410, 415)},
        openapi_extra={
            "security": per_session,
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                    "audio/wav": {"schema": {"type": "string", "format": "binary"}},
                },
            },
        },
    )
    async def push_audio(sid: str, request: Request):
        mgr.authorize(sid, _bearer(request))
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
        return _speak(s, sid, audio)

    @app.post(
        "/sessions/{sid}/interrupt",
        summary="Stop speaking",
        responses={**_ok("Interrupted"), **_errors(*_SESSION_ROUTE, 410)},
        openapi_extra={"security": per_session},
    )
    async def interrupt(sid: str, request: Request):
        mgr.authorize(sid, _bearer(request))
        s = mgr.get_open(sid)
        s.touch()
        s.agent.interrupt()
        return {"session_id": sid, "interrupted": True}

    @app.get(
        "/metrics",
        summary="Prometheus text exposition (per-session series with the operator key)",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
        openapi_extra={"security": [{}, {"apiKey": []}] if cfg.api_key else []},
    )
    async def metrics(request: Request):
        sessions = mgr.is_operator(_bearer(request))
        if sessions:
            for s in list(mgr.sessions.values()):
                s.update_metrics()
        return Response(mgr.metrics.render(sessions=sessions), media_type=CONTENT_TYPE_LATEST)

    def openapi():
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            for ops in spec.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)  # FastAPI's own; every refusal here is a 400
            # FastAPI's spec model turns 2^63 - 1 into a float (2^63): put the exact bound back
            body = spec["paths"]["/sessions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            body["properties"]["seed"]["maximum"] = MAX_SEED
            comps = spec.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                comps.get("schemas", {}).pop(name, None)
            comps["securitySchemes"] = {
                "sessionToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the token POST /sessions returned for this session",
                }
            }
            if cfg.api_key:
                comps["securitySchemes"]["apiKey"] = {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the operator key (cadence serve --api-key-file / --api-key)",
                }
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
    return app
