"""Fair admission (issue 39, probe 3): one client re-posting offers cannot refuse another user more than once in
a row, and Retry-After stays true (``cadence.serve.admission.Turns``, the session manager's ``reserve``).

The issue's probe, replayed on a fake clock: one group; client A (no cookie) re-posts an offer the moment it
can (every 0.1 s) and never connects (each offer holds the group for its 10-s connect timeout); user B comes
back when Retry-After says (or tries once a second) and streams for 5 s when admitted. Without turns A took the
group every time it freed; with them B is refused at most once in a row and the two alternate.
"""

import math
import time

import pytest

from cadence.serve.admission import Turns

A, B = ("addr:127.0.0.1",), ("cookie:" + "b" * 22,)


def _replay(turns: bool, b_every: float | None = None, seconds: float = 120.0):
    """The probe on a fake clock: ``b_every`` None: B follows Retry-After; else B tries every ``b_every`` s.
    Returns (B's refusals in a row, longest; B's admissions; A's admissions; the Retry-After B was told vs
    when the group was B's)."""
    line = Turns(grace_s=2.0)
    holder, free_at = None, 0.0
    a_next, b_next = 0.0, 0.5
    b_row = b_worst = b_in = a_in = 0
    promised: list[tuple[float, float]] = []  # (when B was told it could come back, when it got the group)
    told_at = None
    now, step = 0.0, 0.05
    while now < seconds:
        if holder is not None and now >= free_at:
            holder = None
        for who, keys in (("A", A), ("B", B)):
            due = a_next if who == "A" else b_next
            if now < due:
                continue
            free = 1 if holder is None else 0
            if free and (not turns or line.may_take(keys, free, now)):
                line.admitted(keys, now)
                holder, free_at = who, now + (10.0 if who == "A" else 5.0)
                if who == "A":
                    a_in += 1
                    a_next = free_at  # A re-posts the moment its offer times out
                else:
                    b_in, b_row = b_in + 1, 0
                    if told_at is not None:
                        promised.append((told_at, now))
                    told_at, b_next = None, free_at + 1.0
                continue
            wait = line.wait_s(keys, free, now) if turns else None
            retry = wait if wait is not None else max(1, math.ceil(free_at - now))
            if turns:
                line.refused(keys, now, retry)
            if who == "A":
                a_next = now + 0.1
            else:
                b_row += 1
                b_worst = max(b_worst, b_row)
                told_at = now + retry
                b_next = now + (retry if b_every is None else b_every)
        now = round(now + step, 6)
    return b_worst, b_in, a_in, promised


def test_a_client_that_follows_retry_after_is_refused_at_most_once_in_a_row():
    worst, b_in, a_in, promised = _replay(turns=True)
    assert worst <= 1 and b_in >= 5 and a_in >= 5, (worst, b_in, a_in)  # they alternate
    assert all(got <= told + 0.1 for told, got in promised), promised  # Retry-After was true
    # without turns (before): A took the group every time it freed, B was refused again at every return
    worst, b_in, _, _ = _replay(turns=False)
    assert b_in == 0 and worst > 10, (worst, b_in)


def test_a_user_trying_every_second_gets_the_group_when_it_frees():
    """Trying once a second it is refused while the group is genuinely held (A's offer: up to 10 s), never
    once the group is free: its turn holds the group against A's re-post."""
    worst, b_in, a_in, _ = _replay(turns=True, b_every=1.0)
    assert b_in >= 5 and a_in >= 5 and worst <= 11, (worst, b_in, a_in)
    worst, b_in, _, _ = _replay(turns=False, b_every=1.0)
    assert b_in <= 2, b_in  # before: A won nearly every race


def test_turns_keep_the_place_in_line_and_lapse_when_not_claimed():
    line = Turns(grace_s=2.0)
    c = ("cookie:" + "c" * 22,)
    line.refused(B, now=0.0, retry_after=10)
    line.refused(c, now=1.0, retry_after=9)
    line.refused(B, now=3.0, retry_after=7)  # B asked again: its place (first) is kept
    assert line.ahead(c, 5.0) == []  # B's turn holds nothing before its time (told 10 s: from 8 s on)
    assert [t.keys for t in line.ahead(c, 9.0)] == [frozenset(B)] and line.ahead(B, 9.0) == []
    assert not line.may_take(c, 1, 10.0) and line.may_take(B, 1, 10.0) and line.may_take(c, 2, 10.0)
    assert line.wait_s(A, 1, 10.0) == 2  # a newcomer: when the first turn lapses (12 s)
    line.admitted(B, 10.5)
    assert line.may_take(c, 1, 10.5) and not line.may_take(A, 1, 10.5)
    assert line.may_take(A, 1, 12.5)  # c never came: its turn lapsed at 12 s
    line.refused((), now=0.0, retry_after=5)  # a client with no keys cannot hold a place
    assert line.ahead(A, 13.0) == []


def test_the_managers_admission_takes_turns():
    """The same through ``SessionManager.reserve``: a full server's 503 gives B a turn; the group A's offer
    frees is B's (A re-posting gets 503 with a true Retry-After, and a turn of its own, due then)."""
    from cadence.engine.recipe import EngineSpec
    from cadence.serve.config import ServeConfig
    from cadence.serve.guard import ApiError, client_keys
    from cadence.serve.manager import SessionManager

    mgr = SessionManager(ServeConfig(engine=EngineSpec(model="tiny"), groups=("cpu",)))
    for g in mgr.groups:
        g.ready.set()
    a, b = client_keys("127.0.0.1", None), client_keys("127.0.0.1", "b" * 22)
    assert a == ("addr:127.0.0.1",) and b == ("cookie:" + "b" * 22,)
    g, sid = mgr.reserve(a)
    with pytest.raises(ApiError) as e:
        mgr.reserve(b)
    told_b = int(e.value.headers["Retry-After"])
    assert e.value.status == 503 and told_b >= 1
    mgr.unreserve(g, sid)  # A's offer is gone: the group is free, and B's
    with pytest.raises(ApiError) as e:
        mgr.reserve(a)
    assert e.value.status == 503 and "held for clients refused before" in e.value.message
    told_a = int(e.value.headers["Retry-After"])
    assert 1 <= told_a <= told_b + 3  # when B's turn lapses, at the latest
    g, sid = mgr.reserve(b)
    (turn,) = mgr.turns.line  # A's, due when it was told to come back
    assert turn.keys == frozenset(a) and turn.due == pytest.approx(time.monotonic() + told_a, abs=0.5)
