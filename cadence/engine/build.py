"""``build_engine``: the one place a model is assembled with its fast paths, for every caller.

    recipe = resolve(EngineSpec(model="w14", fast=FastPath(compile=True)), "cuda:0")   # cadence.engine.recipe
    eng = build_engine(recipe, tp=info)              # or build_engine(cfg, "cuda:0", FastPath(...)): the same,
                                                     # through recipe_for(cfg, ...)

The order, and why (torchtitan's ``parallelize`` / gpt-fast's ``tp.py`` shape: a plain model, everything
else applied from outside):

1. **The recipe** (``cadence.engine.recipe``): the fast path resolved for the device and the family's rules,
   the shape-changing choices (decoder, ring cache, FP8 K/V, weights entry) folded into the config. Nothing
   is decided here any more: this module builds what the recipe says.
2. **Build on ``meta``, then allocate** on the device: no random initialisation of weights about to be
   overwritten, no full-size copy on the host. A family with a transformer of its own (its registry entry's
   ``builder``: FlashHead) is built by the function the entry names, from its own folder.
3. **Load weights** (``cfg.model.weights``, the recipe's entry of a family's file) or initialise randomly from
   the recipe's seed; the VAE / decoder load their own (``cfg.vae.weights``).
4. **Tensor parallelism** (``apply_tp`` over ``tp.group``): with random weights the model is sharded while
   still on ``meta`` and only this rank's shard is allocated (W57 does not fit a GPU whole); with a
   checkpoint the full weights load first and are sliced.
5. **FP8 linears** (``apply_fp8``, after TP: it quantises the shards each rank holds; all or nothing).
6. **Compile** (``apply_compile``: the per-block elementwise math, after the FP8 swap), then, with
   ``FastPath.fused_quant``, the **fused FP8 producers** (``apply_fused_quant``, with FP8 linears, CUDA only: the
   norms / GELU before an FP8 linear emit its FP8 input, wrapping the compiled ops).
7. **Cache, session and graphs**: the session type and its policies follow the recipe's rules
   (``cadence.engine.session.session_type``), its cache the config; the engine owns a graph runner
   (capturing only steady-state shapes, after warm-up; a tensor-parallel group agrees on every capture).
8. **The decoder's fast path** (``FastPath.decoder_fast``: channels-last, torch.compile, time-folded
   convs; ``cadence.runtime.vae_fast``; a decoder with its own, the LTX-Video VAE's: ``accelerate``) on the
   decode device's copy of the VAE; it compiles in the warm-up.

Any step that cannot apply falls back with one log line (``Engine.notes``, reported at ``/config``), never
a crash; a converter that fails raises with the model unchanged (no half-converted model is ever served).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time

import torch

from cadence.config import CadenceConfig, PipelineConfig, resolve_asset
from cadence.engine.engine import Engine
from cadence.engine.recipe import EngineRecipe, recipe_for
from cadence.engine.session import StreamGenerator
from cadence.engine.spec import FastPath
from cadence.errors import ConfigError

log = logging.getLogger("cadence.engine")


def build_model_for(
    cfg: CadenceConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    tp=None,
    comm: str = "auto",
    sequence_parallel: bool = False,
    family=None,
):
    """Steps 2-4: the model on ``device`` with its weights (read as the registry entry ``family`` says: the
    recipe's ``entry``), sharded over ``tp.group`` when given (with ``sequence_parallel``:
    ``cadence.parallel.sp``). Returns ``(model, how)`` with how = 'meta' (sharded before allocation) or 'full'."""
    from cadence.model.dit import WanDiT
    from cadence.model.weights import build_model, init_random, load_weights

    weights = resolve_asset(cfg.model.weights) if cfg.model.weights else None
    sharded = tp is not None and tp.world_size > 1
    builder = getattr(family, "builder", None)
    if builder is not None:  # a transformer of the family's own, from its own folder (the registry entry's)
        if sharded:
            raise ConfigError(f"model family {family.name!r} runs on one GPU (no tensor parallelism)")
        return _load_ref(builder.build)(builder, cfg, device, dtype, seed), "full"
    if sharded and weights is None:
        from cadence.parallel import apply_tp

        try:
            with torch.device("meta"):
                model = WanDiT(cfg, device="meta", dtype=dtype)
            apply_tp(model, tp.group, comm=comm, sequence_parallel=sequence_parallel)
            model = model.to_empty(device=device)
            model.rope.to(device)
            init_random(model, seed)
            return model.eval().requires_grad_(False), "meta"
        except (NotImplementedError, RuntimeError, TypeError) as e:
            log.warning("sharding on meta failed (%s): building the full model first", e)
    model = build_model(cfg, device, dtype, seed=None if weights else seed)
    if weights:
        load_weights(model, weights, family=family)
    if sharded:
        from cadence.parallel import apply_tp

        apply_tp(model, tp.group, comm=comm, sequence_parallel=sequence_parallel)
    return model, "full"


def _load_ref(where: str):
    """The object ``"module:name"`` names (a registry entry's builder function)."""
    module, _, name = where.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"no builder {where!r} ({e})") from None


