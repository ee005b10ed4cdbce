"""Fused elementwise math for a built model: ``torch.compile`` of the per-block regions between GEMMs.

    from cadence.runtime.compile import apply_compile
    report = apply_compile(model)          # after apply_fp8 / apply_tp, before the first step
    print(report.describe())

What gets fused. Between its GEMM and attention calls, a block runs a handful of elementwise
sequences (:class:`cadence.model.layers.ElementwiseOps`): the adaLN ``LayerNorm * (1 + scale) + shift``
before the self-attention and the FFN, the float32 ``x + y * gate`` residuals after them, the affine
LayerNorm before the cross / audio attention, and the q/k RMS norms (under tensor parallelism the
sharded norm's local sum of squares and its scaling, on either side of the sum's all-reduce).
Eagerly each of these is 4-8 kernels that read and write full float32 copies of the [tokens, dim] activations; compiled, each is
one or two Triton kernels that read bf16 and write bf16 once. The GEMMs, the attention kernels, the
cache and the collectives stay exactly as they are (they are not traced: only these pure tensor
functions are compiled, so FP8 linears, tensor parallelism, the ring cache and CUDA graphs compose
with it unchanged).

One compiled function per op serves every layer (same code, same shapes); a new token count
(first chunk, prompt length, resolution) compiles once more (``dynamic=False``: static shapes give
the best kernels; the few shapes a stream uses are bounded by ``recompile_limit``). Compilation
happens on the first call of a shape, which is an eager warm-up step under the graph runner,
never inside a CUDA-graph capture.

The whole-sequence RoPE (``forward_full``'s, ``WanDiT.ops.apply_rope``) compiles the same products written as
real float32 arithmetic (:data:`COMPILED_FORM`): one pass over q / k instead of the complex reference's three;
``CADENCE_COMPILE_ROPE=0`` keeps the reference. Each residual add and the norm after it (``ElementwiseOps``'
pairs) compile as one function, one kernel; ``CADENCE_COMPILE_PAIRS=0`` runs their halves (:data:`PAIRS`).

Fallback: when compilation cannot run (no Triton for CUDA tensors, no C++ compiler for CPU
tensors, or the compiler raises on a shape), that op falls back to the plain function with one log
line; the stream never fails because of this module. ``CADENCE_COMPILE=0`` turns it off.

Reference: the plain functions in ``cadence.model.layers``; tests/test_compile.py checks parity.

FP8 from the producers (:func:`apply_fused_quant`, after this and after ``apply_fp8``): where the ops'
outputs feed FP8 linears only (the adaLN norm + modulation before qkv / fc1, the affine LayerNorm before the
cross / audio q, the FFN's GELU before an FP8 fc2), a block's ops hand the linear a
``QuantizedActivation`` made in the same launch (``cadence.kernels.quant``'s fused kernels, or the
references under Inductor), so the linear runs no quantisation of its own; a producer that fails logs one
line and the block runs the plain op + the separate quantisation. tests/test_fused_quant.py checks parity.

Threads (:data:`COMPILE_GATE`): the engine diffuses on one thread and decodes on another, and both may run
compiled code (these ops; the Wan decoder's ``cadence.runtime.vae_fast``). While one thread compiles, torch
sets process-wide tracing state, and a compiled function called from the other thread then raises
("Detected that you are using FX to symbolically trace a dynamo-optimized function"): on an H200 (torch
2.11) a W14 pipeline's norm regions fell back to plain PyTorch for the whole run that way while the decoder
compiled (docs/perf/pipeline/NOTES.md). So a call that may compile (the first at its input signature) holds
the gate alone, and calls of what is compiled share it. The signature is a guess at the compiler's guards
(shapes, strides, dtypes, devices, plain values): when it misses one, a call taken as already compiled
compiles while others run, and a call on another thread meets the tracing state anyway (an H200 W1.3-size
stream with bf16 K/V, session 10). That error is recognised as another thread's compile, not a failure of
the op: the call is run again alone (:meth:`CompileGate.call`, ``restore`` puts back what the failed
attempt may have changed), and the op stays compiled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from cadence.model import layers as L
from cadence.model.dit import Block, WanDiT
from cadence.model.rope import apply_rope_real as rope_real

log = logging.getLogger("cadence.compile")

OPS = (
    "rms_norm",
    "sum_squares",
    "sum_squares_pair",
    "rms_scale",
    "norm_modulate",
    "layer_norm_cast",
    "gate_residual",
    "gate_residual_layer_norm",
    "add_layer_norm",
    "add_norm_modulate",
    "apply_rope",
)

#: Ops whose compiled form starts from another function than the plain reference (the same math written so that
#: Inductor fuses it): the whole-sequence RoPE's complex product as real float32 arithmetic.
COMPILED_FORM = {"apply_rope": rope_real}


def _compiler_problem(device: torch.device) -> str | None:
    """Why inductor cannot compile for `device` here (None = it can)."""
    if os.environ.get("CADENCE_COMPILE", "1") == "0":
        return "CADENCE_COMPILE=0"
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None
    if device.type == "cpu":
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None and shutil.which("c++") is None and shutil.which("clang++") is None:
            return "no C++ compiler for inductor's CPU code"
        return None
    return f"no inductor backend for device type {device.type!r}"


class CompileGate:
    """A readers-writer gate for compiled callables shared by threads: ``compiling()`` (a call that may
    compile) waits until no other thread is inside the gate and keeps it alone; ``running()`` (a call of
    already compiled code) waits while another thread compiles, and runs alongside other runners. Reentrant
    per thread (a runner may compile; a compiler may run)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writer: int | None = None  # thread compiling
        self._depth = 0  # its nesting
        self._readers: dict[int, int] = {}  # thread -> nesting of running() calls
        self.collisions = 0  # runners that met another thread's compile and ran again alone

    @contextlib.contextmanager
    def compiling(self):
        me = threading.get_ident()
        with self._cond:
            while (self._writer not in (None, me)) or any(t != me for t in self._readers):
                self._cond.wait()
            self._writer, self._depth = me, self._depth + 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._writer = None
                self._cond.notify_all()

    @contextlib.contextmanager
    def running(self):
        me = threading.get_ident()
        with self._cond:
            while self._writer not in (None, me):
                self._cond.wait()
            self._readers[me] = self._readers.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                n = self._readers.pop(me) - 1
                if n:
                    self._readers[me] = n
                self._cond.notify_all()

    def call(self, seen: set, key, fn, *args, restore=None):
        """``fn(*args)`` alone when ``key`` (the input signature) is new to ``seen`` (it may compile), else
        alongside other runners. A runner that meets another thread's compile (:func:`traced_elsewhere`)
        is run again alone, after ``restore()`` when given."""
        if key in seen:
            try:
                with self.running():
                    return fn(*args)
            except RuntimeError as e:
                if not traced_elsewhere(e):
                    raise
                self.collisions += 1
                log.info(
                    "compiled call met another thread's compile (a guard the signature misses): rerun alone"
                )
                if restore is not None:
                    restore()
        with self.compiling():
            out = fn(*args)
        seen.add(key)
        return out


