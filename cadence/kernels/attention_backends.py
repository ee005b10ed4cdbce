"""Which kernel reads the ring cache: the choice, made once per cache, and the shipped kernels behind it.

The backends are objects of ``cadence.kernels.attention_registry`` (names, the layout each stores, CPU or
CUDA, error budgets; torch-free); this module holds their torch half, one :class:`AttentionKernel` each
(availability probe, the bench's config space, the call), and :func:`plan`, the choice:

============  ================================  ======================================  ==============
backend       K/V storage the ring keeps        kernel                                  visible length
============  ================================  ======================================  ==============
sdpa          bf16, V [H, N, D]                 torch SDPA, default dispatch             host int
cudnn         bf16, V [H, N, D]                 torch SDPA pinned to cuDNN (the bar)     host int
triton        bf16 V [H, N, D]; FP8 V^T         Cadence's Triton flash attention         device
              [H, D, N], per-(token, head)
              scales
triton_head   FP8 V^T [H, D, N], per-(layer,    the same kernel without per-key scale    device
              head) K/V scales                  work (``ring_attention`` SCALES=2)
triton_short  FP8 V^T [H, D, N], per-(token,    Cadence's short-query Triton kernel      device
              head) scales                      (``ring_attention.short_attention``:
                                                persistent grid over (rows, head, key
                                                split) items, for few queries)
triton_short  FP8 V^T [H, D, N], per-(layer,    the short-query kernel, per-head         device
_head         head) K/V scales                  scales
fa3           bf16 or FP8 V [H, N, D], FP8      FlashAttention-3 (``fa3-fwd`` wheel,     device
              per-(layer, head) scales          ``cadence.kernels.fa3_adapter``)
auto          the first backend of the measured ranking at the shape that can run here
============  ================================  ======================================  ==============

plus ``reference`` (never asked for): the dequantising PyTorch attention over FP8 storage, where no
kernel can run (the CPU). The ring stores what its backend reads, decided at construction, rather than one
layout for all: FA3 cannot read V^T (this build has no column-major V) nor per-token scales, while the
Triton FP8 kernel needs V^T (Hopper's FP8 MMA wants the contraction axis contiguous in both operands);
the write (``rope_quant_write`` / ``qkv_write``) is one fused launch either way, storing through strides.

``auto``: the ranking comes from ``attention_table.json`` beside this file (one place; each entry names
the bench JSON it was measured in), keyed by GPU kind, heads, query tokens, head dim and K/V storage,
at the nearest measured key count; with no entry, the registry's default for the storage. An explicit
choice that cannot run, and every ``auto`` candidate skipped, falls back with one log line (never a
crash) through the registry's fallbacks: FP8 to ``triton`` then ``reference``, bf16 to ``sdpa``. "Can run" is
checked for real: import, device capability, head dim, storage, and on CUDA one small probe call of the
library (or compile of the Triton config) in the ring's layout. Optional libraries are never required.
Measurements, predictions and the layout decision: docs/perf/attention/NOTES.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from cadence.kernels import attention_registry as registry
from cadence.kernels import fa3_adapter
from cadence.kernels import ring_attention as ra
from cadence.kernels.attention_registry import Layout
from cadence.telemetry.devices import device_kind

TABLE_PATH = Path(__file__).with_name("attention_table.json")
#: the nearest measured key count must be within this factor of the cache's to use its ranking
KV_TOLERANCE = 1.25


@dataclass(frozen=True)
class AttentionPlan:
    """What a ring cache runs for attention and how it stores K/V for it."""

    backend: str
    """A registered backend's name (``cadence.kernels.attention_registry``)."""
    storage: str
    """'bf16' (the model dtype) or 'fp8'."""
    v_transposed: bool
    """V stored [H, D, N] (the Triton FP8 kernel) instead of [H, N, D]."""
    scales: str
    """FP8 scales: 'token' (per (token, head)), 'head' (per (layer, head)), or 'none' (float storage)."""
    length_on_device: bool
    """The kernel reads the visible length from the device (one CUDA graph for every fill stage)."""
    config: dict = field(default_factory=dict)
    """Kernel options: ``ring_attention`` keywords (triton) or ``num_splits`` (fa3)."""
    why: str = ""
    """How it was chosen (the table entry's source, or the fallback reason)."""

    @property
    def layout(self) -> Layout:
        """The backend's layout for this storage (the ring's write stores through it)."""
        return registry.get(self.backend).layout(self.storage)

    @property
    def kernel(self) -> Kernel:
        return registry.get(self.backend).load()

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def layout(backend: str, storage: str) -> tuple[bool, str, bool]:
    """(v_transposed, scales, length_on_device) of a backend over a storage it reads."""
    lay = registry.get(backend).layout(storage)
    return lay.v_transposed, lay.scales, lay.length_on_device


