"""The one attention seam: every attention in the model goes through :func:`attention`.

Layout is [batch, tokens, heads, head_dim] in and [batch, tokens, heads*head_dim] out. The plain
path is torch's ``scaled_dot_product_attention`` (cuDNN / flash / math backends as torch picks).
Faster kernels (FP8, ring-cache aware) plug in behind the cache seam or replace this function from
outside the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.telemetry.spans import region


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v.  q [B, Nq, H, D], k/v [B, Nk, H, D], mask broadcastable to
    [B, H, Nq, Nk] (bool, True = may attend) -> [B, Nq, H*D]."""
    with region("attention"):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2).flatten(2)
