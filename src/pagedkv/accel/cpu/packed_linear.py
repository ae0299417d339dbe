"""Linear layers whose weight is repacked once for oneDNN, each one a reference linear layer.

:func:`packed` gives the substitute of a :class:`~pagedkv.model.layers.Linear` (plain,
row-parallel or merged): the same bias, the weight replaced by oneDNN's blocked copy
(:mod:`pagedkv.accel.cpu.onednn`), so the new layer holds one copy of it. Its products of a few
rows may run through a C kernel that reads the packed weight itself
(:class:`~pagedkv.accel.cpu.packed_gemv.PackedGemv`), the others through oneDNN.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.accel.cpu.onednn import onednn_linear, onednn_pack
from pagedkv.accel.cpu.packed_gemv import PackedGemv
from pagedkv.accel.cpu.packed_layout import PackedWeight, read_layout
from pagedkv.accel.substitution import as_subclass
from pagedkv.model.layers import Linear, MergedLinear, RowParallelLinear


class PackedProduct(Linear):
    """The product of a linear layer read from its packed weight; set up by :func:`packed`.

    Attributes:
        packed: the weight in oneDNN's blocked layout (an opaque tensor).
        packed_weight: its address and layout where the layout is one checked byte for byte
            (:func:`~pagedkv.accel.cpu.packed_layout.read_layout`); ``None`` otherwise.
        gemv: the kernel of products of few rows with it, or ``None``: oneDNN for all.
        plain_nbytes: bytes of the plain weight it replaced.
    """

    packed: torch.Tensor
    packed_weight: PackedWeight | None
    gemv: PackedGemv | None
    plain_nbytes: int

    def product(self, x: torch.Tensor, *, with_bias: bool) -> torch.Tensor:
        """``x @ weight.T``, plus the bias (if any) when ``with_bias``."""
        bias = self.bias if with_bias else None
        weight = self.packed_weight
        if self.gemv is not None and weight is not None and self.gemv.takes(x, weight, bias):
            return self.gemv.product(x, weight, self.out_features, bias)
        return onednn_linear(x, self.packed, bias)


class PackedLinear(PackedProduct):
    """A packed :class:`~pagedkv.model.layers.Linear`."""


class PackedRowParallelLinear(PackedProduct, RowParallelLinear):
    """A packed :class:`~pagedkv.model.layers.RowParallelLinear`."""


class PackedMergedLinear(PackedProduct, MergedLinear):
    """A packed :class:`~pagedkv.model.layers.MergedLinear`."""


#: The packed class of each reference linear class.
PACKED_CLASSES: dict[type[Linear], type[PackedProduct]] = {
    Linear: PackedLinear,
    RowParallelLinear: PackedRowParallelLinear,
    MergedLinear: PackedMergedLinear,
}


def packed(layer: Linear, weight: torch.Tensor | None = None) -> PackedProduct:
    """The packed substitute of ``layer`` (of a class of :data:`PACKED_CLASSES`), packing
    ``weight`` (default: its own, ``[out, in]``); ``layer`` is not changed. The substitute
    holds no plain weight, and no kernel of few rows until one is given (:attr:`gemv`).

    Raises:
        TypeError: ``layer``'s class has no packed class.
    """
    cls = PACKED_CLASSES.get(type(layer))
    if cls is None:
        raise TypeError(f"no packed class substitutes {type(layer).__name__}")
    plain = layer.weight if weight is None else weight
    new = as_subclass(layer, cls)
    new.register_parameter("weight", None)
    new.packed = onednn_pack(plain)
    new.packed_weight = read_layout(plain, new.packed)
    new.gemv = None
    new.plain_nbytes = plain.numel() * plain.element_size()
    return new


def is_packed(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` holds a packed weight."""
    return any(isinstance(m, PackedProduct) for m in model.modules())


def has_packed_gemv(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` runs products of few rows through the kernel."""
    return any(isinstance(m, PackedProduct) and m.gemv is not None for m in model.modules())
