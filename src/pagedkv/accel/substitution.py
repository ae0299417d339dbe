"""Building a copy of a module tree in which some modules are replaced, the reference untouched.

Why: an acceleration must never mutate the reference model (two runners given one model would
each see the other's kernels), yet copying the weights would double the memory. The copy made
here is of the tree only: every new module holds the same parameter and buffer tensors as the
module it copies, and a substitute is a subclass instance holding its reference's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

Module = TypeVar("Module", bound=nn.Module)

#: Given a module of the copy (its children already copied and substituted), the module to put
#: in its place, or ``None`` to keep it.
Substitute = Callable[[nn.Module], nn.Module | None]


def as_subclass(module: nn.Module, cls: type[Module], **attributes: object) -> Module:
    """A new ``cls`` holding ``module``'s state: the same parameters, buffers and children, and
    the same attributes, plus ``attributes`` (``cls`` a subclass of ``type(module)`` whose own
    attributes are those). ``module`` is left as it was.

    Raises:
        TypeError: ``cls`` is not a subclass of ``module``'s class.
    """
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} does not substitute {type(module).__name__}")
    new = cls.__new__(cls)
    # nn.Module keeps its parameters, buffers, children and hooks in dicts of its own: copied,
    # so that changing the new module's never changes the reference's.
    for key, value in module.__dict__.items():
        new.__dict__[key] = value.copy() if isinstance(value, dict) else value
    for name, value in attributes.items():
        setattr(new, name, value)
    return new


def substituted_copy(model: Module, substitute: Substitute) -> Module:
    """A copy of ``model``'s module tree, bottom-up, where ``substitute`` replaces modules.

    The copy shares every tensor with ``model``; ``model`` and its modules are not changed, so
    it stays the reference another runner may be given.
    """
    copied: dict[int, nn.Module] = {}

    def copy(module: nn.Module) -> nn.Module:
        known = copied.get(id(module))
        if known is not None:  # a module held twice (a tied submodule) stays one module
            return known
        new = as_subclass(module, type(module))
        for name, child in module._modules.items():
            new._modules[name] = None if child is None else copy(child)
        placed = substitute(new)
        result = new if placed is None else placed
        copied[id(module)] = result
        return result

    root = copy(model)
    if not isinstance(root, type(model)):
        raise TypeError(f"the root {type(model).__name__} was replaced by {type(root).__name__}")
    return root
