"""Compiled elementwise ops (cadence.runtime.compile) against the plain PyTorch reference.

Tolerances: the compiled kernels compute the same float32 math but reduce in a different order
(LayerNorm / RMS statistics over the feature dim) and may contract multiply-adds, so single ops
agree to ~1e-6 relative in float32; through the tiny model and 5 chunks x 4 passes of sampling the
latents agree to 1e-4 relative (the sampler amplifies nothing: each step is a convex update).
In bfloat16 the compiled op rounds once at the end where the reference rounds at the same point,
so results agree to one bf16 ulp (2^-8 relative) on a small share of elements.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from streams import engine_stream

from cadence.config import get_preset
from cadence.engine.session import StreamGenerator
from cadence.model import layers as L
from cadence.model.weights import build_model
from cadence.runtime.compile import _compiler_problem, apply_compile, remove_compile

CPU = torch.device("cpu")
HAVE_INDUCTOR = _compiler_problem(CPU) is None
backends = ["aot_eager"] + (["inductor"] if HAVE_INDUCTOR else [])


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def op_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 96, 64, generator=g) * 3 + 1).to(dtype)
    y = torch.randn(1, 96, 64, generator=g).to(dtype)
    shift, scale, gate = (torch.randn(1, 1, 64, generator=g) for _ in range(3))
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    return x, y, shift, scale, gate, w, b


@pytest.mark.parametrize("backend", backends)
def test_ops_match_reference(backend):
    rep = apply_compile(torch.nn.Linear(2, 2), backend=backend)  # a model without blocks: nothing swapped
    assert rep.enabled and rep.blocks == 0
    from cadence.runtime.compile import FusedOps

    ops = FusedOps(backend)
    x, y, shift, scale, gate, w, b = op_inputs(torch.float32)
    pairs = [
        (ops.norm_modulate(x, shift, scale, 1e-6), L.norm_modulate(x, shift, scale, 1e-6)),
        (ops.layer_norm_cast(x, w, b, 1e-6), L.layer_norm_cast(x, w, b, 1e-6)),
        (ops.gate_residual(x, y, gate), L.gate_residual(x, y, gate)),
        (ops.rms_norm(x, w, 1e-6), L.rms_norm(x, w, 1e-6)),
        # the sharded norm's halves, as one rank of two sees them (its 32 of 64 channels, the full sum)
        (ops.sum_squares(x[..., :32]), L.sum_squares(x[..., :32])),
        (ops.sum_squares_pair(x[..., :32], y[..., 32:]), L.sum_squares_pair(x[..., :32], y[..., 32:])),
        (ops.rms_scale(x[..., :32], L.sum_squares(x), w[:32], 64, 1e-6), L.rms_norm(x, w, 1e-6)[..., :32]),
    ]
    # a residual add with the norm after it (one op: one compiled kernel), both results against the reference
    for name, args in (
        ("gate_residual_layer_norm", (x, y, gate, w, b, 1e-6)),
        ("add_layer_norm", (x, y, w, b, 1e-6)),
        ("add_norm_modulate", (x, y, shift, scale, 1e-6)),
    ):
        pairs += list(zip(getattr(ops, name)(*args), getattr(L, name)(*args)))
    for got, ref in pairs:
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel(got, ref) < 1e-6
    assert all(not s.startswith("failed") for s in ops.status().values()), ops.status()
    xb, yb = x.bfloat16(), y.bfloat16()
    got, ref = ops.norm_modulate(xb, shift, scale, 1e-6), L.norm_modulate(xb, shift, scale, 1e-6)
    assert got.dtype == torch.bfloat16
    ulp = ((got.float() - ref.float()).abs() > ref.float().abs() * 2**-8 + 1e-6).float().mean().item()
    assert ulp == 0.0
    assert (ops.gate_residual(xb, yb, gate).float() - L.gate_residual(xb, yb, gate).float()).abs().max() <= (
        L.gate_residual(xb, yb, gate).float().abs().max() * 2**-8
    )
    # bf16: the new residual is the reference's rounding of the same sum (the plain add rounds x + y once; the
    # gated one rounds x + y * gate once, as gate_residual does); the norm of it within one bf16 unit
    for name, args in (
        ("gate_residual_layer_norm", (xb, yb, gate, w, b, 1e-6)),
        ("add_layer_norm", (xb, yb, w, b, 1e-6)),
        ("add_norm_modulate", (xb, yb, shift, scale, 1e-6)),
    ):
        (gx, gh), (rx, rh) = getattr(ops, name)(*args), getattr(L, name)(*args)
        assert gx.dtype == gh.dtype == torch.bfloat16
        assert (gx.float() - rx.float()).abs().max() <= rx.float().abs().max() * 2**-8, name
        assert ((gh.float() - rh.float()).abs() <= rh.float().abs() * 2**-7 + 1e-3).all(), name


@pytest.mark.parametrize("backend", backends)
def test_pairs_split_into_their_halves(monkeypatch, backend):
    """CADENCE_COMPILE_PAIRS=0 (the kernels before the pairs were one op): each pair runs its two compiled halves
    (the plain add eager); the same values as the one-function pair within the single ops' tolerance."""
    from cadence.runtime.compile import PAIRS, FusedOps

    monkeypatch.setenv("CADENCE_COMPILE_PAIRS", "0")
    split, one = FusedOps(backend), FusedOps(backend, pairs=True)
    assert not split.pairs and one.pairs
    x, y, shift, scale, gate, w, b = op_inputs(torch.float32)
    args = {
        "gate_residual_layer_norm": (x, y, gate, w, b, 1e-6),
        "add_layer_norm": (x, y, w, b, 1e-6),
        "add_norm_modulate": (x, y, shift, scale, 1e-6),
    }
    assert set(args) == set(PAIRS)
    for name, a in args.items():
        for got, want, ref in zip(getattr(split, name)(*a), getattr(one, name)(*a), getattr(L, name)(*a)):
            assert rel(got, ref) < 1e-6 and rel(want, ref) < 1e-6
    st = split.status()
    assert all(st[n] == "split (1 calls)" for n in PAIRS), st
    assert st["layer_norm_cast"] == "compiled (2 calls)" and st["gate_residual"] == "compiled (1 calls)"


