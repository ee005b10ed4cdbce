"""The live server: HTTP API + WebRTC (``cadence serve``).

Serving-only packages (fastapi, uvicorn, aiortc, prometheus-client; the ``serve`` extra) are
imported inside the submodules that need them, never by the engine or the benchmarks.
``cadence.serve.pacing`` is pure (numpy only) and safe to import anywhere.
"""
