"""What the fleet's tests share (tests/test_fleet.py, tests/test_fleet_media.py): the Ray skip, a poll, a
stand-in actor method."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest


def needs_ray() -> None:
    """Skip unless Ray, the serving packages and the ``ray`` command are here."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'cadence[ray]')")
    for mod in ("fastapi", "uvicorn", "aiortc", "httpx"):
        pytest.importorskip(mod, reason=f"the serve extra is not installed ({mod})")
    if shutil.which("ray") is None:
        pytest.skip("the 'ray' command is not on PATH")


def wait_for(pred, timeout: float, what: str, every: float = 0.25):
    """``pred()``'s first truthy value, polled every ``every`` s; an AssertionError naming ``what`` after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class FakeRemote:
    """A stand-in actor method (no Ray): ``.remote(...)`` records the call in ``calls`` and returns an
    awaitable of ``fn(...)``."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def remote(self, *args):
        self.calls.append((self.fn.__name__, args))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args))
        return fut