def stream(gen, n=5):
    cfg = gen.cfg
    g = torch.Generator().manual_seed(0)
    img = torch.rand(3, cfg.stream.height, cfg.stream.width, generator=g) * 2 - 1
    t = torch.arange(n * cfg.audio_samples_per_chunk) / 48_000
    audio = 0.3 * torch.sin(2 * math.pi * 220 * t)
    return [o.latents for o in engine_stream(gen, img, "a person talking", audio, n, seed=0)]


@pytest.mark.parametrize("backend", backends)
def test_model_stream_matches_reference(backend):
    cfg = get_preset("tiny")
    gen = StreamGenerator(cfg, build_model(cfg, "cpu", torch.float32, seed=0))
    with torch.no_grad():
        ref = stream(gen)
        rep = apply_compile(gen.model, backend=backend)
        assert rep.enabled and rep.blocks == cfg.model.num_layers
        assert rep.norms == 2 * 2 * cfg.model.num_layers + sum(
            2 for i in range(cfg.model.num_layers) if cfg.model.has_audio(i)
        )
        got = stream(gen)
    st = rep.status()
    sharded = (
        "sum_squares",
        "sum_squares_pair",
        "rms_scale",
        "apply_rope",
        "layer_norm_cast",
    )  # only TP-sharded norms call the first three (test_tp.py); the RoPE only forward_full (test_step_reuse.py);
    # a Wan block's affine norms come with their residual add (gate_residual_layer_norm, add_layer_norm)
    assert all(
        v.startswith("compiled") and not v.startswith("compiled (0")
        for k, v in st.items()
        if k not in sharded
    ), st
    assert all(st[k] == "compiled (0 calls)" for k in sharded), st
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-4
    remove_compile(gen.model)
    assert all(blk.ops is L.PLAIN_OPS for blk in gen.model.blocks)


def test_failure_falls_back_with_one_log_line(caplog):
    from cadence.runtime.compile import _FusedOp

    calls = []

    def plain(x):
        calls.append(1)
        return x + 1

    op = _FusedOp("plain", plain, "aot_eager")
    op.compiled = lambda x: (_ for _ in ()).throw(RuntimeError("compiler exploded\nsecond line"))
    with caplog.at_level(logging.WARNING, logger="cadence.compile"):
        assert op(torch.ones(2)).tolist() == [2.0, 2.0]
        assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    assert op.failed.startswith("RuntimeError: compiler exploded")
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
    assert len(calls) == 2


def test_off_switch(monkeypatch):
    monkeypatch.setenv("CADENCE_COMPILE", "0")
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    rep = apply_compile(model)
    assert not rep.enabled and "CADENCE_COMPILE=0" in rep.describe()
    assert all(blk.ops is L.PLAIN_OPS for blk in model.blocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_ops_and_graph_capture():
    """On the GPU: inductor's Triton kernels against the plain ops in bf16 (one bf16 ulp), then the
    compiled op inside a CUDA graph (compiled on a warm-up call, captured, replayed on new data)."""
    from cadence.runtime.compile import FusedOps

    ops = FusedOps("inductor")
    dev = torch.device("cuda")
    x, y, shift, scale, gate, w, b = (t.to(dev) for t in op_inputs(torch.bfloat16))
    for name, args in (
        ("norm_modulate", (x, shift, scale, 1e-6)),
        ("layer_norm_cast", (x, w, b, 1e-6)),
        ("gate_residual", (x, y, gate)),
        ("rms_norm", (x, w.bfloat16(), 1e-6)),
        ("gate_residual_layer_norm", (x, y, gate, w, b, 1e-6)),
        ("add_layer_norm", (x, y, w, b, 1e-6)),
        ("add_norm_modulate", (x, y, shift, scale, 1e-6)),
    ):
        got, ref = getattr(ops, name)(*args), getattr(L, name)(*args)
        for g, r in zip(got, ref) if isinstance(ref, tuple) else [(got, ref)]:
            assert g.dtype == r.dtype == torch.bfloat16
            tol = r.float().abs() * 2**-7 + 1e-3
            assert ((g.float() - r.float()).abs() <= tol).all(), name
    assert all(not s.startswith("failed") for s in ops.status().values()), ops.status()
    static = x.clone()
    out = ops.norm_modulate(static, shift, scale, 1e-6)  # warm-up (already compiled for this shape)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = ops.norm_modulate(static, shift, scale, 1e-6)
    torch.cuda.current_stream().wait_stream(s)
    static.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    ref = L.norm_modulate(y, shift, scale, 1e-6)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-3).all()


