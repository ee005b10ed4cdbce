"""A tensor-parallel worker group in the server ('cpu+cpu': the tiny model sharded over two gloo ranks,
two worker processes): rank 0 answers the web side and broadcasts every command to the follower, both
run the same steps (their all-reduces meet), rank 0 decodes. An aiortc client streams from it; then
the server stops and no process of the group is left. The model's TP=2 parity is tests/test_tp.py's."""

import asyncio
import multiprocessing
import os

import pytest

for _mod in ("fastapi", "uvicorn", "aiortc", "prometheus_client", "httpx", "multipart"):
    pytest.importorskip(_mod, reason=f"the serve extra is not installed ({_mod})")

import torch.distributed as dist

from cadence.devtools.client import run_client
from cadence.errors import ConfigError
from cadence.serve.config import ServeConfig

ONE_LAYER = {
    "model": {"num_layers": 1}
}  # half the all-reduces of tiny: the protocol, not the model, is tested
from cadence.engine.recipe import EngineSpec
from cadence.serve.server import ServerThread

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tp_server() -> ServerThread:
    # two gloo ranks on this 2-core CPU with one thread each: ~150 ms of diffusion per 166.7 ms chunk
    # for tiny's two layers (the all-reduces over loopback dominate at this size), ~85 ms with one, and
    # a generous lead; real time is not the point here (on GPUs the group is NCCL over NVLink), the
    # protocol is
    return ServerThread(
        ServeConfig(
            engine=EngineSpec(model="tiny", overrides=ONE_LAYER), port=0, groups=("cpu+cpu",), lead_ms=500.0
        )
    ).start()


def _short_session_ok(url: str) -> None:
    res = asyncio.run(run_client(url, 1.0))
    assert res.error is None and res.report["chunks"]["done"] >= 4 and not res.report["errors"], res.report


def _nothing_left(pids) -> None:
    assert multiprocessing.active_children() == []
    assert not any(_alive(p) for p in pids)


def test_tensor_parallel_group_streams_then_leaves_nothing_behind():
    srv = _tp_server()
    try:
        (g,) = srv.manager.groups
        assert len(g.followers) == 1 and g.info.tp == 2 and g.info.fast_path["tp"] == 2
        pids = [g.pid] + [p.pid for p in g.followers]
        res = asyncio.run(run_client(srv.url, 2.5))
        assert res.error is None, res.error
        assert res.status_code == 201
        rep = res.report
        assert not rep["errors"], rep["errors"]
        assert rep["worker_preopened"] is True  # the default session was opened ahead on both ranks
        assert (
            rep["chunks"]["done"] >= 12 and rep["video_frames_fresh"] + rep["video_frames_skipped"] >= 36
        ), rep
        bad, missing = res.pts_gaps(3750)
        # (held frames are not sent either: the receiver keeps the last one)
        assert bad == [] and missing <= rep["video_frames_skipped"] + rep["underruns"]["video"], rep
        assert rep["video_frames_skipped"] <= 24, rep  # at most 1 s skipped in 2.5 s
        # a second session on the same group: the ranks stayed in step through close and the next open
        _short_session_ok(srv.url)
    finally:
        srv.stop()
    _nothing_left(pids)


@pytest.mark.parametrize("bad", ["cpu+cuda:0", "cuda:0+cuda:0", "cpu+gpu"])
def test_tensor_parallel_group_names_are_checked(bad):
    with pytest.raises(ConfigError, match="tensor-parallel group"):
        ServeConfig(groups=(bad,))


@pytest.mark.slow
def test_a_follower_rank_that_dies_restarts_the_group():
    """Rank 0 would wait in a collective for a dead follower until TP_TIMEOUT_S; the group's watchdog
    reports it at once, the server restarts the whole group (new processes) and it serves again."""
    import time

    srv = _tp_server()
    try:
        (g,) = srv.manager.groups
        old = [g.pid, g.followers[0].pid]
        g.followers[0].kill()
        deadline = time.monotonic() + 60
        while not (g.restarts == 1 and g.ready.is_set()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert g.restarts == 1 and g.ready.is_set()
        assert g.pid not in old and g.followers[0].pid not in old
        _short_session_ok(srv.url)
    finally:
        srv.stop()
    _nothing_left(old)
