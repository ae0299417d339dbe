"""The position-wise building blocks of Qwen3: RMSNorm, rotary embedding and the SwiGLU MLP.

Numerics follow transformers' Qwen3: RMSNorm normalises in float32 and casts back before the
weight multiplies; RoPE angles are computed in float32 and ``cos``/``sin`` cast to the
activation dtype; rotation uses the "rotate half" layout (channel ``i`` pairs with
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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables for given positions (default RoPE, no scaling).

    The inverse frequencies ``theta ** (-2i / head_dim)`` are computed once, in float32 on the
    CPU, and are not parameters: a model built on the meta device still has them.

    Args:
        head_dim: channels per head, even.
        theta: RoPE base, > 0.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        self._inv_freq_cpu = 1.0 / (theta**exponents)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` tables for ``positions``.

        Args:
            positions: ``[T]`` int64 token positions.
            dtype: the activation dtype the tables are cast to.

        Returns:
            ``(cos, sin)``, each ``[T, head_dim]``.
        """
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


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