#: The process's one gate (every compiled callable of the engine's threads goes through it).
COMPILE_GATE = CompileGate()


def traced_elsewhere(e: BaseException) -> bool:
    """True for the error torch raises when a compiled function is called while a compile (on any thread:
    the FX tracing flag is process-wide) is under way."""
    return isinstance(e, RuntimeError) and "symbolically trace a dynamo-optimized function" in str(e)


def input_signature(*args) -> tuple:
    """What a static-shape compile keys on, roughly: each tensor's shape, strides, dtype and device, other
    values as they are (a new signature is a call that may compile)."""
    return tuple(_signature_of(a) for a in args)


def _signature_of(a):
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.stride(), a.dtype, a.device.type)
    if isinstance(a, (list, tuple)):
        return tuple(_signature_of(x) for x in a)
    try:
        hash(a)
    except TypeError:
        return type(a).__name__
    return a


class _FusedOp:
    """A compiled op with its plain reference; the first failure logs one line and switches to plain.
    ``form``: the function compiled when it is not ``plain`` itself (:data:`COMPILED_FORM`)."""

    def __init__(self, name: str, plain, backend: str, form=None):
        self.name, self.plain = name, plain
        self.compiled = torch.compile(form or plain, backend=backend, dynamic=False, fullgraph=True)
        self.failed: str | None = None
        self.calls = 0
        self.seen: set = set()  # input signatures compiled (COMPILE_GATE)

    def __call__(self, *args):
        if self.failed is not None:
            return self.plain(*args)
        try:
            out = COMPILE_GATE.call(self.seen, input_signature(*args), self.compiled, *args)
        except Exception as e:  # compiler missing / a shape it rejects: plain from now on
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning(
                "compiled %s failed (%s); using the plain PyTorch function from now on",
                self.name,
                self.failed,
            )
            return self.plain(*args)
        self.calls += 1
        return out


