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


#: Injected into a page with a ``<video id="video">`` playing a received stream (video + audio): records every
#: presented frame (its display time and the RGB pixels of one region, base64) and the RMS of every 128-sample
#: block of the audio it plays (an AudioWorklet; time = the block's output time). Times are wall-clock ms
#: (``performance.timeOrigin + performance.now()``), comparable with a server's ``time.time()`` on the same
#: machine. ``%s``: the region ``[y0, y1, x0, x1]`` in the frame's pixels (JSON). Read with :func:`read_av_tap`.
AV_TAP_JS = r"""
(async () => {
  const video = document.getElementById("video");
  const stream = video.srcObject;
  if (!stream || !stream.getVideoTracks().length || !stream.getAudioTracks().length)
    throw new Error("no received stream with video and audio");
  const R = %s;
  const T0 = performance.timeOrigin;
  const M = window.__avtap = { frames: [], audio: [] };
  const c = document.createElement("canvas");
  const g = c.getContext("2d", { willReadFrequently: true });
  const onFrame = (now, md) => {
    if (c.width !== md.width) { c.width = md.width; c.height = md.height; }
    g.drawImage(video, 0, 0, md.width, md.height);
    const px = g.getImageData(R[2], R[0], R[3] - R[2], R[1] - R[0]).data;
    let s = "";
    for (let i = 0; i < px.length; i += 4) s += String.fromCharCode(px[i], px[i + 1], px[i + 2]);
    M.frames.push({ t: T0 + md.expectedDisplayTime, w: md.width, h: md.height, px: btoa(s) });
    if (!M.stopped) video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
  const worklet = `
    class Rms extends AudioWorkletProcessor {
      process(inputs) {
        const x = inputs[0] && inputs[0][0];
        if (x) { let s = 0; for (let i = 0; i < x.length; i++) s += x[i] * x[i];
                 this.port.postMessage({ t: currentTime, rms: Math.sqrt(s / x.length) }); }
        return true;
      }
    }
    registerProcessor("rms", Rms);`;
  const ctx = M.ctx = new AudioContext({ sampleRate: 48000 });
  await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([worklet], { type: "application/javascript" })));
  const node = new AudioWorkletNode(ctx, "rms");
  node.port.onmessage = (e) => {
    const ts = ctx.getOutputTimestamp();
    M.audio.push([T0 + ts.performanceTime + (e.data.t - ts.contextTime) * 1000, e.data.rms]);
  };
  ctx.createMediaStreamSource(stream).connect(node);
  node.connect(ctx.destination);
  await ctx.resume();
  return ctx.state;
})()
"""


def read_av_tap(cdp: CDP, region: tuple[int, int, int, int], stop: bool = True):
    """What :data:`AV_TAP_JS` recorded: ``(times_ms, crops, audio)``: the presented frames' wall-clock display
    times (ms), their region pixels (uint8 [N, y1 - y0, x1 - x0, 3]) and the played audio's
    ``[wall ms, rms]`` rows (float64 [M, 2])."""
    import base64

    import numpy as np

    m = cdp.eval(
        "(() => { const M = window.__avtap; M.stopped = %s; return { frames: M.frames, audio: M.audio }; })()"
        % ("true" if stop else "false"),
        timeout_s=60,
    )
    y0, y1, x0, x1 = region
    t = np.array([f["t"] for f in m["frames"]], np.float64)
    crops = (
        np.stack(
            [
                np.frombuffer(base64.b64decode(f["px"]), np.uint8).reshape(y1 - y0, x1 - x0, 3)
                for f in m["frames"]
            ]
        )
        if m["frames"]
        else np.zeros((0, y1 - y0, x1 - x0, 3), np.uint8)
    )
    audio = np.array(m["audio"], np.float64).reshape(-1, 2)
    return t, crops, audio
