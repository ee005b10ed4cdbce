"""``build_engine``: the one place a model is assembled with its fast paths, for every caller.

    eng = build_engine(get_preset("w14"), "cuda:0", FastPath(fp8_linears=True, compile=True), tp=info)

The order, and why (torchtitan's ``parallelize`` / gpt-fast's ``tp.py`` shape: a plain model, everything
else applied from outside):

1. **Resolve the fast path** for the device (``FastPath.resolve``: automatic options on for CUDA, off on the
   CPU; a note for each asked-for option that cannot apply) and fold what changes the model's shapes into
   the config: the decoder, the ring cache (forced by CUDA graphs: fixed addresses), FP8 K/V.
2. **Build on ``meta``, then allocate** on the device: no random initialisation of weights about to be
   overwritten, no full-size copy on the host.
3. **Load weights** (``cfg.model.weights``) or initialise randomly from ``seed``; the VAE / decoder load
   their own (``cfg.vae.weights``).
4. **Tensor parallelism** (``apply_tp`` over ``tp.group``): with random weights the model is sharded while
   still on ``meta`` and only this rank's shard is allocated (W57 does not fit a GPU whole); with a
   checkpoint the full weights load first and are sliced.
5. **FP8 linears** (``apply_fp8``, after TP: it quantises the shards each rank holds; all or nothing).
6. **Compile** (``apply_compile``: the per-block elementwise math, after the FP8 swap), then the **fused FP8
   producers** (``apply_fused_quant``, with FP8 linears, CUDA only: the norms / GELU before an FP8 linear emit
   its FP8 input, wrapping the compiled ops).
7. **Cache and graphs**: the session's cache follows the config (step 1); the engine owns a graph runner
   (capturing only steady-state shapes, after warm-up; a tensor-parallel group agrees on every capture).
8. **The Wan decoder's fast path** (``FastPath.decoder_fast``: channels-last, torch.compile, time-folded
   convs; ``cadence.runtime.vae_fast``) on the decode device's copy of the VAE; it compiles in the warm-up.

Any step that cannot apply falls back with one log line (``Engine.notes``, reported at ``/config``), never
a crash; a converter that fails raises with the model unchanged (no half-converted model is ever served).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from cadence.config import CadenceConfig, PipelineConfig, resolve_asset
from cadence.engine.engine import Engine
from cadence.engine.session import StreamGenerator
from cadence.engine.spec import FastPath

log = logging.getLogger("cadence.engine")


def choose_decoder(cfg: CadenceConfig, device: torch.device) -> str:
    """The automatic decoder (``FastPath.decoder`` None): the preset's own on the CPU; on CUDA the tiny
    streaming decoder when it has trained weights (``vae.taehv_weights``, or ``taehv.safetensors`` beside the
    VAE) or when nothing has weights (random-weight benchmarks: the fast one), else the Wan VAE the given
    weights are for (a random tiny decoder in front of real weights would draw noise)."""
    from pathlib import Path

    v = cfg.vae
    if device.type != "cuda":
        return v.decoder
    trained_tiny = bool(v.taehv_weights) or bool(
        v.weights and (Path(resolve_asset(v.weights)) / "taehv.safetensors").is_file()
    )
    if trained_tiny or not v.weights:
        return "taehv"
    return "wan"


def engine_config(cfg: CadenceConfig, fast: FastPath, device: torch.device | None = None) -> CadenceConfig:
    """``cfg`` with the shape-changing choices of a resolved ``fast`` folded in (decoder, ring cache, FP8 K/V)."""
    stream: dict = {}
    if fast.kv_fp8:
        stream.update(cache="ring", kv_fp8=True)
    if fast.graphs and cfg.stream.cache != "ring":
        stream["cache"] = "ring"  # graphs need the ring cache's fixed addresses
    if fast.attention != "auto":
        stream["attention"] = fast.attention  # the ring's kernel (cadence.kernels.attention_backends)
    if stream:
        cfg = cfg.with_overrides(stream=stream)
    decoder = fast.decoder or choose_decoder(cfg, device or torch.device("cpu"))
    if decoder != cfg.vae.decoder:
        cfg = cfg.with_overrides(vae={"decoder": decoder})
    return cfg


def clip_fast_path(cfg: CadenceConfig, fast: FastPath, notes: list[str]) -> FastPath:
    """A clip-based family (``cadence.engine.clip``: FlashTalk) has no K/V stream and decodes inside its step with
    the Wan VAE: the ring cache, FP8 K/V, CUDA graphs and another decoder do not apply (one note for those
    asked for or on by default; the model's own fast paths, FP8 linears and compile, still do). ``fast``
    unchanged for every other configuration."""
    from cadence.engine.clip import is_clip_family

    if not is_clip_family(cfg):
        return fast
    off = [n for n in ("graphs", "kv_fp8", "capture_filling") if getattr(fast, n)]
    if fast.decoder not in (None, "wan"):
        off.append(f"decoder {fast.decoder}")
    if fast.decoder_fast not in (None, "off"):
        off.append(f"decoder_fast {fast.decoder_fast}")
    if off:
        notes.append(
            f"{cfg.model.family}: {', '.join(off)} off (clips are bidirectional, no K/V cache; each clip is "
            "decoded and re-encoded by the Wan VAE inside its step)"
        )
    return dataclasses.replace(
        fast, graphs=False, kv_fp8=False, capture_filling=False, decoder="wan", decoder_fast="off"
    )


def build_model_for(
    cfg: CadenceConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    tp=None,
    comm: str = "auto",
    sequence_parallel: bool = False,
):
    """Steps 2-4: the model on ``device`` with its weights, sharded over ``tp.group`` when given (with
    ``sequence_parallel``: ``cadence.parallel.sp``). Returns ``(model, how)`` with how = 'meta' (sharded
    before allocation) or 'full'."""
    from cadence.model.dit import WanDiT
    from cadence.model.weights import build_model, init_random, load_weights

    weights = resolve_asset(cfg.model.weights) if cfg.model.weights else None
    sharded = tp is not None and tp.world_size > 1
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
        load_weights(model, weights)
    if sharded:
        from cadence.parallel import apply_tp

        apply_tp(model, tp.group, comm=comm, sequence_parallel=sequence_parallel)
    return model, "full"


def apply_decoder_fast(eng: Engine, mode: str | None, notes: list[str]) -> str:
    """Step 8: the full Wan decoder's fast path (``cadence.runtime.vae_fast``) on the decode device's copy of
    the VAE (built here, before any session, so the copy is made from plain modules). Returns what applied;
    appends a note when something asked for could not (the stand-in / tiny decoders have no fast path)."""
    mode = mode or "off"
    if mode == "off":
        return "off"
    vae = eng.gen.vae_on(eng.placement.decode_device)
    wan = getattr(vae, "wan", None)
    if wan is None or getattr(vae, "taehv", None) is not None:
        return f"off (decoder {eng.gen.cfg.vae.decoder} has none)"
    if torch.device(eng.placement.decode_device).type != "cuda" and mode in ("compile", "fold", "up", "fp8"):
        notes.append(f"decoder_fast: {mode} needs a CUDA decode device: channels-last only")
        mode = "cl"
    from cadence.runtime.vae_fast import accelerate_decoder

    return accelerate_decoder(wan, mode).describe()


def build_engine(
    cfg: CadenceConfig,
    device: str | torch.device = "cpu",
    fast: FastPath | None = None,
    tp=None,
    pipeline: PipelineConfig | None = None,
    seed: int = 0,
    graph_capture=None,
    on_chunk=None,
) -> Engine:
    """The engine for ``cfg`` on ``device`` with ``fast`` applied (see the module docstring for the order).

    ``tp``: this rank's ``cadence.parallel.TPInfo`` (a tensor-parallel group; every rank calls this with the
    same arguments). ``pipeline``: placement and queues (default: decode on the diffusion device, on its own
    stream / thread); its ``graphs`` and ``capture_filling`` follow ``fast``. ``graph_capture`` injects a
    capture function (tests). ``on_chunk``: deliver finished chunks to this callback (the worker process)."""
    t0 = time.monotonic()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fast, notes = (fast or FastPath()).resolve(str(device))
    fast = clip_fast_path(cfg, fast, notes)
    cfg = engine_config(cfg, fast, device)
    dtype = getattr(torch, fast.dtype)
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
    }
    sharded = tp is not None and tp.world_size > 1
    if fast.sequence_parallel and not sharded:
        notes.append("sequence_parallel: needs tensor parallelism (tp > 1): off")
    sp = bool(fast.sequence_parallel and sharded)
    model, how = build_model_for(cfg, device, dtype, seed, tp, fast.comm, sp)
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
    if applied["fp8_linears"]:  # after compile: the fused producers wrap the (compiled) elementwise ops
        from cadence.runtime.compile import apply_fused_quant

        applied["fused_quant"] = apply_fused_quant(model).describe()
    gen = StreamGenerator(cfg, model)
    base = pipeline or PipelineConfig(diffusion_devices=(str(device),), decode_device="same")
    pcfg = dataclasses.replace(base, graphs=bool(fast.graphs), capture_filling=bool(fast.capture_filling))
    eng = Engine(gen, pcfg, graph_capture=graph_capture, applied=applied, tp=tp, on_chunk=on_chunk)
    eng.applied["decoder_fast"] = apply_decoder_fast(eng, fast.decoder_fast, notes)
    for n in notes:
        eng._note(n)
    eng.build_ms = (time.monotonic() - t0) * 1e3
    return eng
