"""Running the app under uvicorn: in the foreground (``cadence serve``) or in a background thread
(tests, ``cadence bench serve`` when it starts its own server), with the connection limits of
``cadence.serve.connections`` (header-read and keep-alive timeouts, a minimum body rate, a cap per client
address)."""

from __future__ import annotations

import logging
import sys
import threading
import time

from cadence.serve.config import ServeConfig
from cadence.serve.connections import ConnectionLimits, guarded_protocol


def _missing_extra(e: ModuleNotFoundError):
    from cadence.errors import InputError

    return InputError(
        f"'cadence serve' needs the serve extra ({e.name} is not installed): pip install 'cadence[serve]'"
    )


class StartupInOneLine:
    """The app for uvicorn, but a failed start-up (a worker that cannot start) is one log line, the reason,
    where Starlette hands uvicorn the whole traceback to log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def one_line(msg):
            if msg["type"] == "lifespan.startup.failed":
                msg = {**msg, "message": f"the server could not start: {startup_error(self.app)}"}
            await send(msg)

        await self.app(scope, receive, one_line)


def startup_error(app) -> str:
    return getattr(app.state, "startup_error", None) or "see the log above"


def uvicorn_config(app, cfg: ServeConfig, limits: ConnectionLimits, **kw):
    """uvicorn's config for ``app``: ``cfg``'s address, ``limits`` (the guarded h11 protocol, the keep-alive
    timeout; refusals counted in the app's ``/metrics``), a bounded graceful shutdown."""
    import uvicorn

    def count(status: int) -> None:
        app.state.manager.metrics.bad_requests.labels(str(status)).inc()

    return uvicorn.Config(
        StartupInOneLine(app),
        host=cfg.host,
        port=cfg.port,
        http=guarded_protocol(limits, on_refuse=count),
        timeout_keep_alive=limits.keepalive_timeout_s,
        timeout_graceful_shutdown=15,
        **kw,
    )


def run(cfg: ServeConfig, log_level: str = "info", limits: ConnectionLimits | None = None) -> None:
    """Serve until interrupted (uvicorn handles SIGINT/SIGTERM and runs the app's shutdown)."""
    try:
        import uvicorn

        from cadence.serve.app import create_app
    except ModuleNotFoundError as e:
        raise _missing_extra(e) from None
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from cadence.serve.heap import cap_arenas

    cap_arenas()  # before any thread starts: this process is the server's own (cadence.serve.heap)
    limits = limits or ConnectionLimits()
    app = create_app(cfg, limits=limits)
    # what group 0 builds (each group logs its own), from the recipe its groups were made with
    print(app.state.manager.source.recipe.describe().text(), file=sys.stderr)
    where = (
        f"http://{cfg.host}:{cfg.port}/"
        if cfg.port
        else f"{cfg.host} on a free port (uvicorn prints it below)"
    )
    print(
        f"cadence serve: {where} (preset {cfg.preset}, {len(cfg.groups)} session slot(s); the workers warm up "
        f"first; OpenAPI at /openapi.json)",
        flush=True,
    )
    server = uvicorn.Server(uvicorn_config(app, cfg, limits, log_level=log_level))
    try:
        server.run()
    except SystemExit:  # uvicorn's own exit (3) after a failed start-up: said below, once
        pass
    if not server.started:  # the start-up failed (its one line is in the log above): an error, not exit 0
        from cadence.errors import CadenceError

        raise CadenceError(f"the server could not start: {startup_error(app)}")


class ServerThread:
    """uvicorn on its own event loop in a daemon thread; ``url`` once started; ``stop()`` runs the
    app's shutdown (sessions closed, workers stopped) and joins the thread.

        with ServerThread(ServeConfig(port=0)) as srv:
            httpx.get(srv.url + "/healthz")
    """

    def __init__(self, cfg: ServeConfig, log_level: str = "warning", limits: ConnectionLimits | None = None):
        try:
            import uvicorn

            from cadence.serve.app import create_app
        except ModuleNotFoundError as e:
            raise _missing_extra(e) from None
        self.cfg = cfg
        self.limits = limits or ConnectionLimits()
        self.app = create_app(cfg, limits=self.limits)
        self.server = uvicorn.Server(
            uvicorn_config(self.app, cfg, self.limits, log_level=log_level, lifespan="on")
        )
        self.thread = threading.Thread(target=self._run, name="cadence-uvicorn", daemon=True)
        self.url = ""

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # uvicorn exits after a failed start-up: ``start`` says why
            pass

    @property
    def manager(self):
        return self.app.state.manager

    def start(self, timeout: float = 180.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server could not start: {startup_error(self.app)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout:.0f} s")
            time.sleep(0.05)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self, timeout: float = 90.0) -> None:
        # uvicorn's shutdown: up to 15 s for open requests, then the app's (bounded: 20 s + worker stops)
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():  # pragma: no cover
            raise RuntimeError(f"the server thread did not stop within {timeout:.0f} s")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
