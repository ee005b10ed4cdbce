"""The per-window timeline of a long session (cadence.serve.timeline), on a fake clock."""

import pytest

from cadence.serve.timeline import Timeline


def _run(
    tl, seconds, *, chunk_s=1 / 6, fresh_per_chunk=4, latency=lambda t: 60.0, rss=lambda t: 500.0, stall=None
):
    """Feed ``seconds`` of chunks; ``stall=(t_from, t_to)``: no chunk comes back in between."""
    counts = {"video_fresh": 0, "chunks_done": 0, "underruns_video": 0, "deadline_misses": 0}
    t, k = 100.0, 0
    while t < 100.0 + seconds:
        if stall and stall[0] <= t - 100.0 < stall[1]:
            tl.tick(t, dict(counts))  # the session's watchdog
            counts["underruns_video"] += fresh_per_chunk  # the held frames
        else:
            tl.chunk(t, latency(t - 100.0), dict(counts), {"rss_mb": rss(t - 100.0), "cuda_mb": None})
            counts["chunks_done"] += 1
            counts["video_fresh"] += fresh_per_chunk
        k += 1
        t = 100.0 + k * chunk_s
    return counts, t


def test_windows_count_exactly_what_the_session_counted():
    tl = Timeline(window_s=60.0)
    counts, now = _run(tl, 150.0, latency=lambda t: 50.0 + t / 10)  # latency creeps up 10 ms a minute... x6
    rows = tl.rows(now, counts)
    assert [r["t_s"] for r in rows] == pytest.approx([0.0, 60.0, 120.0], abs=0.2)  # a window ends at a call
    assert [r["seconds"] for r in rows[:2]] == pytest.approx([60.0, 60.0], abs=0.2)
    assert [r.get("partial", False) for r in rows] == [False, False, True]
    # the windows partition the session: their counts add up to its totals
    assert sum(r["video_fresh"] for r in rows) == counts["video_fresh"]
    assert sum(r["chunks"] for r in rows) == counts["chunks_done"]
    # 24 fps in every full window: its counts and its length are the same interval's
    for r in rows[:2]:
        assert r["fps"] == pytest.approx(24.0, abs=0.01)
    # what a whole-session p50 would hide: the latency rose window after window
    p50 = [r["chunk_latency_ms_p50"] for r in rows]
    assert p50 == sorted(p50) and p50[-1] - p50[0] > 10
    assert rows[0]["worker_rss_mb"] == 500.0 and "worker_cuda_mb" not in rows[0]  # None: not reported


def test_a_stall_and_a_leak_show_in_their_window():
    tl = Timeline(window_s=10.0)
    counts, now = _run(tl, 40.0, rss=lambda t: 400.0 + 2.0 * t, stall=(12.0, 25.0))
    rows = tl.rows(now, counts)
    assert len(rows) == 4
    assert rows[0]["fps"] == pytest.approx(24.0, abs=0.5) and rows[0]["underruns_video"] == 0
    # no chunk between 12 s and 25 s: the window [10, 20) closes on time all the same (the watchdog's
    # tick) with its 8 s of held frames; the next one has the other 5 s of them and 5 s of chunks
    assert rows[1]["underruns_video"] == pytest.approx(8 * 24, abs=4) and rows[1]["fps"] == pytest.approx(
        4.8, abs=0.5
    )
    assert rows[2]["underruns_video"] == pytest.approx(5 * 24, abs=4) and rows[2]["chunks"] == pytest.approx(
        30, abs=1
    )
    assert rows[1]["seconds"] == pytest.approx(10.0, abs=0.2)
    assert sum(r["underruns_video"] for r in rows) == counts["underruns_video"]
    assert tl.memory_first == {"rss_mb": 400.0}
    assert tl.memory_growth()["rss_mb"] == pytest.approx(80.0, abs=1.0)  # 2 MB/s for 40 s
    assert tl.memory_max["rss_mb"] == pytest.approx(480.0, abs=1.0)
    rss = [r["worker_rss_mb"] for r in rows]
    assert rss == sorted(rss)


def test_bounded_and_empty():
    tl = Timeline(window_s=1.0, max_windows=5)
    assert tl.rows(0.0, {}) == []
    counts, now = _run(tl, 20.0)
    rows = tl.rows(now, counts)
    assert len(tl.windows) == 5 and tl.dropped == 14 and len(rows) == 6
    assert rows[0]["t_s"] == pytest.approx(14.0, abs=0.2)  # the oldest went first
    # no call for 3.5 windows (no watchdog in this test): one longer window, then back on the grid
    tl = Timeline(window_s=1.0)
    tl.chunk(0.0, 10.0, {"video_fresh": 0})
    tl.chunk(3.5, 10.0, {"video_fresh": 48})
    tl.chunk(4.0, 10.0, {"video_fresh": 60})
    rows = tl.rows(4.0, {"video_fresh": 60})
    assert [(r["t_s"], r["seconds"], r["video_fresh"]) for r in rows] == [(0.0, 3.5, 48), (3.5, 0.5, 12)]
    assert rows[0]["fps"] == pytest.approx(48 / 3.5, abs=0.01) and rows[1]["fps"] is None  # 0.5 s: not rated
    with pytest.raises(ValueError, match="positive"):
        Timeline(window_s=0)
