"""The request guard: what every request passes before a handler acts on it.

* **Errors.** Every refusal is one line of JSON, ``{"error": "..."}``, with a 4xx status (never a 500 for
  bad input): :class:`ApiError` raised anywhere becomes that answer; so do Starlette's own errors (404, a
  405 with an ``Allow`` header naming every method of the path), FastAPI's validation errors (a 400, never
  a 422) and a :class:`~cadence.errors.CadenceError` (400). 4xx answers are counted in ``/metrics``.
* **Body limits.** Per route, while the body streams in (:class:`BodyLimit`): a chunked body with no
  Content-Length is cut at the limit, 413, connection closed; a body slower than the minimum rate
  (``cadence.serve.connections.ConnectionLimits``), 408, connection closed.
* **Credentials** (:class:`Access`), as ``Authorization: Bearer <secret>``, compared in constant time.
  Each session has a **token** (32 random bytes, URL-safe), returned once, in the answer to the POST that
  created it; the server keeps only its SHA-256. Every route under ``/sessions/{id}`` needs that token (or
  the operator key): none is 401, any other secret (another session's token included) is 403 and nothing
  happens to the session. An id the server does not know is 404 whatever the credential (ids are 128-bit
  random: knowing whether one exists gives nothing; the session manager, which knows the ids, answers it).
  A closed session's token keeps opening its state and report for as long as the report is kept.
  The **operator key** (``ServeConfig.api_key``: ``cadence serve --api-key-file PATH``, ``--api-key`` or
  ``CADENCE_API_KEY``), when set, is needed to create a session (401 without it) and to list the sessions
  (``GET /sessions``) or see the per-session series of ``/metrics`` (which otherwise carries only
  aggregates). Without one (the default loopback run), anyone who reaches the server may create a session,
  and the session list and per-session series are off (403). A non-loopback ``host`` refuses to start
  without a key unless ``insecure_no_auth`` is set (logged as a WARNING).
* **Fields** are the request models' (``cadence.serve.schemas``: their refusals are 400s naming the field);
  JSON that ``json`` cannot or should not take is a 400; an SDP offer is checked for its shape before
  aiortc sees it.

Imports no torch and no FastAPI at module level (the answers are built where a request is answered).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import re
import secrets

from cadence.errors import CadenceError

log = logging.getLogger("cadence.serve")

#: Body limit of every route but POST /sessions and /audio (JSON with a line of text, or nothing).
SMALL_BODY = 64 * 1024


class ApiError(Exception):
    """A refusal: the request's answer is ``{"error": message}`` with ``status`` (and ``headers``)."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, " ".join(str(message).split()), headers or {}


# ---- errors as answers ------------------------------------------------------------------------------------


def json_error(metrics, status: int, message: str, headers: dict | None = None):
    """The one shape of every refusal: ``{"error": "<one line>"}``; a 4xx is counted (``bad_requests``)."""
    from fastapi.responses import JSONResponse

    if 400 <= status < 500:
        metrics.bad_requests.labels(str(status)).inc()
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status, headers=headers)


def allowed_methods(app, path: str) -> list[str]:
    """Every method of every route whose path matches ``path`` (a 405's ``Allow``)."""
    methods: set[str] = set()
    for r in app.router.routes:
        m = getattr(r, "methods", None)
        if m and r.path_regex.match(path):
            methods |= set(m)
    return sorted(methods)


