"""Helpers for driving a server from tests: a client in a background thread, code on the server's loop."""

import asyncio
import threading


class BackgroundClient:
    """``run_client`` in its own thread and event loop (the test's thread fires requests meanwhile)."""

    def __init__(self, url: str, seconds: float, **kw):
        self.result = None
        self.error = None

        def main():
            from cadence.devtools.client import run_client

            try:
                self.result = asyncio.run(run_client(url, seconds, **kw))
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=main, name="test-client", daemon=True)
        self.thread.start()

    def join(self, timeout: float = 60.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the client did not finish"
        if self.error:
            raise self.error
        return self.result


def on_server_loop(srv, coro_fn, timeout: float = 30.0):
    """Run ``coro_fn()`` on the server's event loop and return its result."""
    fut = asyncio.run_coroutine_threadsafe(coro_fn(), srv.manager.loop)
    return fut.result(timeout)


def offer_sdp() -> str:
    """A real WebRTC offer from aiortc (recvonly video + sendrecv audio) whose peer is closed at once: the
    server accepts it and answers, and the session waits to connect until its connect timeout."""
    from aiortc import RTCPeerConnection

    from cadence.serve.rtc import rtc_configuration

    async def make():
        pc = RTCPeerConnection(rtc_configuration())
        pc.addTransceiver("video", direction="recvonly")
        pc.addTransceiver("audio", direction="sendrecv")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp

    return asyncio.run(make())


class AppThread:
    """Any ASGI app served by uvicorn on a loopback port in a background thread (a stand-in endpoint, an
    example's app); ``with AppThread(app) as url:`` -> ``http://127.0.0.1:<port>``. For ``cadence serve``
    itself use ``cadence.serve.server.ServerThread`` (it owns the session manager's start and stop)."""

    def __init__(self, app, start_timeout: float = 30.0):
        import time

        import uvicorn

        self._time = time
        self.start_timeout = start_timeout
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="app-thread", daemon=True)
        self.url = ""

    def __enter__(self) -> str:
        self.thread.start()
        deadline = self._time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or self._time.monotonic() > deadline:
                raise RuntimeError(f"the app did not start within {self.start_timeout:.0f} s")
            self._time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def wait_ready(url: str, timeout: float, proc=None) -> None:
    """Until ``url``'s ``/healthz`` answers ok; RuntimeError when ``proc`` (a Popen) exits first or ``timeout``
    seconds pass."""
    import time

    from cadence.devtools.browser import get_json

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"`cadence serve` exited with status {proc.returncode} before it was ready")
        try:
            if get_json(url + "/healthz").get("ok"):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} was not ready within {timeout:.0f} s")
        time.sleep(0.5)


class ServeProcess:
    """``cadence serve WORDS`` in its own process on a free loopback port, as the README starts it (the benches
    that drive a real server: ``bench browser``, ``bench soak``). Its output goes to a temporary log, whose
    tail :meth:`wait_ready` prints when the server fails to start; :meth:`close` (or leaving ``with``) stops it:
    terminate, then kill after 30 s."""

    def __init__(self, words: list[str]):
        import subprocess
        import sys
        import tempfile

        from cadence.net import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "cadence", "serve", "--port", str(port), *words]
        print("server: " + " ".join(cmd[1:]), file=sys.stderr)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        import sys

        try:
            wait_ready(self.url, timeout, self.proc)
        except RuntimeError:
            self.log.seek(0)
            print(self.log.read()[-3000:], file=sys.stderr)
            raise

    def close(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def float_wav(samples, rate: int = 48_000) -> bytes:
    """Mono IEEE-float WAV bytes (format 3): unlike 16-bit PCM they can carry NaN and infinity (the probes of
    the server's finite-audio checks)."""
    import struct

    import numpy as np

    data = np.asarray(samples, "<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    chunks = (
        b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks
