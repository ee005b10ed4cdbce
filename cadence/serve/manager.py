"""The session manager: the server's worker groups, its open sessions, closed sessions' reports, admission.

:class:`SessionManager` takes its groups from a *source* (``cadence.serve.workers.LocalGroups``: this
machine's worker processes, the default; ``cadence.fleet.frontend.FleetGroups`` with ``cadence serve
--ray``), routes every worker reply to the session that holds the group, and keeps the bookkeeping of
admission by session id (the creator's address, the token's digest: ``cadence.serve.guard.Access``), not in
the sessions. Admission: one session per worker group, and on a GPU shared by several groups at most its
measured capacity (``cadence.serve.sharing``: a group there is free only while its GPU has room); a request
is checked for a free slot (503 + Retry-After) and for the client's pending offers (429 + Retry-After: at most
``max_pending_offers_per_client`` sessions per client address not yet connected) before its image is
looked at (``cadence.serve.uploads``). An offer that never connects is closed after ``connect_timeout_s``
(10 s; the session's watchdog). A closed session's report is kept ``report_ttl_s`` (at most
``max_reports`` and ``max_report_bytes``, compressed: ``cadence.serve.reports``), and its token opens it for
as long.

The seams are declared in :mod:`cadence.serve.ports`: the manager takes a ``GroupSource`` (given, or the one
``cfg`` names: :func:`group_source`), builds each new session with the source's ``session_factory(group)``
(a ``SessionPort``: ``LiveSession``, or a fleet's own class) and is the ``SessionHost`` the sessions report
to (``cfg``, ``metrics``, ``background``, ``release``, ``session_closed``). It imports no torch, and no
FastAPI: the routes (``cadence.serve.routes``) call it; ``create_local`` opens a session in process with no
WebRTC (Pipecat).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
import uuid

import numpy as np
from aiortc.exceptions import InvalidAccessError, OperationError

from cadence.engine.messages import Died
from cadence.errors import InputError
from cadence.serve.admission import Turns
from cadence.serve.agent import espeak_binary
from cadence.serve.agents import make_agent
from cadence.serve.config import DEFAULT_PROMPT, ServeConfig, agent_endpoint
from cadence.serve.guard import Access, ApiError, check_sdp, short
from cadence.serve.ports import GroupPort, GroupSource, SessionPort, WorkerSpeed
from cadence.serve.reports import ReportStore, report_json
from cadence.serve.rtc import VIDEO_CODECS, use_ice_host_addresses
from cadence.serve.schemas import MAX_PROMPT, SessionCreated
from cadence.serve.session import LiveSession, worker_speed
from cadence.serve.uploads import ImageDecoder
from cadence.telemetry.metrics import ServeMetrics

log = logging.getLogger("cadence.serve")


def group_source(cfg: ServeConfig) -> GroupSource:
    """The groups ``cfg`` names, where its deployment runs them (``cfg.deployment``: this machine's, a fleet's)."""
    return cfg.deployment.group_source(cfg)


class SessionManager:
    """Worker groups (from ``source``; default: :func:`group_source`), open sessions, closed sessions'
    reports, metrics."""

    def __init__(self, cfg: ServeConfig, source: GroupSource | None = None):
        self.cfg = cfg
        self.metrics = ServeMetrics()
        self.metrics.groups.set(len(cfg.groups))
        self.source = source if source is not None else group_source(cfg)
        self.engine_cfg = e = (
            self.source.recipe.config
        )  # the geometry every session follows: its groups' recipe
        self.groups = self.source.groups  # (a fleet's list is kept up to date in place)
        self.sessions: dict[str, SessionPort] = {}
        self.reports = ReportStore(cfg.report_ttl_s, cfg.max_reports, cfg.max_report_bytes)
        self.background: set[asyncio.Task] = set()
        self.started = False
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.access = Access(cfg.api_key)  # the operator key, each session's token (by session id)
        # the creator's keys (guard.client_keys), while its slot is reserved or its session open
        self.clients: dict[str, tuple[str, ...]] = {}
        self.turns = Turns()  # clients refused for want of a free group, in line (cadence.serve.admission)
        self.images = ImageDecoder(cfg, e)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.images.start()
        use_ice_host_addresses(self.cfg.ice_host_addresses)
        await self.source.start(self._route, self.metrics, self.cfg.worker_start_timeout_s)
        self.metrics.groups.set(len(self.groups))  # (fewer than configured: those that did not fit a GPU)
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
            [str(g) for g in self.cfg.groups],
            [round(self.lead_ms(g), 1) for g in self.groups],
        )
        for share in getattr(self.source, "sharing", lambda: [])():  # groups sharing a GPU (LocalGroups)
            log.info(
                "cadence serve: %s shared by %d groups, %s",
                share["placement"],
                share["groups"],
                f"at most {share['capacity']} sessions at once (measured)"
                if share["enforced"]
                else "one session per group"
                + (f" (measured capacity {share['capacity']})" if share["capacity"] else ""),
            )

    async def _warm_up_media(self) -> None:
        """What the web side does once per process, done before the first user: an image decoded (Pillow's
        plugins), an audio upload decoded (PyAV), a peer connection made (aiortc's first takes ~60 ms: its
        crypto), a VP8 frame encoded, on the threads that will do it for sessions. The first session's request
        no longer pays for it, and its memory (+5-8 MB, once) is in the server before any session, not
        counted as growth across sessions (docs/perf/soak/NOTES.md). Best effort: a failure is one log line."""
        import fractions
        import io

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

    def lead_ms(self, g: GroupPort) -> float:
        """How long before a chunk is due the scheduler hands it to group ``g``'s worker at a session's start
        (``cadence.serve.session.worker_speed``), in ms."""
        return self.worker_speed(g).lead * 1e3

    def worker_speed(self, g: GroupPort) -> WorkerSpeed:
        """How a new session on group ``g`` plans (``cadence.serve.session.worker_speed``)."""
        return worker_speed(self.cfg, self.engine_cfg.chunk_seconds, g)

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
        self.images.stop()
        use_ice_host_addresses(None)
        # what ``start`` froze goes back to the collector: a process that goes on without the server (a test
        # run, an app that stops its Pipecat manager) must be able to free it, and at exit frozen objects are
        # never freed (their native parts then "leak": nanobind's lines after a test run's summary)
        gc.unfreeze()
        self.started = False

    def _route(self, g: GroupPort, msg) -> None:
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

    # ---- the sessions' host ---------------------------------------------------------------------
    def release(self, group: GroupPort, sid: str) -> None:
        """Session ``sid`` is done with ``group``: back to the source (a fleet: the claim to the registry)."""
        self.source.release(group, sid)

    def session_closed(self, sess: SessionPort, report: dict) -> None:
        self.sessions.pop(sess.sid, None)
        self.clients.pop(sess.sid, None)
        self.metrics.remove_session(sess.sid)
        self.metrics.sessions.labels(sess.close_reason or "unknown").inc()
        self.metrics.active.set(len(self.sessions))
        data = report_json(report)
        self._forget(self.reports.put(sess.sid, data))
        if log.isEnabledFor(logging.INFO):
            log.info("session report %s", data.decode())
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
        self.images.trim_soon()  # on the image pool: the loop goes on

    # ---- open and closed sessions ---------------------------------------------------------------
    def _expire_reports(self) -> None:
        self._forget(self.reports.expire())

    def _forget(self, sids: list[str]) -> None:
        """Reports dropped: their tokens open nothing any more (unless the session is open again)."""
        for sid in sids:
            if sid not in self.sessions:
                self.access.forget(sid)

    def get_open(self, sid: str) -> SessionPort:
        s = self.sessions.get(sid)
        if s is not None and s.state not in ("closing", "closed"):
            return s
        self._expire_reports()
        if s is not None or sid in self.reports:
            raise ApiError(410, f"session {sid} is closed")
        raise ApiError(404, f"unknown session {short(sid)!r}")

    def authorize(self, sid: str, credential: str | None) -> None:
        """Let a request on session ``sid`` through, or raise: 404 for an id the server does not know (open
        or with its report kept), else what ``Access.require_session`` says (401, 403)."""
        self._expire_reports()
        if sid not in self.sessions and sid not in self.reports:
            raise ApiError(404, f"unknown session {short(sid)!r}")
        self.access.require_session(sid, credential)

    # ---- admission ------------------------------------------------------------------------------------
    def acquire(self) -> GroupPort | None:
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

    def pending_offers(self, client: tuple[str, ...]) -> int:
        """Sessions created (or being created) by a client with any of the keys ``client`` (see
        ``cadence.serve.guard.client_keys``) that are not connected yet."""
        n = 0
        for sid, keys in self.clients.items():
            if not set(keys) & set(client):
                continue
            s = self.sessions.get(sid)
            n += s is None or s.state in ("starting", "connecting")
        return n

    def reserve(self, client: tuple[str, ...]) -> tuple[GroupPort, str]:
        """Admit a new session from ``client`` (its keys: ``cadence.serve.guard.client_keys``) or raise: 429
        (+ Retry-After) when the client already has ``max_pending_offers_per_client`` sessions waiting to
        connect, 503 (+ Retry-After) when no group is free for it: none is, or the free ones are held for the
        turns of clients refused before it (``cadence.serve.admission.Turns``: a client that comes back when
        Retry-After says is refused at most once in a row). The group is held for the new id at once (nothing
        awaits in between), so an image decoding meanwhile cannot lose its slot to a later request."""
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
        now = time.monotonic()
        free = sum(1 for g in self.groups if g.free)
        # the source decides when no turn is ahead (a fleet's group is claimed before it counts as free here)
        ahead = self.turns.ahead(client, now)
        g = self.acquire() if not ahead or self.turns.may_take(client, free, now) else None
        if g is None:  # none free, or the free ones held for the turns of clients refused earlier
            self.metrics.refused.inc()
            wait = self.turns.wait_s(client, free, now)
            retry = wait if wait is not None else self.retry_after()
            self.turns.refused(client, now, retry)
            held = " or held for clients refused before this one" if free else ""
            busy = sum(g.session_id is not None for g in self.groups)
            full = f"{busy} of {len(self.groups)} group(s) busy: each GPU at its measured capacity"
            raise ApiError(
                503,
                f"no free session slot ({len(self.groups)} group(s), all busy{held}); retry in {retry} s"
                if busy >= len(self.groups) or free
                else f"no free session slot ({full}); retry in {retry} s",
                {"Retry-After": str(retry)},
            )
        self.turns.admitted(client, now)
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

    def unreserve(self, g: GroupPort, sid: str) -> None:
        self.source.release(g, sid)
        self.clients.pop(sid, None)

    async def decode_image(self, data: bytes) -> np.ndarray:
        """The reference image as the engine takes it (``cadence.serve.uploads``, at most
        ``decode_concurrency`` at once, on a pool of that many threads)."""
        return await self.images.decode(data)

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
    ) -> SessionCreated:
        """Check the request, admit it (429 / 503), decode its image, start the session. The answer carries
        the session's token, which only this answer ever shows."""
        ag = self.new_agent(agent)
        if len(prompt) > MAX_PROMPT:
            raise ApiError(400, f"prompt is too long ({len(prompt)} characters; limit {MAX_PROMPT})")
        check_sdp(sdp, sdp_type, self.cfg.max_sdp_bytes)
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
        token = self.access.issue(sid)
        sess = self.source.session_factory(g)(self, sid, g, ag, self.engine_cfg, prompt, seed)
        sess.t_created = t_request
        self.sessions[sid] = sess
        self.metrics.active.set(len(self.sessions))
        answer = await self._answer(sess, image, sdp, sdp_type)
        e = self.engine_cfg
        return SessionCreated(
            session_id=sid,
            token=token,
            sdp=answer.sdp,
            type=answer.type,
            agent=ag.name,
            preset=e.name,
            fps=e.stream.fps,
            width=e.stream.width,
            height=e.stream.height,
        )

    async def _answer(self, sess, image, sdp: str, sdp_type: str):
        """Start ``sess`` and answer its offer; a failure closes it and is the request's refusal (400 for an
        offer aiortc cannot parse or answer, 500 for anything else)."""
        try:
            return await sess.start(image, sdp, sdp_type)
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
            log.exception("session %s failed to start", sess.sid)
            detail = " ".join(str(e).split())[:300] or "see the server's log"
            raise ApiError(500, f"session failed to start: {detail}") from None
