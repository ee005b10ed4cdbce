"""Row-parallel communication modes (cadence.parallel.fused) on CPU.

Two gloo ranks (the spawn harness of tests/test_tp.py): every mode must give exactly the nccl
reference's output. On CPU/gloo the symmetric-memory modes cannot run, so each falls back to the
nccl path and the process logs that ONE time (warn-once), however many layers and modes hit it.
Then a sequence of token counts (64, 128, 64 + a sink row, 37, 512, 64) through the TP=2 tiny model
with comm="auto" must match TP=1 at each step (same tolerance as tests/test_tp.py), and the
symmetric buffer cache must stay within its bound. The LRU itself (buckets, ping-pong, eviction,
freeing) and the chooser (table, default, log once per shape) are tested in-process with an
injected CPU allocator, since symmetric memory needs CUDA.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker

from cadence.parallel import fused

WORLD = 2
TP_TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = tmp_path_factory.mktemp("fused")
    mp.spawn(tp_worker.run_fused_rank, args=(WORLD, tp_worker.free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"fused_rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_mode_equals_nccl_reference(results):
    for r in range(WORLD):
        ref = results[r]["nccl"]
        for mode, y in results[r]["modes"].items():
            assert torch.equal(y, ref), (
                f"rank {r} comm={mode}: {tp_worker.rel_err(y, ref):.2e} from the nccl reference"
            )
    assert torch.equal(results[0]["nccl"], results[1]["nccl"])


@pytest.mark.slow
def test_cpu_fallback_warns_exactly_once(results):
    for r in range(WORLD):
        w = results[r]["warnings_after_modes"]
        assert len(w) == 1, f"rank {r}: expected one fallback warning line, got {w}"
        assert "falls back to nccl" in w[0] and "CUDA" in w[0]
        counts = results[r]["fallback_counts"]
        assert sum(counts.values()) > 1  # hit by many layers and modes, logged once
        assert results[r]["warnings_total"] == w  # comm="auto" on CPU picks nccl: no further warning


@pytest.mark.slow
def test_token_count_sequence_matches_tp1_and_cache_bounded(results):
    grids = results[0]["grids"]
    assert [g["tokens"] for g in grids] == [64, 128, 80, 37, 512, 64]
    for r in range(WORLD):
        for i, g in enumerate(results[r]["grids"]):
            e = tp_worker.rel_err(g["tp"], grids[i]["ref"])
            assert e < TP_TOL, f"rank {r}, {g['tokens']} tokens: TP=2 vs TP=1 relative error {e:.2e}"
            info = g["cache"]
            assert info["entries"] <= info["max_entries"]
            assert info["entries"] == 0  # CPU: the nccl path never allocates symmetric buffers
        for a, b in zip(results[0]["grids"], results[1]["grids"]):
            assert torch.equal(a["tp"], b["tp"])
    why = " ".join(d["why"] for d in results[0]["decisions"].values())
    assert all(d["mode"] == "nccl" for d in results[0]["decisions"].values()) and "cpu" in why


# ---- in-process: LRU, buckets, chooser -------------------------------------------------------
def test_bucket_rows():
    assert fused.bucket_rows(1) == 64 and fused.bucket_rows(64) == 64
    assert fused.bucket_rows(748) == 768 and fused.bucket_rows(4680) == 5120
    for m in (37, 65, 100, 748, 749, 1496, 4680, 9999):
        b = fused.bucket_rows(m)
        assert m <= b <= max(64, 1.25 * m + 1)


def test_symm_buffer_cache_lru_bounded_and_frees():
    allocated: list[weakref.ref] = []

    def alloc(numel, dtype, device, group):
        t = torch.empty(numel, dtype=dtype, device=device)
        allocated.append(weakref.ref(t))
        return t

    c = fused.SymmBufferCache(max_entries=3, alloc=alloc)
    seq = [64, 128, 80, 37, 512, 64, 748, 1496, 4680, 748, 768, 64, 5000, 37]
    for m in seq:
        buf = c.get(m, 128, torch.bfloat16, torch.device("cpu"), None)
        assert buf.numel() >= m * 128
        info = c.info()
        assert info["entries"] <= 3
        assert info["bytes"] <= 3 * 2 * fused.bucket_rows(max(seq)) * 128 * 2
    info = c.info()
    assert info["evictions"] > 0 and info["hits"] > 0
    assert info["allocations"] == 2 * (info["entries"] + info["evictions"])
    del buf
    gc.collect()
    alive = sum(r() is not None for r in allocated)
    assert alive == 2 * info["entries"], "evicted buffers must be freed"
    # ping-pong: the two buffers of an entry alternate; the same M never allocates again
    a1 = c.get(37, 128, torch.bfloat16, torch.device("cpu"), None)
    a2 = c.get(37, 128, torch.bfloat16, torch.device("cpu"), None)
    a3 = c.get(37, 128, torch.bfloat16, torch.device("cpu"), None)
    assert a1.data_ptr() != a2.data_ptr() and a1.data_ptr() == a3.data_ptr()
    n_alloc = c.info()["allocations"]
    for _ in range(5):
        c.get(40, 128, torch.bfloat16, torch.device("cpu"), None)  # same bucket as 37
    assert c.info()["allocations"] == n_alloc


def test_tile_state_cache_lru_bounded_and_frees():
    """The tile kernel's buffer sets (one per N and row bucket) are an LRU too: a sequence of token
    counts keeps at most max_entries sets alive, reuses a bucket's set, and frees evicted ones."""
    made: list[weakref.ref] = []

    class FakeState:
        def __init__(self, group, device, n, rows, dtype):
            self.part = torch.empty(rows * n, dtype=dtype, device=device)
            self.flags = torch.zeros(2 * rows, dtype=torch.int32)
            self.rows = rows
            made.append(weakref.ref(self))

    c = fused.TileStateCache(max_entries=3, make=FakeState)
    seq = [64, 128, 80, 37, 512, 64, 748, 1496, 4680, 748, 768, 64, 5000, 37]
    for m in seq:
        st = c.get(None, torch.device("cpu"), 128, m, torch.bfloat16)
        assert st.rows == fused.bucket_rows(m) >= m
        assert c.info()["entries"] <= 3
    info = c.info()
    assert (
        info["evictions"] > 0
        and info["hits"] > 0
        and info["allocations"] == info["entries"] + info["evictions"]
    )
    assert c.get(None, torch.device("cpu"), 128, 40, torch.bfloat16) is c.get(
        None, torch.device("cpu"), 128, 37, torch.bfloat16
    )  # one bucket
    del st
    gc.collect()
    assert sum(r() is not None for r in made) == c.info()["entries"], "evicted sets must be freed"


