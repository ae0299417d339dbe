"""The position-wise building blocks of Qwen3: linear layers (plain, and merged: several
projections of one input stacked on the output dimension), RMSNorm, the rotation by RoPE tables
and the SwiGLU MLP (the tables themselves are in :mod:`pagedkv.model.rope`).

Numerics follow transformers' Qwen3: RMSNorm normalises in float32 and casts back before the
weight multiplies; rotation uses the "rotate half" layout (channel ``i`` pairs with
``i + head_dim/2``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.model.packed_layout import PackedWeight, read_layout
from pagedkv.model.tensor_parallel import Collectives, SingleRank

if TYPE_CHECKING:
    from pagedkv.model.fused_norms import FusedNorms
    from pagedkv.model.fused_swiglu import FusedSwiGLU
    from pagedkv.model.packed_gemv import PackedGemv

#: The batch size oneDNN chooses a packed weight's blocked layout for. Measured on the 0.6B
#: shape's 28 layers (2 threads, AVX-512 without AMX): packed for 32 rows, float32 products of
#: 1, 8 and 32 rows took 31, 40 and 87 ms against 54, 68 and 114 ms packed for 1 row (bfloat16:
#: 17, 22, 48 against 27, 28, 52 ms), and no slower at 128 rows. vLLM's CPU backend packs
#: for 32 rows too.
PACKED_FOR_ROWS = 32


def onednn_pack(weight: torch.Tensor, rows: int = PACKED_FOR_ROWS) -> torch.Tensor:
    """``weight`` ``[out, in]`` repacked into oneDNN's blocked layout for products of about
    ``rows`` rows (an opaque oneDNN tensor, read only by :func:`onednn_linear`)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    return packed


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN, ``packed`` from :func:`onednn_pack`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x, packed, None if bias is None else bias.detach(), "none", [], ""
    )
    return out


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be repacked once for a faster CPU kernel.

    :meth:`pack` swaps the weight for oneDNN's blocked layout (the format its AVX-512 and AMX
    kernels read); the plain weight is then released, so the layer holds one copy. Packed, its
    products of a few rows may run through a kernel that reads the packed weight itself
    (:attr:`gemv`, :mod:`pagedkv.model.packed_gemv`). Unpacked, it is exactly ``nn.Linear``.
    """

    packed: torch.Tensor | None = None
    #: Bytes per element of the weight that was packed (0 while unpacked).
    packed_itemsize: int = 0
    #: The packed weight's address and layout, where the layout is one checked byte for byte
    #: (:func:`~pagedkv.model.packed_layout.read_layout`); ``None`` otherwise.
    packed_weight: PackedWeight | None = None
    #: The kernel for products of few rows with the packed weight, or ``None``: oneDNN.
    gemv: PackedGemv | None = None

    def pack(self) -> None:
        """Repack the weight for oneDNN (see :mod:`pagedkv.model.packing`); idempotent."""
        if self.packed is None:
            self.packed_itemsize = self.weight.element_size()
            self.packed = onednn_pack(self.weight)
            self.packed_weight = read_layout(self.weight, self.packed)
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in_features]``; returns ``[..., out_features]``."""
        return self.product(x, with_bias=True)

    def product(self, x: torch.Tensor, *, with_bias: bool) -> torch.Tensor:
        """``x @ weight.T``, plus the bias (if any) when ``with_bias``."""
        bias = self.bias if with_bias else None
        if self.packed is not None:
            packed = self.packed_weight
            if self.gemv is not None and packed is not None and self.gemv.takes(x, packed, bias):
                return self.gemv.product(x, packed, self.out_features, bias)
            return onednn_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


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
    result cast to ``x``'s dtype before the scale multiplies. With a fused kernel set
    (:func:`~pagedkv.model.fused_norms.use_fused_norms`), inputs it takes are normalised in one
    call, with the residual add before (:meth:`add_forward`) or the rotation after
    (:meth:`rotated`) in the same call.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square, > 0.
    """

    #: The fused kernel, or ``None``: the torch formulation.
    fused: FusedNorms | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]``; returns the same shape and dtype."""
        if self.fused is not None and self.fused.takes(x, self.weight):
            return self.fused.add_rms_norm(x, None, self.weight, self.eps)[1]
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``, ``x`` and ``residual`` of one shape."""
        if self.fused is not None and self.fused.takes_sum(x, residual, self.weight):
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rotary(norm(x), cos, sin)`` of ``x`` ``[T, heads, dim]`` (see
        :func:`apply_rotary`)."""
        if self.fused is not None and self.fused.takes_rotation(x, self.weight, cos, sin):
            return self.fused.rms_norm_rope(x, self.weight, cos, sin, self.eps)
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
    ranks). With a fused kernel set (:func:`~pagedkv.model.fused_swiglu.use_fused_swiglu`),
    the activation of a product it takes runs in one call, reading the merged product in place.

    Args:
        hidden_size: input and output width.
        intermediate_size: width of the gated hidden layer held by this rank.
        collectives: the rank's group (none: a group of one).
    """

    #: The fused activation kernel, or ``None``: the torch formulation.
    fused: FusedSwiGLU | None = None

    def __init__(
        self, hidden_size: int, intermediate_size: int, collectives: Collectives | None = None
    ) -> None:
        super().__init__()
        parts = (("gate_proj", intermediate_size), ("up_proj", intermediate_size))
        self.gate_up_proj = MergedLinear(hidden_size, parts, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, collectives)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, hidden_size]``; returns ``[T, hidden_size]``."""
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and self.fused.takes(gate_up):
            activated = self.fused.swiglu(gate_up)
        else:
            gate, up = gate_up.split(self.gate_up_proj.sizes, dim=-1)
            activated = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(activated)
        return out
