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

Fallback: when compilation cannot run (no Triton for CUDA tensors, no C++ compiler for CPU
tensors, or the compiler raises on a shape), that op falls back to the plain function with one log
line; the stream never fails because of this module. ``CADENCE_COMPILE=0`` turns it off.

Reference: the plain functions in ``cadence.model.layers``; tests/test_compile.py checks parity.

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
from cadence.model.dit import Block

log = logging.getLogger("cadence.compile")

OPS = ("rms_norm", "sum_squares", "rms_scale", "norm_modulate", "layer_norm_cast", "gate_residual")


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
    """A compiled op with its plain reference; the first failure logs one line and switches to plain."""

    def __init__(self, name: str, plain, backend: str):
        self.name, self.plain = name, plain
        self.compiled = torch.compile(plain, backend=backend, dynamic=False, fullgraph=True)
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


class FusedOps(L.ElementwiseOps):
    """:class:`~cadence.model.layers.ElementwiseOps` with every op compiled (one instance per model)."""

    def __init__(self, backend: str = "inductor"):
        for name in OPS:
            setattr(self, name, _FusedOp(name, getattr(L, name), backend))

    def status(self) -> dict:
        return {
            name: ("failed: " + op.failed) if op.failed else f"compiled ({op.calls} calls)"
            for name in OPS
            for op in [getattr(self, name)]
        }


@dataclass
class CompileReport:
    enabled: bool
    reason: str = ""
    blocks: int = 0
    norms: int = 0
    backend: str = ""
    ops: FusedOps | None = field(default=None, repr=False)

    def describe(self) -> str:
        if not self.enabled:
            return f"compile off ({self.reason})"
        return f"compile on ({self.backend}): {self.blocks} blocks, {self.norms} RMS norms"

    def status(self) -> dict:
        """Per-op state after running: compiled (with call counts) or the failure that made it plain."""
        return self.ops.status() if self.ops is not None else {}


def apply_compile(model: nn.Module, backend: str = "inductor", recompile_limit: int = 16) -> CompileReport:
    """Swap the model's per-block elementwise ops for compiled ones (in place; returns a report).

    Touches only modules that have an ``ops`` attribute holding the plain ops: blocks, RMS norms and
    the tensor-parallel sharded norms (whose two local halves are compiled around their all-reduce,
    which stays outside the compiled code).
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
    blocks = norms = 0
    for m in model.modules():
        if getattr(m, "ops", None) is not L.PLAIN_OPS:
            continue
        m.ops = ops
        if isinstance(m, Block):
            blocks += 1
        else:  # RMS norms, plain or tensor-parallel sharded
            norms += 1
    rep = CompileReport(True, "", blocks, norms, backend, ops)
    log.info("%s", rep.describe())
    return rep


def remove_compile(model: nn.Module) -> None:
    """Back to the plain ops (reference runs in the same process)."""
    for m in model.modules():
        if isinstance(getattr(m, "ops", None), FusedOps):
            m.ops = L.PLAIN_OPS
