"""Test-session setup: without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1)
when a test asks for them; set before any kernel module is imported (Triton decides at decoration)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def fp8_on_the_cpu(monkeypatch):
    """The FP8 linears' CPU code path (the reference fallback), forced for a test of what a benchmark does with
    FP8 linears: ``--fp8`` on the CPU resolves off ("needs a CUDA worker", as ``cadence serve`` builds it there),
    so the test says explicitly that it runs them anyway."""
    import dataclasses

    from cadence.engine import recipe as rec

    real = rec.resolve

    def resolve(spec, device, exists=None):
        r = real(spec, device, exists)
        if not (spec.fast.fp8_linears and str(device).startswith("cpu")):
            return r
        notes = tuple(n for n in r.notes if not n.startswith(("fp8_linears:", "gemm:")))
        return dataclasses.replace(r, fast=dataclasses.replace(r.fast, fp8_linears=True), notes=notes)

    monkeypatch.setattr(rec, "resolve", resolve)
