"""WebRTC terminated on the group's own node (``cadence serve --ray ... --fleet-media group``): the group
actor's :class:`MediaHost`.

    browser <--WebRTC--> group actor (this module: aiortc, the session's scheduler, tracks, agent)
                             <--pipe / shared memory--> worker
    browser <--HTTP--> front end <--Ray: open_media / media_request / poll--> group actor

The front end keeps admission (the registry's claim), validation, tokens, the HTTP API and the session's
bookkeeping (``cadence.fleet.remote.GroupMediaSession``); it hands the browser's SDP offer to the actor
(:class:`~cadence.fleet.messages.OpenMedia`) and returns the actor's answer. Here the session is the very
:class:`~cadence.serve.session.LiveSession` the single-machine server runs (its ``ChunkScheduler``,
``AVBuffer``, ``VideoOut`` / ``AudioOut`` tracks, agent and stats: one media path, no second copy), fed by
the actor's own ``WorkerGroup``: a chunk's frames go from the worker's pipe (or shared memory) straight into
the session's playout buffer, and the encoded media leaves from this process. Only small messages cross to
the front end: the status every ``UPDATE_S`` with the metric events (``MediaUpdate``) and the report at the
end (``MediaClosed``).

The sessions run on an asyncio loop of their own, in a thread of the actor (``cadence-media``), not on Ray's
actor loop: pacing never waits behind Ray calls. The actor's loop owns the ``WorkerGroup`` (as in the
``frontend`` mode); replies of a session held here are handed to the media loop, requests go into the
group's writer queue (thread-safe), and a restart of the group runs on the actor's loop.

The planner's lead here has no Ray hop (the worker's pipe only, as on one machine). ICE candidates: the
addresses of ``MediaSettings.ice`` (by default the node's Ray address, 127.0.0.1 in the tests' local
cluster); a browser must reach them by UDP (docs/fleet.md, "Media path and its cost").

This module imports aiortc / PyAV (through ``cadence.serve``): the actor imports it only when the first such
session opens.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time

from cadence.fleet.messages import (
    UPDATE_S,
    MediaAnswer,
    MediaClose,
    MediaClosed,
    MediaInterrupt,
    MediaPrompt,
    MediaSettings,
    MediaSpeak,
    MediaTouch,
    MediaUpdate,
    MetricsRecorder,
    OpenMedia,
)
from cadence.serve.agents import make_agent
from cadence.serve.rtc import use_ice_host_addresses
from cadence.serve.session import LiveSession

log = logging.getLogger("cadence.fleet")

#: Closed sessions whose ``MediaClosed`` the host keeps (a front end's close that comes after the session
#: ended here gets it).
KEEP_CLOSED = 16


def node_address() -> str:
    """This Ray node's address as the cluster knows it (``ray start --node-ip-address``: its raylet's address;
    127.0.0.1 in the tests' local cluster), not whatever interface routes outward."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n.get("NodeID") == me and n.get("NodeManagerAddress"):
            return n["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class GroupView:
    """The actor's ``WorkerGroup`` as the media loop's sessions see it (a ``SessionGroup`` of
    ``cadence.serve.ports``). The group lives on the actor's loop."""

    transport_s = 0.0  # the worker's pipe only: no Ray hop between the worker's replies and the tracks

    def __init__(self, group, actor_loop: asyncio.AbstractEventLoop):
        self.group, self.actor_loop = group, actor_loop
        self.session_id: str | None = None
        self.latency_profile = group.latency_profile  # the actor's group's, across its sessions

    @property
    def index(self) -> int:
        return self.group.index

    @property
    def ready(self):
        return self.group.ready  # (read with is_set() only: safe from another thread)

    @property
    def info(self):
        return self.group.info

    def send(self, msg) -> None:
        self.group.send(msg)  # (a thread-safe queue; the frame ring's slots have a lock)

    async def restart(self) -> None:
        """A worker that would not release its session: restarted on the actor's loop (its own)."""
        fut = asyncio.run_coroutine_threadsafe(self.group.restart(), self.actor_loop)
        await asyncio.wrap_future(fut)


class MediaHost:
    """The sessions of one group actor whose WebRTC ends here: the ``SessionHost`` (``cadence.serve.ports``) a
    ``LiveSession`` reports to (``cfg``, ``metrics``, ``background``, ``release``, ``session_closed``). The
    session's own rules are the single-machine server's, not a copy: its lead from the worker's warm-up
    (``cadence.serve.session.worker_speed``) and the worker's release at its end (CloseSession, a bounded
    wait, a restart if it does not answer) are the ``LiveSession``'s."""

    def __init__(self, group, engine_cfg, actor_loop: asyncio.AbstractEventLoop, push):
        """``group``: the actor's ``WorkerGroup``; ``push(msg)``: queue a reply for the front end's poll (called
        on the actor's loop)."""
        self.view = GroupView(group, actor_loop)
        self.engine_cfg = engine_cfg
        self.actor_loop, self._push = actor_loop, push
        self.cfg = MediaSettings()
        self.metrics = MetricsRecorder()
        self.sessions: dict[str, LiveSession] = {}
        self.closed: collections.OrderedDict[str, MediaClosed] = collections.OrderedDict()
        self.owned: set[str] = set()  # every session id this host holds or held (its replies come here)
        self.background: set[asyncio.Task] = set()
        self._ice: str | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="cadence-media", daemon=True)
        self.thread.start()
        self._updates = asyncio.run_coroutine_threadsafe(self._send_updates(), self.loop)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    # ---- from the actor's loop ----------------------------------------------------------------------------
    async def call(self, coro):
        """Run ``coro`` on the media loop; its result (on the caller's loop)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def owns(self, sid: str | None) -> bool:
        return sid is not None and sid in self.owned

    def deliver(self, msg) -> None:
        """A worker reply of a session held here (called on the actor's loop)."""
        self.loop.call_soon_threadsafe(self._deliver, msg)

    def _deliver(self, msg) -> None:
        s = self.sessions.get(msg.sid)
        if s is not None:
            s.on_worker_message(msg)

    def push(self, msg) -> None:
        """A message for the front end (from the media loop): into the actor's reply queue, on its loop."""
        try:
            self.actor_loop.call_soon_threadsafe(self._push, msg)
        except RuntimeError:  # the actor's loop is gone (the actor is exiting)
            pass

    # ---- on the media loop --------------------------------------------------------------------------------
    async def open(self, req: OpenMedia) -> MediaAnswer:
        for other in list(self.sessions.values()):  # (the registry's claims make this impossible; be sure)
            log.warning("group %d: session %s still open; closing it", self.view.index, other.sid)
            await other.close("replaced")
        self.cfg = req.settings
        self._use_ice(req.settings.ice)
        agent = make_agent(req.agent, self.engine_cfg.chunk_seconds, req.settings.agent_endpoint)
        self.view.session_id = req.sid
        sess = LiveSession(self, req.sid, self.view, agent, self.engine_cfg, req.prompt, req.seed)
        sess.t_created -= req.age_s  # the front end's request time, as the single-machine server counts it
        sess.wall_created -= req.age_s
        self.sessions[req.sid] = sess
        self.owned.add(req.sid)
        try:
            answer = await sess.start(req.image, req.sdp, req.sdp_type)
        except Exception as e:
            if not isinstance(e, ValueError):
                log.exception("session %s failed to start on group %d", req.sid, self.view.index)
            await sess.close("start_failed")
            return MediaAnswer(
                req.sid, error_type=type(e).__name__, error=str(e), closed=self.closed.get(req.sid)
            )
        return MediaAnswer(req.sid, sdp=answer.sdp, type=answer.type, status=sess.status(), pid=os.getpid())

    async def request(self, sid: str, req):
        """One of the front end's requests on session ``sid`` (None when it is not open here)."""
        s = self.sessions.get(sid)
        if isinstance(req, MediaClose):
            if s is not None:
                await s.close(req.reason)
            return self.closed.get(sid)
        if s is None or s.state in ("closing", "closed"):
            return None
        s.touch()
        match req:
            case MediaSpeak(samples=samples, age_s=age, new_segment=new):
                s.agent.speak(samples, t_agent=time.monotonic() - age, new_segment=new)
            case MediaInterrupt():
                s.agent.interrupt()
            case MediaPrompt(prompt=prompt):
                return await s.set_prompt(prompt)
            case MediaTouch():
                pass
        return None

    def close_soon(self, sid: str, reason: str) -> None:
        """Close session ``sid`` (from the actor's loop: a ``CloseSession`` of the registry, whose front end's
        lease expired)."""

        def go():
            s = self.sessions.get(sid)
            if s is not None:
                s.close_soon(reason)

        self.loop.call_soon_threadsafe(go)

    async def _send_updates(self) -> None:
        while True:
            await asyncio.sleep(UPDATE_S)
            for sid, s in list(self.sessions.items()):
                if s.state not in ("closing", "closed"):
                    try:
                        self.push(MediaUpdate(sid, s.status(), self.metrics.drain()))
                    except Exception:
                        log.exception("session %s: status update", sid)

    def _use_ice(self, ice: str) -> None:
        if ice == self._ice:
            return
        if ice == "auto":
            addresses = None
        elif ice == "node":
            addresses = [node_address()]
        else:
            addresses = [a.strip() for a in ice.split(",") if a.strip()]
        use_ice_host_addresses(addresses)
        self._ice = ice
        log.info("group %d: WebRTC host candidates on %s", self.view.index, addresses or "every interface")

    # ---- the LiveSession's host --------------------------------------------------------------------------
    def release(self, group, sid: str) -> None:
        """The session's worker let it go: the group is free here (the claim is the front end's to return)."""
        if group.session_id == sid:
            group.session_id = None

    def session_closed(self, sess: LiveSession, report: dict) -> None:
        self.sessions.pop(sess.sid, None)
        msg = MediaClosed(sess.sid, report, self.metrics.drain())
        self.closed[sess.sid] = msg
        while len(self.closed) > KEEP_CLOSED:
            old, _ = self.closed.popitem(last=False)
            self.owned.discard(old)
        self.push(msg)

    async def stop(self, timeout: float = 20.0) -> None:
        """Close every session (the actor is stopping) and end the loop's thread."""
        for s in list(self.sessions.values()):
            s.close_soon("shutdown")
        deadline = time.monotonic() + timeout
        while self.background and time.monotonic() < deadline:
            await asyncio.wait(list(self.background), timeout=max(0.0, deadline - time.monotonic()))
        self._updates.cancel()
