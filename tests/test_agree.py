"""Decisions every rank of a tensor-parallel group takes together (two gloo ranks on the CPU): the serve
worker's warm-up runs its second session on every rank when any rank saw a slow chunk (through
``cadence.parallel.graphs.all_ranks_ok``; capture agreement is tests/test_step_graphs.py's). A rank
that took the other branch alone would run collectives its peers never meet (a hang until the group's
timeout). At teardown rank 0 keeps the group's store up until the other ranks have destroyed their
groups (``destroy_tp``)."""

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.slow,  # two gloo ranks through two warm-ups and a teardown
]


def test_ranks_agree_on_the_second_warm_up_session_and_tear_down_in_order(tmp_path):
    r0, r1 = tp_worker.spawn_agree(tmp_path)
    assert r0["all_true"] and r1["all_true"]
    assert not r0["one_false"] and not r1["one_false"]
    # only rank 1's warm-up had a slow chunk (fast in its second stream): both ran the repeat stream
    assert r0["repeat_stream"] and r1["repeat_stream"] and r0["warm_streams"] == r1["warm_streams"]
    assert r0["notes"] == [] and len(r1["notes"]) == 1 and "first stream only" in r1["notes"][0], r1["notes"]
    # rank 1 took 1 s to destroy its group (patched): rank 0, the store's server, waited for it
    assert r0["destroy_s"] >= 0.9 and r1["destroy_s"] >= 1.0, (r0["destroy_s"], r1["destroy_s"])
