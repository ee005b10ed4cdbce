"""``cadence bench serve`` end to end on the CPU (tiny preset, a few seconds), and its timeline summary."""

import json

import pytest

for _mod in ("fastapi", "uvicorn", "aiortc", "prometheus_client", "httpx"):
    pytest.importorskip(_mod, reason=f"the serve extra is not installed ({_mod})")

pytestmark = pytest.mark.timeout(180)


def test_bench_serve_records_json_with_codec_and_timeline(tmp_path, capsys, monkeypatch):
    import sys

    from cadence.cli import main

    argv = [
        "bench",
        "serve",
        "--preset",
        "tiny",
        "--seconds",
        "3",
        "--window-s",
        "1",
        "--video-codec",
        "H264",
        "--progress-every",
        "1",
        "--out-dir",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", ["cadence", *argv])  # the JSON records the command line it ran with
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    (path,) = (tmp_path / "serve").glob("*-cpu-tiny-tp1-s1-h264.json")
    doc = json.loads(path.read_text())
    r = doc["results"]
    assert doc["bench"] == "serve" and doc["command"] == "cadence " + " ".join(argv) and doc["git"]
    # a sanity floor, not a performance gate (3 s on two shared cores: 21.2 fps seen once in session 10)
    assert r["errors"] == 0 and r["video_codec"] == ["H264"] and 18.0 <= r["fps_mean"] <= 26.0, r
    assert r["timeline_window_s"] == 1.0 and r["full_windows"] >= 2, r
    (timeline,) = doc["timelines"]
    assert len(timeline) >= 3 and all(w["worker_rss_mb"] > 100 for w in timeline), timeline
    assert r["worker_rss_growth_mb_max"] is not None and r["worker_cuda_growth_mb_max"] is None
    assert "window by window" in out.out and "streaming:" in out.err  # the table and the progress lines


def test_timeline_summary_across_sessions():
    from cadence.bench.serve import _timeline_summary

    def w(fps, p50, partial=False):
        return {"fps": fps, "chunk_latency_ms_p50": p50, **({"partial": True} if partial else {})}

    reports = [
        {
            "timeline": [w(24.0, 60.0), w(23.5, 80.0), w(30.0, 200.0, partial=True)],
            "worker_memory_growth_mb": {"rss_mb": 1.5},
        },
        {"timeline": [w(23.9, 50.0)], "worker_memory_growth_mb": {"rss_mb": 12.0, "cuda_mb": 0.0}},
        {"timeline": []},
    ]
    s = _timeline_summary(reports)
    assert s == {
        "full_windows": 3,
        "fps_min_window": 23.5,
        "chunk_latency_ms_p50_first_window": 55.0,
        "chunk_latency_ms_p50_worst_window": 80.0,
        "worker_rss_growth_mb_max": 12.0,
        "worker_cuda_growth_mb_max": 0.0,
    }  # partial windows do not count
    assert _timeline_summary([])["fps_min_window"] is None


def test_search_capacity_finds_the_largest_n_that_holds_in_few_runs():
    from cadence.bench.serve import search_capacity

    for cap in range(0, 18):
        for start in (1, 4, 12, 17):
            for max_n in (1, 6, 16):
                got, seen = search_capacity(lambda n, cap=cap: n <= cap, max_n, start)
                assert got == min(cap, max_n), (cap, start, max_n, seen)
                assert all(n <= max_n for n in seen) and len(seen) <= 8, seen
    # from a measured capacity that is right: two runs
    assert search_capacity(lambda n: n <= 12, 16, 12) == (12, {12: True, 13: False})
    # from nothing: doubling, then halving the interval
    assert list(search_capacity(lambda n: n <= 5, 16)[1]) == [1, 2, 4, 8, 6, 5]


def test_each_sessions_fresh_fps_and_whether_the_run_holds_the_target():
    from types import SimpleNamespace

    from cadence.bench.serve import _session_figures

    def client(fps, underruns=0, error=None):
        def fresh(step):
            return (int(fps * 10), 10.0, [])

        return SimpleNamespace(
            error=error,
            status_code=201 if error is None else 503,
            fresh=fresh,
            report={"underruns": {"video": underruns, "audio": 0}},
        )

    cfg = {"fps": 25}
    good = [client(24.9), client(24.6)]
    f = _session_figures(cfg, good, good, 24.5)
    assert f == {
        "target_fps": 24.5,
        "sessions_fresh_fps": [24.9, 24.6],
        "sessions_underruns": [0, 0],
        "share_sessions_ge_target": 1.0,
        "holds_target": True,
    }
    assert not _session_figures(cfg, good, [*good, client(24.9, underruns=1)][:3], 24.5)["holds_target"]
    refused = client(0.0, error="HTTP 503")
    f = _session_figures(cfg, good, [*good, refused], 24.5)
    assert f["sessions_fresh_fps"][-1] == 0.0 and f["sessions_underruns"][-1] is None
    assert f["share_sessions_ge_target"] == 0.667 and not f["holds_target"]


@pytest.mark.slow
def test_a_sweep_on_one_server_records_every_n_and_the_capacity(tmp_path, capsys):
    """``--sessions 1,3 --one-server`` on the CPU (tiny): one server with three groups on the one device, its
    capacity measured and reported; a run of 1 session, then 3; each N's JSON and the sweep's summary. Three
    viewers are three clients (each its own cookie, as browsers that opened the page): the server's cap of two
    pending offers per client refused the third when the bench's viewers shared one HTTP client (seen on the
    H200, 2026-12-03: 2 of 12 sessions streamed)."""
    from cadence.cli import main

    argv = ["bench", "serve", "--preset", "tiny", "--sessions", "1,3", "--one-server", "--seconds", "2"]
    rc = main([*argv, "--capacity-seconds", "1", "--progress-every", "0", "--out-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    (summary,) = (tmp_path / "serve").glob("*-sweep-of3.json")
    r = json.loads(summary.read_text())["results"]
    assert [row["sessions"] for row in r["rows"]] == [1, 3] and r["one_server"] and r["target_fps"] == 23.5
    assert r["capacity"] == max([0] + [row["sessions"] for row in r["rows"] if row["holds_target"]])
    assert r["server_capacity"] >= 1 and all(row["groups"] == 3 for row in r["rows"])
    three = json.loads(next((tmp_path / "serve").glob("*-s3-of3.json")).read_text())["results"]
    assert len(three["sessions_fresh_fps"]) == 3 and three["errors"] == 0, three.get("error_messages")
    assert all(fps > 0 for fps in three["sessions_fresh_fps"]), three["sessions_fresh_fps"]
    (share,) = three["shares"]
    assert share["placement"] == "cpu" and share["groups"] == 3 and not share["enforced"]
    assert "the largest N at which every session holds the target" in out.out


def test_viewers_spread_over_processes_by_default_only_where_there_are_cores():
    import os

    from cadence.bench.serve_viewers import CpuProbe, cpu_s, default_viewer_procs

    assert default_viewer_procs(16, cores=16) == 4 and default_viewer_procs(9, cores=16) == 3
    assert default_viewer_procs(3, cores=16) == 1 and default_viewer_procs(16, cores=2) == 1
    assert default_viewer_procs(16, cores=128) == 4 and default_viewer_procs(1, cores=128) == 1
    before = cpu_s(os.getpid())
    assert before is not None and before > 0 and cpu_s(None) is None and cpu_s(2**22 + 7) is None
    probe = CpuProbe(os.getpid())
    sum(i * i for i in range(300_000))  # some CPU work of this process's own
    assert 0 < probe.done() <= 2.0 and CpuProbe(None).done() is None
    from cadence.bench.serve import parse

    assert parse(["--viewer-procs", "3"]).viewer_procs == 3 and parse([]).viewer_procs is None
    with pytest.raises(SystemExit):
        parse(["--viewer-procs", "0"])


@pytest.mark.slow  # (24 s on the 2-core machine: two sessions' groups, two spawned viewer processes)
def test_bench_serve_with_two_viewer_processes_records_each_sides_cpu(tmp_path, capsys):
    """Two sessions watched from two viewer processes (``--viewer-procs 2``): every session's result comes back
    in order, and the record names the server's CPU use and each viewer process's."""
    from cadence.cli import main

    argv = ["bench", "serve", "--preset", "tiny", "--sessions", "2", "--seconds", "2", "--viewer-procs", "2"]
    rc = main([*argv, "--out-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    (path,) = (tmp_path / "serve").glob("*-cpu-tiny-tp1-s2.json")
    r = json.loads(path.read_text())["results"]
    assert r["errors"] == 0 and len(r["sessions_fresh_fps"]) == 2 and min(r["sessions_fresh_fps"]) > 0, r
    cpu = r["cpu"]
    assert len(cpu["viewers"]) == 2 and all(0 < v < 4 for v in cpu["viewers"]), cpu
    assert cpu["server"] is not None and cpu["server"] > 0 and cpu["server_with_viewers"] is False, cpu
