"""The mark of a module whose forward launches this room's Triton kernels (ENG-220), in a
module of its own that imports no triton: the option's resolution asks whether a model holds
such modules without importing the kernels (PST-046)."""

from __future__ import annotations

from torch import nn


class TritonSubstitute:
    """Mixed into each substitute of :mod:`pagedkv.accel.cuda.fused_modules`."""


def has_triton_substitutes(model: nn.Module) -> bool:
    """Whether any module of ``model`` is a :class:`TritonSubstitute`."""
    return any(isinstance(m, TritonSubstitute) for m in model.modules())
