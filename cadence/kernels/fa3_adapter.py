"""FlashAttention-3 (the optional ``fa3-fwd`` wheel: ``pip install 'cadence[fa3]'``) behind a small adapter.

``fa3-fwd`` 0.0.3 is FlashAttention-3's forward kernels alone (Hopper, sm90; bf16 and FP8 e4m3 inputs,
bf16 output; no fp16, no paged KV), imported as ``fa3_fwd_interface``. Its ``round_up_headdim`` imports
``flash_attn_config``, a module the wheel ships as ``fa3_fwd_config``: :func:`load` aliases it first.

How the ring's buffers map onto its ``flash_attn_with_kvcache`` (no copy, no host sync):

* ``q [H, M, D]`` (the ring's query scratch) -> ``[1, M, H, D]`` by a permuted view: FA3 takes any row
  and head strides as long as the channel axis is contiguous;
* ``K, V [H, N, D]`` (one layer's buffers) -> ``[1, N, H, D]`` the same way. FA3 reads V row-major only
  (this build has ``FLASHATTENTION_ENABLE_VCOLMAJOR`` off, and its FP8 path transposes V tiles in the
  kernel), so a ring read by FA3 stores V as ``[H, N, D]``, not the ``[H, D, N]`` the Triton FP8 kernel
  wants: the layout is chosen once per cache from its backend (``cadence.kernels.attention_backends``);
* the visible length ``n_valid`` (int32 device tensor [1]) -> ``cache_seqlens``: FA3 reads it on the
  device, so a filling ring launches what a full one launches (one CUDA graph for both);
* FP8 scales: FA3 takes one descale per (batch, head): ``[1, H]`` float32 views of the ring's per-(layer,
  head) K/V scales and of the pass's per-head query scale. Per-token scales cannot be expressed, which is
  why the ring stores per-head scales for this backend (its error cost: tests/test_attention_backends.py).

The output is ``[1, M, H, D]`` bf16, contiguous: the ``[1, M, H*D]`` the output projection reads, as a view.
"""

from __future__ import annotations

import importlib
import sys

import torch

MODULE = "fa3_fwd_interface"
CONFIG_MODULE = "fa3_fwd_config"
_loaded: dict = {}


def load():
    """The ``fa3_fwd_interface`` module (ImportError when the wheel is not installed)."""
    if "mod" not in _loaded:
        if "flash_attn_config" not in sys.modules:
            try:
                sys.modules["flash_attn_config"] = importlib.import_module(CONFIG_MODULE)
            except ImportError:
                pass
        _loaded["mod"] = importlib.import_module(MODULE)
    return _loaded["mod"]


def forget() -> None:
    """Drop the cached module (tests swap a stub in and out)."""
    _loaded.clear()


def why_not(device: torch.device, head_dim: int, fp8: bool) -> str:
    """'' when FA3 can read a ring of this head dim and storage on ``device``, else why not (one line)."""
    try:
        load()
    except Exception as e:  # ImportError, or a wheel built against another torch (undefined symbols)
        return f"fa3-fwd is not importable ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
    if device.type != "cuda":
        return f"FlashAttention-3 needs a CUDA device (got {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return f"FlashAttention-3 is a Hopper (sm90) kernel; this device is sm{cap[0]}{cap[1]}"
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention-3 takes head dims that are multiples of 8 up to 256 (got {head_dim})"
    return ""


def _view(x: torch.Tensor) -> torch.Tensor:
    """[H, N, D] -> [1, N, H, D] (a view)."""
    return x.permute(1, 0, 2).unsqueeze(0)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    """Attention of q [H, M, D] over the first n_valid keys of k, v [H, N, D] (bf16, or FP8 with the
    [H] float32 descales: value = stored * descale). Returns [1, M, H, D] bf16."""
    mod = load()
    ds = {}
    if q.dtype == torch.float8_e4m3fn:
        ds = dict(
            q_descale=q_descale.unsqueeze(0),
            k_descale=k_descale.unsqueeze(0),
            v_descale=v_descale.unsqueeze(0),
        )
    return mod.flash_attn_with_kvcache(
        _view(q), _view(k), _view(v), cache_seqlens=n_valid, causal=False, num_splits=num_splits, **ds
    )