def apply_decoder_fast(eng: Engine, mode: str | None, notes: list[str]) -> str:
    """Step 8: the full Wan decoder's fast path (``cadence.runtime.vae_fast``) on the decode device's copy of
    the VAE (built here, before any session, so the copy is made from plain modules). Returns what applied;
    appends a note when something asked for could not (the stand-in / tiny decoders have no fast path)."""
    mode = mode or "off"
    if mode == "off":
        return "off"
    vae = eng.gen.vae_on(eng.placement.decode_device)
    accelerate = getattr(vae, "accelerate", None)
    if accelerate is not None:  # a decoder with fast paths of its own (the LTX-Video VAE: cadence.engine.ltx)
        return accelerate(mode, notes)
    wan = getattr(vae, "wan", None)
    if wan is None or getattr(vae, "taehv", None) is not None:
        return f"off (decoder {eng.gen.cfg.vae.decoder} has none)"
    if torch.device(eng.placement.decode_device).type != "cuda" and mode in ("compile", "fold", "up", "fp8"):
        notes.append(f"decoder_fast: {mode} needs a CUDA decode device: channels-last only")
        mode = "cl"
    from cadence.runtime.vae_fast import accelerate_decoder

    return accelerate_decoder(wan, mode).describe()


def build_engine(
    what: EngineRecipe | CadenceConfig,
    device: str | torch.device | None = None,
    fast: FastPath | None = None,
    tp=None,
    pipeline: PipelineConfig | None = None,
    seed: int | None = None,
    graph_capture=None,
    on_chunk=None,
) -> Engine:
    """The engine a recipe describes (see the module docstring for the order); or, given a configuration, the
    one ``recipe_for(cfg, device, fast)`` describes (``seed``: its random-weight seed, default 0).

    ``device``: this rank's device (default: the recipe's first). ``tp``: this rank's ``cadence.parallel.TPInfo``
    (a tensor-parallel group; every rank calls this with the same arguments). ``pipeline``: placement and
    queues (default: decode where the recipe says, on its own stream / thread); its ``graphs``,
    ``capture_filling`` and (when 0) ``prewarm_chunks`` follow the recipe. ``graph_capture`` injects a capture
    function (tests). ``on_chunk``: deliver finished chunks to this callback (the worker process)."""
    t0 = time.monotonic()
    if isinstance(what, EngineRecipe):
        recipe = what
        device = torch.device(device if device is not None else recipe.devices[0])
    else:
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        tp_n = tp.world_size if tp is not None else 1
        recipe = recipe_for(what, str(device), fast, tp=tp_n, seed=0 if seed is None else seed)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    eng = _assemble(recipe, device, tp, pipeline, graph_capture, on_chunk)
    eng.build_ms = (time.monotonic() - t0) * 1e3
    return eng


def _assemble(recipe: EngineRecipe, device: torch.device, tp, pipeline, graph_capture, on_chunk) -> Engine:
    """Steps 2-8 for ``recipe`` on ``device``."""
    cfg, fast = recipe.config, recipe.fast
    notes = list(recipe.notes)
    dtype = getattr(torch, fast.dtype)
    if device.type == "cuda":  # compiled kernels kept across restarts, in one per-user folder
        from cadence.engine.startup import use_compile_cache

        use_compile_cache()
    if device.type == "cpu" and fast.threads:
        torch.set_num_threads(fast.threads)
    applied: dict = {
        "decoder": cfg.vae.decoder,
        "cache": cfg.stream.cache,
        "kv_fp8": cfg.stream.kv_fp8,
        "dtype": fast.dtype,
        "fp8_linears": 0,
        "graphs": bool(fast.graphs),
        "tp": 1,
        "compile": "off",
        "capture_filling": bool(fast.capture_filling),
        "weights_entry": recipe.weights_entry,
    }
    sharded = tp is not None and tp.world_size > 1
    if fast.sequence_parallel and not sharded:
        notes.append("sequence_parallel: needs tensor parallelism (tp > 1): off")
    sp = bool(fast.sequence_parallel and sharded)
    model, how = build_model_for(cfg, device, dtype, recipe.seed, tp, fast.comm, sp, family=recipe.entry)
    if sharded:
        applied.update(tp=tp.world_size, comm=fast.comm, tp_build=how, sequence_parallel=sp)
        if graph_capture is None and device.type == "cuda":
            from cadence.parallel.graphs import agreeing_capture

            graph_capture = agreeing_capture(tp.group)  # every rank captures a step, or none does
    if fast.fp8_linears:
        from cadence.quant.fp8 import apply_fp8

        try:
            applied["fp8_linears"] = apply_fp8(model, gemm=fast.gemm)
        except Exception as e:  # all or nothing: the plain linears stay
            notes.append(f"fp8_linears: could not apply ({type(e).__name__}: {e}): plain linears")
    if fast.compile:
        from cadence.runtime.compile import apply_compile

        rep = apply_compile(model)
        applied["compile"] = rep.describe()
        if not rep.enabled:
            notes.append(f"compile: {rep.describe()}")
    if applied["fp8_linears"] and fast.fused_quant:  # after compile: they wrap the (compiled) elementwise ops
        from cadence.runtime.compile import apply_fused_quant

        applied["fused_quant"] = apply_fused_quant(model).describe()
    gen = StreamGenerator(cfg, model, recipe.rules)
    decode = "same" if tp is not None and tp.world_size > 1 else recipe.decode_device
    base = pipeline or PipelineConfig(diffusion_devices=(str(device),), decode_device=decode)
    pcfg = dataclasses.replace(
        base,
        graphs=bool(fast.graphs),
        capture_filling=bool(fast.capture_filling),
        prewarm_chunks=base.prewarm_chunks or recipe.warmup_chunks,
    )
    eng = Engine(gen, pcfg, graph_capture=graph_capture, applied=applied, tp=tp, on_chunk=on_chunk)
    eng.recipe = recipe
    eng.applied["decoder_fast"] = apply_decoder_fast(eng, fast.decoder_fast, notes)
    for n in notes:
        eng._note(n)
    return eng
