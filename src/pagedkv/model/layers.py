"""The position-wise building blocks of Qwen3: linear layers (plain, and merged: several
projections of one input stacked on the output dimension), RMSNorm, the rotation by RoPE tables
and the SwiGLU MLP (the tables themselves are in :mod:`pagedkv.model.rope`).

Numerics follow transformers' Qwen3: RMSNorm normalises in float32 and casts back before the
weight multiplies; rotation uses the "rotate half" layout (channel ``i`` pairs with
``i + head_dim/2``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.model.tensor_parallel import Collectives, SingleRank


class Linear(nn.Linear):
    """``nn.Linear`` with its product split from its forward, so that a row-parallel layer can
    leave the bias out on all ranks but one (:class:`RowParallelLinear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in_features]``; returns ``[..., out_features]``."""
        return self.product(x, with_bias=True)

    def product(self, x: torch.Tensor, *, with_bias: bool) -> torch.Tensor:
        """``x @ weight.T``, plus the bias (if any) when ``with_bias``."""
        return F.linear(x, self.weight, self.bias if with_bias else None)


class RowParallelLinear(Linear):
    """A linear layer whose input features are split over the ranks (Megatron's row-parallel
    layer): each rank multiplies its block of the input by its block of the weight's columns,
    and the partial products are summed by one all-reduce. Rank 0 alone adds the bias, before
    the sum (as vLLM does), so it is added once. In a group of one it is exactly ``Linear``.

    Args:
        in_features: this rank's input width (its block).
        out_features: output width (whole).
        bias: whether the layer has a bias (replicated on every rank).
        collectives: the rank's group.
        adds_bias: whether this rank adds the bias (rank 0).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        collectives: Collectives | None = None,
        adds_bias: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.collectives: Collectives = collectives or SingleRank()
        self.adds_bias = adds_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in_features]`` (this rank's block); returns ``[..., out_features]``,
        the same on every rank."""
        return self.collectives.all_reduce(self.product(x, with_bias=self.adds_bias))


class MergedLinear(Linear):
    """Projections of one input computed as one: their weights stacked on the output dimension.

    The layout of vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` (q, k and v
    rows in that order; gate then up), so a tensor-parallel rank can take its block of each
    part. Checkpoints store the parts under their own names (``q_proj``, ``k_proj``, ...); the
    loader copies each into its rows (:mod:`pagedkv.model.checkpoint_layout`).

    Args:
        in_features: input width.
        parts: ``(name, out_features)`` of each projection, in row order.
        bias: whether every part has a bias.
    """

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], bias: bool) -> None:
        super().__init__(in_features, sum(size for _, size in parts), bias=bias)
        self.parts = tuple(parts)
        self.sizes = [size for _, size in parts]

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each part's output, in order (views of one product)."""
        return tuple(self(x).split(self.sizes, dim=-1))


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension, with a learned scale.

    ``y = weight * (x / sqrt(mean(x**2) + eps))``, the normalisation done in float32 and the
    result cast to ``x``'s dtype before the scale multiplies. The residual add before a norm
    (:meth:`add_forward`) and the rotation after a query or key norm (:meth:`rotated`) are
    methods of the norm, so that a backend's norm can compute either in the same pass.

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

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``, ``x`` and ``residual`` of one shape."""
        total = x + residual
        return total, self(total)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rotary(norm(x), cos, sin)`` of ``x`` ``[T, heads, dim]`` (see
        :func:`apply_rotary`)."""
        return apply_rotary(self(x), cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the tables ``[T, head_dim]``; same shape out."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with bias-free projections, gate and up merged into one
    product (``gate_up_proj``, stored as ``gate_proj`` and ``up_proj``).

    Tensor-parallel, ``gate_up_proj`` holds this rank's rows of gate then of up
    (column-parallel) and ``down_proj`` the matching columns (row-parallel, summed over the
    ranks).

    Args:
        hidden_size: input and output width.
        intermediate_size: width of the gated hidden layer held by this rank.
        collectives: the rank's group (none: a group of one).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, collectives: Collectives | None = None
    ) -> None:
        super().__init__()
        parts = (("gate_proj", intermediate_size), ("up_proj", intermediate_size))
        self.gate_up_proj = MergedLinear(hidden_size, parts, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, collectives)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, hidden_size]``; returns ``[T, hidden_size]``."""
        out: torch.Tensor = self.down_proj(self.activation(self.gate_up_proj(x)))
        return out

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the merged product ``gate_up`` ``[T, 2 * intermediate]``."""
        return swiglu(gate_up)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged product ``[T, 2 * width]``, gate its first ``width``
    columns: the activation of every SwiGLU MLP, dense or expert."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
