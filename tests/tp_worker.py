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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streams import engine_stream  # noqa: E402  (the spawned ranks import this file by path)

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
    from cadence.engine.session import StreamGenerator

    out = {"full": model.forward_full(*inputs)}
    gen = StreamGenerator(cfg, model)
    chunks = engine_stream(gen, img, "a person talking", speech, NUM_CHUNKS, seed=0)
    out["stream"] = torch.stack([o.latents for o in chunks])
    sess = gen.session(img, "a person talking", seed=0)  # the sink's cached K: heads per rank
    out["sink_k_shape"] = tuple(sess.cache.sink[0][0].shape)
    return out


def ring_config(cfg):
    """The ring cache with FP8 K/V (per-(token, head) scales: sharding by heads leaves them as they are)."""
    return cfg.with_overrides(stream={"cache": "ring", "kv_fp8": True})


def _run_ring(model, cfg, img, speech) -> dict:
    """A stream through the FP8 ring cache (the window slides): latents and the per-layer buffer shape."""
    from cadence.engine.session import StreamGenerator

    gen = StreamGenerator(ring_config(cfg), model)
    chunks = engine_stream(gen, img, "a person talking", speech, NUM_CHUNKS, seed=0)
    sess = gen.session(img, "a person talking", seed=0)
    return {
        "stream": torch.stack([o.latents for o in chunks]),
        "k_shape": tuple(sess.cache.k.shape),
        "v_shape": tuple(sess.cache.v.shape),
        "k_dtype": str(sess.cache.k.dtype),
    }