def test_process_cache_api():
    info = fused.symm_cache_info()
    assert {"entries", "max_entries", "bytes", "allocations", "evictions"} <= set(info)
    assert info["max_entries"] >= 1


def test_parse_mode():
    assert fused.parse_mode("chunked") == ("chunked", fused.DEFAULT_CHUNKS)
    assert fused.parse_mode("chunked4") == ("chunked", 4)
    assert fused.parse_mode("two_shot") == ("two_shot", 1)
    assert fused.parse_mode("auto") == ("auto", 1)
    with pytest.raises(ValueError, match="unknown row-parallel comm mode"):
        fused.parse_mode("multimem")


def test_chooser_table_default_and_logs_once(tmp_path, monkeypatch, caplog):
    table = {
        "entries": [
            {
                "m": 748,
                "n": 8192,
                "k": 12288,
                "dtype": "fp8",
                "world": 2,
                "best_mode": "rs_ag",
                "modes_us": {"nccl": 198.0, "rs_ag": 150.0},
            },
            {"m": 748, "n": 8192, "k": 4096, "dtype": "bf16", "world": 2, "best_mode": "nccl"},
        ]
    }
    p = tmp_path / "chooser-test-tp2.json"
    p.write_text(json.dumps(table))
    monkeypatch.setenv("CADENCE_FUSED_TABLE", str(p))
    fused.reset_chooser()
    try:
        with caplog.at_level(logging.INFO, logger="cadence.parallel.fused"):
            assert fused.choose_mode(748, 8192, 12288, "fp8", 2) == "rs_ag"
            assert fused.choose_mode(748, 8192, 12288, "fp8", 2) == "rs_ag"
            assert fused.choose_mode(1000, 8192, 4096, torch.bfloat16, 2) == "nccl"  # within 2x of 748
            assert fused.choose_mode(4680, 8192, 4096, "bf16", 2) == "two_shot"  # too far: default
            assert fused.choose_mode(20000, 8192, 4096, "bf16", 2) == "nccl"  # default, large M
            assert fused.choose_mode(748, 8192, 4096, "bf16", 2, device_type="cpu") == "nccl"
        msgs = [r.getMessage() for r in caplog.records if "comm mode" in r.getMessage()]
        assert len(msgs) == 5, msgs  # once per shape
        assert "measured table" in msgs[0] and "built-in default" in msgs[3]
        assert len(fused.chooser_decisions()) == 5
    finally:
        fused.reset_chooser()


def test_symm_code_paths_with_emulated_ops(results):
    """The symmetric-memory paths themselves (views of the buffer, GEMM into it, chunks, reduce-scatter
    + all-gather, FP8 arguments), with the symm_mem ops emulated by gloo: same result as nccl."""
    for r in range(WORLD):
        em = results[r]["emulated"]
        assert em["unusable"] == {}, em["unusable"]
        for mode, e in em["modes"].items():
            assert e < 1e-6, f"rank {r} emulated {mode}: {e:.2e} from nccl"
        for mode, e in em["fp8"].items():
            assert e < 1e-5, f"rank {r} emulated FP8 {mode}: {e:.2e} from nccl"
        calls = em["calls"]
        for op in (
            "two_shot_all_reduce_out",
            "two_shot_all_reduce_",
            "one_shot_all_reduce",
            "one_shot_small",  # the q/k norms' sums through fused.small_all_reduce
            "fused_matmul_reduce_scatter",
            "fused_scaled_matmul_reduce_scatter",
        ):
            assert calls.get(op, 0) > 0, f"{op} never called: {calls}"
        for g in em["grids"]:
            c = g["cache"]
            assert 0 < c["entries"] <= c["max_entries"] == 3
            assert c["allocations"] == 2 * (c["entries"] + c["evictions"])
        assert em["grids"][-1]["cache"]["evictions"] >= 1  # 6 token counts, 5 buckets, 3 slots
    for g in results[0]["emulated"]["grids"]:
        assert g["rel_vs_tp1"] < TP_TOL, f"emulated two_shot, {g['tokens']} tokens: {g['rel_vs_tp1']:.2e}"
