"""The HTTP API (FastAPI): the app, assembled from the server's parts.

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

What each route answers (every status code, every field) is the OpenAPI document (``/openapi.json``).
The server's parts, one job per file:

* :mod:`cadence.serve.routes`    the handlers, one small function per route;
* :mod:`cadence.serve.guard`     the request guard: errors as JSON, body limits, credentials (per-session
  tokens, the operator key);
* :mod:`cadence.serve.schemas`   what each route takes and answers, as pydantic models (they validate the
  requests, and the OpenAPI document is generated from them);
* :mod:`cadence.serve.uploads`   the session request's body, the reference image's decode, speech audio;
* :mod:`cadence.serve.manager`   the session manager: groups, sessions, reports, admission (whose turn it is
  when a group frees: :mod:`cadence.serve.admission`);
* :mod:`cadence.serve.connections` the connection limits under the app (header and keep-alive timeouts, a cap
  per client address), :mod:`cadence.serve.server` uvicorn with them;
* :mod:`cadence.serve.session`   one live session (scheduler, stats, tracks), :mod:`cadence.serve.workers`
  the worker processes.

This module assembles them: :func:`create_app`, given the groups' source and the routes to add beside the
server's own (the seams of :mod:`cadence.serve.ports`; by default those ``cfg`` names: this machine's
groups, or with ``cfg.deployment`` a Ray fleet's groups and its ``/fleet`` routes).
"""

import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from cadence.serve.config import ServeConfig
from cadence.serve.connections import ConnectionLimits
from cadence.serve.guard import install_guard
from cadence.serve.manager import SessionManager, group_source
from cadence.serve.ports import ExtraRoutes, GroupSource

log = logging.getLogger("cadence.serve")
STATIC = Path(__file__).parent / "static"
DESCRIPTION = (
    "Live talking characters over WebRTC: chunk-causal video diffusion. Each "
    "session's routes need the token POST /sessions returned (Authorization: Bearer "
    "<token>); with an operator key configured, creating sessions and listing them "
    "need it."
)


def create_app(
    cfg: ServeConfig | None = None,
    *,
    source: GroupSource | None = None,
    routes: Sequence[ExtraRoutes] | None = None,
    limits: ConnectionLimits | None = None,
):
    """The FastAPI app of a server configured by ``cfg``, whose sessions run on the groups of ``source``
    (default: those ``cfg`` names, ``cadence.serve.manager.group_source``) and which serves ``routes`` beside
    its own (default: its deployment's, ``cfg.deployment.routes``: a fleet's operator routes): its session
    manager started and stopped with the app (``lifespan``), the request guard (body limits: ``limits``' minimum
    body rate), the routes, the OpenAPI document."""
    from fastapi import FastAPI

    from cadence.serve.routes import add_routes, install_openapi

    cfg = cfg or ServeConfig()
    if not cfg.loopback and cfg.api_key is None:  # ServeConfig allows it only with insecure_no_auth
        log.warning(
            "WARNING: serving on %s (not loopback) WITHOUT an API key (--insecure-no-auth): anyone "
            "who reaches this address can start sessions; use --api-key-file PATH",
            cfg.host,
        )
    source = source if source is not None else group_source(cfg)
    if routes is None:  # its deployment's (a fleet's: GET /fleet, POST|DELETE /fleet/groups/{name}/drain)
        routes = cfg.deployment.routes(source)
    mgr = SessionManager(cfg, source)
    app = FastAPI(title="cadence", version="0.1.0", lifespan=_lifespan(mgr), description=DESCRIPTION)
    app.state.manager = mgr
    for add in routes:  # (ahead of the server's own: the OpenAPI document lists them first)
        add(app, mgr.access)
    install_guard(app, cfg, mgr.metrics, limits or ConnectionLimits())
    add_routes(app, mgr, STATIC)
    install_openapi(app)
    return app


def _lifespan(mgr: SessionManager):
    @asynccontextmanager
    async def lifespan(app):
        try:  # a worker that cannot start still gets its process stopped and its shared memory unlinked
            try:
                await mgr.start()
            except Exception as e:  # said in one line (cadence.serve.server), not as a traceback
                app.state.startup_error = " ".join(str(e).split()) or "see the log above"
                raise
            yield
        finally:
            await mgr.stop()

    return lifespan
