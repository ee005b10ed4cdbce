"""One gloo rank of the sequence-parallelism and emulation tests (tests/test_sp.py, tests/test_emulate.py).

Each rank builds the tiny float32 model from one seed, shards it with ``apply_tp`` with and without
``sequence_parallel``, and saves its outputs to ``<outdir>/sp<rank>.pt``; rank 0 also runs TP=1. Geometries:
the tiny preset (64 tokens a chunk, no padding), a 112x144 stream (63 tokens: uneven at TP=2 and 4), and a
whole-sequence forward over 748 tokens (W57's chunk: 187 rows a rank at TP=4, padded to 188). Each rank also
records one stream step's per-op shapes and collectives (``cadence.parallel.emulate.OpShapes``,
``cadence.parallel.group.CollectiveLog``), which the emulation test compares with an emulated rank's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_worker  # noqa: E402  (the spawned ranks import this file by path)

UNEVEN = {"stream": {"height": 112, "width": 144}}  # 7 x 9 = 63 tokens a chunk
W57_GRID = (1, 44, 68)  # one latent frame of 22 x 34 patches: 748 tokens


def configs(light: bool = False):
    """The geometries ('uneven' only when `light`: it and the 748-token forward cover the padded rows)."""
    from cadence.config import get_preset

    cfg = get_preset("tiny")
    out = {"tiny": cfg, "uneven": cfg.with_overrides(**UNEVEN)}
    return {"uneven": out["uneven"]} if light else out


def build(cfg, group, sp: bool, fp8: bool = False):
    from cadence.model.weights import build_model
    from cadence.parallel import apply_tp
    from cadence.quant import apply_fp8

    model = build_model(cfg, "cpu", torch.float32, seed=0)
    if group is not None:
        apply_tp(model, group, sequence_parallel=sp)
    if fp8:
        apply_fp8(model)
    return model


def full_inputs(cfg, grid=None):
    """forward_full inputs: the tiny test's 3 frames (per-frame timesteps), or one frame of `grid`."""
    if grid is None:
        inputs, _, _ = tp_worker._inputs(cfg)
        return inputs
    return tp_worker._grid_inputs(cfg, *grid, seed=7)


def outputs(model, cfg) -> dict:
    inputs, img, speech = tp_worker._inputs(cfg)
    out = tp_worker._run(model, cfg, full_inputs(cfg), img, speech)
    out["full748"] = model.forward_full(*full_inputs(cfg, W57_GRID))
    return out


def step_record(model, cfg) -> dict:
    """One session's first stream step (all its passes) with the per-op shapes and the collectives recorded."""
    from cadence.engine.session import StreamGenerator
    from cadence.parallel.emulate import OpShapes
    from cadence.parallel.group import CollectiveLog

    _, img, speech = tp_worker._inputs(cfg)
    gen = StreamGenerator(cfg, model)
    sess = gen.session(img, "a person talking", seed=0)
    with OpShapes(model, sess.cache) as ops, CollectiveLog() as log:
        sess.step(speech[: cfg.audio_samples_per_chunk])
    return {"ops": ops.calls, "collectives": [c.as_dict() for c in log.calls], "summary": log.summary()}


def engine_stream_of(cfg, info, sp: bool) -> dict:
    """Three chunks from an engine built by ``build_engine`` (random weights: sharded on meta) with
    ``FastPath(sequence_parallel=sp)``, and what it says it applied."""
    from cadence.engine.build import build_engine
    from cadence.engine.spec import FastPath

    _, img, speech = tp_worker._inputs(cfg)
    eng = build_engine(cfg, "cpu", FastPath(threads=1, sequence_parallel=sp), tp=info)
    try:
        out = [c.latents for c in eng.stream(img, "a person talking", speech, 3, seed=0)]
        return {
            "stream": torch.stack(out),
            "applied": dict(eng.applied),
            "notes": [str(n) for n in eng.notes],
        }
    finally:
        eng.close()


@torch.no_grad()
def run_rank(rank: int, world: int, port: int, outdir: str, light: bool = False) -> None:
    tp_worker.gloo_env(rank, world, port)

    from cadence.parallel import destroy_tp, init_tp

    info = init_tp(backend="gloo")
    try:
        res: dict = {}
        for name, cfg in configs(light).items():
            for sp in (False, True):
                model = build(cfg, info.group, sp)
                res[(name, sp)] = outputs(model, cfg)
                res[("record", name, sp)] = step_record(model, cfg)
                if sp:
                    res[("rows", name)] = model.token_layout.rows
        cfgs = configs()
        cfg = cfgs["uneven"]
        inputs = full_inputs(cfg)
        for sp in (False, True):  # FP8 linears: the SP gathers move the quantised rows
            res[("fp8", sp)] = build(cfg, info.group, sp, fp8=True).forward_full(*inputs)
            res[("record_fp8", sp)] = step_record(build(cfg, info.group, sp, fp8=True), cfg)
        if world == 2:  # the engine applies it: FastPath.sequence_parallel through build_engine
            res["engine"] = {sp: engine_stream_of(cfgs["uneven"], info, sp) for sp in (False, True)}
        if rank == 0:
            for name, cfg in configs(light).items():
                res[("ref", name)] = outputs(build(cfg, None, False), cfg)
            res[("ref_fp8",)] = build(cfg, None, False, fp8=True).forward_full(*inputs)
        torch.save(res, Path(outdir) / f"sp{rank}.pt")
    finally:
        destroy_tp()


def spawn(outdir, world: int, light: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(run_rank, args=(world, tp_worker.free_port(), str(outdir), light), nprocs=world, join=True)
    return [torch.load(Path(outdir) / f"sp{r}.pt", weights_only=False) for r in range(world)]
