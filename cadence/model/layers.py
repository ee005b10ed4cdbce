"""Small building blocks of the Wan DiT: norms, linears that report their time, embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from cadence.model.rope import apply_rope
from cadence.telemetry.spans import region


class Linear(nn.Linear):
    """nn.Linear whose time is reported under the "linear" region. Quantised / tensor-parallel
    replacements (applied from outside the model) subclass or replace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with region("linear"):
            return F.linear(x, self.weight, self.bias)


class LayerNorm32(nn.Module):
    """LayerNorm computed in float32 (input upcast), optional affine; returns float32."""

    def __init__(self, dim: int, eps: float, affine: bool, device=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32))
            self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=torch.float32))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (self.dim,), self.weight, self.bias, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim in float32, cast back to x's dtype, times the weight."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight.to(x.dtype)


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """Float32 sum of squares over the last dim, kept as [..., 1]: the part of an RMS norm that a
    norm over channels split across ranks reduces (``cadence.parallel.tp.ShardedRMSNorm``)."""
    return x.float().pow(2).sum(-1, keepdim=True)


def sum_squares_pair(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Both float32 sums of squares over the last dim in one [..., 2] tensor (q's, then k's): what the two
    q/k norms of a self-attention split across ranks reduce together (one collective, not two)."""
    return torch.cat([sum_squares(q), sum_squares(k)], dim=-1)


def rms_scale(x: torch.Tensor, ss: torch.Tensor, weight: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """The rest of that RMS norm, from the (reduced) sum of squares ``ss`` over ``dim`` channels:
    ``rms_scale(x, sum_squares(x), w, x.shape[-1], eps)`` is ``rms_norm(x, w, eps)``."""
    y = x.float() * torch.rsqrt(ss / dim + eps)
    return y.to(x.dtype) * weight.to(x.dtype)


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """adaLN: LayerNorm (float32, no affine) * (1 + scale) + shift, cast back to x's dtype."""
    h = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (h * (1 + scale) + shift).to(x.dtype)


def layer_norm_cast(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm in float32 (optional affine), cast back to x's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps).to(x.dtype)


def gate_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y * gate, summed in float32, cast back to x's dtype."""
    return (x.float() + y.float() * gate).to(x.dtype)


# ---- a residual add and the norm after it: one op, so that a compiler makes one kernel of the pair -----------
def gate_residual_layer_norm(
    x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, weight, bias, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_residual(x, y, gate)`` and ``layer_norm_cast`` of it: (the new residual, the next input)."""
    x = gate_residual(x, y, gate)
    return x, layer_norm_cast(x, weight, bias, eps)


def add_layer_norm(
    x: torch.Tensor, y: torch.Tensor, weight, bias, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + y`` (in x's dtype, as the block's plain residual of a cross-attention) and ``layer_norm_cast`` of it."""
    x = x + y
    return x, layer_norm_cast(x, weight, bias, eps)


def add_norm_modulate(
    x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + y`` (in x's dtype) and ``norm_modulate`` of it: the last cross-attention's residual and the FFN's
    input."""
    x = x + y
    return x, norm_modulate(x, shift, scale, eps)


class ElementwiseOps:
    """The per-block elementwise math between the GEMMs and the attention calls, as plain functions.

    A residual add and the norm that reads its result are one op (``gate_residual_layer_norm``,
    ``add_layer_norm``, ``add_norm_modulate``: each returns the new residual and the next linear's input), so
    that a compiled version reads the two addends once and writes both results in one kernel; here they are the
    plain functions composed, the same values as calling the two.

    Blocks and RMS norms call these through an instance (``Block.ops``, ``RMSNorm.ops``; the
    tensor-parallel ``ShardedRMSNorm`` calls ``sum_squares`` / ``rms_scale`` around its all-reduce; the model's
    own ``WanDiT.ops`` the whole-sequence RoPE, ``apply_rope``) so that a fused implementation can be swapped in
    from outside a built model (:func:`cadence.runtime.compile.apply_compile`); this class is the reference.
    """

    rms_norm = staticmethod(rms_norm)
    sum_squares = staticmethod(sum_squares)
    sum_squares_pair = staticmethod(sum_squares_pair)
    rms_scale = staticmethod(rms_scale)
    norm_modulate = staticmethod(norm_modulate)
    layer_norm_cast = staticmethod(layer_norm_cast)
    gate_residual = staticmethod(gate_residual)
    gate_residual_layer_norm = staticmethod(gate_residual_layer_norm)
    add_layer_norm = staticmethod(add_layer_norm)
    add_norm_modulate = staticmethod(add_norm_modulate)
    apply_rope = staticmethod(apply_rope)


PLAIN_OPS = ElementwiseOps()


class TokenLayout:
    """Which of a pass's tokens the transformer blocks' per-token work (norms, modulation, gates, residual
    adds) runs on. This class is the reference: every token (the model's ``token_layout`` is
    :data:`ALL_TOKENS`). Sequence parallelism (``cadence.parallel.sp.ShardedTokens``, applied from outside a
    built model) gives each tensor-parallel rank a share of the tokens between the blocks' linears; the
    block forwards are the same math either way (their attention always sees every token's queries).

    ``scatter(x [B, N, dim], temb6)`` -> the tokens the blocks work on, and the 6-way modulation to match
    (``temb6`` [B, 6, dim] per sample, or [B, N, 6, dim] per token); ``gather(x)`` -> all N tokens again."""

    def scatter(self, x: torch.Tensor, temb6: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, temb6

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


ALL_TOKENS = TokenLayout()


class RMSNorm(nn.Module):
    """RMS norm over the last dim (Wan normalises q and k across all heads at once)."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.ops = PLAIN_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class MLP2(nn.Module):
    """fc1 -> activation -> fc2 (timestep, text and audio embedders; the FFN)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, act: str, device=None, dtype=None):
        super().__init__()
        self.fc1 = Linear(d_in, d_hidden, device=device, dtype=dtype)
        self.fc2 = Linear(d_hidden, d_out, device=device, dtype=dtype)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh")
        return self.fc2(h)


def timestep_embedding(
    t: torch.Tensor, dim: int, max_period: float = 10_000.0, fp64: bool = False
) -> torch.Tensor:
    """Sinusoidal embedding [..., dim] of (fractional) timesteps, cos first (Wan / diffusers order).

    float32 as diffusers computes it, or (``fp64``) in float64 as the original Wan code does
    (``max_period ** (-i / half)``), returned as float32 either way."""
    half = dim // 2
    if fp64:
        i = torch.arange(half, dtype=torch.float64, device=t.device)
        args = t.double()[..., None] * torch.pow(max_period, -i.div(half))
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).float()
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
