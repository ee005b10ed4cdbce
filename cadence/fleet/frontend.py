"""The front end's side of the fleet: :class:`FleetGroups`, the group source of a ``cadence serve --ray``
front end, and :class:`RayGroup`, one remote group seen from the event loop.

The session manager (``cadence.serve.manager.SessionManager``) gets its groups from a source (the
``GroupSource`` Protocol of ``cadence.serve.ports``): on one machine ``cadence.serve.workers.LocalGroups``
(this machine's ``WorkerGroup`` processes), with ``--ray`` this module's :class:`FleetGroups`. A
:class:`RayGroup` is a ``GroupPort`` as a ``WorkerGroup`` is (``send``, ``on_message``, ``ready``, ``info``,
``session_id``, ``free``, ``restart``, ``stop``), and the same messages (:mod:`cadence.engine.messages`)
travel, through Ray instead of a pipe.

Admission is fleet-wide: before the manager's (synchronous) ``reserve`` runs, :meth:`FleetGroups.admission`
claims a free group in the registry (one Ray call); ``acquire`` then hands that claimed group to the
request, and a claim the request did not use (429, a bad image) goes back at once. With no free group in
the whole fleet the claim comes back empty and the request gets 503 with the registry's Retry-After.

Media path: browser <-WebRTC-> this front end <-Ray-> group actor <-pipe/shared memory-> worker. Per chunk:
one ``send`` (the chunk's audio, 8,000 float32 samples = 32 KB at 24 fps / 4 frames) and the chunk's frames
back in one ``poll`` answer (character: 4 x 128 x 128 x 3 = 196 KB; W1.3 12 x 480 x 832 x 3 = 14.4 MB,
which goes through Ray's object store: a node-to-node copy when the group is on another machine). Costs
measured here: docs/fleet.md.

With ``--fleet-media group`` the browser's WebRTC ends on the group's node instead: a new session is a
``cadence.fleet.remote.GroupMediaSession`` (``FleetGroups.session_factory``), whose offer goes to the actor
(``open_media``) and whose frames and audio never come here; the poll then carries the session's status
updates and its end (``cadence.fleet.messages``).

Faults seen from here: a poll that fails (the actor died, its node left) is reported once as ``Died``;
the session on it ends with that error (``worker_error``) and its claim is released; Ray restarts the
actor and the registry puts it back when it is ready. Nothing here restarts a group: ``restart`` only
kills an actor that would not release a session (Ray then restarts it), as the single-machine server
restarts a stuck worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import uuid

from cadence.engine.messages import Died, WorkerInfo
from cadence.serve.pacing import LatencyProfile

log = logging.getLogger("cadence.fleet")

#: The group claimed for the request being admitted (set by ``admission``, read by ``acquire``).
_CLAIMED: contextvars.ContextVar = contextvars.ContextVar("cadence_fleet_claim", default=None)


class RayGroup:
    """One group of the fleet, as the session manager sees it (a ``GroupPort``)."""

    def __init__(self, source: FleetGroups, name: str, index: int):
        self.source, self.name, self.index = source, name, index
        self.handle = None
        self.ready = asyncio.Event()
        self.info: WorkerInfo | None = None
        self.session_id: str | None = None
        self.claim_id: str | None = None
        self.on_message = None
        self.start_error: str | None = None
        self.restarts = 0
        self.state = "starting"
        self.draining = False
        self.node_id: str | None = None
        self.claimed_elsewhere = False
        self.incarnation: str | None = None
        self.died_incarnation: str | None = None
        self._device = "?"
        self._pid: int | None = None
        self._poll: asyncio.Task | None = None
        # (read by the session's worker_speed; with the media on the group the actor plans without the Ray hop)
        self.transport_s = 0.0 if source.media_on_group else source.fleet_cfg.hop_ms / 1e3
        self.media_prepared: str | None = None  # the incarnation asked to prepare its media (group mode)
        self.latency_profile = (
            LatencyProfile()
        )  # this front end's sessions on the group (session.worker_speed)

    # ---- the GroupPort -----------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self._device

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def free(self) -> bool:
        return (
            self.ready.is_set()
            and self.session_id is None
            and self.claim_id is None
            and not self.claimed_elsewhere
            and not self.draining
        )

    def info_dict(self) -> dict:
        out = dataclasses.asdict(self.info) if self.info is not None else {}
        out.update(group=self.name, node_id=self.node_id, state=self.state, draining=self.draining)
        return out

    def send(self, msg) -> None:
        """Queue a request for the group (a Ray actor call: returns at once; calls from one caller run in order)."""
        if self.handle is None:
            self._dispatch(Died(f"group {self.name} is not reachable"))
            return
        self.handle.send.remote(msg)

    def start(self) -> None:
        """Nothing to start: the group is built once, fleet-wide (the registry); see ``FleetGroups.start``."""

    async def stop(self) -> None:
        """This front end stops listening to the group (the group itself lives on for the other front ends)."""
        self._stop_poll()

    async def restart(self) -> None:
        """A group that would not release its session: kill its actor (Ray restarts it: a fresh group).
        A group whose actor already died is being restarted by Ray: nothing to do."""
        self._stop_poll()
        if self.handle is not None and self.ready.is_set():
            import ray

            log.warning(
                "group %s did not release its session: killing its actor (Ray restarts it)", self.name
            )
            ray.kill(self.handle, no_restart=False)
        self.ready.clear()

    # ---- replies ------------------------------------------------------------------------------------
    def start_poll(self) -> None:
        if self._poll is None or self._poll.done():
            self._poll = asyncio.get_running_loop().create_task(
                self._polling(), name=f"cadence-poll-{self.name}"
            )

    def _stop_poll(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None

    async def _polling(self) -> None:
        # the incarnation this poll talks to: a death it sees is that one's, even when a heartbeat has
        # meanwhile brought the restarted actor's (a fast restart, seen by the registry before the failed
        # call came back here); taking the newer one would keep the group from ever being ready again
        handle, inc = self.handle, self.incarnation
        while True:
            try:
                msgs = await handle.poll.remote(0.5)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the actor died (or is restarting), or its node left
                self._dispatch(Died(f"worker group {self.name} failed ({_why(e)}); Ray restarts it"), inc)
                return
            for msg in msgs:
                self._dispatch(msg, inc)
                if isinstance(msg, Died):
                    return

    def _dispatch(self, msg, incarnation: str | None = None) -> None:
        if isinstance(msg, Died):
            self.ready.clear()
            self.state = "restarting"
            self.died_incarnation = incarnation if incarnation is not None else self.incarnation
        if self.on_message is not None:
            self.on_message(msg)


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:120]}" if text else type(e).__name__


class FleetGroups:
    """The group source of a ``--ray`` front end: the fleet's groups, kept in step with the registry."""

    fleet = True

    def __init__(self, cfg):
        from cadence.serve.config import frame_shape, worker_spec

        self.cfg, self.fleet_cfg = cfg, cfg.deployment
        self.metrics = None  # the manager's (``start``): the fleet's gauges go there
        # resolved once for the fleet's group device; the sessions' geometry is this recipe's
        self.spec, self.shm = worker_spec(cfg, self.fleet_cfg.placement)
        self.recipe = self.spec.recipe
        self.frame_shape = frame_shape(self.recipe.config)
        self.preset = self.recipe.config.name
        self.media_on_group = self.fleet_cfg.media == "group"
        self.media_settings = None
        if self.media_on_group:
            from cadence.fleet.messages import MediaSettings

            self.media_settings = MediaSettings.from_serve(cfg, self.fleet_cfg.media_ice)
        self.frontend_id = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.groups: list[RayGroup] = []  # the manager's ``groups`` (the same list, updated in place)
        self.by_name: dict[str, RayGroup] = {}
        self.snapshot: dict = {}
        self.registry = None
        self._owns_ray = False
        self._beat: asyncio.Task | None = None
        self._route = None
        self._retry_after = 5

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self, route, metrics, timeout_s: float) -> None:
        """Join (or start) the Ray cluster, find or create the registry and the groups, wait for them; every
        group's replies go to ``route``, the fleet's state to ``metrics`` (each heartbeat)."""
        import ray

        from cadence.fleet.registry import registry_handle

        f = self.fleet_cfg
        self._route, self.metrics = route, metrics
        if not ray.is_initialized():
            await asyncio.to_thread(self._init_ray, f)
        self.registry = registry_handle(f, self.cfg.max_duration_s)
        if f.groups:
            names = await self.registry.ensure_groups.remote(
                f.groups,
                self.spec,
                self.frame_shape,
                self.cfg.max_in_flight + 1,
                self.shm,
                f.bundle(),
                f.max_restarts,
            )
            log.info("fleet: %d group(s): %s", len(names), names)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        want = max(1, f.groups)
        while True:
            await self.sync()
            ready = sum(g.ready.is_set() for g in self.groups)
            failed = [g for g in self.groups if g.state == "failed"]
            if ready >= want:
                break
            if failed and ready + len(failed) >= want:
                raise RuntimeError("; ".join(f"group {g.name}: {g.start_error}" for g in failed))
            if loop.time() > deadline:
                if ready:
                    log.warning(
                        "fleet: %d of %d group(s) ready after %.0f s; serving with those",
                        ready,
                        want,
                        timeout_s,
                    )
                    break
                raise RuntimeError(f"no fleet group ready within {timeout_s:.0f} s")
            await asyncio.sleep(0.25)
        self._beat = loop.create_task(self._heartbeats(), name="cadence-fleet-heartbeat")

    def _init_ray(self, f) -> None:
        import ray

        kw = {"namespace": f.namespace, "logging_level": logging.WARNING, "log_to_driver": False}
        if f.address == "auto":
            try:
                ray.init(address="auto", **kw)
            except ConnectionError:
                log.warning("fleet: no Ray cluster on this machine: starting a local one")
                ray.init(**kw)
        else:
            ray.init(address=f.address, **kw)
        self._owns_ray = True

    async def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
        for g in self.groups:
            await g.stop()
            if g.claim_id is not None:
                self.release(g, g.session_id or "")
        if self._owns_ray:
            import ray

            await asyncio.to_thread(ray.shutdown)

    # ---- the registry's view ----------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.fleet_cfg.heartbeat_s)
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("fleet: heartbeat failed (%s)", _why(e))

    def claims(self) -> dict:
        return {g.name: (g.claim_id, g.session_id) for g in self.groups if g.claim_id is not None}

    async def sync(self) -> None:
        """One heartbeat: our claims out, the fleet's state back (the groups, /metrics)."""

        snap = await self.registry.heartbeat.remote(self.frontend_id, self.claims())
        self.snapshot = snap
        self._retry_after = snap.get("retry_after", 5)
        seen = set()
        for d in snap["groups"]:
            name = d["name"]
            seen.add(name)
            g = self.by_name.get(name)
            if g is None:
                g = self.by_name[name] = RayGroup(self, name, d["index"])
                g.on_message = lambda msg, g=g: self._route(g, msg) if self._route else None
                self.groups.append(g)
                self.groups.sort(key=lambda x: x.index)
            if g.handle is None:  # (the handle stays valid across the actor's restarts)
                g.handle = self._actor(name)
            g.incarnation = d["incarnation"]
            info = d.get("info") or {}
            if info and info.get("preset") != self.preset:
                d = {
                    **d,
                    "state": "failed",
                    "start_error": f"builds preset {info.get('preset')!r}, not {self.preset!r}",
                }
            g.state, g.draining, g.node_id, g.restarts = (
                d["state"],
                d["draining"],
                d["node_id"],
                d["restarts"],
            )
            g.start_error, g._pid = d.get("start_error"), d.get("pid")
            g._device = info.get("device", str(self.fleet_cfg.placement))
            g.info = WorkerInfo.of(info) if info else None
            claim = d.get("claim")
            g.claimed_elsewhere = claim is not None and claim[0] != self.frontend_id
            # ready: up, and not the incarnation this front end saw die (the registry notices a death a
            # check later than a poll does)
            # (a group holding a session changes only through the session: a Died clears it, the release
            # sets it again; so a session closing after its group died never talks to the restarted one)
            up = d["state"] == "up" and g.info is not None and g.incarnation != g.died_incarnation
            if up and self.media_on_group and g.handle is not None and g.media_prepared != g.incarnation:
                g.media_prepared = g.incarnation  # (aiortc imported on the group before its first session)
                g.handle.prepare_media.remote()
            if not up:
                g.ready.clear()
            elif g.session_id is None:
                g.ready.set()
        for name in [n for n in self.by_name if n not in seen]:  # left the registry (its node left)
            g = self.by_name.pop(name)
            self.groups.remove(g)
            if g.session_id is None:
                await g.stop()
        self._metrics(snap)

    def _actor(self, name: str):
        """The group actor's handle (None: no such actor now)."""
        import ray

        try:
            return ray.get_actor(name, namespace=self.fleet_cfg.namespace)
        except ValueError:
            return None

    def _metrics(self, snap: dict) -> None:
        m = self.metrics
        if m is None:
            return
        states: dict[str, int] = {s: 0 for s in ("starting", "up", "draining", "restarting", "failed")}
        for d in snap["groups"]:
            st = "draining" if d["draining"] and d["state"] == "up" else d["state"]
            states[st] = states.get(st, 0) + 1
            m.fleet_restarts.labels(d["name"]).set(d["restarts"])
        for st, n in states.items():
            m.fleet_groups.labels(st).set(n)
        m.fleet_sessions.set(snap["sessions"])
        m.fleet_free.set(snap["free"])
        m.fleet_restarts_total.set(snap["restarts"])
        m.groups.set(len(snap["groups"]))

    # ---- admission (the manager's acquire / release) -------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admission(self):
        """Claim a free group of the fleet for the request being admitted; give it back if the request did
        not take it (``acquire``)."""
        cid = uuid.uuid4().hex
        got = await self.registry.claim.remote(self.frontend_id, cid)
        self._retry_after = got.get("retry_after", self._retry_after)
        g = self.by_name.get(got["group"]) if got["group"] else None
        if got["group"] and g is None:  # a group we have not synced yet: give it back
            self.registry.release.remote(self.frontend_id, got["group"], cid)
        if g is not None:
            g.claim_id = cid
        token = _CLAIMED.set(g)
        try:
            yield
        finally:
            _CLAIMED.reset(token)
            if g is not None and g.session_id is None and g.claim_id == cid:
                self.release(g, "")

    def acquire(self):
        g = _CLAIMED.get()
        if g is None or g.session_id is not None or not g.ready.is_set():
            return None
        g.start_poll()
        return g

    def release(self, group: RayGroup, sid: str) -> None:
        """Session ``sid`` (or an unused claim) is done with ``group``: the claim goes back to the registry."""
        if group.session_id not in (None, sid):
            return
        group._stop_poll()
        cid, group.claim_id, group.session_id = group.claim_id, None, None
        if cid is not None and self.registry is not None:
            self.registry.release.remote(self.frontend_id, group.name, cid)
        if group.state == "up" and group.info is not None and group.incarnation != group.died_incarnation:
            group.ready.set()

    def retry_after(self) -> int:
        return int(self._retry_after)

    def session_factory(self, group: RayGroup):
        """A new session's class: a ``LiveSession`` here (the frames through Ray) or, with the media on the
        group (``--fleet-media group``), a ``GroupMediaSession`` (WebRTC ends in the group actor)."""
        if self.media_on_group:
            from cadence.fleet.remote import GroupMediaSession

            return GroupMediaSession
        from cadence.serve.session import LiveSession

        return LiveSession

    async def drain(self, name: str, on: bool) -> bool:
        return await self.registry.drain.remote(name, on)
