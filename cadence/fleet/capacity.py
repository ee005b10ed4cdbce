"""How many GPUs a load needs: a discrete-event simulation of fleet admission (``python3 -m
cadence.fleet.capacity --help``; the assumptions: docs/fleet.md).

The model. Sessions arrive as a Poisson process (``arrival_per_s``); each holds one worker group for its
length (``session_dist``: 'exp', 'lognormal' with ``session_sigma``, or 'fixed'; mean ``session_mean_s``,
capped at ``max_duration_s`` as the server caps it). A group serves one session at a time (as
``cadence serve`` does). A request that finds no free group waits in one fleet-wide FIFO queue (the best a
client retrying on 503 + Retry-After can do; real retries add up to one Retry-After of slack) until a group
frees; its *admission wait* is that time. Groups fail (``group_mtbf_s``, each independently; a node's
failure, ``node_mtbf_s``, takes its ``groups_per_node`` groups at once): the session on a failed group ends
(counted as ``dropped``; its user reconnects at once for the rest of it, a new admission), and the group
is back after ``restart_s`` (Ray's restart + build + warm-up,
measured per preset). ``gpus = groups x gpus_per_group``; groups come in whole nodes.

:func:`gpus_needed` searches the fewest whole nodes whose p99 admission wait is within
``target_p99_wait_s``. With exponential lengths and no failures the model is M/M/c, and the simulation
agrees with Erlang C (``tests/test_fleet.py``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CapacityModel:
    arrival_per_s: float
    """New sessions per second (Poisson)."""
    session_mean_s: float
    """Mean session length (s)."""
    session_dist: str = "lognormal"
    """'exp', 'lognormal' (``session_sigma``: the sigma of log length) or 'fixed'."""
    session_sigma: float = 1.0
    max_duration_s: float = 600.0
    """The server's cap on a session (``--max-duration``)."""
    groups_per_node: int = 8
    """Worker groups per node (8 GPUs per node at TP 1; 4 at TP 2)."""
    gpus_per_group: int = 1
    group_mtbf_s: float = 0.0
    """Mean time between failures of one group (0: never)."""
    node_mtbf_s: float = 0.0
    """Mean time between failures of one node (0: never)."""
    restart_s: float = 60.0
    """A failed group is back this long after it failed."""
    target_p99_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.arrival_per_s <= 0 or self.session_mean_s <= 0 or self.groups_per_node < 1:
            raise ValueError("arrival_per_s, session_mean_s and groups_per_node must be positive")
        if self.session_dist not in ("exp", "lognormal", "fixed"):
            raise ValueError(f"session_dist must be exp, lognormal or fixed, got {self.session_dist!r}")

    @property
    def load_erlangs(self) -> float:
        """Offered load: sessions in progress on average (before the max-duration cap)."""
        return self.arrival_per_s * self.session_mean_s


def _length(m: CapacityModel, rng: random.Random) -> float:
    if m.session_dist == "exp":
        x = rng.expovariate(1.0 / m.session_mean_s)
    elif m.session_dist == "fixed":
        x = m.session_mean_s
    else:  # lognormal with the given mean: mu = ln(mean) - sigma^2 / 2
        s = m.session_sigma
        x = rng.lognormvariate(math.log(m.session_mean_s) - s * s / 2, s)
    return min(x, m.max_duration_s)


