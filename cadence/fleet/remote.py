"""A front end's session whose WebRTC ends on its group's node (``--fleet-media group``):
:class:`GroupMediaSession`.

The session manager (``cadence.serve.manager.SessionManager``) admits, validates and keeps the session as it
keeps a ``LiveSession`` (same routes, same JSON, same errors), but this object holds no peer connection,
tracks, scheduler or buffer: those run in the group actor (``cadence.fleet.media``), which answers the SDP
offer. This side forwards the API's requests (``/say``, ``/audio``, ``/interrupt``, ``/prompt``, the
client's activity, DELETE) as Ray calls with the dataclasses of :mod:`cadence.fleet.messages`, serves the
session's status from the actor's updates (every ``UPDATE_S``; at most that old), applies the actor's metric
events to ``/metrics``, and gives the group's claim back when the session ends, however it ends:

* the client's DELETE or the server's shutdown: the actor closes the session and returns its report;
* the actor ends it (idle, max duration, the peer connection failed or never connected): ``MediaClosed``
  arrives with the report;
* the group dies (its actor killed, its worker exited, its node gone): one error,
  ``worker: worker group cadence-group-N failed (...); Ray restarts it``, ``close_reason`` ``worker_error``,
  and the report is the last status the actor sent (its timeline died with it).
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from cadence.engine.messages import Died
from cadence.fleet.messages import (
    MediaClose,
    MediaClosed,
    MediaInterrupt,
    MediaPrompt,
    MediaSpeak,
    MediaTouch,
    MediaUpdate,
    OpenMedia,
    apply_metric_events,
)
from cadence.serve.session import ClosesInBackground

log = logging.getLogger("cadence.fleet")

#: The client's activity is passed on to the actor (its idle timeout) at most this often.
TOUCH_EVERY_S = 1.0
#: How long a close waits for the actor's report (its own close is bounded by ~25 s: tasks, peer, worker).
CLOSE_TIMEOUT_S = 30.0
SAMPLE_RATE = 48_000


class RemoteAgent:
    """The session's agent as the API sees it (``speak``, ``interrupt``, ``queued_samples``); the agent itself
    runs in the group actor, beside the microphone track it listens to."""

    def __init__(self, session: GroupMediaSession, name: str):
        self.session, self.name = session, name
        self._queued = 0  # samples queued at the actor's last update
        self._pushed = 0  # samples sent since

    def speak(self, samples: np.ndarray, t_agent: float | None = None, new_segment: bool = True) -> None:
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if samples.size == 0:
            return
        age = 0.0 if t_agent is None else max(0.0, time.monotonic() - t_agent)
        self._pushed += samples.size
        self.session._fire(MediaSpeak(samples, age, new_segment))

    def interrupt(self) -> None:
        self._queued = self._pushed = 0
        self.session._fire(MediaInterrupt())

    @property
    def queued_samples(self) -> int:
        """The actor's queue at its last update plus what was sent since (an estimate: /say's ``queued_s``)."""
        return self._queued + self._pushed

    def updated(self, status: dict) -> None:
        self._queued = int(round(float(status.get("agent_queued_s") or 0.0) * SAMPLE_RATE))
        self._pushed = 0

    def close(self) -> None:
        pass


class _Answer:
    def __init__(self, sdp: str, type: str):
        self.sdp, self.type = sdp, type


def _error(name: str, text: str) -> Exception:
    """The actor's start failure as the exception the session manager maps to its answer (400 for aiortc's
    SDP errors, 500 otherwise), with the same class name in the message."""
    if name == "ValueError":
        return ValueError(text)
    if name in ("OperationError", "InvalidAccessError"):
        from aiortc import exceptions

        return getattr(exceptions, name)(text)
    return type(name, (RuntimeError,), {})(text)


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:120]}" if text else type(e).__name__


class GroupMediaSession(ClosesInBackground):
    """One session of this front end whose media runs on its group (a ``SessionPort`` of
    ``cadence.serve.ports``, as a ``LiveSession`` is), on a ``RayGroup`` (its ``handle``, ``name`` and
    ``source``: the ``FleetGroups`` that gave it, whose media settings travel with the offer)."""

    def __init__(self, server, sid: str, group, agent, engine_cfg, prompt: str, seed: int):
        self.server, self.sid, self.group = server, sid, group
        self.engine_cfg, self.prompt, self.seed = engine_cfg, prompt, seed
        self.agent = RemoteAgent(self, agent.name)
        self.state = "starting"
        self.close_reason: str | None = None
        self.t_created = time.monotonic()
        self.wall_created = time.time()
        self.t_closed: float | None = None
        self.errors: list[str] = []  # this side's (the actor's are in its status)
        self.final_report: dict | None = None
        self.media_pid: int | None = None  # the process that terminates the session's WebRTC
        self._status: dict = {}
        self._remote = False  # the actor holds the session open
        self._dead = False  # the group died: nothing more to ask it
        self._closed: MediaClosed | None = None
        self._close_task: asyncio.Task | None = None
        self._last_touch = 0.0

    # ---- start -------------------------------------------------------------------------------------------
    async def start(self, image: np.ndarray | None, offer_sdp: str, offer_type: str):
        """Open the session on the group, which answers the offer there. Returns the answer."""
        req = OpenMedia(
            self.sid,
            image,
            self.prompt,
            self.seed,
            self.agent.name,
            offer_sdp,
            offer_type,
            self.group.source.media_settings,
            age_s=max(0.0, time.monotonic() - self.t_created),
        )
        try:
            ans = await self.group.handle.open_media.remote(req)
        except Exception as e:  # the actor died meanwhile, or cannot be reached
            self._dead = True
            raise RuntimeError(f"worker group {self.group.name} failed ({_why(e)})") from None
        if ans.error_type is not None:
            self._closed = ans.closed
            raise _error(ans.error_type, ans.error)
        self._remote, self.media_pid = True, ans.pid
        self._update(ans.status)
        if self.state in ("closing", "closed"):  # closed while the actor was answering: close it there too
            self._fire(MediaClose(self.close_reason or "closed"))
            raise RuntimeError(f"the session was closed while starting ({self.close_reason})")
        return _Answer(ans.sdp, ans.type)

    # ---- requests the API forwards ---------------------------------------------------------------------------
    def _fire(self, req) -> None:
        """A request on the session, not waited for (calls from this front end reach the actor in order)."""
        if self._dead or self.group.handle is None:
            return
        ref = self.group.handle.media_request.remote(self.sid, req)

        async def settle():
            try:
                await ref
            except Exception as e:  # the group died: its poll tells the session
                log.debug("session %s: %s not delivered (%s)", self.sid, type(req).__name__, _why(e))

        t = asyncio.get_running_loop().create_task(settle())
        self.server.background.add(t)
        t.add_done_callback(self.server.background.discard)

    def touch(self) -> None:
        now = time.monotonic()
        if self._remote and now - self._last_touch >= TOUCH_EVERY_S:
            self._last_touch = now
            self._fire(MediaTouch())

    async def set_prompt(self, prompt: str) -> int:
        """The new prompt from the next chunk the group plans; that chunk's index."""
        self.prompt = prompt
        got = None
        if self._remote and not self._dead:
            got = await self.group.handle.media_request.remote(self.sid, MediaPrompt(prompt))
        if got is None:  # (closed meanwhile)
            return int((self._status.get("chunks") or {}).get("planned", 0))
        return int(got)

    def update_metrics(self) -> None:
        """(The per-session series come with the actor's updates.)"""

    # ---- the group's messages (the front end's poll) ----------------------------------------------------------
    def on_worker_message(self, msg) -> None:
        match msg:
            case MediaUpdate(status=status, events=events):
                if self.state not in ("closing", "closed"):
                    self._update(status)
                apply_metric_events(self.server.metrics, events, self.state not in ("closing", "closed"))
            case MediaClosed():
                self._take_closed(msg)
                self._remote = False
                self.close_soon(msg.report.get("close_reason") or "closed")
            case Died(reason=text):
                self._dead = True
                if self.state not in ("closing", "closed"):
                    text = f"worker: {text}"
                    self.errors.append(text)
                    log.error("session %s: %s", self.sid, text)
                    self.close_soon("worker_error")

    def _update(self, status: dict) -> None:
        self._status = status
        self.agent.updated(status)
        st = status.get("state")
        if st in ("connecting", "streaming") and self.state in ("starting", "connecting"):
            self.state = st

    def _take_closed(self, msg: MediaClosed | None) -> None:
        if msg is None or self._closed is msg:
            return
        first = self._closed is None
        self._closed = msg
        self._status = {k: v for k, v in msg.report.items() if k != "report"}
        if first:
            apply_metric_events(self.server.metrics, msg.events, False)

    # ---- status and report -----------------------------------------------------------------------------
    def _mine(self, out: dict) -> dict:
        end = self.t_closed or time.monotonic()
        out.update(
            session_id=self.sid,
            state=self.state,
            agent=self.agent.name,
            preset=self.engine_cfg.name,
            group=self.group.index,
            close_reason=self.close_reason,
            age_s=round(end - self.t_created, 3),
            errors=list(out.get("errors") or []) + self.errors,
        )
        if self.state == "closed":
            out.update(fps=0.0, degraded=False, buffer_ms=0.0)
        return out

    def status(self) -> dict:
        """The actor's last status (at most ``UPDATE_S`` old), this side's state, age and errors."""
        out = self._mine(dict(self._status))
        out["errors"] = out["errors"][-5:]
        return out

    def report(self) -> dict:
        """The actor's report (a group that died: its last status)."""
        base = dict(self._closed.report) if self._closed is not None else dict(self._status)
        end = self.t_closed or time.monotonic()
        base.setdefault("started_at", self.wall_created)
        base.setdefault("duration_s", round(end - self.t_created, 3))
        base["report"] = True
        out = self._mine(base)
        out["errors"] = out["errors"][-20:]
        return out

    # ---- close ------------------------------------------------------------------------------------------
    async def _teardown(self) -> None:
        try:
            if self._remote and not self._dead:
                call = asyncio.ensure_future(self._close_remote())
                done, _ = await asyncio.wait({call}, timeout=CLOSE_TIMEOUT_S)
                if not done:
                    call.cancel()
                    self.errors.append(
                        f"close: group {self.group.name} did not answer in {CLOSE_TIMEOUT_S:.0f} s"
                    )
                elif call.exception() is not None:
                    self.errors.append(f"close: {_why(call.exception())}")
        finally:
            self._remote = False
            await self._finish_close(self._give_back, "group")

    async def _give_back(self) -> None:
        """The claim back to the registry, through the fleet source that gave the group."""
        self.group.source.release(self.group, self.sid)

    async def _close_remote(self) -> None:
        msg = await self.group.handle.media_request.remote(
            self.sid, MediaClose(self.close_reason or "closed")
        )
        self._take_closed(msg)
