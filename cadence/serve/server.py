"""Running the app under uvicorn: in the foreground (``cadence serve``) or in a background thread
(tests, ``cadence bench serve`` when it starts its own server)."""

from __future__ import annotations

import logging
import sys
import threading
import time

from cadence.serve.config import ServeConfig


def _missing_extra(e: ModuleNotFoundError):
    from cadence.errors import InputError

    return InputError(
        f"'cadence serve' needs the serve extra ({e.name} is not installed): pip install 'cadence[serve]'"
    )


def run(cfg: ServeConfig, log_level: str = "info") -> None:
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
    app = create_app(cfg)
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
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=log_level, timeout_graceful_shutdown=15)


class ServerThread:
    """uvicorn on its own event loop in a daemon thread; ``url`` once started; ``stop()`` runs the
    app's shutdown (sessions closed, workers stopped) and joins the thread.

        with ServerThread(ServeConfig(port=0)) as srv:
            httpx.get(srv.url + "/healthz")
    """

    def __init__(self, cfg: ServeConfig, log_level: str = "warning"):
        try:
            import uvicorn

            from cadence.serve.app import create_app
        except ModuleNotFoundError as e:
            raise _missing_extra(e) from None
        self.cfg = cfg
        self.app = create_app(cfg)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=cfg.host,
                port=cfg.port,
                log_level=log_level,
                lifespan="on",
                timeout_graceful_shutdown=15,
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="cadence-uvicorn", daemon=True)
        self.url = ""

    @property
    def manager(self):
        return self.app.state.manager

    def start(self, timeout: float = 180.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup (see its log)")
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
