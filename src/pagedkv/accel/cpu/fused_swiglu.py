"""The SwiGLU activation ``silu(gate) * up`` in one call, as a small C kernel
(``native/swiglu.c``) built on first use by :mod:`pagedkv.native.build`.

Why: in torch the activation is a split of the merged gate/up product into two views, a silu
and a product, each an operator dispatch with its own output tensor; a Qwen3 layer runs one,
so a decode step pays three dispatches and two allocations per layer for a few kilobytes of
arithmetic. The kernel reads the merged product in place and writes the activation once, in
about half the time of torch's three operators (``bench/kernels.md``).

The kernel repeats torch's arithmetic with its roundings (the C file says which); only its
exp differs from the one torch calls, by about a unit in the last place, so float32 results
agree with torch's to a unit or two in the last place and bfloat16 ones almost always exactly
(ENG-159). Inside ``torch.compile`` the torch formulation runs instead (inductor fuses it into
the step), and so it does for a dtype or device the kernel was not built for.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedkv.accel.substitution import as_subclass
from pagedkv.model.layers import SwiGLUMLP
from pagedkv.native.build import BuildFailure, entry_address, load_library

#: The kernel's C source, shipped with the package.
SOURCE = Path(__file__).with_name("native") / "swiglu.c"

#: No fused multiply-add: every product is rounded before it is summed, as torch rounds it.
EXTRA_FLAGS = ("-ffp-contract=off",)

#: Dtypes the kernel computes in: the entry point's first argument for each.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

#: The entry point's argument types: dtype code, input, row stride, output, rows, width,
#: threads.
_INT, _POINTER, _SIZE = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
_ARGTYPES: list[Any] = [_INT, _POINTER, _SIZE, _POINTER, _SIZE, _SIZE, _INT]


class FusedSwiGLU:
    """The kernel for one dtype on the CPU. Build it with :meth:`build`; a call is made only
    for products :meth:`takes` accepts (:class:`FusedSwiGLUMLP` asks first),
    others stay with torch."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._swiglu = library.swiglu
        self._swiglu.argtypes = _ARGTYPES
        self._swiglu.restype = None
        self.dtype = dtype
        self._code = DTYPE_CODES[dtype]

    @property
    def address(self) -> int:
        """The entry point ``swiglu``, for C code that calls it (``decode_layers.c``)."""
        return entry_address(self._swiglu)

    @classmethod
    def build(
        cls, dtype: torch.dtype, folder: Path | None = None, extra_flags: tuple[str, ...] = ()
    ) -> FusedSwiGLU | BuildFailure:
        """The kernel for ``dtype``, built if needed (with ``extra_flags``:
        ``-DPAGEDKV_PORTABLE`` builds the path without AVX-512); the reason it cannot be."""
        if dtype not in DTYPE_CODES:
            return BuildFailure(f"the fused SwiGLU computes in float32 and bfloat16, not {dtype}")
        library = load_library(SOURCE, folder, (*EXTRA_FLAGS, *extra_flags))
        return library if isinstance(library, BuildFailure) else cls(library, dtype)

    def takes(self, gate_up: torch.Tensor) -> bool:
        """Whether this kernel computes the activation of ``gate_up`` ``[T, 2 * width]``: of
        its dtype on the CPU, each row contiguous, and not inside ``torch.compile``."""
        return (
            gate_up.dtype == self.dtype
            and gate_up.dim() == 2
            and gate_up.device.type == "cpu"
            and gate_up.stride(-1) == 1
            and not torch.compiler.is_compiling()
        )

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[T, 2 * width]`` (gate the first ``width``
        columns, up the rest): a new contiguous ``[T, width]``.

        Raises:
            ValueError: an odd number of columns (no gate and up of one width).
        """
        rows, columns = gate_up.shape
        if columns % 2:
            raise ValueError(f"gate and up of one width take an even row, not {columns}")
        width = columns // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self._swiglu(
            self._code,
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            rows,
            width,
            torch.get_num_threads(),
        )
        return out


class FusedSwiGLUMLP(SwiGLUMLP):
    """A :class:`~pagedkv.model.layers.SwiGLUMLP` whose activation runs through the kernel
    where it takes the product, the reference formulation elsewhere. Build it with
    :meth:`substitute`."""

    kernel: FusedSwiGLU

    @classmethod
    def substitute(cls, mlp: SwiGLUMLP, kernel: FusedSwiGLU) -> FusedSwiGLUMLP:
        """``mlp``'s substitute (its projections shared), ``mlp`` not changed."""
        return as_subclass(mlp, cls, kernel=kernel)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the merged product ``gate_up`` ``[T, 2 * intermediate]``."""
        if self.kernel.takes(gate_up):
            return self.kernel.swiglu(gate_up)
        return super().activation(gate_up)


def has_fused_swiglu(model: nn.Module) -> bool:
    """Whether any dense MLP of ``model`` is a :class:`FusedSwiGLUMLP`."""
    return any(isinstance(m, FusedSwiGLUMLP) for m in model.modules())
