"""One worker group as a Ray actor (:class:`GroupActor`), placed by the registry in a STRICT_PACK placement
group of its own (one bundle: all of the group's GPUs on one node).

The actor does not run a second engine: it owns the same :class:`~cadence.serve.workers.WorkerGroup` the
single-machine server owns, on the group's node, so the worker processes, the engine, its warm-up, the
tensor-parallel followers and the shared-memory frame ring are exactly ``cadence serve``'s (the actor is a
thin async relay between Ray calls and that group's pipe). Requests and replies are the dataclasses of
:mod:`cadence.engine.messages`, passed through Ray as they are.

    front end --send(msg)--> actor --pipe--> worker rank 0 (+ TP followers)
    front end <--poll()----- actor <--pipe / shared memory-- worker

``poll`` is a long poll: it returns every reply queued since the last one (waiting up to ``timeout`` for
the first), so a chunk's frames cross Ray once per chunk, with the chunk's other replies. Only a session's
replies are queued (the worker's ``Ready`` becomes the actor's ``ping`` state instead).

With ``--fleet-media group`` the session's WebRTC ends here instead (``open_media``, ``media_request``):
the actor's :class:`~cadence.fleet.media.MediaHost` runs the session (aiortc, scheduler, tracks, agent) on a
loop of its own, the worker's replies of that session go to it and not to ``poll``, and ``poll`` carries the
session's status updates and its end (``cadence.fleet.messages``). Imported only then: the actor of a
``frontend``-mode fleet never imports aiortc.

Faults: a worker process that exits (``Died``) takes the actor down with it (``os._exit``) after its
replies are queued for half a second, so there is one recovery path: Ray restarts the actor (its
``max_restarts``) and the restarted actor builds and warms a fresh group; the registry counts the restart
when a new incarnation answers ``ping``. The actor process being killed ends the worker processes too
(their pipe closes: the worker's command loop reads EOF and stops).

The worker starts on the first call (the registry's ``ping`` comes within a check interval), because Ray
runs ``__init__`` outside the actor's event loop and the group needs that loop. It runs at normal priority
(nice 0), not at Ray's worker niceness (15), at which its engine loses the CPU to everything else on the
node (measured: docs/fleet.md, "Measured", fix 1).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

from cadence.engine.messages import CloseSession, Died, Ready
from cadence.engine.recipe import WorkerSpec

log = logging.getLogger("cadence.fleet")

#: How long a group actor whose worker died keeps serving polls (so its sessions get the error) before it exits.
EXIT_AFTER_DIED_S = 0.5


def _normal_priority() -> None:
    """Ray starts workers at nice 15 (its ``worker_niceness``): a group's engine (this actor's children
    inherit it) would lose the CPU to anything else on the node. Back to 0 where allowed; else one warning
    (set ``RAY_worker_niceness=0`` in the nodes' environment: ``cadence.fleet.cluster``, deploy/kuberay)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        log.warning(
            "group actor runs at nice %d (Ray's worker_niceness) and may not lower it: its engine can be "
            "starved by other work on the node; start the nodes with RAY_worker_niceness=0",
            nice,
        )


class GroupActor:
    """Decorated with ``ray.remote`` by the registry (``cadence.fleet.registry``): this module imports no Ray."""

    def __init__(self, name: str, index: int, spec: WorkerSpec, frame_shape, slots: int, shm: bool):
        self.name, self.index = name, index
        self.spec, self.frame_shape, self.slots, self.shm = spec, frame_shape, slots, shm
        self.incarnation = uuid.uuid4().hex
        self.t_created = time.time()
        self.group = None
        self.media = None  # the MediaHost, from the first session whose WebRTC ends here
        self.replies: list = []
        self._wake: asyncio.Event | None = None
        self._exiting = False

    def _ensure(self) -> None:
        if self.group is not None:
            return
        from cadence.serve.workers import WorkerGroup

        _normal_priority()
        self._wake = asyncio.Event()
        self.group = WorkerGroup(
            self.index, self.spec, frame_shape=self.frame_shape, slots=self.slots, shm=self.shm
        )
        self.group.on_message = self._on_message
        self.group.start()

    def _on_message(self, msg) -> None:
        if isinstance(msg, Ready):  # (WorkerGroup keeps Ready to itself; kept here in case)
            return
        if self.media is not None and self.media.owns(getattr(msg, "sid", None)):
            self.media.deliver(msg)  # a reply of a session whose WebRTC ends here: to its loop, not to poll
            return
        self._push(msg)
        if isinstance(msg, Died) and not self._exiting:
            self._exiting = True
            log.error("group %s: %s; the actor exits so that Ray restarts it", self.name, msg.reason)
            asyncio.get_running_loop().call_later(EXIT_AFTER_DIED_S, os._exit, 1)

    def _push(self, msg) -> None:
        """Queue a message for the front end's next ``poll`` (on the actor's loop)."""
        self.replies.append(msg)
        if self._wake is not None:
            self._wake.set()

    def _media(self):
        if self.media is None:
            from cadence.fleet.media import MediaHost  # (aiortc, PyAV: only in this mode)

            self.media = MediaHost(
                self.group, self.spec.recipe.config, asyncio.get_running_loop(), self._push
            )
        return self.media

    async def ping(self) -> dict:
        """The group's state (starts the worker on the first call)."""
        import ray

        self._ensure()
        g = self.group
        ctx = ray.get_runtime_context()
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "restarted": bool(ctx.was_current_actor_reconstructed),
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "worker_pid": g.pid,
            "ready": g.ready.is_set() and not self._exiting,
            "start_error": g.start_error,
            "info": g.info_dict(),
            "device": g.device,
        }

    async def send(self, msg) -> None:
        """Queue a request for the worker (``WorkerGroup.send``: never blocks). A ``CloseSession`` of a session
        whose WebRTC ends here (the registry's, for a front end whose lease expired) closes that session."""
        self._ensure()
        if isinstance(msg, CloseSession) and self.media is not None and self.media.owns(msg.sid):
            self.media.close_soon(msg.sid, "frontend_lost")
            return
        self.group.send(msg)

    async def open_media(self, req):
        """Open a session whose WebRTC ends on this node (``cadence.fleet.messages.OpenMedia``): its SDP
        answer (``MediaAnswer``)."""
        self._ensure()
        host = self._media()
        return await host.call(host.open(req))

    async def prepare_media(self) -> bool:
        """Import and start what a session whose WebRTC ends here needs, ahead of the first one (a front end in
        that mode calls it once per incarnation: the first session does not wait for aiortc's import)."""
        self._ensure()
        self._media()
        return True

    async def media_request(self, sid: str, req):
        """A front end's request on a session held here (``MediaSpeak``, ``MediaPrompt``, ``MediaClose``, ...)."""
        self._ensure()
        if self.media is None:
            return None
        return await self.media.call(self.media.request(sid, req))

    async def poll(self, timeout: float = 0.5) -> list:
        """Every reply since the last poll; waits up to ``timeout`` s for the first."""
        self._ensure()
        if not self.replies:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
        out, self.replies = self.replies, []
        return out

    async def stop(self) -> None:
        """Close the sessions held here, stop the worker processes (before the actor is killed for good)."""
        if self.media is not None:
            await self.media.call(self.media.stop())
            self.media.loop.call_soon_threadsafe(self.media.loop.stop)
        if self.group is not None:
            self._exiting = True
            await self.group.stop()
