"""Clients that drive ``cadence serve`` from outside, for the tests, the benchmarks and the integrations.

* :mod:`cadence.devtools.client`   a Python WebRTC client of the server (aiortc): what the page does, timed
  (``run_client``); its ``MicTrack`` is also what ``cadence.integrations.pipecat``'s remote mode sends.
* :mod:`cadence.devtools.browser`  a real browser: headless Chromium over the DevTools protocol.
* :mod:`cadence.devtools.testing`  a client in a background thread, code on the server's loop, a real offer,
  any ASGI app on a loopback port.

They sit above the server in the layers (``tests/test_layers.py``): the server never imports them, and the
benchmarks, the integrations and the tests may.
"""
