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