#: The residual add + norm ops (``ElementwiseOps``' pairs) and their halves: the add (None: the plain ``x + y`` in
#: x's dtype) and the norm op.
PAIRS = {
    "gate_residual_layer_norm": ("gate_residual", "layer_norm_cast"),
    "add_layer_norm": (None, "layer_norm_cast"),
    "add_norm_modulate": (None, "norm_modulate"),
}


def pairs_fused() -> bool:
    """``CADENCE_COMPILE_PAIRS`` (default 1): each residual add + norm pair compiled as one function (one kernel);
    0: as its two halves, each compiled apart, the plain add eager (the kernels before the pairs were one op)."""
    return os.environ.get("CADENCE_COMPILE_PAIRS", "1") != "0"


class _SplitPair:
    """A pair op run as its two halves (``CADENCE_COMPILE_PAIRS=0``): the reference's kernel sequence."""

    def __init__(self, add, norm):
        self.add, self.norm = add, norm
        self.calls = 0
        self.failed = None

    def __call__(self, x, y, *rest):
        self.calls += 1
        if self.add is None:
            x = x + y
        else:
            x, rest = self.add(x, y, rest[0]), rest[1:]
        return x, self.norm(x, *rest)


class FusedOps(L.ElementwiseOps):
    """:class:`~cadence.model.layers.ElementwiseOps` with every op compiled (one instance per model); the pair
    ops as one compiled function each, or (``pairs`` False, default :func:`pairs_fused`) as their halves."""

    def __init__(self, backend: str = "inductor", pairs: bool | None = None):
        self.pairs = pairs_fused() if pairs is None else pairs
        for name in OPS:
            if name in PAIRS and not self.pairs:
                continue
            setattr(self, name, _FusedOp(name, getattr(L, name), backend, COMPILED_FORM.get(name)))
        if not self.pairs:
            for name, (add, norm) in PAIRS.items():
                setattr(self, name, _SplitPair(getattr(self, add) if add else None, getattr(self, norm)))

    def status(self) -> dict:
        out = {}
        for name in OPS:
            op = getattr(self, name)
            if isinstance(op, _SplitPair):
                out[name] = f"split ({op.calls} calls)"
            else:
                out[name] = ("failed: " + op.failed) if op.failed else f"compiled ({op.calls} calls)"
        return out


@dataclass
class CompileReport:
    enabled: bool
    reason: str = ""
    blocks: int = 0
    norms: int = 0
    backend: str = ""
    models: int = 0  # models whose whole-sequence RoPE (WanDiT.ops.apply_rope) is compiled
    ops: FusedOps | None = field(default=None, repr=False)

    def describe(self) -> str:
        if not self.enabled:
            return f"compile off ({self.reason})"
        return f"compile on ({self.backend}): {self.blocks} blocks, {self.norms} RMS norms" + (
            f", the whole-sequence RoPE of {self.models} model" if self.models else ""
        )

    def status(self) -> dict:
        """Per-op state after running: compiled (with call counts) or the failure that made it plain."""
        return self.ops.status() if self.ops is not None else {}