# ---- the kernels -----------------------------------------------------------------------------------------
class Kernel:
    """The torch half of a backend (``attention_registry.AttentionKernel``): by default it runs anywhere,
    has no options and no probe."""

    def why_not(self, device, head_dim, storage, interpreter=False, float_dtype=torch.bfloat16) -> str:
        return ""

    def probe(self, device, head_dim, storage, layout, config, m) -> str:
        return ""

    def configs(self, device, storage, sweep, ctas) -> list[dict]:
        return []  # no options: one variant, named after its family

    def attend(self, q, qs, k, ks, v, vs, n_valid, n, layout, config, out_dtype):
        raise NotImplementedError


class SdpaKernel(Kernel):
    """torch SDPA over a prefix view of bf16 K/V (``pinned``: the SDPA backends it may use, None: any)."""

    def __init__(self, pinned: str | None = None):
        self.pinned = pinned

    def why_not(self, device, head_dim, storage, interpreter=False, float_dtype=torch.bfloat16) -> str:
        if self.pinned is None:
            return ""
        if device.type != "cuda":
            return f"needs CUDA (got {device.type})"
        x = torch.randn(1, 2, 64, head_dim, device=device, dtype=torch.bfloat16)
        try:
            with self._backend():
                F.scaled_dot_product_attention(x, x, x)
        except RuntimeError as e:
            return f"torch SDPA has no cuDNN kernel here ({str(e).splitlines()[0][:100]})"
        return ""

    def _backend(self):
        if self.pinned is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, self.pinned)])

    def attend(self, q, qs, k, ks, v, vs, n_valid, n, layout, config, out_dtype):
        with self._backend():
            o = F.scaled_dot_product_attention(q[None], k[:, :n][None], v[:, :n][None])
        return o[0].transpose(0, 1)


class ReferenceKernel(Kernel):
    """The dequantising PyTorch attention over FP8 storage (``ring_attention.ring_attention_reference``)."""

    def attend(self, q, qs, k, ks, v, vs, n_valid, n, layout, config, out_dtype):
        return ra.ring_attention_reference(q, qs, k, ks, v, vs, n, v_transposed=layout.v_transposed).to(
            out_dtype
        )


class TritonKernel(Kernel):
    """Cadence's Triton flash attention (``ring_attention.ring_attention``); ``bases``: per storage, the block
    shapes (block_m, block_n, warps, stages) the bench sweeps, its default first."""

    def __init__(self, bases: dict[str, list[tuple[int, int, int, int]]], variants: bool):
        self.bases, self.variants = bases, variants

    def why_not(self, device, head_dim, storage, interpreter=False, float_dtype=torch.bfloat16) -> str:
        ok, why = ra.triton_usable(device, head_dim, allow_interpreter=interpreter)
        if (
            ok
            and storage == "fp8"
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)
        ):
            return "FP8 MMA needs compute capability >= 8.9"
        return "" if ok else why

    #: How a probe names the kernel, and how many key tiles its one call reads.
    probe_name, probe_tiles = "Triton", 2

    def probe(self, device, head_dim, storage, layout, config, m) -> str:
        """Compile (and run once, tiny: ``probe_tiles`` key tiles, ``m`` query rows) the config on CUDA, at
        set-up, never in a step: a config the compiler rejects falls back here."""
        if device.type != "cuda":
            return ""
        dt = ra.FP8 if storage == "fp8" else torch.bfloat16
        n = self.probe_tiles * (config.get("block_n") or 128)
        q = torch.zeros(1, m, head_dim, device=device, dtype=dt)
        k = torch.zeros(1, n, head_dim, device=device, dtype=dt)
        vt = torch.zeros(1, head_dim, n, device=device, dtype=dt) if layout.v_transposed else k.clone()
        qs = torch.ones(1, m, device=device)
        ks = torch.ones(1, device=device) if layout.scales == "head" else torch.ones(1, n, device=device)
        nv = torch.tensor([n - 3], dtype=torch.int32, device=device)
        name = f"the {self.probe_name} config {config}"
        try:
            out = self._probe_call(q, qs, k, ks, vt, nv, layout, config)
            torch.cuda.synchronize(device)
        except Exception as e:
            return f"{name} does not run ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
        return "" if torch.isfinite(out.float()).all() else f"{name} gave non-finite output"

    def _probe_call(self, q, qs, k, ks, vt, nv, layout, config) -> torch.Tensor:
        return ra.ring_attention(q, qs, k, ks, vt, ks, nv, v_transposed=layout.v_transposed, **config)

    def configs(self, device, storage, sweep, ctas) -> list[dict]:
        """Block shapes x key splits (x the dual / pv_bf16 / ws / register / cluster variants with FP8); one
        small set off the GPU."""
        if device.type != "cuda":
            return [dict(split=1), dict(split=2), dict(dual=True)] if sweep else [dict()]
        base = self.bases[storage] if sweep else self.bases[storage][:1]
        # key splits only where the grid leaves SMs idle (~132 SMs x 2-3 resident programs on an H200)
        splits = (1, 2, 3, 4, 6) if sweep and ctas < 3 * 132 else ((1, 2) if sweep else (1,))
        out = [
            dict(block_m=a, block_n=b, num_warps=w, num_stages=s, split=x)
            for a, b, w, s in base
            for x in splits
        ]
        if sweep and self.variants and storage == "fp8":
            out += _triton_fp8_variants()
        return out

    def attend(self, q, qs, k, ks, v, vs, n_valid, n, layout, config, out_dtype):
        return ra.ring_attention(
            q, qs, k, ks, v, vs, n_valid, v_transposed=layout.v_transposed, out_dtype=out_dtype, **config
        )


