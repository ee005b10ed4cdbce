"""The fleet registry: one named, detached Ray actor (``cadence-registry`` in namespace ``cadence``) that
builds the worker groups and knows, for every front end, which group is free.

* ``ensure_groups``: the groups the fleet should have, each a :class:`~cadence.fleet.group.GroupActor`
  (detached, named ``cadence-group-<i>``, ``max_restarts``) in a detached STRICT_PACK placement group of
  one bundle (its CPUs and GPUs on one node). Groups that exist are reused: a front end that restarts, or
  a second front end, finds them by name; nothing is rebuilt.
* A check loop (every ``ping_s``) pings every group and lists the cluster's live nodes, and feeds both to
  :class:`~cadence.fleet.state.FleetState` (the rules: states, restarts, node loss, claims, leases).
* Front ends ``claim`` a group for a new session and ``release`` it; their ``heartbeat`` carries their
  claims and returns the fleet's snapshot (what ``/metrics`` and ``GET /fleet`` show). Claims of a
  front end whose lease expired are closed on their groups (``CloseSession``).
* ``drain`` / ``undrain``: an operator's switch per group.

The registry lives on the head node (it dies only with the cluster's head). If it dies anyway, Ray restarts
it: it finds the groups again by name (``ray.util.list_named_actors``) and the front ends' next heartbeats
give it back their claims (restart counts start again from each actor's own "restarted" flag).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cadence.engine.messages import CloseSession
from cadence.fleet.group import GroupActor
from cadence.fleet.names import GROUP_PREFIX, REGISTRY_NAME
from cadence.fleet.state import FleetState

log = logging.getLogger("cadence.fleet")

#: A group that does not answer a check within this long counts as down (restarting).
PING_TIMEOUT_S = 5.0


def group_index(name: str) -> int:
    return int(name.removeprefix(GROUP_PREFIX))


class Registry:
    def __init__(self, lease_s: float = 10.0, ping_s: float = 0.5, max_duration_s: float = 600.0):
        self.state = FleetState(lease_s=lease_s, max_duration_s=max_duration_s)
        self.ping_s = ping_s
        self.handles: dict[str, object] = {}
        self._loop_task: asyncio.Task | None = None
        self._discovered = False

    # ---- the check loop -------------------------------------------------------------------------
    def _start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._checks())

    async def _discover(self) -> None:
        """After a restart of the registry: the groups that exist, by name."""
        names = await asyncio.to_thread(ray.util.list_named_actors)
        for n in names:
            if isinstance(n, str) and n.startswith(GROUP_PREFIX) and n not in self.handles:
                try:
                    self.handles[n] = ray.get_actor(n)
                except ValueError:
                    pass
        self._discovered = True

    async def _ping(self, name: str, h) -> tuple[str, dict | None]:
        try:
            return name, await asyncio.wait_for(h.ping.remote(), PING_TIMEOUT_S)
        except Exception:  # dead, restarting, or too slow to answer: not admitting sessions now
            return name, None

    async def _checks(self) -> None:
        while True:
            try:
                if not self._discovered:
                    await self._discover()
                nodes = await asyncio.to_thread(ray.nodes)
                alive = {n["NodeID"] for n in nodes if n.get("Alive")}
                now = time.monotonic()
                for name in self.state.nodes(alive):
                    log.warning("group %s left the registry: its node left the cluster", name)
                answers = await asyncio.gather(*(self._ping(n, h) for n, h in list(self.handles.items())))
                now = time.monotonic()
                for name, ping in answers:
                    self.state.observe(name, group_index(name), ping, now, alive)
                for name, sid in self.state.expire(now):
                    self._close_on(name, sid)
            except Exception:
                log.exception("registry: check failed")
            await asyncio.sleep(self.ping_s)

    def _close_on(self, name: str, sid: str) -> None:
        h = self.handles.get(name)
        if h is not None and sid:
            log.warning("group %s: its front end's lease expired: closing session %s", name, sid)
            h.send.remote(CloseSession(sid))

    # ---- building the groups ------------------------------------------------------------------------
    async def ensure_groups(
        self, n: int, spec, frame_shape, slots: int, shm: bool, bundle: dict, max_restarts: int
    ) -> list[str]:
        """Make sure groups 0..n-1 exist (existing ones are kept as they are). Returns every group's name."""
        self._start()
        if not self._discovered:
            await self._discover()
        actor_cls = ray.remote(GroupActor)
        for i in range(n):
            name = f"{GROUP_PREFIX}{i}"
            if name in self.handles:
                continue
            try:
                self.handles[name] = ray.get_actor(name)
                continue
            except ValueError:
                pass
            pg = placement_group(
                [dict(bundle)], strategy="STRICT_PACK", name=f"{name}-pg", lifetime="detached"
            )
            self.handles[name] = actor_cls.options(
                name=name,
                lifetime="detached",
                max_restarts=max_restarts,
                max_concurrency=64,
                num_cpus=bundle.get("CPU", 1),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0
                ),
            ).remote(name, i, spec, frame_shape, slots, shm)
            log.info("group %s created (bundle %s, STRICT_PACK)", name, bundle)
        return sorted(self.handles)

    # ---- front ends ------------------------------------------------------------------------------------
    async def claim(self, frontend: str, claim_id: str) -> dict:
        self._start()
        now = time.monotonic()
        name = self.state.claim(frontend, claim_id, now)
        return {"group": name, "retry_after": self.state.retry_after(now)}

    async def release(self, frontend: str, name: str, claim_id: str) -> bool:
        return self.state.release(frontend, name, claim_id)

    async def heartbeat(self, frontend: str, claims: dict) -> dict:
        self._start()
        now = time.monotonic()
        for name, sid in self.state.heartbeat(frontend, {k: tuple(v) for k, v in claims.items()}, now):
            self._close_on(name, sid)
        return self.state.snapshot(now)

    async def snapshot(self) -> dict:
        self._start()
        return self.state.snapshot(time.monotonic())

    async def drain(self, name: str, on: bool = True) -> bool:
        return self.state.drain(name, on)

    async def group_handle(self, name: str):
        return self.handles.get(name)

    async def remove_all(self) -> None:
        """Tear the fleet down (tests, ``cadence fleet down``): stop every group's workers, kill the actors and
        remove their placement groups."""
        from ray.util import get_placement_group, remove_placement_group

        for name, h in list(self.handles.items()):
            try:
                await asyncio.wait_for(h.stop.remote(), 20.0)
            except Exception:
                pass
            ray.kill(h, no_restart=True)
            try:
                remove_placement_group(get_placement_group(f"{name}-pg"))
            except Exception:
                pass
        self.handles.clear()
        self.state.groups.clear()


def registry_handle(fleet, max_duration_s: float = 600.0):
    """The fleet's registry actor (created if this is the first front end; ``ray.init`` first). ``fleet``: a
    ``cadence.fleet.config.FleetConfig`` (not imported here: the config builds the front end, which reaches this)."""
    return (
        ray.remote(Registry)
        .options(
            name=REGISTRY_NAME,
            namespace=fleet.namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_concurrency=256,
            num_cpus=0,
            # on the head node: a node that leaves (with its groups) must not take the registry along
            resources={"node:__internal_head__": 0.001},
        )
        .remote(fleet.lease_s, fleet.ping_s, max_duration_s)
    )
