"""The ring cache's attention backends, one object each, registered by name: :data:`BACKENDS`.

Torch-free: the names and what they need are plain data, so the torch-free engine spec and recipe
(``cadence.engine.spec``: ``FastPath.attention``) validate and resolve against this registry, and its torch
half (the probe and the call: an :class:`AttentionKernel`) is imported only when a ring cache is built
(``cadence.kernels.attention_backends.plan``). Everything that handles a backend goes through its object:

* the **K/V layout** a ring read by it stores, per storage it reads (:class:`Layout`: V or V^T, per-token or
  per-head K/V scales, per-token or per-head query scales, the visible length read on the device or sliced
  with a host int). That layout is the **write hook**: the ring's one fused write (``rope_quant_write`` /
  ``qkv_write``) stores through it, so a backend needs no write code of its own;
* whether a **CPU worker** can run it (``FastPath.resolve`` turns a CUDA-only choice into 'auto' with a note);
* its **error budget** per storage: relative L2 error against float64 attention on N(0, 1) inputs
  (``cadence bench attention --check`` and ``--ring-check``);
* the ``bench attention`` **family** its timings are recorded under (the measured table 'auto' reads is keyed
  by backend name);
* its **kernel**: ``"module:attribute"`` of an :class:`AttentionKernel` (availability probe, the bench's
  config space, the call), loaded on first use.

Adding a kernel: one :class:`AttentionBackend` here and its :class:`AttentionKernel` in its own module
(docs/architecture.md, "Adding an attention kernel"). 'auto' is not a backend: it picks the fastest measured
one that runs (``attention_backends.plan``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

#: K/V storages a ring keeps: the model dtype ('bf16'; float32 on a CPU model) or FP8 e4m3.
STORAGES = ("bf16", "fp8")
#: Relative L2 error budgets against float64 attention of unquantised N(0, 1) inputs: bf16 rounding (measured
#: 0.37% for cuDNN), e4m3 on q, k, v and P (measured ~5.3%).
BF16_BUDGET, FP8_BUDGET = 0.01, 0.08


@dataclass(frozen=True)
class Layout:
    """How a ring read by one backend stores one storage (what the ring's fused write stores)."""

    v_transposed: bool
    """V stored [H, D, N] (the Triton FP8 kernel: P @ V contracts over the token axis) instead of [H, N, D]."""
    scales: str
    """K/V scales: 'none' (float storage), 'token' (per (token, head)) or 'head' (per (layer, head))."""
    length_on_device: bool
    """The kernel reads the visible length from the device (one CUDA graph for every fill stage); else the
    ring slices a prefix with a host int."""
    q_scales: str = "token"
    """FP8 query scales the write stores: 'token' (per (query, head)) or 'head' (one per head: FA3's descale)."""


BF16 = Layout(False, "none", False)
BF16_ON_DEVICE = Layout(False, "none", True)


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend of the ring cache (see the module docstring)."""

    name: str
    """The name ``--attention`` takes."""
    about: str
    """One line: what it is."""
    layouts: Mapping[str, Layout]
    """The storages it reads, each with the layout a ring read by it stores."""
    kernel: str
    """``"module:attribute"``: its :class:`AttentionKernel` (imported when first used)."""
    bench: Mapping[str, str] = field(default_factory=dict)
    """Storage -> the ``cadence bench attention`` family it is timed as (its table rows)."""
    cpu: bool = False
    """A CPU worker can run it (otherwise asking for it on the CPU resolves to 'auto', with a note)."""
    choosable: bool = True
    """False: a fallback only (the reference), never asked for."""
    budget: Mapping[str, float] = field(default_factory=lambda: {"bf16": BF16_BUDGET, "fp8": FP8_BUDGET})
    """Storage -> relative error budget (see :data:`BF16_BUDGET`)."""

    def reads(self, storage: str) -> bool:
        return storage in self.layouts

    def layout(self, storage: str) -> Layout:
        return self.layouts[storage]

    def load(self) -> AttentionKernel:
        """Its kernel object (imports torch and the kernel's module)."""
        module, attr = self.kernel.split(":")
        return getattr(importlib.import_module(module), attr)


class AttentionKernel(Protocol):
    """The torch half of a backend (``cadence.kernels.attention_backends`` holds the shipped ones). Shapes: ``q``
    [H, M, D] (rotated, quantised for FP8 storage), ``k`` [H, N, D], ``v`` [H, N, D] or [H, D, N], ``qs`` /
    ``ks`` / ``vs`` their scales in the layout's granularity, ``n_valid`` the visible length (int32 [1] on the
    device), ``n`` the same as a host int (None when the layout reads it on the device)."""

    def why_not(self, device: Any, head_dim: int, storage: str, interpreter: bool, float_dtype: Any) -> str:
        """'' when it can run here (import, device capability, head dim; on CUDA one small probe call in the
        ring's layout), else why not in one line."""

    def probe(self, device: Any, head_dim: int, storage: str, layout: Layout, config: dict, m: int) -> str:
        """'' when ``config`` (a measured table's kernel options) runs here, else why not."""

    def configs(self, device: Any, storage: str, sweep: bool, ctas: int) -> list[dict]:
        """The kernel options ``cadence bench attention`` times (``sweep``: the whole space)."""

    def attend(self, q, qs, k, ks, v, vs, n_valid, n: int | None, layout: Layout, config: dict, out_dtype):
        """Attention over the visible keys: [M, H, D] or [1, M, H, D] in ``out_dtype``."""


_TRITON_FP8 = Layout(True, "token", True)
_HEAD_FP8 = Layout(True, "head", True)
_KERNELS = "cadence.kernels.attention_backends"

#: Every backend by name, in the order the help lists them.
BACKENDS: dict[str, AttentionBackend] = {}


def register(backend: AttentionBackend) -> AttentionBackend:
    """Add ``backend`` (a new name, or a replacement of one: tests swap stubs in)."""
    if backend.name == "auto" or not set(backend.layouts) <= set(STORAGES):
        raise ValueError(
            f"attention backend {backend.name!r}: a name other than 'auto', storages in {STORAGES}"
        )
    BACKENDS[backend.name] = backend
    return backend


for _b in (
    AttentionBackend(
        "sdpa", "torch SDPA, the default dispatch, bf16 K/V", {"bf16": BF16}, f"{_KERNELS}:SDPA",
        bench={"bf16": "sdpa_default_bf16"}, cpu=True,
    ),
    AttentionBackend(
        "cudnn", "torch SDPA pinned to its cuDNN backend, bf16 K/V", {"bf16": BF16}, f"{_KERNELS}:CUDNN",
        bench={"bf16": "sdpa_cudnn_bf16"},
    ),
    AttentionBackend(
        "triton", "Cadence's Triton flash attention: bf16, or FP8 with per-token scales",
        {"bf16": BF16_ON_DEVICE, "fp8": _TRITON_FP8}, f"{_KERNELS}:TRITON",
        bench={"bf16": "triton_bf16", "fp8": "triton_fp8"},
    ),
    AttentionBackend(
        "triton_head", "the same kernel, FP8 with per-head scales", {"fp8": _HEAD_FP8},
        f"{_KERNELS}:TRITON_HEAD", bench={"fp8": "triton_head_fp8"},
    ),
    AttentionBackend(
        "triton_short", "Cadence's short-query Triton kernel (few queries, many keys), FP8 with per-token scales",
        {"fp8": _TRITON_FP8}, f"{_KERNELS}:TRITON_SHORT", bench={"fp8": "triton_short_fp8"},
    ),
    AttentionBackend(
        "triton_short_head", "the short-query kernel, FP8 with per-head scales", {"fp8": _HEAD_FP8},
        f"{_KERNELS}:TRITON_SHORT_HEAD", bench={"fp8": "triton_short_head_fp8"},
    ),
    AttentionBackend(
        "fa3", "FlashAttention-3 from the optional fa3-fwd wheel, cadence[fa3]: bf16, or FP8 with per-head scales",
        {"bf16": BF16_ON_DEVICE, "fp8": Layout(False, "head", True, q_scales="head")}, f"{_KERNELS}:FA3",
        bench={"bf16": "fa3_bf16", "fp8": "fa3_fp8"},
    ),
    AttentionBackend(
        "reference", "the dequantising PyTorch attention over FP8 storage (where no kernel runs)",
        {"fp8": Layout(True, "token", False)}, f"{_KERNELS}:REFERENCE", cpu=True, choosable=False,
    ),
):  # fmt: skip
    register(_b)

#: Per storage: what 'auto' takes with no table entry, and the fallbacks of any choice that cannot run, in order.
DEFAULT = {"fp8": "triton", "bf16": "sdpa"}
FALLBACK = {"fp8": ("triton", "reference"), "bf16": ("sdpa",)}


def choices() -> tuple[str, ...]:
    """What ``--attention`` takes: 'auto' and every backend that may be asked for."""
    return ("auto", *(n for n, b in BACKENDS.items() if b.choosable))


def get(name: str) -> AttentionBackend:
    """The backend ``name``; one clear error listing the choices otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention must be one of {', '.join(choices())}, got {name!r}") from None


def help_text() -> str:
    """The backends, one clause each (``FastPath.attention``'s help)."""
    return "; ".join(
        f"'{n}': {b.about}{'' if b.cpu else ' (CUDA)'}" for n, b in BACKENDS.items() if b.choosable
    )


def bench_families() -> dict[str, tuple[str, str]]:
    """``bench attention`` family -> (backend, storage): the rows the measured table is built from."""
    return {fam: (b.name, s) for b in BACKENDS.values() for s, fam in b.bench.items()}