def _triton_fp8_variants() -> list[dict]:
    """The FP8 kernel's variants beyond block shapes: dual, pv_bf16, ws, a register cap (more programs per SM)
    and clusters of 2 (a block split over 2 CTAs sharing K/V)."""
    out = [
        dict(block_m=64, block_n=b, num_warps=4, num_stages=2, dual=True, split=x)
        for b in (64, 128)
        for x in (1, 2, 4)
    ]
    out += [
        dict(block_m=64, block_n=128, num_warps=4, num_stages=3, split=x, **v)
        for v in (dict(pv_bf16=True), dict(ws=True))
        for x in (1, 2)
    ]
    out += [dict(block_m=64, block_n=64, num_warps=4, num_stages=3, maxnreg=128, split=x) for x in (1, 3)]
    out += [dict(block_m=64, block_n=128, num_warps=4, num_stages=2, maxnreg=168, split=x) for x in (1, 3)]
    out += [dict(block_m=128, block_n=128, num_warps=4, num_stages=3, num_ctas=2, split=x) for x in (1, 2)]
    return out


class ShortKernel(TritonKernel):
    """The short-query form of the Triton kernel (``ring_attention.short_attention``): same ring layout, same
    result, its work cut into (row block, head, key split) items over a persistent grid; the key split is
    picked on the host from the query rows, heads and the buffer's length (never the device's visible length:
    graph-safe)."""

    def __init__(self):
        super().__init__({}, variants=False)

    probe_name, probe_tiles = "short-query", 4

    def _probe_call(self, q, qs, k, ks, vt, nv, layout, config) -> torch.Tensor:
        return ra.short_attention(q, qs, k, ks, vt, ks, nv, **config)

    def configs(self, device, storage, sweep, ctas) -> list[dict]:
        """The host-picked split (and, swept, the splits, warp specialisation, lazy rescale (with the unit found
        4,096 scales at a time, or the per-head row sums by the tensor cores: ignored with per-token scales) and
        tiles of scripts/attention_short.py's rounds)."""
        if not sweep:
            return [dict()]
        out = [dict()] + [dict(split=s) for s in (1, 2, 4)] + [dict(ws=True)]
        out += [dict(lazy=2.0, unit_chunk=4096), dict(lazy=2.0, l_mma=True)]
        if device.type == "cuda":
            out += [dict(programs_per_sm=p) for p in (1, 3)]
            out += [dict(block_m=64, block_n=64, num_warps=4), dict(block_m=128, block_n=128, num_warps=8)]
        return out

    def attend(self, q, qs, k, ks, v, vs, n_valid, n, layout, config, out_dtype):
        return ra.short_attention(
            q, qs, k, ks, v, vs, n_valid, v_transposed=layout.v_transposed, out_dtype=out_dtype, **config
        )


