"""Connection limits of the web process, as a server meant to face the internet keeps them.

uvicorn reads a request's headers for as long as the client takes, keeps a connection that never sends a byte
open for ever, and bounds nothing per client: 300 sockets sending a header byte every 2 s (slowloris), an idle
connection and an HTTP/0.9 ``GET /`` all stayed open indefinitely (issue 39). :func:`guarded_protocol` is
uvicorn's h11 protocol with, per :class:`ConnectionLimits`:

* **a header-read timeout** (``header_timeout_s``): from the connection (or the end of the previous answer) to
  the end of the request's headers; past it, ``408`` and the connection closed, whatever was sent;
* **an idle keep-alive timeout** (``keepalive_timeout_s``, uvicorn's own): a connection idle after an answer is
  closed;
* **a cap on open connections per client address** (``max_per_client``): one more is answered ``429`` and
  closed at once, before anything is read;
* a request that is not HTTP/1.x is answered ``400`` as JSON.

The **minimum body rate** (``min_body_rate`` bytes/s after ``body_grace_s``; ``408`` below it) is kept where
the body is read, in the app (``cadence.serve.guard.BodyLimit``), so that its refusal is the app's JSON answer.
Every refusal here is one line of JSON, ``{"error": ...}``, and one log line per client address at most every
``LOG_EVERY_S`` (an attack of 300 sockets is not 300 lines); the counts are in ``/metrics``
(``cadence_bad_requests``).

What this does not do, and a TLS-terminating proxy in front has to: TLS itself; telling clients apart behind
it (every connection from the proxy has the proxy's address: the per-address cap then counts the proxy, so
the proxy's own per-client limits must take over, or ``max_per_client`` be raised); bandwidth and request-rate
limits beyond these; HTTP/2.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("cadence.serve")

#: A client address's refusals are logged at most once per this many seconds (with the count since).
LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    """The web process's connection limits (see the module doc)."""

    header_timeout_s: float = 10.0
    """From the connection (or the end of the previous answer) to the end of the request's headers."""
    keepalive_timeout_s: float = 5.0
    """A connection idle after an answer is closed after this long."""
    min_body_rate: float = 1024.0
    """Bytes per second a request body must arrive at on average, counted after ``body_grace_s``."""
    body_grace_s: float = 10.0
    """How long a body may take before its rate is held to ``min_body_rate``."""
    max_per_client: int = 32
    """Open connections one client address may hold (a browser opens at most 6 per server)."""

    def __post_init__(self) -> None:
        if min(self.header_timeout_s, self.keepalive_timeout_s, self.body_grace_s) <= 0:
            raise ValueError("connection timeouts must be positive")
        if self.min_body_rate < 0 or self.max_per_client < 1:
            raise ValueError("min_body_rate must be >= 0 and max_per_client >= 1")


class _Throttled:
    """One log line per key at most every ``LOG_EVERY_S`` seconds, with how many were not logged since."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, int]] = {}

    def warn(self, key: str, message: str, *args) -> None:
        now = time.monotonic()
        at, skipped = self.last.get(key, (float("-inf"), 0))
        if now - at < LOG_EVERY_S:
            self.last[key] = (at, skipped + 1)
            return
        more = f" (and {skipped} more since)" if skipped else ""
        log.warning(message + more, *args)
        self.last[key] = (now, 0)
        if len(self.last) > 10_000:  # bounded, whatever the number of addresses
            self.last.clear()


def raw_answer(status: int, reason: str, message: str, headers: dict | None = None) -> bytes:
    """A whole HTTP/1.1 answer ``{"error": message}`` that closes the connection (for refusals made before
    a request exists: h11 sends a response only to a request it has read)."""
    body = json.dumps({"error": message}).encode()
    lines = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def guarded_protocol(limits: ConnectionLimits, on_refuse=None):
    """uvicorn's h11 protocol class with ``limits`` (pass it as ``uvicorn.Config(http=...)``, with
    ``timeout_keep_alive=limits.keepalive_timeout_s``). ``on_refuse(status)`` counts each refusal."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    shared = {
        "limits": limits,
        "open_by_client": {},
        "logs": _Throttled(),
        "count": staticmethod(on_refuse or (lambda status: None)),
    }
    return type("GuardedH11Protocol", (_Guarded, H11Protocol), shared)


class _Guarded:
    """The limits, over uvicorn's ``H11Protocol`` (:func:`guarded_protocol` makes the class, with the state its
    connections share: ``limits``, ``open_by_client``, ``logs``, ``count``)."""

    limits: ConnectionLimits
    open_by_client: dict[str, int]
    logs: _Throttled
    count = None
    _host: str | None = None
    _header_timer = None
    _waiting_cycle = None  # the cycle before the request whose headers are awaited

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if peer else "unknown"
        cap = self.limits.max_per_client
        if self.open_by_client.get(host, 0) >= cap:
            self.count(429)
            self.logs.warn(f"cap:{host}", "refused a connection from %s: %d open already (limit)", host, cap)
            message = f"too many open connections from this address (limit {cap})"
            retry = {"retry-after": str(max(1, round(self.limits.header_timeout_s)))}
            transport.write(raw_answer(429, "Too Many Requests", message, retry))
            transport.close()
            return
        self._host = host
        self.open_by_client[host] = self.open_by_client.get(host, 0) + 1
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc) -> None:
        if self._host is None:  # refused at once: uvicorn never saw it
            return
        self._stop_header_timer()
        n = self.open_by_client.get(self._host, 1) - 1
        if n > 0:
            self.open_by_client[self._host] = n
        else:
            self.open_by_client.pop(self._host, None)
        self._host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._waiting_cycle:
            self._stop_header_timer()  # a request's headers are in

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is before:  # (a pipelined request is in already)
            self._await_headers()

    def send_400_response(self, msg: str) -> None:  # not HTTP/1.x (h11 could not read it)
        self.count(400)
        self.logs.warn(f"400:{self._host}", "%s sent something that is not an HTTP/1.x request", self._host)
        self.transport.write(raw_answer(400, "Bad Request", "not an HTTP/1.x request"))
        self.transport.close()

    def _await_headers(self) -> None:
        self._stop_header_timer()
        self._waiting_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.cycle is not self._waiting_cycle:
            return
        self.count(408)
        timeout = self.limits.header_timeout_s
        self.logs.warn(
            f"408:{self._host}", "closed a connection from %s: no complete request headers within %.0f s",
            self._host, timeout,
        )  # fmt: skip
        message = f"no complete request headers within {timeout:g} s"
        self.transport.write(raw_answer(408, "Request Timeout", message))
        self.transport.close()
