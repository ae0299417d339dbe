"""A dispatch mode that shows each aten op to its subclass, the one base of the tests that count
what a block of code launches, reads back or makes, and where."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every aten op of the block it is entered around, showing it to :meth:`before`
    (before it runs, so an op that fails is seen too) and to :meth:`after` (with its result)."""

    def before(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Sees ``func`` about to run on ``args`` and ``kwargs``."""

    def after(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """Sees ``func`` having returned ``out``."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.before(func, args, kwargs)
        out = func(*args, **kwargs)
        self.after(func, args, kwargs, out)
        return out


def tensors_of(args: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors among an op's positional arguments, in order."""
    return [a for a in args if isinstance(a, torch.Tensor)]