class FA3Kernel(Kernel):
    """FlashAttention-3 through ``cadence.kernels.fa3_adapter`` (the optional ``fa3-fwd`` wheel)."""

    def why_not(self, device, head_dim, storage, interpreter=False, float_dtype=torch.bfloat16) -> str:
        if storage == "bf16" and float_dtype != torch.bfloat16:
            return f"fa3-fwd reads bf16 or FP8 (the model is {str(float_dtype).replace('torch.', '')})"
        return fa3_adapter.why_not(device, head_dim, storage == "fp8") or _fa3_probe(
            device, head_dim, storage
        )

    def configs(self, device, storage, sweep, ctas) -> list[dict]:
        splits = ((0, 1, 2, 3, 4, 6) if storage == "fp8" else (0, 1, 2)) if sweep else (0,)
        return [{"num_splits": s} for s in splits]

    def attend(self, q, qs, k, ks, v, vs, n_valid, n, layout, config, out_dtype):
        fp8 = layout.scales != "none"
        out = fa3_adapter.attend(
            q,
            k,
            v,
            n_valid,
            q_descale=qs if fp8 else None,
            k_descale=ks if fp8 else None,
            v_descale=vs if fp8 else None,
            num_splits=config.get("num_splits", 0),
        )
        return out if out.dtype == out_dtype else out.to(out_dtype)


def _fa3_probe(device: torch.device, head_dim: int, storage: str) -> str:
    """One tiny call in the ring's layout against the PyTorch reference: a wheel built for another torch,
    or a kernel missing from the build, shows here instead of inside a stream."""
    g = torch.Generator(device=device).manual_seed(0)
    h, m, n = 2, 64, 128
    x = torch.randn(3, h, n, head_dim, device=device, generator=g)
    nv = torch.tensor([100], dtype=torch.int32, device=device)
    try:
        if storage == "fp8":
            s = x.abs().amax(dim=(2, 3)) / ra.FP8_MAX  # [3, H]
            q8, k8, v8 = (
                (x[i] / s[i, :, None, None]).clamp(-ra.FP8_MAX, ra.FP8_MAX).to(ra.FP8) for i in range(3)
            )
            out = fa3_adapter.attend(q8[:, :m], k8, v8, nv, q_descale=s[0], k_descale=s[1], v_descale=s[2])
            ref = ra.ring_attention_reference(q8[:, :m], s[0], k8, s[1], v8, s[2], 100, v_transposed=False)
            budget = 0.1
        else:
            b = x.to(torch.bfloat16)
            out = fa3_adapter.attend(b[0, :, :m], b[1], b[2], nv)
            ones = torch.ones(h, device=device)
            ref = ra.ring_attention_reference(
                b[0, :, :m], ones, b[1], ones, b[2], ones, 100, v_transposed=False
            )
            budget = 0.02
        err = float((out[0].float() - ref).norm() / ref.norm())
    except Exception as e:  # any failure of the library call is a reason not to use it
        return f"fa3 probe failed ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
    return "" if math.isfinite(err) and err < budget else f"fa3 probe: relative error {err:.3g} > {budget}"


# the registry's kernels (``AttentionBackend.kernel`` names them)
SDPA = SdpaKernel()
CUDNN = SdpaKernel("CUDNN_ATTENTION")
TRITON = TritonKernel(
    {
        "fp8": [(64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)],
        "bf16": [(128, 128, 8, 3), (128, 64, 8, 2), (64, 128, 4, 3)],
    },
    variants=True,
)
TRITON_HEAD = TritonKernel({"fp8": [(64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3)]}, variants=True)
TRITON_SHORT = ShortKernel()
TRITON_SHORT_HEAD = ShortKernel()
FA3 = FA3Kernel()
REFERENCE = ReferenceKernel()


# ---- can it run here? ------------------------------------------------------------------------------------
def why_not(
    backend: str,
    device: torch.device,
    head_dim: int,
    storage: str,
    interpreter: bool = False,
    float_dtype: torch.dtype = torch.bfloat16,
) -> str:
    """'' when ``backend`` can read a ``storage`` ring of this head dim on ``device`` (float storage in
    ``float_dtype``, the model's), else why not (one line)."""
    b = registry.BACKENDS.get(backend)
    if b is None:
        return f"unknown attention backend {backend!r} (one of {', '.join(registry.choices())})"
    if not b.reads(storage):
        return f"{backend} reads {' or '.join(b.layouts)} K/V"
    return b.load().why_not(device, head_dim, storage, interpreter, float_dtype)


