"""A stand-in for ``fa3_fwd_interface`` (the optional, CUDA-only fa3-fwd wheel): FA3's documented contract,
computed with PyTorch, for the adapter, ring and bench tests."""

from __future__ import annotations

import types

import torch

from cadence.kernels import fa3_adapter


def fake_fa3(calls: list | None = None, fail: bool = False) -> types.ModuleType:
    """``flash_attn_with_kvcache`` as FA3 documents it: q [B, M, H, D], caches [B, N, H, D], channel axis
    contiguous, ``cache_seqlens`` int32 [B], FP8 descales [B, H] float32 (value = stored * descale),
    bf16 output. It checks what the real kernel requires of its inputs, then attends in float32."""
    mod = types.ModuleType(fa3_adapter.MODULE)

    def flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=None, q_descale=None, k_descale=None, v_descale=None, **kw
    ):
        if fail:
            raise RuntimeError("no kernel image is available for execution on the device")
        assert q.dim() == k_cache.dim() == v_cache.dim() == 4 and q.shape[0] == 1
        assert all(x.stride(-1) == 1 for x in (q, k_cache, v_cache)), "FA3 needs a contiguous channel axis"
        assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.bfloat16, torch.float8_e4m3fn)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (1,)
        assert kw.get("causal") is False
        h = q.shape[2]
        fp8 = q.dtype == torch.float8_e4m3fn
        if fp8:
            for d in (q_descale, k_descale, v_descale):
                assert d.shape == (1, h) and d.dtype == torch.float32
        n = int(cache_seqlens[0])  # the stub reads it on the host; the kernel reads it on the device

        def f(x, d):
            return x[0].float() * (d[0][None, :, None] if fp8 else 1.0)

        qf, kf, vf = f(q, q_descale), f(k_cache[:, :n], k_descale), f(v_cache[:, :n], v_descale)
        s = torch.einsum("mhd,nhd->hmn", qf, kf) * q.shape[-1] ** -0.5
        out = torch.einsum("hmn,nhd->mhd", s.softmax(-1), vf)
        if calls is not None:
            calls.append({"fp8": fp8, "n": n, "num_splits": kw.get("num_splits")})
        return out[None].to(torch.bfloat16)

    def flash_attn_func(q, k, v, q_descale=None, k_descale=None, v_descale=None, **kw):
        """Fixed length: every key of k, v (the same contract otherwise)."""
        n = torch.tensor([k.shape[1]], dtype=torch.int32, device=q.device)
        return flash_attn_with_kvcache(q, k, v, n, q_descale, k_descale, v_descale, **{**kw, "causal": False})

    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.flash_attn_func = flash_attn_func
    return mod
