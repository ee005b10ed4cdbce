"""One gloo rank of tests/test_comm_fp8.py (torch.multiprocessing spawns it; results saved per rank).

Each rank: the FP8-payload all-reduce (``cadence.parallel.comm_fp8``) of its own random partials through a real
gloo group (uint8 all-to-all + all-gather), and the tiny model's whole-sequence forward with every
row-parallel sum in ``two_shot_fp8`` and in the bf16-free reference (``nccl``: the group's float32
all-reduce); rank 0 also runs the unsharded model (TP=1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_worker  # noqa: E402


def partials(world: int, m: int, n: int) -> list[torch.Tensor]:
    """Every rank's partial (all ranks can make all of them: the test checks against their exact sum)."""
    g = torch.Generator().manual_seed(7)
    ps = [torch.randn(m, n, generator=g) for _ in range(world)]
    for p in ps:
        p[3] *= 300.0  # outlier rows, as a residual stream's sums have
        p[:, 5] *= 40.0  # and an outlier channel
    return ps


@torch.no_grad()
def run_rank(rank: int, world: int, port: int, outdir: str) -> None:
    tp_worker.gloo_env(rank, world, port)

    from cadence.config import get_preset
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp, destroy_tp, init_tp, set_comm
    from cadence.parallel.comm_fp8 import fp8_all_reduce
    from cadence.parallel.group import CollectiveLog, DistGroup

    info = init_tp(backend="gloo")
    try:
        res: dict = {}
        group = DistGroup(info.group)
        for m, n in ((37, 256), (64, 96)):  # rows not divisible by the world; a width with one scale per row
            mine = partials(world, m, n)[rank].clone()
            res[(m, n)] = fp8_all_reduce(mine, group, "test").clone()
        cfg = get_preset("tiny")
        inputs, _, _ = tp_worker._inputs(cfg)
        model = apply_tp(build_model(cfg, "cpu", torch.float32, seed=0), group, comm="nccl")
        res["nccl"] = model.forward_full(*inputs)
        set_comm(model, "two_shot_fp8")
        with CollectiveLog() as log:
            res["fp8"] = model.forward_full(*inputs)
        res["algos"] = sorted({(c["algo"], c["dtype"]) for c in log.summary() if c["nbytes"] > 4096})
        if rank == 0:
            res["tp1"] = build_model(cfg, "cpu", torch.float32, seed=0).forward_full(*inputs)
        torch.save(res, Path(outdir) / f"rank{rank}.pt")
    finally:
        destroy_tp()


def spawn(outdir, world: int) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(run_rank, args=(world, tp_worker.free_port(), str(outdir)), nprocs=world, join=True)
    return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
