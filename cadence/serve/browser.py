"""A real browser for tests and benchmarks: headless Chromium driven over the DevTools protocol.

    with Chromium() as cdp:                 # a fresh profile, loopback only, fake media devices
        open_page(cdp, "http://127.0.0.1:8000")
        cdp.eval("window.cadence.start()")  # the page's own hooks (static/app.js)

Used by tests/test_e2e_browser.py and ``cadence bench browser``. Needs Debian's ``chromium`` (or another
Chromium on PATH) and the ``websocket-client`` package (the test extra); nothing here is imported by the
server. Chromium is started the way this machine's probes showed it works as root in a container
(``--headless --no-sandbox --disable-gpu``), with the background networking that would try to reach
Google's hosts off, ``--allow-loopback-in-peer-connection`` (WebRTC on 127.0.0.1) and fake media devices.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--allow-loopback-in-peer-connection",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--autoplay-policy=no-user-gesture-required",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]


def chromium_path() -> str | None:
    """Chromium's executable on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDP:
    """A minimal DevTools-protocol client for one page (websocket-client, synchronous)."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.n = 0

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expr: str, timeout_s: float = 20.0):
        r = self.call(
            "Runtime.evaluate",
            expression=expr,
            awaitPromise=True,
            returnByValue=True,
            timeout=int(timeout_s * 1000),
        )
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise RuntimeError(
                f"page exception: {d.get('exception', {}).get('description') or d.get('text')}"
            )
        return r["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()


@contextlib.contextmanager
def Chromium(exe: str | None = None, extra_flags: list[str] | None = None):
    """Headless Chromium with a fresh profile; yields a :class:`CDP` on its first page; kills it after."""
    exe = exe or chromium_path()
    if exe is None:
        raise RuntimeError("Chromium is not installed (Debian: apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="cadence-chromium-")
    proc = subprocess.Popen(
        [exe, *CHROMIUM_FLAGS, *(extra_flags or []), f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    cdp = None
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")  # --remote-debugging-port=0: no port race
        deadline = time.monotonic() + 30
        port = None
        while port is None:
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited at startup (rc {proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port within 30 s")
            try:
                with open(port_file) as fh:
                    port = int(fh.readline().strip())
            except (OSError, ValueError):
                time.sleep(0.1)
        tabs: list = []
        while not [t for t in tabs if t.get("type") == "page"]:
            if time.monotonic() > deadline:
                raise RuntimeError("chromium has no page target")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    tabs = json.load(r)
            except OSError:
                time.sleep(0.1)
        cdp = CDP(next(t for t in tabs if t["type"] == "page")["webSocketDebuggerUrl"])
        yield cdp
    finally:
        if cdp is not None:
            cdp.close()
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


def open_page(cdp: CDP, url: str, timeout_s: float = 20.0) -> None:
    """Navigate to the server's page and wait until its script has set up ``window.cadence``."""
    cdp.call("Page.navigate", url=url.rstrip("/") + "/")
    deadline = time.monotonic() + timeout_s
    while cdp.eval("document.readyState === 'complete' && typeof window.cadence === 'object'") is not True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the page at {url} did not load within {timeout_s:.0f} s")
        time.sleep(0.1)


#: Injected into the page: the received video's inbound-rtp counters (decoded frames, dropped, size) and the
#: audio's (samples received, concealed), read from the page's peer connection.
STATS_JS = r"""
(async () => {
  const pc = window.cadence.state().pc;
  const out = { t: performance.now() };
  (await pc.getStats()).forEach((r) => {
    if (r.type === "inbound-rtp" && r.kind === "video")
      Object.assign(out, { framesDecoded: r.framesDecoded || 0, framesReceived: r.framesReceived || 0,
                           frameWidth: r.frameWidth, codec: r.codecId, framesDropped: r.framesDropped || 0,
                           playoutV: r.estimatedPlayoutTimestamp });
    if (r.type === "inbound-rtp" && r.kind === "audio")
      Object.assign(out, { samples: r.totalSamplesReceived || 0, concealed: r.concealedSamples || 0,
                           audioEnergy: r.totalAudioEnergy || 0, playoutA: r.estimatedPlayoutTimestamp });
  });
  return out;
})()
"""


def get_json(url: str, token: str | None = None) -> dict:
    """GET ``url`` (with ``Authorization: Bearer <token>`` when given, as the page sends it)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())