def install_guard(app, cfg, metrics, limits) -> None:
    """The body limits (middleware: size, and the minimum rate of ``limits``, a
    ``cadence.serve.connections.ConnectionLimits``) and the error handlers of the app."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def err(status: int, message: str, headers: dict | None = None):
        return json_error(metrics, status, message, headers)

    app.add_middleware(
        BodyLimit,
        limit_for=body_limits(cfg),
        on_refuse=err,
        min_rate=limits.min_body_rate,
        grace_s=limits.body_grace_s,
    )

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return err(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of the path, not only those of the route that matched first
            allow = allowed_methods(app, request.url.path)
            if allow:
                headers["Allow"] = ", ".join(allow)
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # (FastAPI's words)
            detail = "request body is not valid JSON (or nested too deeply, or a number too long)"
        return err(exc.status_code, detail, headers or None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):  # a request model's refusal: one line naming the field
        from cadence.serve.schemas import validation_message

        return err(400, validation_message(list(exc.errors())))

    @app.exception_handler(CadenceError)
    async def _cadence_error(request, exc):
        return err(400, str(exc))


# ---- body limits ------------------------------------------------------------------------------------------


def body_limits(cfg):
    """``limit_for(method, path)``: POST /sessions takes the image (base64: 4/3 of its bytes) and the SDP
    offer, POST /sessions/{id}/audio the audio; every other route ``SMALL_BODY``."""
    session_body = math.ceil(cfg.max_image_bytes * 4 / 3) + cfg.max_sdp_bytes + SMALL_BODY
    audio_body = cfg.max_audio_bytes + SMALL_BODY

    def limit_for(method: str, path: str) -> int:
        if method == "POST" and path.rstrip("/") == "/sessions":
            return session_body
        if method == "POST" and path.startswith("/sessions/") and path.endswith("/audio"):
            return audio_body
        return SMALL_BODY

    return limit_for


class BodyLimit:
    """ASGI middleware: a request body may not exceed ``limit_for(method, path)`` bytes, however it is sent, and
    must arrive at ``min_rate`` bytes/s at least, counted after ``grace_s`` (0: no minimum).

    A declared Content-Length over the limit is refused before anything is read; a body without one
    (chunked) is counted as it streams in, and the first message past the limit ends it: the app's
    ``receive`` raises, whatever the handler then answers is replaced by one 413 (``on_refuse`` makes
    it), sent with ``Connection: close`` so the server stops reading the rest (at most ``limit`` bytes
    plus one read buffer are ever read). A body slower than the minimum rate ends the same way, with a
    408. Any answer sent before the body was read to its end (a 401, 404, 503 that needs no body) closes
    the connection too: otherwise the server would go on reading, and discarding, whatever the client
    still sends. A client that goes away before its body is complete is one log line (never a traceback:
    nothing can be answered to it)."""

    def __init__(self, app, limit_for, on_refuse, min_rate: float = 0.0, grace_s: float = 10.0):
        self.app, self.limit_for, self.on_refuse = app, limit_for, on_refuse
        self.min_rate, self.grace_s = min_rate, grace_s

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
        body = _Body(self, scope, receive, send, limit)
        body.left = size > 0 or any(k == b"transfer-encoding" for k, _ in headers)
        await body.run()

    async def _refuse(self, send, status: int, message: str) -> None:
        resp = self.on_refuse(status, message)
        resp.headers["connection"] = "close"
        await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


class _Body:
    """One request's body as :class:`BodyLimit` lets it through (``receive``) and its answer (``send``)."""

    def __init__(self, guard: BodyLimit, scope, receive, send, limit: int):
        import asyncio

        self.guard, self.scope, self._receive, self._send, self.limit = guard, scope, receive, send, limit
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.left = False  # more body to come
        self.seen = 0
        self.refusal: tuple[int, str] | None = None  # (status, message) that replaces the app's answer
        self.started = self.replaced = self.gone = False

    async def receive(self):
        if self.refusal is not None:
            raise ApiError(*self.refusal)
        msg = await self._next()
        if msg["type"] == "http.request":
            self.seen += len(msg.get("body", b""))
            if self.seen > self.limit:
                self.refusal = (413, f"request body is too large (over {self.limit} bytes)")
                raise ApiError(*self.refusal)
            self.left = self.left and msg.get("more_body", False)
        elif msg["type"] == "http.disconnect" and self.left:
            self.gone = True
        return msg

    async def _next(self):
        """The next message, or a 408 when the body falls below the minimum rate."""
        import asyncio

        rate = self.guard.min_rate
        if not (self.left and rate > 0):
            return await self._receive()
        deadline = self.t0 + self.guard.grace_s + self.seen / rate  # when more must have come
        waiting = asyncio.ensure_future(self._receive())
        try:
            done, _ = await asyncio.wait({waiting}, timeout=max(0.0, deadline - self.loop.time()))
        finally:
            if not waiting.done():
                waiting.cancel()
        if not done:
            took = self.loop.time() - self.t0
            self.refusal = (
                408,
                f"request body too slow ({self.seen} bytes in {took:.1f} s; minimum {rate:g} bytes/s)",
            )
            raise ApiError(*self.refusal)
        return waiting.result()

    async def send(self, msg):
        if self.replaced:
            return
        if msg["type"] == "http.response.start":
            if self.refusal is not None:
                self.replaced = True
                return await self.guard._refuse(self._send, *self.refusal)
            self.started = True
            if self.left:
                msg = {**msg, "headers": [*msg.get("headers", ()), (b"connection", b"close")]}
        await self._send(msg)

    async def run(self) -> None:
        try:
            await self.guard.app(self.scope, self.receive, self.send)
        except Exception as e:
            if self.gone or type(e).__name__ == "ClientDisconnect":  # starlette's: nothing can be answered
                client = self.scope.get("client") or ("?",)
                log.info(
                    "client %s went away during %s %s (%d bytes of its body read)",
                    client[0],
                    self.scope["method"],
                    self.scope["path"],
                    self.seen,
                )
                return
            if self.refusal is None or self.started or self.replaced:
                raise
            await self.guard._refuse(self._send, *self.refusal)


# ---- credentials ------------------------------------------------------------------------------------------


def bearer(request) -> str | None:
    """The secret of an ``Authorization: Bearer <secret>`` header; None when there is none."""
    h = request.headers.get("authorization")
    if h is None:
        return None
    scheme, _, value = h.strip().partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


def _b(text: str) -> bytes:
    """A credential as bytes for ``hmac.compare_digest`` (which takes ASCII-only str): any str encodes."""
    return text.encode("utf-8", "surrogatepass")


class Access:
    """The operator key and each session's token (only its SHA-256 is kept, by session id)."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key
        self.tokens: dict[str, bytes] = {}  # SHA-256 of each token, while the session or its report is kept

    def issue(self, sid: str) -> str:
        """A new token for session ``sid``: returned here once, never kept."""
        token = secrets.token_urlsafe(32)
        self.tokens[sid] = hashlib.sha256(token.encode()).digest()
        return token

    def forget(self, sid: str) -> None:
        self.tokens.pop(sid, None)

    def is_operator(self, credential: str | None) -> bool:
        """``credential`` is the operator key (constant-time compare; False when no key is configured)."""
        key = self.api_key
        return key is not None and credential is not None and hmac.compare_digest(_b(credential), _b(key))

    def require_session(self, sid: str, credential: str | None) -> None:
        """Let a request on (known) session ``sid`` through, or raise: 401 without a credential, 403 for one
        that is neither this session's token nor the operator key."""
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
        """The operator key, or 403 (this server has none) / 401 (missing or wrong) naming ``what``."""
        if self.api_key is None:
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

    def require_creator(self, credential: str | None) -> None:
        """Creating a session: free on a server without an operator key, else the key (401)."""
        if self.api_key is None:
            return
        if credential is None:
            raise ApiError(
                401,
                "creating a session needs the API key (Authorization: Bearer <key>)",
                {"WWW-Authenticate": "Bearer"},
            )
        if not self.is_operator(credential):
            raise ApiError(401, "invalid API key", {"WWW-Authenticate": "Bearer"})


# ---- fields -----------------------------------------------------------------------------------------------