class _Run:
    """One simulation's state: the event heap, each group's holder, the FIFO queue, the counters."""

    def __init__(self, m: CapacityModel, groups: int, sessions: int, seed: int, warmup: float):
        self.m, self.groups, self.sessions = m, groups, sessions
        self.rng = random.Random(seed)  # arrivals and lengths: the same with and without failures
        self.frng = random.Random(seed + 1_000_003)  # failures: a stream of their own
        self.events: list = []  # (time, seq, kind, a, b)
        self.seq = 0
        self.holder = [0] * groups  # 0 = free, -1 = down, else the session's id
        self.ends: dict[int, float] = {}  # a running session's end
        self.counted: set[int] = set()  # reconnects of counted sessions count too
        self.next_id = sessions + 1
        self.free: list[int] = list(
            range(groups)
        )  # a heap of free group indices (lowest first, as the registry)
        self.queue: deque = deque()  # (session id, arrival time)
        self.waits: list[float] = []
        self.busy_time = 0.0
        self.t_first: float | None = None
        self.dropped = 0
        self.counted_from = int(sessions * warmup)
        self.started: dict[int, float] = {}
        self.lengths: dict[int, float] = {}

    def push(self, t: float, kind: str, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def is_counted(self, sid: int) -> bool:
        return sid > self.counted_from and (sid <= self.sessions or sid in self.counted)

    def start(self, sid: int, t_arr: float, t: float, g: int) -> None:
        self.holder[g] = sid
        self.started[sid] = t
        if self.is_counted(sid):
            self.waits.append(t - t_arr)
        self.ends[sid] = t + self.lengths.pop(sid)
        self.push(self.ends[sid], "end", g, sid)

    def take(self, t: float, g: int) -> None:
        if self.queue:
            sid, t_arr = self.queue.popleft()
            self.start(sid, t_arr, t, g)
        else:
            self.holder[g] = 0
            heapq.heappush(self.free, g)

    def fail(self, t: float, g: int) -> None:
        if self.holder[g] == -1:
            return
        if self.holder[g] > 0:  # the session ends with the error; its user reconnects at once for the rest
            sid = self.holder[g]
            if self.is_counted(sid):
                self.dropped += 1
                self.counted.add(self.next_id)
            self.busy_time += t - self.started.pop(sid)
            self.lengths[self.next_id] = max(0.0, self.ends.pop(sid) - t)
            self.push(t, "arrive", self.next_id)
            self.next_id += 1
        else:
            self.free.remove(g)
            heapq.heapify(self.free)
        self.holder[g] = -1
        self.push(t + self.m.restart_s, "up", g)

    def schedule(self) -> float:
        """Every arrival (and each group's and node's first failure) on the heap; the last arrival's time."""
        m, t = self.m, 0.0
        for sid in range(1, self.sessions + 1):
            t += self.rng.expovariate(m.arrival_per_s)
            self.lengths[sid] = _length(m, self.rng)
            self.push(t, "arrive", sid)
        if m.group_mtbf_s > 0:
            for g in range(self.groups):
                self.push(self.frng.expovariate(1.0 / m.group_mtbf_s), "gfail", g)
        if m.node_mtbf_s > 0:
            for n in range(math.ceil(self.groups / m.groups_per_node)):
                self.push(self.frng.expovariate(1.0 / m.node_mtbf_s), "nfail", n)
        return t

    def run(self) -> float:
        """Play every event; the last session's end (utilization is over arrivals -> that)."""
        m = self.m
        t_last_arrival = t_end_busy = self.schedule()
        while self.events:
            t, _, kind, a, b = heapq.heappop(self.events)
            if kind == "arrive":
                if a == self.counted_from + 1:
                    self.t_first = t
                if self.free:
                    self.start(a, t, t, heapq.heappop(self.free))
                else:
                    self.queue.append((a, t))
            elif kind == "end":
                if self.holder[a] == b:  # (a failure may have ended this session already)
                    t_end_busy = max(t_end_busy, t)
                    self.busy_time += t - self.started.pop(b)
                    self.ends.pop(b, None)
                    self.take(t, a)
            elif kind == "up":
                self.take(t, a)
            elif t <= t_last_arrival:  # failures only while sessions arrive
                if kind == "gfail":
                    self.fail(t, a)
                    self.push(t + m.restart_s + self.frng.expovariate(1.0 / m.group_mtbf_s), "gfail", a)
                else:
                    for g in range(a * m.groups_per_node, min(self.groups, (a + 1) * m.groups_per_node)):
                        self.fail(t, g)
                    self.push(t + m.restart_s + self.frng.expovariate(1.0 / m.node_mtbf_s), "nfail", a)
        return t_end_busy


def simulate(
    m: CapacityModel, groups: int, sessions: int = 50_000, seed: int = 0, warmup: float = 0.1
) -> dict:
    """Run ``sessions`` arrivals on ``groups`` groups; statistics over all but the first ``warmup`` share.
    Returns p_wait (share that waited at all), mean / p50 / p99 / max admission wait (s), utilization,
    dropped (sessions ended by a failure)."""
    run = _Run(m, groups, sessions, seed, warmup)
    t_end_busy = run.run()
    waits = sorted(run.waits)
    n = len(waits)
    span = max(1e-9, t_end_busy - (run.t_first or 0.0))
    return {
        "groups": groups,
        "gpus": groups * m.gpus_per_group,
        "sessions": n,
        "p_wait": sum(w > 0 for w in waits) / n,
        "mean_wait_s": sum(waits) / n,
        "p50_wait_s": waits[n // 2],
        "p99_wait_s": waits[min(n - 1, int(math.ceil(0.99 * n)) - 1)],
        "max_wait_s": waits[-1],
        "utilization": run.busy_time / (span * groups),
        "dropped": run.dropped,
    }


def gpus_needed(m: CapacityModel, sessions: int = 50_000, seed: int = 0, max_nodes: int = 10_000) -> dict:
    """The fewest whole nodes whose p99 admission wait is <= ``m.target_p99_wait_s``: the simulation's result
    for that many groups, plus ``nodes``. Starts at the offered load (fewer groups cannot keep up)."""
    nodes = max(1, math.floor(m.load_erlangs / m.groups_per_node))
    while nodes <= max_nodes:
        r = simulate(m, nodes * m.groups_per_node, sessions, seed)
        if r["p99_wait_s"] <= m.target_p99_wait_s:
            return {**r, "nodes": nodes, "model": asdict(m)}
        nodes += 1
    raise ValueError(f"no fleet of up to {max_nodes} nodes meets p99 wait <= {m.target_p99_wait_s} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m cadence.fleet.capacity", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--arrival-per-min", type=float, required=True, help="new sessions per minute")
    p.add_argument("--session-mean-s", type=float, required=True)
    p.add_argument("--session-dist", default="lognormal", choices=["exp", "lognormal", "fixed"])
    p.add_argument("--session-sigma", type=float, default=1.0)
    p.add_argument("--max-duration-s", type=float, default=600.0)
    p.add_argument("--groups-per-node", type=int, default=8)
    p.add_argument("--gpus-per-group", type=int, default=1)
    p.add_argument(
        "--group-mtbf-h", type=float, default=0.0, help="hours between failures of one group (0: none)"
    )
    p.add_argument(
        "--node-mtbf-h", type=float, default=0.0, help="hours between failures of one node (0: none)"
    )
    p.add_argument("--restart-s", type=float, default=60.0, help="a failed group is back after this long")
    p.add_argument("--target-p99-wait-s", type=float, default=1.0)
    p.add_argument("--sessions", type=int, default=50_000, help="simulated arrivals")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    m = CapacityModel(
        arrival_per_s=a.arrival_per_min / 60.0,
        session_mean_s=a.session_mean_s,
        session_dist=a.session_dist,
        session_sigma=a.session_sigma,
        max_duration_s=a.max_duration_s,
        groups_per_node=a.groups_per_node,
        gpus_per_group=a.gpus_per_group,
        group_mtbf_s=a.group_mtbf_h * 3600.0,
        node_mtbf_s=a.node_mtbf_h * 3600.0,
        restart_s=a.restart_s,
        target_p99_wait_s=a.target_p99_wait_s,
    )
    r = gpus_needed(m, a.sessions, a.seed)
    print(json.dumps(r, indent=1))
    print(
        f"load {m.load_erlangs:.1f} erlangs -> {r['nodes']} node(s) x {m.groups_per_node} group(s) = "
        f"{r['gpus']} GPU(s): p99 admission wait {r['p99_wait_s']:.2f} s, {100 * r['p_wait']:.2f}% waited, "
        f"utilization {100 * r['utilization']:.1f}%, {r['dropped']} session(s) ended by failures"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
