"""The self-attention's q/k RMS norms applied inside the ring cache's write, installed from outside a built model.

The plain :class:`cadence.model.dit.SelfAttention` normalises q and k (two norm modules, each a kernel that
reads its input and writes the normed copy), then hands them to ``cache.attend``, whose write reads them again
to rotate and quantise them into the ring. :func:`fold_qk_norms` changes each self-attention's class to
:class:`FoldedSelfAttention` (same parameters and state dict, same math) which, when its cache says it folds
(``RingCache.folds_qk_norm``: the Triton write, ``CADENCE_QK_NORM_IN_WRITE`` not 0), computes only the norms'
sums of squares and passes them, with the norms' weights, to ``cache.attend(..., qk_norm=...)``: the write
applies ``x * rsqrt(ss / dim + eps) * weight`` in float32 on its way in (``cadence.kernels.ring_attention``,
``qkv_write``). With any other cache it runs the plain forward.

Where the sums come from:

* tensor parallel (``cadence.parallel.tp.ShardedRMSNorm``): the norm's ``reduced_sums`` (the all-reduced sum,
  taken from the qkv projection's paired reduction where ``QKVNormStats`` made one); the weight is the rank's
  slice, the width the full one;
* one rank (a plain RMSNorm): both sums in one op (``ops.sum_squares_pair``, compiled with ``apply_compile``).

What changes against the separate norms: the normed q and k are no longer rounded to the model dtype (twice:
after the scale, after the weight) before the write's float32 rotation; in float32 the two paths are the same
arithmetic. The write still rounds (bf16 storage) or quantises (FP8) as before.
"""

from __future__ import annotations

import torch

from cadence.kernels.ring_attention import RowNorm
from cadence.model.dit import SelfAttention


class FoldedSelfAttention(SelfAttention):
    """A :class:`SelfAttention` whose q/k norms the cache's write applies, where the cache can
    (``folds_qk_norm``); the plain forward otherwise. Made by :func:`fold_qk_norms` (class change only)."""

    def forward(self, x: torch.Tensor, cache, layer: int, commit: bool) -> torch.Tensor:
        if not getattr(cache, "folds_qk_norm", False) or self.norm_q is None:
            return super().forward(x, cache, layer, commit)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        norms = qk_row_norms(self.norm_q, self.norm_k, q, k)
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))
        return self.out(cache.attend(layer, q, k, v, commit, qk_norm=norms))


def qk_row_norms(norm_q, norm_k, q: torch.Tensor, k: torch.Tensor) -> tuple[RowNorm, RowNorm]:
    """The two norms' (sums of squares, weight, full width, eps) for q and k [.., tokens, channels]."""
    reduced = getattr(norm_q, "reduced_sums", None)
    if reduced is not None:  # sharded over a tensor-parallel group: the reduced sums, the full width
        ss_q, ss_k = reduced(q), norm_k.reduced_sums(k)
        dim_q, dim_k = norm_q.full_dim, norm_k.full_dim
    else:  # one rank: both local sums in one op
        ss = norm_q.ops.sum_squares_pair(q, k)
        ss_q, ss_k = ss[..., 0], ss[..., 1]
        dim_q, dim_k = norm_q.weight.numel(), norm_k.weight.numel()
    return RowNorm(ss_q, norm_q.weight, dim_q, norm_q.eps), RowNorm(ss_k, norm_k.weight, dim_k, norm_k.eps)


def fold_qk_norms(model) -> int:
    """Make every transformer block's self-attention a :class:`FoldedSelfAttention` (in place; idempotent);
    return how many. Harmless with caches that do not fold (they get the plain forward)."""
    n = 0
    for blk in getattr(model, "blocks", ()):
        attn = getattr(blk, "self_attn", None)
        if type(attn) is SelfAttention:
            attn.__class__ = FoldedSelfAttention
        n += isinstance(attn, FoldedSelfAttention)
    return n


def unfold_qk_norms(model) -> None:
    """Back to the plain self-attention class (reference runs in the same process)."""
    for blk in getattr(model, "blocks", ()):
        if type(getattr(blk, "self_attn", None)) is FoldedSelfAttention:
            blk.self_attn.__class__ = SelfAttention
