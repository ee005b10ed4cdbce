"""Which kernel reads the ring cache: the backend seam, chosen once per cache, and the layout it needs.

``FastPath.attention`` (``cadence.engine.spec.ATTENTION`` is the torch-free copy of :data:`BACKENDS`):

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
at the nearest measured key count; with no entry, FP8 uses ``triton`` and bf16 ``sdpa``. An explicit
choice that cannot run, and every ``auto`` candidate skipped, falls back with one log line (never a
crash): FP8 to ``triton`` then ``reference``, bf16 to ``sdpa``. "Can run" is checked for real: import,
device capability, head dim, storage, and on CUDA one small probe call of the library (or compile of the
Triton config) in the ring's layout. Optional libraries are never required. Measurements, predictions
and the layout decision: docs/perf/attention/NOTES.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cadence.kernels import fa3_adapter
from cadence.kernels import ring_attention as ra
from cadence.telemetry.devices import device_kind

BACKENDS = ("auto", "sdpa", "cudnn", "triton", "triton_head", "fa3")
TABLE_PATH = Path(__file__).with_name("attention_table.json")
#: the nearest measured key count must be within this factor of the cache's to use its ranking
KV_TOLERANCE = 1.25
_DEFAULT = {"fp8": "triton", "bf16": "sdpa"}
_FALLBACK = {"fp8": ("triton", "reference"), "bf16": ("sdpa",)}


@dataclass(frozen=True)
class AttentionPlan:
    """What a ring cache runs for attention and how it stores K/V for it."""

    backend: str
    """'sdpa', 'cudnn', 'triton', 'triton_head', 'fa3' or 'reference'."""
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

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def layout(backend: str, storage: str) -> tuple[bool, str, bool]:
    """(v_transposed, scales, length_on_device) of a backend over a storage it can read."""
    if storage == "bf16":
        return False, "none", backend in ("triton", "fa3")
    if backend == "triton":
        return True, "token", True
    if backend == "triton_head":
        return True, "head", True
    if backend == "fa3":
        return False, "head", True
    return True, "token", False  # reference: the Triton path's layout, read by PyTorch


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
    if backend == "reference":
        return "" if storage == "fp8" else "the bf16 reference is sdpa"
    if backend in ("sdpa", "cudnn") and storage != "bf16":
        return f"{backend} reads bf16 K/V (torch SDPA has no FP8 input)"
    if backend == "triton_head" and storage != "fp8":
        return "triton_head is FP8 storage with per-head scales"
    if backend == "sdpa":
        return ""
    if backend == "cudnn":
        return _cudnn_probe(device, head_dim) if device.type == "cuda" else f"needs CUDA (got {device.type})"
    if backend in ("triton", "triton_head"):
        ok, why = ra.triton_usable(device, head_dim, allow_interpreter=interpreter)
        if (
            ok
            and storage == "fp8"
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)
        ):
            return "FP8 MMA needs compute capability >= 8.9"
        return "" if ok else why
    if backend == "fa3":
        if storage == "bf16" and float_dtype != torch.bfloat16:
            return f"fa3-fwd reads bf16 or FP8 (the model is {str(float_dtype).replace('torch.', '')})"
        return fa3_adapter.why_not(device, head_dim, storage == "fp8") or _fa3_probe(
            device, head_dim, storage
        )
    return f"unknown attention backend {backend!r} (one of {', '.join(BACKENDS)})"


def _cudnn_probe(device: torch.device, head_dim: int) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(1, 2, 64, head_dim, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(x, x, x)
    except RuntimeError as e:
        return f"torch SDPA has no cuDNN kernel here ({str(e).splitlines()[0][:100]})"
    return ""


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


def _triton_probe(device: torch.device, head_dim: int, storage: str, scales: str, cfg: dict, m: int) -> str:
    """Compile (and run once, tiny) the Triton config on CUDA: a config the compiler rejects falls back here."""
    if device.type != "cuda":
        return ""
    dt = ra.FP8 if storage == "fp8" else torch.bfloat16
    n = 2 * (cfg.get("block_n") or 128)
    q = torch.zeros(1, m, head_dim, device=device, dtype=dt)
    k = torch.zeros(1, n, head_dim, device=device, dtype=dt)
    vt = torch.zeros(1, head_dim, n, device=device, dtype=dt) if storage == "fp8" else k.clone()
    qs = torch.ones(1, m, device=device)
    ks = torch.ones(1, device=device) if scales == "head" else torch.ones(1, n, device=device)
    nv = torch.tensor([n - 3], dtype=torch.int32, device=device)
    try:
        out = ra.ring_attention(q, qs, k, ks, vt, ks, nv, v_transposed=storage == "fp8", **cfg)
        torch.cuda.synchronize(device)
    except Exception as e:
        return f"the Triton config {cfg} does not run ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
    return "" if torch.isfinite(out.float()).all() else f"the Triton config {cfg} gave non-finite output"


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
    if requested not in BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(BACKENDS)}, got {requested!r}")
    device = torch.device(device)
    storage = "fp8" if fp8 else "bf16"
    if requested == "auto":
        found = _ranked(device, heads, q_tokens, kv_tokens, head_dim, storage)
        # per-head FP8 scales ('fa3' FP8, 'triton_head') only when asked for: on keys with uneven channel
        # gains their error measured 3.7x the per-token one (docs/perf/attention/NOTES.md), and no lip-sync
        # eval has judged them yet; auto keeps per-token FP8 (or bf16) numerics
        found = [e for e in found if layout(e["backend"], storage)[1] != "head"]
        ranked = [(e["backend"], e.get("config", {}), f"table: {e.get('source', '?')}") for e in found]
        candidates = ranked + [(_DEFAULT[storage], {}, "default (no table entry for this shape)")]
    else:
        candidates = [(requested, {}, "requested")]
    candidates += [(b, {}, "fallback") for b in _FALLBACK[storage]]
    skipped = []
    for backend, cfg, why in candidates:
        reason = why_not(backend, device, head_dim, storage, interpreter, float_dtype)
        v_t, scales, on_dev = layout(backend, storage)
        if not reason and backend in ("triton", "triton_head"):
            reason = _triton_probe(device, head_dim, storage, scales, cfg, q_tokens)
        if reason:
            skipped.append(f"{backend}: {reason}")
            continue
        if skipped:
            asked = requested != "auto" or device.type == "cuda" and backend == "reference"
            ra.warn_once(
                f"attention-{device.type}-{requested}-{storage}-{backend}-{len(skipped)}",
                f"ring attention ({storage} K/V, {heads} heads x {q_tokens} q x {kv_tokens} kv): using {backend}; "
                + "; ".join(skipped),
                level=logging.WARNING if asked and device.type == "cuda" else logging.INFO,
            )
        return AttentionPlan(backend, storage, v_t, scales, on_dev, dict(cfg), why)
    raise AssertionError("unreachable: the last fallback always runs")  # pragma: no cover


def _ranked(device, heads, q_tokens, kv_tokens, head_dim, storage) -> list[dict]:
    if device.type != "cuda":
        return []
    return ranking(device_kind(device), heads, q_tokens, kv_tokens, head_dim, storage)
