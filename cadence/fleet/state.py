"""The fleet registry's bookkeeping as a plain class (:class:`FleetState`): no Ray, no clock of its own,
so every rule below is unit-tested with a fake time (``tests/test_fleet.py``).

Groups. A group is in the registry while its actor answers: ``starting`` (alive, engine warming up) ->
``up`` (ready); ``restarting`` when a check fails (the actor died, or is too slow to answer; Ray restarts a dead one and the
next answer from a new incarnation counts one restart); ``failed`` when its worker could not start. A group whose node left
the cluster is dropped from the registry (``lost``: kept only in ``history`` for its restart count) until
its actor answers again from a live node. ``draining``: no new session; the live one finishes.

Claims. Admission is one claim per group: ``claim`` gives a free ``up`` group to a front end (None when the
whole fleet is busy). A front end's heartbeat lists its claims: the registry re-learns them after its own
restart, and a front end not heard from for ``lease_s`` loses them (returned to the caller, which tells the
groups to close those sessions). A group that restarted (a new incarnation) holds no claim; one that only
missed a check keeps it (its front end releases it when it sees the actor fail).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

LIVE = ("starting", "up", "restarting", "failed")


@dataclass
class GroupEntry:
    name: str
    index: int
    state: str = "starting"
    node_id: str | None = None
    pid: int | None = None
    incarnation: str | None = None
    info: dict = field(default_factory=dict)
    start_error: str | None = None
    draining: bool = False
    claim: tuple[str, str] | None = None  # (front end id, claim id)
    claim_sid: str | None = None  # the session id the front end bound to the claim (informational)
    claimed_at: float | None = None
    restarts: int = 0
    last_ok: float | None = None

    @property
    def free(self) -> bool:
        return self.state == "up" and not self.draining and self.claim is None


class FleetState:
    def __init__(self, lease_s: float = 10.0, max_duration_s: float = 600.0):
        self.lease_s, self.max_duration_s = lease_s, max_duration_s
        self.groups: dict[str, GroupEntry] = {}
        self.history: dict[str, int] = {}  # restarts of groups that left the registry (node lost)
        self.frontends: dict[str, float] = {}  # front end id -> last heard
        self.drained: set[str] = set()  # draining survives a group leaving and coming back

    # ---- the groups' health, as the registry's checks see it ------------------------------------
    def observe(
        self, name: str, index: int, ping: dict | None, now: float, alive_nodes: set[str] | None = None
    ):
        """One check of group ``name``: ``ping`` is what its actor answered (None: it did not answer)."""
        g = self.groups.get(name)
        if ping is None:  # no new session there; a claim stays until its front end releases it (it
            # sees the actor fail first), a new incarnation answers, or the front end's lease expires: a
            # check that is only slow (a loaded node) must not free a group that still holds a session
            if g is not None:
                g.state = "restarting"
            return
        if alive_nodes is not None and ping.get("node_id") not in alive_nodes:
            return  # an answer from a node the cluster no longer lists: not back yet
        if g is None:
            g = self.groups[name] = GroupEntry(name, index, restarts=self.history.pop(name, 0))
            g.draining = name in self.drained
        if g.incarnation is not None and ping["incarnation"] != g.incarnation:
            g.restarts += 1
            g.claim = g.claim_sid = g.claimed_at = None  # a new process holds no session
        elif g.incarnation is None and ping.get("restarted"):
            g.restarts += 1  # the registry met it after a restart it did not see (e.g. its own restart)
        g.incarnation, g.node_id, g.pid = ping["incarnation"], ping.get("node_id"), ping.get("pid")
        g.info = ping.get("info") or {}
        g.start_error = ping.get("start_error")
        g.state = "failed" if g.start_error else "up" if ping.get("ready") else "starting"
        g.last_ok = now

    def nodes(self, alive: set[str]) -> list[str]:
        """The cluster's live nodes now: groups on any other node leave the registry. Returns their names."""
        gone = [n for n, g in self.groups.items() if g.node_id is not None and g.node_id not in alive]
        for n in gone:
            self.history[n] = self.groups.pop(n).restarts
        return gone

    # ---- admission ---------------------------------------------------------------------------------
    def claim(self, frontend: str, claim_id: str, now: float) -> str | None:
        """A free group for a new session of ``frontend`` (the lowest index first), or None: the fleet is full."""
        self.frontends[frontend] = now
        free = sorted((g for g in self.groups.values() if g.free), key=lambda g: g.index)
        if not free:
            return None
        g = free[0]
        g.claim, g.claim_sid, g.claimed_at = (frontend, claim_id), None, now
        return g.name

    def release(self, frontend: str, name: str, claim_id: str) -> bool:
        g = self.groups.get(name)
        if g is None or g.claim != (frontend, claim_id):
            return False
        g.claim = g.claim_sid = g.claimed_at = None
        return True

    def heartbeat(
        self, frontend: str, claims: dict[str, tuple[str, str | None]], now: float
    ) -> list[tuple[str, str]]:
        """``frontend`` is alive and holds ``claims`` ({group: (claim id, session id)}). Claims the registry
        lost (its own restart) are taken back where the group is free; returns the (group, session id) of
        every claim whose front end's lease expired (the caller closes those sessions on their groups)."""
        self.frontends[frontend] = now
        for name, (cid, sid) in claims.items():
            g = self.groups.get(name)
            if g is None:
                continue
            if g.claim is None and g.state in ("up", "starting"):
                g.claim, g.claimed_at = (frontend, cid), now
            if g.claim == (frontend, cid):
                g.claim_sid = sid
        return self.expire(now)

    def expire(self, now: float) -> list[tuple[str, str]]:
        dead = {f for f, t in self.frontends.items() if now - t > self.lease_s}
        out = []
        for g in self.groups.values():
            if g.claim is not None and g.claim[0] in dead:
                out.append((g.name, g.claim_sid or ""))
                g.claim = g.claim_sid = g.claimed_at = None
        for f in dead:
            self.frontends.pop(f, None)
        return out

    def drain(self, name: str, on: bool = True) -> bool:
        """Stop (``on``) or resume admitting sessions to group ``name``; False if the registry has no such group."""
        if name not in self.groups:
            return False
        self.groups[name].draining = on
        (self.drained.add if on else self.drained.discard)(name)
        return True

    # ---- what front ends and /metrics read ------------------------------------------------------------
    def retry_after(self, now: float) -> int:
        """Seconds until a group is likely free: the soonest end of a claimed session at its max duration
        (or 5 s when no group is claimed: the fleet is down or draining), 1..60."""
        left = [
            self.max_duration_s - (now - g.claimed_at)
            for g in self.groups.values()
            if g.claimed_at is not None
        ]
        return int(min(60, max(1, math.ceil(min(left)) if left else 5)))

    def snapshot(self, now: float) -> dict:
        groups = [asdict(g) for g in sorted(self.groups.values(), key=lambda g: g.index)]
        for d, g in zip(groups, sorted(self.groups.values(), key=lambda g: g.index)):
            d["free"] = g.free
            d["claim"] = list(g.claim) if g.claim else None
        return {
            "groups": groups,
            "free": sum(g.free for g in self.groups.values()),
            "sessions": sum(g.claim is not None for g in self.groups.values()),
            "restarts": sum(g.restarts for g in self.groups.values()) + sum(self.history.values()),
            "lost": sorted(self.history),
            "frontends": len(self.frontends),
            "retry_after": self.retry_after(now),
        }