def apply_compile(model: nn.Module, backend: str = "inductor", recompile_limit: int = 16) -> CompileReport:
    """Swap the model's per-block elementwise ops for compiled ones (in place; returns a report).

    Touches only modules that have an ``ops`` attribute holding the plain ops: blocks, RMS norms,
    the tensor-parallel sharded norms (whose two local halves are compiled around their all-reduce,
    which stays outside the compiled code) and the model itself (its whole-sequence RoPE, ``forward_full``).
    ``backend="aot_eager"`` traces without generating code (tests of the plumbing)."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    problem = _compiler_problem(device) if backend == "inductor" else None
    if problem is not None:
        log.info("compile: off (%s); the model keeps its plain elementwise ops", problem)
        return CompileReport(False, problem)
    import torch._dynamo as dynamo

    # every distinct token count is one more specialisation of each op: allow the few a stream uses
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(getattr(dynamo.config, knob), recompile_limit))
    ops = FusedOps(backend)
    blocks = norms = models = 0
    for m in model.modules():
        if getattr(m, "ops", None) is not L.PLAIN_OPS:
            continue
        m.ops = ops
        if isinstance(m, Block):
            blocks += 1
        elif isinstance(m, WanDiT):  # the whole-sequence RoPE of forward_full
            if os.environ.get("CADENCE_COMPILE_ROPE", "1") == "0":  # its reference: the complex float32 path
                m.ops = L.PLAIN_OPS
                continue
            models += 1
        else:  # RMS norms, plain or tensor-parallel sharded
            norms += 1
    rep = CompileReport(True, "", blocks, norms, backend, models=models, ops=ops)
    log.info("%s", rep.describe())
    return rep


def remove_compile(model: nn.Module) -> None:
    """Back to the plain ops (reference runs in the same process)."""
    for m in model.modules():
        if isinstance(getattr(m, "ops", None), FusedOps):
            m.ops = L.PLAIN_OPS


# ---- FP8 emitted by the producers of the FP8 linears' inputs ---------------------------------------------
#: How a fused producer runs: "triton" (Cadence's one-launch kernels, ``cadence.kernels.quant``),
#: "compile" (the reference function torch.compile'd: Inductor fuses the norm, the modulation, the
#: rounding and the row quantisation), "torch" (the plain reference: parity tests, no speed).
PRODUCERS = ("triton", "compile", "torch")


class _Producer:
    """One fused producer (norm + modulation, affine LayerNorm, or GELU) -> (e4m3 [M, K], float32 [M, 1]),
    in the implementation asked for; the first failure logs one line and returns None from then on (the
    caller then runs the plain op and the consumer quantises, as without this)."""

    def __init__(self, name: str, impl: str, triton_fn, reference, backend: str = "inductor"):
        self.name, self.impl = name, impl
        if impl == "triton":
            self.fn = triton_fn
        elif impl == "compile":
            self.fn = _FusedOp(name, reference, backend)
        else:
            self.fn = reference
        self.failed: str | None = None
        self.calls = 0

    def __call__(self, *args):
        if self.failed is not None:
            return None
        try:
            out = self.fn(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001  (a kernel that cannot run: the unfused path, logged once)
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning(
                "fused %s + FP8 quantisation (%s) failed (%s): plain op + separate quantisation from now on",
                self.name,
                self.impl,
                self.failed,
            )
            return None
        self.calls += 1
        return out


def _producers(impl: str, backend: str) -> dict[str, _Producer]:
    from cadence.kernels import quant as kq

    def modulate(x, shift, scale, eps):
        return kq.quantize_rows_modulated_triton(x, shift, scale, eps, out_dtype=x.dtype)

    def modulate_ref(x, shift, scale, eps):
        return kq.quantize_rows_modulated_reference(x, shift, scale, eps, "layer", x.dtype)

    return {
        "norm_modulate": _Producer("norm_modulate", impl, modulate, modulate_ref, backend),
        "layer_norm_cast": _Producer(
            "layer_norm_cast",
            impl,
            kq.quantize_rows_layer_norm_triton,
            kq.quantize_rows_layer_norm_reference,
            backend,
        ),
        "gelu": _Producer(
            "gelu", impl, kq.gelu_quantize_rows_triton, kq.gelu_quantize_rows_reference, backend
        ),
    }


def _activation(qs, x: torch.Tensor):
    from cadence.quant.fp8 import QuantizedActivation

    return QuantizedActivation(qs[0], qs[1], tuple(x.shape), x.dtype)


class QuantizingOps:
    """A block's elementwise ops (``base``: plain or compiled) whose ``norm_modulate`` (the inputs of qkv and
    fc1) and / or ``layer_norm_cast`` (the inputs of the cross / audio attention's q) hand the FP8 linear
    that follows a :class:`cadence.quant.fp8.QuantizedActivation`: the norm, the modulation (or affine),
    the rounding to the model dtype and the per-row quantisation in one producer, so the linear launches
    no quantisation of its own. Every other op (any added to ``ElementwiseOps`` later too) is the base's.
    Per block: only where every consumer of the op's output is an FP8Linear (:func:`apply_fused_quant`)."""

    def __init__(self, base, producers: dict, modulate: bool, layer_norm: bool):
        self.base, self.producers = base, producers
        # a residual add + norm op whose norm is produced here: the base's add, then the producer (two launches,
        # as before the pair became one op: the producer fuses the quantisation, not the add)
        if modulate:
            self.norm_modulate = self._norm_modulate
            self.add_norm_modulate = self._add_norm_modulate
        if layer_norm:
            self.layer_norm_cast = self._layer_norm_cast
            self.gate_residual_layer_norm = self._gate_residual_layer_norm
            self.add_layer_norm = self._add_layer_norm

    def __getattr__(self, name):  # only for what __init__ did not set: the base's op
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def _norm_modulate(self, x, shift, scale, eps):
        qs = self.producers["norm_modulate"](x, shift, scale, eps)
        return self.base.norm_modulate(x, shift, scale, eps) if qs is None else _activation(qs, x)

    def _add_norm_modulate(self, x, y, shift, scale, eps):
        x = x + y
        return x, self._norm_modulate(x, shift, scale, eps)

    def _gate_residual_layer_norm(self, x, y, gate, weight, bias, eps):
        x = self.base.gate_residual(x, y, gate)
        return x, self._layer_norm_cast(x, weight, bias, eps)

    def _add_layer_norm(self, x, y, weight, bias, eps):
        x = x + y
        return x, self._layer_norm_cast(x, weight, bias, eps)

    def _layer_norm_cast(self, x, weight, bias, eps):
        qs = (
            None
            if weight is None or bias is None
            else self.producers["layer_norm_cast"](x, weight, bias, eps)
        )
        return self.base.layer_norm_cast(x, weight, bias, eps) if qs is None else _activation(qs, x)


class GeluQuantFFN(nn.Module):
    """The FFN (``MLP2``: fc1 -> GELU -> fc2) with the GELU and fc2's input quantisation as one producer:
    fc1 (FP8) -> gelu + per-row FP8 -> fc2 (FP8, given the :class:`QuantizedActivation`). ``plain`` is the
    module it replaced (``remove_fused_quant`` puts it back); its fc1 / fc2 are the same modules."""

    def __init__(self, plain: nn.Module, producer: _Producer):
        super().__init__()
        self.fc1, self.fc2 = plain.fc1, plain.fc2
        self.act = plain.act
        self.producer = producer
        self.__dict__["plain"] = plain  # not a submodule: its parameters are fc1's / fc2's

    def forward(self, x):
        h = self.fc1(x)
        qs = self.producer(h)
        if qs is None:
            return self.fc2(torch.nn.functional.gelu(h, approximate="tanh"))
        return self.fc2(_activation(qs, h))


@dataclass
class FusedQuantReport:
    enabled: bool
    impl: str = ""
    reason: str = ""
    modulate_blocks: int = 0
    layer_norm_blocks: int = 0
    ffns: int = 0
    skipped: dict = field(default_factory=dict)  # why -> blocks
    producers: dict = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        if not self.enabled:
            return f"fused FP8 producers off ({self.reason})"
        skip = "; ".join(f"{n} x {why}" for why, n in self.skipped.items())
        return (
            f"fused FP8 producers ({self.impl}): norm+modulation in {self.modulate_blocks} blocks, affine "
            f"LayerNorm in {self.layer_norm_blocks}, GELU in {self.ffns} FFNs"
            + (f"; not: {skip}" if skip else "")
        )

    def status(self) -> dict:
        return {
            k: ("failed: " + p.failed) if p.failed else f"{p.impl} ({p.calls} calls)"
            for k, p in self.producers.items()
        }


def _block_plan(blk: Block, fp8_cls) -> tuple[bool, bool, bool, list[str]]:
    """(modulate, layer_norm, gelu, reasons not) for one block: a producer is fused only where every
    consumer of its output is an FP8Linear taking the activation directly."""
    why: list[str] = []
    qkv = getattr(blk.self_attn.qkv, "qkv_linear", blk.self_attn.qkv)  # through tp.QKVNormStats
    modulate = isinstance(qkv, fp8_cls) and isinstance(blk.ffn.fc1, fp8_cls)
    if not modulate:
        why.append("qkv / fc1 not both FP8Linear")
    sites = []
    if blk.norm2 is not None:
        sites.append((blk.norm2, blk.cross_attn))
    if blk.audio_attn is not None:
        sites.append((blk.norm_audio, blk.audio_attn))
    layer_norm = bool(sites) and all(n.weight is not None and isinstance(a.q, fp8_cls) for n, a in sites)
    if sites and not layer_norm:
        why.append("a cross / audio q not FP8Linear (or its LayerNorm not affine)")
    ffn = blk.ffn.plain if isinstance(blk.ffn, GeluQuantFFN) else blk.ffn
    gelu = isinstance(ffn, L.MLP2) and ffn.act == "gelu"
    gelu = gelu and isinstance(ffn.fc1, fp8_cls) and isinstance(ffn.fc2, fp8_cls)
    if not gelu:
        why.append("fc2 not an FP8Linear (row-parallel under TP: its own quantisation)")
    return modulate, layer_norm, gelu, why


def apply_fused_quant(model: nn.Module, impl: str = "auto", backend: str = "inductor") -> FusedQuantReport:
    """Make the producers of the FP8 linears' inputs emit FP8 + per-token scales (in place; after
    ``apply_fp8`` / ``apply_tp`` and after ``apply_compile``, whose ops it wraps).

    impl: "auto" (CUDA where the Triton kernels can run: "triton"; elsewhere off, so the CPU keeps the
    reference path), or one of :data:`PRODUCERS` anywhere (tests). Per block, only producers whose every
    consumer is an :class:`~cadence.quant.fp8.FP8Linear` are fused; the report says which and why not."""
    from cadence.kernels import quant as kq
    from cadence.quant.fp8 import FP8Linear

    if impl not in ("auto", *PRODUCERS):
        raise ValueError(f"fused producer impl must be auto or one of {PRODUCERS}, got {impl!r}")
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    if impl == "auto":
        ok, why = kq.triton_usable(torch.empty(1, 16, dtype=torch.bfloat16, device=device))
        if not ok:
            log.info("fused FP8 producers: off (%s)", why)
            return FusedQuantReport(False, reason=why)
        impl = "triton"
    if impl == "compile" and backend == "inductor" and (problem := _compiler_problem(device)) is not None:
        return FusedQuantReport(False, reason=problem)
    prods = _producers(impl, backend)
    rep = FusedQuantReport(True, impl, producers=prods)
    for blk in (m for m in model.modules() if isinstance(m, Block)):
        modulate, layer_norm, gelu, why = _block_plan(blk, FP8Linear)
        for w in why:
            rep.skipped[w] = rep.skipped.get(w, 0) + 1
        if modulate or layer_norm:
            base = blk.ops.base if isinstance(blk.ops, QuantizingOps) else blk.ops
            blk.ops = QuantizingOps(base, prods, modulate, layer_norm)
            rep.modulate_blocks += modulate
            rep.layer_norm_blocks += layer_norm
        if gelu:
            plain = blk.ffn.plain if isinstance(blk.ffn, GeluQuantFFN) else blk.ffn
            blk.ffn = GeluQuantFFN(plain, prods["gelu"])
            rep.ffns += 1
    log.info("%s", rep.describe())
    return rep


def remove_fused_quant(model: nn.Module) -> None:
    """Back to the ops and FFNs :func:`apply_fused_quant` wrapped (reference runs in the same process)."""
    for m in model.modules():
        if isinstance(m, Block):
            if isinstance(m.ops, QuantizingOps):
                m.ops = m.ops.base
            if isinstance(m.ffn, GeluQuantFFN):
                m.ffn = m.ffn.plain
