"""The position-wise building blocks of Qwen3: RMSNorm, the rotation by RoPE tables and the
SwiGLU MLP (the tables themselves are in :mod:`pagedkv.model.rope`).

Numerics follow transformers' Qwen3: RMSNorm normalises in float32 and casts back before the
weight multiplies; rotation uses the "rotate half" layout (channel ``i`` pairs with
``i + head_dim/2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension, with a learned scale.

    ``y = weight * (x / sqrt(mean(x**2) + eps))``, the normalisation done in float32 and the
    result cast to ``x``'s dtype before the scale multiplies.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square, > 0.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]``; returns the same shape and dtype."""
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the tables ``[T, head_dim]``; same shape out."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with bias-free projections.

    Args:
        hidden_size: input and output width.
        intermediate_size: width of the gated hidden layer.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, hidden_size]``; returns ``[T, hidden_size]``."""
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out
