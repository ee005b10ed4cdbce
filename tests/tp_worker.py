"""One rank of the tensor-parallel parity test (tests/test_tp.py starts it with torch.multiprocessing).

Each rank joins a gloo group through ``init_tp`` (torchrun's environment variables, set here), builds
the same tiny float32 model from the same seed, shards it with ``apply_tp``, and writes its outputs
to ``<outdir>/rank<r>.pt``; rank 0 also runs the unsharded model (TP=1) as the reference. The
parent process compares (assertions live in the test, where pytest reports them).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

NUM_CHUNKS = 5  # > window_chunks (4) of the tiny preset: the window slides


def _inputs(cfg):
    g = torch.Generator().manual_seed(0)
    m = cfg.model
    x = torch.randn(1, 16, 3, *cfg.latent_hw, generator=g)
    t = torch.tensor([[900.0, 500.0, 100.0]])  # one timestep per latent frame
    text = torch.randn(1, m.text_len, m.text_dim, generator=g)
    audio = torch.randn(1, 3, m.audio_tokens_per_frame, m.audio_dim, generator=g)
    img = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    n = NUM_CHUNKS * cfg.audio_samples_per_chunk
    speech = 0.3 * torch.sin(2 * math.pi * 220 * torch.arange(n) / 48_000) + 0.1 * torch.randn(n, generator=g)
    return (x, t, text, audio), img, speech


def _run(model, cfg, inputs, img, speech) -> dict:
    from cadence.engine.generate import StreamGenerator

    out = {"full": model.forward_full(*inputs)}
    gen = StreamGenerator(cfg, model)
    chunks = gen.stream(img, "a person talking", speech, NUM_CHUNKS, seed=0)
    out["stream"] = torch.stack([o.latents for o in chunks])
    sess = gen.session(img, "a person talking", seed=0)  # the sink's cached K: heads per rank
    out["sink_k_shape"] = tuple(sess.cache.sink[0][0].shape)
    return out


@torch.no_grad()
def run_rank(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no hostname resolution needed
    torch.set_num_threads(1)  # two ranks on a 2-core runner

    from cadence.config import get_preset
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp, destroy_tp, init_tp
    from cadence.quant import apply_fp8

    info = init_tp(backend="gloo")
    try:
        assert (info.rank, info.world_size) == (rank, world)
        cfg = get_preset("tiny")
        inputs, img, speech = _inputs(cfg)
        model = apply_tp(build_model(cfg, "cpu", torch.float32, seed=0), info.group)
        res = {"tp": _run(model, cfg, inputs, img, speech), "heads": model.blocks[0].self_attn.heads}
        # FP8 composed with TP, in both orders
        m1 = build_model(cfg, "cpu", torch.float32, seed=0)
        apply_tp(m1, info.group)
        apply_fp8(m1)
        m2 = build_model(cfg, "cpu", torch.float32, seed=0)
        apply_fp8(m2)
        apply_tp(m2, info.group)
        res["tp_then_fp8"] = m1.forward_full(*inputs)
        res["fp8_then_tp"] = m2.forward_full(*inputs)
        if rank == 0:
            ref = build_model(cfg, "cpu", torch.float32, seed=0)
            res["ref"] = _run(ref, cfg, inputs, img, speech)
            apply_fp8(ref)
            res["ref_fp8"] = ref.forward_full(*inputs)
        torch.save(res, Path(outdir) / f"rank{rank}.pt")
    finally:
        destroy_tp()


@torch.no_grad()
def main() -> None:
    """``torchrun --nproc_per_node N tests/tp_worker.py [bf16|fp32]``: the same parity check on the
    launcher's devices (NCCL on CUDA), printed by rank 0 (for the GPU machines)."""
    import torch.distributed as dist

    from cadence.config import get_preset
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp, destroy_tp, init_tp

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[1] if len(sys.argv) > 1 else "bf16"]
    info = init_tp()
    try:
        cfg = get_preset("tiny")
        inputs, img, speech = _inputs(cfg)
        inputs = tuple(t.to(info.device) for t in inputs)
        model = apply_tp(build_model(cfg, info.device, dtype, seed=0), info.group)
        tp = _run(model, cfg, inputs, img, speech)
        r0 = {k: v.clone() for k, v in tp.items() if torch.is_tensor(v)}
        for v in r0.values():
            dist.broadcast(v, src=0)
        same = all(torch.equal(r0[k], tp[k]) for k in r0)
        flags = torch.tensor([float(same)], device=info.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if info.rank == 0:
            ref = _run(build_model(cfg, info.device, dtype, seed=0), cfg, inputs, img, speech)
            for k in ("full", "stream"):
                e = ((tp[k].float() - ref[k].float()).norm() / ref[k].float().norm()).item()
                print(f"TP={info.world_size} {info.backend} {dtype} {k}: relative L2 vs TP=1 {e:.2e}")
            print(f"identical on all ranks: {bool(flags.item())}; sink K shape {tp['sink_k_shape']}")
    finally:
        destroy_tp()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