def short(text: str, n: int = 64) -> str:
    return text if len(text) <= n else text[:n] + "..."


def parse_json(body: bytes, what: str):
    """JSON text -> a value, or a 400 for anything ``json`` cannot or should not take: not JSON, not UTF-8,
    nesting deep enough to exhaust the recursion limit, an integer literal over Python's 4,300 digits."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, f"{what} is nested too deeply") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise ApiError(400, f"{what} is not valid JSON") from None


#: What POST /sessions checks of an SDP offer's text before anything else, and the ``pattern`` of its ``sdp``
#: field in the OpenAPI schema (one predicate, so that a string the schema allows passes these checks): a
#: first line ``v=0``, a video section (``m=video``) and a DTLS fingerprint (``a=fingerprint:``) at the start
#: of lines, no NUL. ECMA-262 and Python read it alike.
SDP_PATTERN = (
    r"^[ \t]*v=0[ \t]*\r?\n(?:[^\u0000]*\n)?[ \t]*"
    r"(?:m=video[^\u0000]*\n[ \t]*a=fingerprint:|a=fingerprint:[^\u0000]*\n[ \t]*m=video)[^\u0000]*$"
)
_SDP_RE = re.compile(SDP_PATTERN)

#: The cookie that tells one client (a browser, an HTTP client keeping cookies) from another for the
#: pending-offer limit and the turns of a full server: on loopback every local user has the same address
#: (127.0.0.1, and so has everyone behind a TLS proxy on the same host), so the address alone would let one
#: user's pending offers lock out the others. The server sets it (random, HttpOnly) on the page and on the
#: answer to POST /sessions.
CLIENT_COOKIE = "cadence_client"
_COOKIE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def client_keys(address: str | None, cookie: str | None) -> tuple[str, ...]:
    """Who a request comes from, for the pending-offer limit and the turns of a full server
    (``cadence.serve.admission``): its ``CLIENT_COOKIE`` (when it carries a well-formed one) and its address,
    but on loopback the address only without a cookie (on loopback the address is every local user's: a
    local client with the cookie is itself, and every local client without one is one client, 127.0.0.1, so
    that re-posting without cookies cannot make it a new client each time)."""
    import ipaddress

    keys = []
    if cookie and 16 <= len(cookie) <= 64 and set(cookie) <= _COOKIE_CHARS:
        keys.append(f"cookie:{cookie}")
    try:
        local = address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        local = False
    if address and not (local and keys):
        keys.append(f"addr:{address}")
    return tuple(keys)


def request_client(request) -> tuple[str, ...]:
    """:func:`client_keys` of a Starlette request."""
    return client_keys(request.client.host if request.client else None, request.cookies.get(CLIENT_COOKIE))


def with_client_cookie(request, response):
    """Give a client without one its ``CLIENT_COOKIE`` (the pending-offer limit's key on loopback)."""
    if request.cookies.get(CLIENT_COOKIE) is None:
        response.set_cookie(
            CLIENT_COOKIE, secrets.token_urlsafe(16), httponly=True, samesite="strict", max_age=86400 * 30
        )
    return response


def check_sdp(sdp: str, sdp_type: str, limit: int) -> None:
    """An SDP offer's shape (aiortc parses it only then; its fields' types are the request model's,
    ``cadence.serve.schemas``): type 'offer', under ``limit`` bytes, starting with 'v=0', with a video section
    and a DTLS fingerprint."""
    if not sdp.strip():
        raise ApiError(400, "missing SDP offer ('sdp')")
    if sdp_type != "offer":
        raise ApiError(400, f"SDP type must be 'offer', got {short(str(sdp_type))!r}")
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
        detail = short(" ".join(str(e).split()), 200)  # (aiortc's words, never Python's exception name)
        raise ApiError(
            400, "malformed SDP offer: the WebRTC stack cannot parse it" + (f" ({detail})" if detail else "")
        ) from None