def test_a_compile_on_one_thread_never_meets_a_compiled_call_on_another():
    """The engine's diffusion and decode threads both run compiled code; while one compiles, torch's
    process-wide tracing state makes a compiled call on the other raise (seen on an H200: the norm regions
    fell back to plain PyTorch for a whole W14 run). Simulated here: a fake compile (the first call at a
    signature) holds a process-wide flag for 50 ms, and a compiled function called while it is up raises,
    as torch's does. Through the gate no call ever sees it, and neither op falls back; without the gate the
    same schedule raises (checked first, so this test can fail)."""
    import threading
    import time

    from cadence.runtime.compile import COMPILE_GATE, _FusedOp

    tracing = {"on": False}

    def fake_compiled(seen_shapes: set):
        def fn(x):
            if tracing["on"] and threading.get_ident() != tracing.get("by"):
                raise RuntimeError(
                    "Detected that you are using FX to symbolically trace a dynamo-optimized function"
                )
            if tuple(x.shape) not in seen_shapes:  # a compile: the flag is up meanwhile
                tracing.update(on=True, by=threading.get_ident())
                time.sleep(0.05)
                seen_shapes.add(tuple(x.shape))
                tracing["on"] = False
            return x * 2

        return fn

    def schedule(call_a, call_b) -> list[str]:
        errors: list[str] = []
        call_b(torch.ones(3))  # b is compiled for its shape before a starts

        def runner():
            try:
                for _ in range(200):
                    call_b(torch.ones(3))
                    time.sleep(0.001)
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=runner)
        t.start()
        for n in range(4, 8):  # a compiles four shapes while b runs
            call_a(torch.ones(n))
        t.join()
        return errors

    # without the gate: the compiled function called bare
    assert schedule(fake_compiled(set()), fake_compiled(set())), (
        "the simulation should raise without the gate"
    )

    a = _FusedOp("rms_norm", lambda x: x * 2, "aot_eager")
    b = _FusedOp("sum_squares", lambda x: x * 2, "aot_eager")
    a.compiled, b.compiled = fake_compiled(set()), fake_compiled(set())
    assert schedule(a, b) == []
    assert a.failed is None and b.failed is None
    assert a.calls == 4 and b.calls == 201
    assert len(a.seen) == 4 and len(b.seen) == 1
    # the gate is reentrant on one thread and free again afterwards
    with COMPILE_GATE.running(), COMPILE_GATE.compiling(), COMPILE_GATE.running():
        pass
    assert COMPILE_GATE._writer is None and not COMPILE_GATE._readers


def test_gate_reruns_a_call_that_met_a_compile_its_signature_missed():
    """The gate's signature is a guess at the compiler's guards; when it misses one, a call taken as
    compiled compiles on one thread while another runs, and the other meets torch's tracing error. That
    call is run again alone (after ``restore``), the op stays compiled, and the collision is counted; any
    other error still propagates (a real failure: the op falls back)."""
    from cadence.runtime.compile import COMPILE_GATE, _FusedOp, traced_elsewhere

    msg = "Detected that you are using FX to symbolically trace a dynamo-optimized function"
    assert traced_elsewhere(RuntimeError(msg)) and not traced_elsewhere(RuntimeError("shape mismatch"))
    state = {"raise": 0, "restored": 0, "alone": []}

    def compiled(x):
        state["alone"].append(COMPILE_GATE._writer is not None)
        if state["raise"]:
            state["raise"] -= 1
            raise RuntimeError(msg)
        return x + 1

    op = _FusedOp("rms_norm", lambda x: x + 1, "aot_eager")
    op.compiled = compiled
    before = COMPILE_GATE.collisions
    x = torch.zeros(2)
    assert torch.equal(op(x), x + 1)  # first call: a new signature, alone
    state["raise"] = 1
    assert torch.equal(op(x), x + 1)  # seen: runs shared, meets the error, reruns alone
    assert op.failed is None and op.calls == 2
    assert COMPILE_GATE.collisions == before + 1
    assert state["alone"] == [True, False, True]
    # restore runs before the rerun
    seen = {("k",)}
    state["raise"] = 1
    out = COMPILE_GATE.call(seen, ("k",), compiled, x, restore=lambda: state.update(restored=1))
    assert torch.equal(out, x + 1) and state["restored"] == 1
    # a different error is the op's own failure: plain from now on
    op.compiled = lambda x: (_ for _ in ()).throw(RuntimeError("inductor: unsupported"))
    assert torch.equal(op(x), x + 1) and op.failed is not None
