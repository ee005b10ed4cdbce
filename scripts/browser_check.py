"""Manual browser smoke check: headless Chromium opens a running `cadence serve`, starts a session
through the page's `window.cadence.start()`, and prints the page's state, fps and the video's
size and clock once a second for 8 s, then saves a screenshot.

    cadence serve --port 8767 &          # then
    python3 scripts/browser_check.py [--port 8767] [--out /tmp/live.png]

Needs Debian's chromium and `pip install websocket-client`. Loopback only: Chromium gets
--allow-loopback-in-peer-connection and a fake microphone. The automated end-to-end test (fps, audio,
A/V sync marker) is tests/test_e2e_browser.py.
"""
import argparse
import base64
import json
import subprocess
import time
import urllib.request

import websocket

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, default=8767)
ap.add_argument("--out", default="/tmp/live.png")
args = ap.parse_args()
port = 9333  # Chromium remote-debugging port
proc = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--user-data-dir=/tmp/chr2",
    f"--remote-debugging-port={port}", "--allow-loopback-in-peer-connection", "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream", "--disable-features=WebRtcHideLocalIpsWithMdns", "--autoplay-policy=no-user-gesture-required",
    "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(50):
        try:
            tabs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json")); break
        except Exception: time.sleep(0.2)
    ws = websocket.create_connection([t for t in tabs if t["type"] == "page"][0]["webSocketDebuggerUrl"])
    n = [0]
    def call(method, **params):
        n[0] += 1; ws.send(json.dumps({"id": n[0], "method": method, "params": params}))
        while True:
            m = json.loads(ws.recv())
            if m.get("id") == n[0]: return m
    def ev(expr):
        r = call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        return r.get("result", {}).get("result", {}).get("value", r)
    call("Page.navigate", url=f"http://127.0.0.1:{args.port}/"); time.sleep(2)
    print("start:", ev("window.cadence.start().then(()=>'ok').catch(e=>'ERR '+e)"))
    for _ in range(8):
        time.sleep(1)
        print(ev("JSON.stringify({state: document.body.dataset.state, fps: document.body.dataset.fps, conn: document.body.dataset.connection, vw: document.querySelector('video').videoWidth, t: document.querySelector('video').currentTime, err: document.getElementById('error').textContent})"))
    shot = call("Page.captureScreenshot", format="png")
    with open(args.out, "wb") as fh:
        fh.write(base64.b64decode(shot["result"]["data"]))
    print("stop:", ev("window.cadence.stop().then(()=>'ok').catch(e=>'ERR '+e)"))
finally:
    proc.kill()