# ---- the measured table ----------------------------------------------------------------------------------
@functools.cache
def table() -> dict:
    """attention_table.json: {"sources": {...}, "entries": [...]} (empty when the file is missing)."""
    try:
        return json.loads(TABLE_PATH.read_text())
    except (OSError, ValueError):
        return {"sources": {}, "entries": []}


def ranking(gpu: str, heads: int, q_tokens: int, kv_tokens: int, head_dim: int, storage: str) -> list[dict]:
    """The table's entries for this shape, fastest first (by ratio vs cuDNN bf16 measured in the same run),
    at the nearest measured key count within KV_TOLERANCE; [] when there is none."""
    rows = [
        e
        for e in table().get("entries", [])
        if e["gpu"] == gpu
        and (e["heads"], e["q_tokens"], e["head_dim"], e["storage"]) == (heads, q_tokens, head_dim, storage)
    ]
    if not rows:
        return []
    near = min({e["kv_tokens"] for e in rows}, key=lambda kv: abs(math.log(kv / max(kv_tokens, 1))))
    if abs(math.log(near / max(kv_tokens, 1))) > math.log(KV_TOLERANCE):
        return []
    return sorted((e for e in rows if e["kv_tokens"] == near), key=lambda e: -e["speedup_vs_cudnn_bf16"])


# ---- the choice ------------------------------------------------------------------------------------------
def plan(
    requested: str,
    device: torch.device | str,
    *,
    heads: int,
    q_tokens: int,
    kv_tokens: int,
    head_dim: int,
    fp8: bool,
    interpreter: bool = False,
    float_dtype: torch.dtype = torch.bfloat16,
) -> AttentionPlan:
    """The backend a ring of this shape runs on ``device`` (see the module docstring for the rules)."""
    if requested != "auto":
        registry.get(requested)  # one clear error for an unknown name
    device = torch.device(device)
    storage = "fp8" if fp8 else "bf16"
    if requested == "auto":
        found = _ranked(device, heads, q_tokens, kv_tokens, head_dim, storage)
        # per-head FP8 scales ('fa3' FP8, 'triton_head', 'triton_short_head') only when asked for: on keys
        # with uneven channel gains their error measured 3.7x the per-token one, and the lip-sync eval found
        # per-head scales differ from the reference beyond the rerun spread (docs/perf/attention/NOTES.md);
        # auto keeps per-token FP8 (or bf16) numerics
        found = [e for e in found if _scales(e["backend"], storage) != "head"]
        ranked = [(e["backend"], e.get("config", {}), f"table: {e.get('source', '?')}") for e in found]
        candidates = ranked + [(registry.DEFAULT[storage], {}, "default (no table entry for this shape)")]
    else:
        candidates = [(requested, {}, "requested")]
    candidates += [(b, {}, "fallback") for b in registry.FALLBACK[storage]]
    skipped = []
    for backend, cfg, why in candidates:
        reason = why_not(backend, device, head_dim, storage, interpreter, float_dtype)
        if not reason:
            lay = registry.get(backend).layout(storage)
            reason = registry.get(backend).load().probe(device, head_dim, storage, lay, cfg, q_tokens)
        if reason:
            skipped.append(f"{backend}: {reason}")
            continue
        if skipped:
            asked = requested != "auto" or device.type == "cuda" and not registry.get(backend).choosable
            ra.warn_once(
                f"attention-{device.type}-{requested}-{storage}-{backend}-{len(skipped)}",
                f"ring attention ({storage} K/V, {heads} heads x {q_tokens} q x {kv_tokens} kv): using {backend}; "
                + "; ".join(skipped),
                level=logging.WARNING if asked and device.type == "cuda" else logging.INFO,
            )
        return AttentionPlan(
            backend, storage, lay.v_transposed, lay.scales, lay.length_on_device, dict(cfg), why
        )
    raise AssertionError("unreachable: the last fallback always runs")  # pragma: no cover


def _scales(backend: str, storage: str) -> str:
    b = registry.BACKENDS.get(backend)
    return b.layout(storage).scales if b is not None and b.reads(storage) else ""


def _ranked(device, heads, q_tokens, kv_tokens, head_dim, storage) -> list[dict]:
    if device.type != "cuda":
        return []
    return ranking(device_kind(device), heads, q_tokens, kv_tokens, head_dim, storage)