def gloo_env(rank: int, world: int, port: int) -> None:
    """torchrun's environment for rank `rank` of a `world`-rank gloo group on loopback (no hostname
    resolution), one thread per rank (two ranks on a 2-core runner)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)


@torch.no_grad()
def run_rank(rank: int, world: int, port: int, outdir: str, extended: bool = False) -> None:
    """The TP parity run of one rank. `extended` (the 4-rank test) adds a stream through the FP8 ring
    cache and the symmetric-memory code paths with gloo-emulated ops (reduce-scatter over 4 ranks,
    chunked GEMMs, FP8 arguments)."""
    gloo_env(rank, world, port)

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
        if not extended:  # compile composed with TP: the sharded q/k norms' local halves are compiled too
            from cadence.runtime.compile import apply_compile, remove_compile

            rep = apply_compile(model, backend="aot_eager")  # traced, no code generated: the plumbing
            res["compiled"] = {
                "full": model.forward_full(*inputs),
                "blocks": rep.blocks,
                "norms": rep.norms,
                "status": rep.status(),
            }
            remove_compile(model)
        ref = build_model(cfg, "cpu", torch.float32, seed=0) if rank == 0 else None
        if extended:
            res["ring"] = _run_ring(model, cfg, img, speech)
            # the paths whose arithmetic depends on the group size: the reduce-scatter (M / world rows a
            # rank, bf16 and FP8 scaled) and the chunked GEMM + two-shot (every mode runs at TP=2 in test_fused)
            res["emulated"] = _emulated_symm_modes(
                model,
                ref,
                cfg,
                inputs,
                info.group,
                rank,
                grids=False,
                modes=("rs_ag", "chunked4"),
                fp8_modes=("rs_ag",),
            )
        if rank == 0:
            if extended:
                res["ref_ring"] = _run_ring(ref, cfg, img, speech)
            res["ref"] = _run(ref, cfg, inputs, img, speech)
            apply_fp8(ref)
            res["ref_fp8"] = ref.forward_full(*inputs)
        torch.save(res, Path(outdir) / f"rank{rank}.pt")
    finally:
        destroy_tp()


#: (frames, latent h, latent w) -> tokens = frames * h/2 * w/2: 64, 128, 64 + a 16-token sink row, 37, 512, 64
FUSED_GRIDS = [(1, 16, 16), (2, 16, 16), (1, 16, 20), (1, 2, 74), (2, 32, 32), (1, 16, 16)]
FUSED_MODES = ["two_shot", "one_shot", "rs_ag", "chunked", "chunked4", "tiles", "auto"]


def _grid_inputs(cfg, f: int, h: int, w: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = cfg.model
    x = torch.randn(1, 16, f, h, w, generator=g)
    t = torch.linspace(900.0, 100.0, f)[None]
    text = torch.randn(1, m.text_len, m.text_dim, generator=g)
    audio = torch.randn(1, f, m.audio_tokens_per_frame, m.audio_dim, generator=g)
    return x, t, text, audio


class _GlooSymmOps:
    """gloo emulation of the torch.ops.symm_mem ops cadence.parallel.fused calls (same signatures),
    so the symmetric-memory code paths (buffer views, GEMM into the buffer, chunking, reduce-scatter
    + all-gather, FP8 arguments) run on CPU."""

    def __init__(self, group):
        self.group = group
        self.calls: dict[str, int] = {}

    def _n(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def two_shot_all_reduce_(self, buf, op, gname):
        assert op == "sum" and isinstance(gname, str) and buf.is_contiguous()
        self._n("two_shot_all_reduce_")
        import torch.distributed as dist

        dist.all_reduce(buf, group=self.group)
        return buf

    def two_shot_all_reduce_out(self, buf, op, gname, out):
        self._n("two_shot_all_reduce_out")
        import torch.distributed as dist

        out.copy_(buf)
        dist.all_reduce(out, group=self.group)
        return out

    def one_shot_all_reduce(self, buf, op, gname):
        self._n("one_shot_all_reduce")
        if buf.dtype == torch.float32 and buf.numel() <= 1024:  # a q/k norms' sum (fused.small_all_reduce)
            self._n("one_shot_small")
        import torch.distributed as dist

        out = buf.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _rs(self, full, scatter_dim):
        import torch.distributed as dist

        assert scatter_dim == 0
        dist.all_reduce(full, group=self.group)
        w, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        return full.chunk(w, dim=0)[r].contiguous()

    def fused_matmul_reduce_scatter(self, a, b, op, scatter_dim, gname):
        self._n("fused_matmul_reduce_scatter")
        return self._rs(a @ b, scatter_dim)

    def fused_scaled_matmul_reduce_scatter(
        self,
        a,
        b,
        a_scale,
        b_scale,
        op,
        orig_dim,
        dim,
        gname,
        out_shape,
        bias,
        result_scale,
        out_dtype,
        fast_accum,
    ):
        self._n("fused_scaled_matmul_reduce_scatter")
        assert list(out_shape) == [a.shape[0], b.shape[1]] and a_scale.shape == (a.shape[0], 1)
        full = (a.float() * a_scale) @ (b.float() * b_scale)
        return self._rs(full.to(out_dtype or torch.float32), orig_dim)


EMULATED_MODES = ("two_shot", "one_shot", "rs_ag", "chunked", "chunked4")
EMULATED_FP8_MODES = ("two_shot", "rs_ag", "chunked")


def _emulated_symm_modes(
    model,
    ref_model,
    cfg,
    inputs,
    group,
    rank,
    grids: bool = True,
    modes=EMULATED_MODES,
    fp8_modes=EMULATED_FP8_MODES,
) -> dict:
    """Every mode through the symmetric-memory code paths with gloo-emulated ops and a CPU buffer
    allocator, against nccl (model level, float32 and FP8), and a token-count sequence in two_shot
    with a small buffer cache (bounded, buffers reused)."""
    import os

    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp, fused, set_comm
    from cadence.quant import apply_fp8

    ops = _GlooSymmOps(group)
    saved = (fused._ops, fused.symm_unavailable_reason, fused._prepare, fused._CACHE, fused._SMALL_CACHE)
    fused._ops = lambda: ops
    fused.symm_unavailable_reason = lambda device, group: None
    fused._prepare = lambda group: None

    def cpu_alloc(numel, dt, dev, g):
        return torch.empty(numel, dtype=dt, device=dev)

    fused._CACHE = fused.SymmBufferCache(3, alloc=cpu_alloc)
    fused._SMALL_CACHE = fused.SymmBufferCache(2, alloc=cpu_alloc)
    os.environ["CADENCE_TP_SMALL_COMM"] = "one_shot"  # the q/k norms' sums through the one-shot path too
    out: dict = {"modes": {}, "fp8": {}, "grids": []}
    try:
        set_comm(model, "nccl")
        ref = model.forward_full(*inputs)
        for mode in modes:
            set_comm(model, mode)
            out["modes"][mode] = rel_err(model.forward_full(*inputs), ref)
        # FP8: the modes compared with the bias added after the sum in all of them (rs_ag / chunked cannot take
        # it in rank 0's epilogue): moving it there changes fp32 rounding by an ulp, which can flip one e4m3
        # step of a later quantised activation (measured 5.5e-4 on this output); its float32 parity with TP=1
        # is tests/test_tp.py's
        os.environ["CADENCE_TP_BIAS"] = "after"
        m8 = apply_tp(build_model(cfg, "cpu", torch.float32, seed=0), group, comm="nccl")
        apply_fp8(m8)
        ref8 = m8.forward_full(*inputs)
        for mode in fp8_modes:
            set_comm(m8, mode)
            out["fp8"][mode] = rel_err(m8.forward_full(*inputs), ref8)
        os.environ.pop("CADENCE_TP_BIAS")
        set_comm(model, "two_shot")
        for i, (f, h, w) in enumerate(FUSED_GRIDS if grids else []):
            inp = _grid_inputs(cfg, f, h, w, seed=i)
            y = model.forward_full(*inp)
            e = {"tokens": f * (h // 2) * (w // 2), "cache": fused.symm_cache_info()}
            if rank == 0:
                e["rel_vs_tp1"] = rel_err(y, ref_model.forward_full(*inp))
            out["grids"].append(e)
        out["calls"] = dict(ops.calls)
        out["unusable"] = {str(k): v for k, v in fused._unusable.items()}
        set_comm(model, "auto")
    finally:
        fused._ops, fused.symm_unavailable_reason, fused._prepare, fused._CACHE, fused._SMALL_CACHE = saved
        os.environ.pop("CADENCE_TP_SMALL_COMM", None)
        os.environ.pop("CADENCE_TP_BIAS", None)
    return out


def free_port() -> int:
    from cadence.net import free_port as _free

    return _free()


def spawn_results(outdir, world: int, extended: bool = False) -> list[dict]:
    """Run :func:`run_rank` on `world` spawned gloo ranks and load what each rank saved."""
    import torch.multiprocessing as mp

    mp.spawn(run_rank, args=(world, free_port(), str(outdir), extended), nprocs=world, join=True)
    return [torch.load(Path(outdir) / f"rank{r}.pt") for r in range(world)]


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def run_fused_rank(rank: int, world: int, port: int, outdir: str) -> None:
    """tests/test_fused.py: every comm mode against the nccl reference (CPU: all fall back, with one
    warning line), and a sequence of token counts through a TP model with comm="auto" vs TP=1."""
    import logging

    gloo_env(rank, world, port)

    from cadence.config import get_preset
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp, destroy_tp, fused, init_tp, set_comm

    class Count(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.records: list[str] = []

        def emit(self, record):
            self.records.append(record.getMessage())

    counter = Count()
    logging.getLogger("cadence.parallel.fused").addHandler(counter)
    info = init_tp(backend="gloo")
    try:
        cfg = get_preset("tiny")
        inputs, _, _ = _inputs(cfg)
        res: dict = {"modes": {}, "grids": []}
        model = apply_tp(build_model(cfg, "cpu", torch.float32, seed=0), info.group, comm="nccl")
        ref = model.forward_full(*inputs)
        for mode in FUSED_MODES:
            assert set_comm(model, mode) == 2 * 4  # 2 blocks x (self out, cross out, audio out, fc2)
            res["modes"][mode] = model.forward_full(*inputs)
        res["nccl"] = ref
        res["warnings_after_modes"] = list(counter.records)
        res["fallback_counts"] = fused.fallback_warnings()
        # a sequence of token counts, comm="auto", against TP=1 (rank 0)
        set_comm(model, "auto")
        ref_model = build_model(cfg, "cpu", torch.float32, seed=0) if rank == 0 else None
        for i, (f, h, w) in enumerate(FUSED_GRIDS):
            inp = _grid_inputs(cfg, f, h, w, seed=i)
            y = model.forward_full(*inp)
            entry = {"tokens": f * (h // 2) * (w // 2), "tp": y, "cache": fused.symm_cache_info()}
            if rank == 0:
                entry["ref"] = ref_model.forward_full(*inp)
            res["grids"].append(entry)
        res["warnings_total"] = list(counter.records)
        res["decisions"] = fused.chooser_decisions()
        res["emulated"] = _emulated_symm_modes(model, ref_model, cfg, inputs, info.group, rank)
        torch.save(res, Path(outdir) / f"fused_rank{rank}.pt")
    finally:
        logging.getLogger("cadence.parallel.fused").removeHandler(counter)
        destroy_tp()


@torch.no_grad()
def main() -> None:
    """``torchrun --nproc_per_node N tests/tp_worker.py [bf16|fp32] [comm]``: the same parity check on the
    launcher's devices (NCCL on CUDA), printed by rank 0 (for the GPU machines). `comm` is the
    row-parallel mode (default auto; see cadence.parallel.fused)."""
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
        comm = sys.argv[2] if len(sys.argv) > 2 else "auto"
        model = apply_tp(build_model(cfg, info.device, dtype, seed=0), info.group, comm=comm)
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
            from cadence.parallel import fused

            print(
                f"comm={comm}: decisions {fused.chooser_decisions()}; fallbacks {fused.fallback_warnings()}; "
                f"symm cache {fused.symm_cache_info()}"
            )
    finally:
        destroy_tp()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()


def run_agree_rank(rank: int, world: int, port: int, outdir: str) -> None:
    """tests/test_agree.py: the start-up decisions that every rank of a group must take together.

    ``all_ranks_ok`` (MIN of a flag; agreeing_capture on top of it is tests/test_step_graphs.py's), and
    ``Engine.warm_up`` on a TP engine whose chunk times (faked) are slow on rank 1 only: every rank must
    run the second warm-up session, or a real group's collectives would not meet. Then the teardown
    order of ``destroy_tp``."""
    import json
    import time

    import torch.distributed as dist

    gloo_env(rank, world, port)

    from cadence.config import get_preset
    from cadence.engine.build import build_engine
    from cadence.engine.messages import ChunkTimings
    from cadence.engine.spec import FastPath
    from cadence.media.image import default_reference_image
    from cadence.parallel import destroy_tp, init_tp
    from cadence.parallel.graphs import all_ranks_ok

    info = init_tp(backend="gloo")
    res: dict = {}
    try:
        res["all_true"] = all_ranks_ok(True, info.group)
        res["one_false"] = all_ranks_ok(rank == 0, info.group)

        cfg = get_preset("tiny").with_overrides(model={"num_layers": 1})
        eng = build_engine(cfg, "cpu", FastPath(threads=1), tp=info)
        w = cfg.stream.window_chunks
        calls = [0]

        def fake_steps(eng, image, audio, n):  # the first stream's chunk w is slow on rank 1 only
            slow = rank == 1 and calls[0] == 0
            calls[0] += 1
            return [ChunkTimings(work_ms=900.0 if slow and i == w else 100.0, step="eager") for i in range(n)]

        from cadence.engine import warmup

        warmup._steps_only = fake_steps  # (this process only: a spawned rank)
        warm = eng.warm_up(default_reference_image(cfg.stream.height, cfg.stream.width), decode=False)
        res["warm_streams"] = warm.streams
        res["repeat_stream"] = warm.repeat_stream
        res["notes"] = [str(n) for n in eng.notes]
        # teardown: rank 0 (the store's server here) must wait until rank 1 has destroyed its group
        if rank == 1:
            destroy = dist.destroy_process_group

            def slow_destroy(*a, **k):
                time.sleep(1.0)
                destroy(*a, **k)

            dist.destroy_process_group = slow_destroy
        t0 = time.monotonic()
        destroy_tp()
        res["destroy_s"] = time.monotonic() - t0
    finally:
        destroy_tp()
    Path(outdir, f"agree{rank}.json").write_text(json.dumps(res))


def spawn_agree(outdir, world: int = 2) -> list[dict]:
    import json

    import torch.multiprocessing as mp

    mp.spawn(run_agree_rank, args=(world, free_port(), str(outdir)), nprocs=world, join=True)
    return [json.loads(Path(outdir, f"agree{r}.json").read_text()) for r in range(world)]
