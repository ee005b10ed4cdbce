"""The TP fusions of issue 36 against their reference paths, in one process: N ranks as N threads of a
:class:`cadence.parallel.group.TPGroup` whose collectives sum through shared memory (the group seam's contract:
``all_reduce`` / ``reduce_scatter`` / ``all_gather`` hand every rank the same sums), so each check takes well
under a second. The gloo ranks of tests/test_tp.py, test_tp4.py and test_sp.py check the whole model.

* The row-parallel bias in rank 0's GEMM epilogue (``fused.bias_in_epilogue``) against the reference (added
  after the sum on every rank, ``CADENCE_TP_BIAS=after``) and against the unsharded linear, plain TP and
  sequence parallelism (``sp.row_scatter``), float32: the sums only change order, so within 1e-6 relative
  (float32 reordering of a 4-term sum is ~1e-7).
* The paired q/k norm sums (``tp.QKVNormStats`` + ``ShardedRMSNorm``): one collective of [.., 2] instead of two
  of [.., 1], bitwise the same sums (the same local sums, summed in the same rank order), so the normed q and k
  are bitwise those of the unpaired reference; and both against the unsharded ``RMSNorm`` within 1e-6.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from cadence.model.layers import RMSNorm
from cadence.parallel import fused
from cadence.parallel import tp as tpm
from cadence.parallel.group import TPGroup


class ThreadGroup(TPGroup):
    """Rank `rank` of `world` threads; collectives through a shared slot list and a barrier."""

    def __init__(self, world: int, rank: int, shared: dict):
        self.world, self.rank, self.shared = world, rank, shared
        self.calls: list[tuple] = []  # (kind, label, shape): this rank's (a CollectiveLog is process-wide)

    def all_reduce(self, t, label="", algo="nccl", per_layer=True):
        self.calls.append(("all_reduce", label, tuple(t.shape)))
        super().all_reduce(t, label, algo, per_layer)

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        sh = self.shared
        sh["slots"][self.rank] = t.clone()
        sh["barrier"].wait()
        parts = list(sh["slots"])
        sh["barrier"].wait()
        return parts

    def _all_reduce(self, t):
        parts = self._exchange(t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        t.copy_(total)

    def _reduce_scatter(self, out, inp):
        parts = self._exchange(inp)
        total = sum(p.view(self.world, *out.shape)[self.rank] for p in parts)
        out.copy_(total)

    def _all_gather(self, out, part):
        parts = self._exchange(part)
        out.copy_(torch.cat(parts))


def run_ranks(world: int, fn) -> list:
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    out, errs = [None] * world, []

    def body(r):
        try:
            with torch.no_grad():
                out[r] = fn(ThreadGroup(world, r, shared))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errs:
        raise errs[0]
    return out


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("where", ["epilogue", "after"])
def test_row_parallel_bias(world, where, monkeypatch):
    monkeypatch.setenv("CADENCE_TP_BIAS", where)
    g = torch.Generator().manual_seed(0)
    m, k, n = 37, 64, 48
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / 8
    b = torch.randn(n, generator=g)
    ref = F.linear(x, w, b)

    def rank(group):
        per = k // world
        sl = slice(group.rank * per, (group.rank + 1) * per)
        lin = torch.nn.Linear(per, n, bias=False)
        lin.weight.copy_(w[:, sl])
        y = fused.row_parallel(lin, x[:, sl], b, group, "nccl", "t.out")
        return y, [c[0] for c in group.calls]

    outs = run_ranks(world, rank)
    for y, kinds in outs:
        assert kinds == ["all_reduce"]
        assert rel(y, ref) < 1e-6
        assert torch.equal(y, outs[0][0])  # every rank holds the same sum


@pytest.mark.parametrize("where", ["epilogue", "after"])
def test_sequence_parallel_reduce_scatter_bias(where, monkeypatch):
    from cadence.parallel.sp import ShardedTokens, row_scatter

    monkeypatch.setenv("CADENCE_TP_BIAS", where)
    world, tokens, k, n = 2, 63, 32, 40
    g = torch.Generator().manual_seed(1)
    x, w, b = (
        torch.randn(1, tokens, k, generator=g),
        torch.randn(n, k, generator=g) / 6,
        torch.randn(n, generator=g),
    )
    ref = F.linear(x, w, b)

    def rank(group):
        per = k // world
        sl = slice(group.rank * per, (group.rank + 1) * per)
        lin = torch.nn.Linear(per, n, bias=False)
        lin.weight.copy_(w[..., sl])
        st = ShardedTokens(group)
        st.scatter(torch.zeros(1, tokens, 1), torch.zeros(1, 6, 1))  # the pass's token count and rows
        return row_scatter(lin, x[..., sl], b, st, "t.out"), st.rows

    outs = run_ranks(world, rank)
    full = torch.cat([y for y, _ in outs], dim=1)[:, :tokens]
    assert rel(full, ref) < 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_paired_qk_norm_sums_equal_the_unpaired_ones(world, monkeypatch):
    g = torch.Generator().manual_seed(2)
    m, dim = 21, 64
    x = torch.randn(1, m, dim, generator=g)
    wqkv = torch.randn(3 * dim, dim, generator=g) / 8
    nq, nk = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
    nq.weight.data = torch.rand(dim, generator=g) + 0.5
    nk.weight.data = torch.rand(dim, generator=g) + 0.5
    q_full, k_full, _ = F.linear(x, wqkv).chunk(3, dim=-1)
    ref = (nq(q_full), nk(k_full))

    def rank(group, paired):
        idx = tpm._rows(3, dim, group.rank, world, "cpu")
        lin = torch.nn.Linear(dim, 3 * dim // world, bias=False)
        lin.weight.copy_(wqkv[idx])
        pair = tpm.QKStats() if paired else None
        qkv = tpm.QKVNormStats(lin, group, pair, "self_attn.norm_qk") if paired else lin
        norm_q = tpm._norm(nq, group, "self_attn.norm_q", pair, 0)
        norm_k = tpm._norm(nk, group, "self_attn.norm_k", pair, 1)
        q, k, _ = qkv(x).chunk(3, dim=-1)  # as SelfAttention.forward does
        out = (norm_q(q), norm_k(k))
        return out, [c[1:] for c in group.calls]

    paired = run_ranks(world, lambda gr: rank(gr, True))
    plain = run_ranks(world, lambda gr: rank(gr, False))
    per = dim // world
    for r in range(world):
        (pq, pk), calls = paired[r]
        (uq, uk), ucalls = plain[r]
        assert calls == [("self_attn.norm_qk", (1, m, 2))]
        assert ucalls == [("self_attn.norm_q", (1, m, 1)), ("self_attn.norm_k", (1, m, 1))]
        assert torch.equal(pq, uq) and torch.equal(pk, uk)
        sl = slice(r * per, (r + 1) * per)
        assert rel(pq, ref[0][..., sl]) < 1e-6 and rel(pk, ref[1][..., sl]) < 1e-6


def test_a_norm_fed_something_else_reduces_its_own_sum():
    """The pairing checks its input: a norm handed a tensor that is not the qkv output's slice (another model)
    takes no stale sum; it reduces its own, so the result stays right."""
    pair = tpm.QKStats()
    q = torch.randn(1, 5, 8)
    pair.put(q, q, torch.ones(1, 5, 2))
    assert pair.take(0, torch.randn(1, 5, 8)) is None
    assert pair.take(0, q) is not None and pair.take(1, q) is not None
    assert pair.take(0, q) is None  # both taken: nothing stale is left


def test_small_sums_take_the_one_shot_on_cuda_only(monkeypatch):
    t = torch.zeros(748, 2)
    assert fused.small_mode(t) == "nccl"  # CPU
    monkeypatch.setenv("CADENCE_TP_SMALL_COMM", "one_shot")
    assert fused.small_mode(t) == "one_shot"
    monkeypatch.setenv("CADENCE_TP_SMALL_COMM", "nccl")
    assert fused.small_mode(t) == "nccl"
