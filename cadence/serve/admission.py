"""Fair admission: whose turn it is when a group frees.

A full server answers 503 with Retry-After, the time by which a group frees at the latest. Without turns, the
group went to whoever asked first once it was free: a client that re-posts the moment it is told (or keeps
posting) won every time, and a user who came back when Retry-After said was refused again and again (issue 39:
one cookieless client re-posting offers that never connect got 4 x 201 in 40 s while another user, trying once a
second, was refused 36 times of 40).

:class:`Turns`: a client refused for want of a free group gets a turn (its place in line is kept while it keeps
asking); a group that frees is held for the clients whose turns come first, each until ``grace_s`` after the
Retry-After it was told (what it was promised); a client without a turn ahead of them is refused (503, with the
time the turns ahead run out at the latest) and takes its own place in line. So a client that follows
Retry-After is refused at most once in a row when the group frees when it was told (an offer that never
connects: at its connect timeout), whoever else is asking, and Retry-After stays true. A turn not
claimed in time lapses, and a turn holds nothing before its time (a group that frees earlier than Retry-After
said is anyone's). Clients are told apart by their keys (``cadence.serve.guard.client_keys``: a cookie, or
the address; every cookieless local client is one client, 127.0.0.1). Pure: the caller gives the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Turn:
    keys: frozenset[str]
    since: float  # when it was first refused (its place in line)
    due: float  # when it was told to come back (the last Retry-After it was given)
    until: float  # when the turn lapses: due + grace


class Turns:
    """The line of clients refused for want of a free group (see the module doc). A turn holds a free group
    only around the time its client was told to come back, from ``slack_s`` before (Retry-After is whole
    seconds, "at the latest") to ``grace_s`` after: a group that frees long before then (a session that ends
    early) is anyone's, and a client that was told 60 s and never comes back holds nothing meanwhile."""

    def __init__(self, grace_s: float = 2.0, slack_s: float = 2.0, max_turns: int = 1000):
        self.grace_s, self.slack_s, self.max_turns = grace_s, slack_s, max_turns
        self.line: list[Turn] = []

    def _live(self, now: float) -> list[Turn]:
        self.line = [t for t in self.line if t.until > now]
        return self.line

    def _mine(self, keys, now: float) -> Turn | None:
        keys = frozenset(keys)
        return next((t for t in self._live(now) if t.keys & keys), None) if keys else None

    def ahead(self, keys, now: float) -> list[Turn]:
        """The turns before this client's (all of them when it has none) that hold a group now."""
        mine = self._mine(keys, now)
        return [
            t
            for t in self.line
            if (mine is None or t.since < mine.since) and t is not mine and t.due - self.slack_s <= now
        ]

    def may_take(self, keys, free: int, now: float) -> bool:
        """Whether a client may take one of ``free`` free groups now: fewer turns hold one ahead of it."""
        return free > len(self.ahead(keys, now))

    def wait_s(self, keys, free: int, now: float) -> int | None:
        """Seconds until enough of the turns ahead of a client have lapsed for it to take one of ``free`` free
        groups (None: it may take one now, or none is free: the groups' own time applies)."""
        ahead = sorted(t.until for t in self.ahead(keys, now))
        if free <= 0 or free > len(ahead):
            return None
        return max(1, math.ceil(ahead[len(ahead) - free] - now))

    def refused(self, keys, now: float, retry_after: float) -> None:
        """A client was refused and told to come back in ``retry_after`` s: its turn (its place kept if it has
        one), due then."""
        if not keys:
            return
        mine = self._mine(keys, now)
        if mine is None:
            if len(self.line) >= self.max_turns:
                return
            mine = Turn(frozenset(keys), now, 0.0, 0.0)
            self.line.append(mine)
        mine.keys |= frozenset(keys)
        mine.due = now + retry_after
        mine.until = mine.due + self.grace_s

    def admitted(self, keys, now: float) -> None:
        """A client took a group: its turn is used."""
        mine = self._mine(keys, now)
        if mine is not None:
            self.line.remove(mine)
