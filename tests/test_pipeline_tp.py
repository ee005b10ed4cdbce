"""`cadence bench pipeline --tp 2` under torchrun with gloo on the CPU: both ranks run the whole
pipeline (prewarm, steady run, conditioning-length changes) in step and rank 0 reports.
TP=2 output equality with TP=1 is tested at the model level (tests/test_tp.py, tests/tp_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_pipeline_tp2_gloo(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "cadence",
        "bench",
        "pipeline",
        "--preset",
        "tiny",
        "--tp",
        "2",
        "--device",
        "cpu",
        "--chunks",
        "6",
        "--shape-change-every",
        "3",
        "--out-dir",
        str(tmp_path),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "tensor parallel                 2 ranks" in p.stdout
    files = list((tmp_path / "pipeline").glob("*-tiny-tp2-*.json"))
    assert len(files) == 1, files  # rank 0 records, once
    import json

    doc = json.loads(files[0].read_text())
    assert doc["tp"] == 2 and doc["results"]["tp_comm"] == "auto"
    assert doc["results"]["chunks"] == 6 and doc["results"]["shape_changes"] >= 1


def test_bench_pipeline_tp_needs_torchrun(capsys):
    from cadence.bench.pipeline import main

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        assert main(["--preset", "tiny", "--tp", "2", "--chunks", "2"]) == 2
    finally:
        os.environ.update(env)
    assert "runs under torchrun" in capsys.readouterr().err
