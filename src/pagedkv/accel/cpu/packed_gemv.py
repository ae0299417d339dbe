"""Products of few rows with a packed weight, read where oneDNN keeps it, by small C kernels
built on first use by :mod:`pagedkv.native.build`: one to four rows by ``native/packed_gemv.c``
(ENG-117), bfloat16 products of 1 to 32 rows in the AMX layout on the AMX tiles by
``native/amx_gemm.c`` where the CPU has them (ENG-118; faster than ``packed_gemv.c`` at every
row count there), and products of 5 to 8 rows with weights in 64-output
blocks (float32; bfloat16 where the CPU has no AMX) by the wide entries of
``native/packed_gemv.c`` (ENG-119).

Why: a decode step of a few sequences multiplies a few rows by every weight of the model, so
it only streams the weights, and oneDNN's kernel streams them below the memory's rate; with
more rows oneDNN's AMX kernel still streams a bfloat16 weight slowly (``bench/kernels.md`` has
the figures). Products of more rows stay with oneDNN, whose blocked kernels reuse each weight
across many rows.

The kernel reads the layouts :mod:`pagedkv.accel.cpu.packed_layout` checks byte for byte; a layer
whose packed weight is in any other layout keeps oneDNN for every product. It sums in float32
in its own order, so float32 results differ from oneDNN's in the last places (as oneDNN's
differ from MKL's), and bfloat16 results are rounded once, from float32 (ENG-117).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from pagedkv.accel.cpu.packed_layout import AMX_LAYOUT, BlockedLayout, PackedWeight
from pagedkv.native.build import BuildFailure, entry_address, load_library

#: The kernel's C source, shipped with the package.
SOURCE = Path(__file__).with_name("native") / "packed_gemv.c"

#: The most rows a product may have to run in ``packed_gemv.c`` (its MAX_ROWS).
MAX_ROWS = 4

#: The kernel of bfloat16 products of more rows, on the AMX tiles.
AMX_SOURCE = Path(__file__).with_name("native") / "amx_gemm.c"

#: The most rows a bfloat16 product may have to run in ``amx_gemm.c`` (its MAX_ROWS).
AMX_ROWS = 32

#: The most rows a product with a weight in a layout of :data:`WIDE_ENTRIES` may have to run
#: in ``packed_gemv.c``'s wide entries (its WIDE_ROWS).
WIDE_ROWS = 8

#: The layouts of 64-output blocks, each with its wide entry point and the function that says
#: whether this build has it (AVX-512 for float32, the bfloat16 dot product for bfloat16).
WIDE_ENTRIES = {
    "AB16b64a": ("gemv_f32_wide", "f32_wide_ready"),
    "AB16b64a2b": ("gemv_bf16_o64_wide", "bf16_wide_ready"),
}

#: The entry points' argument types: weight, x, x's row stride, bias, out, out's row stride,
#: rows, out features, in features, threads.
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_GEMV: list[Any] = [_POINTER, _POINTER, _SIZE, _POINTER, _POINTER, *[_SIZE] * 4, ctypes.c_int]


def _entry(library: ctypes.CDLL, name: str) -> Any:
    entry = getattr(library, name)
    entry.argtypes = _GEMV
    entry.restype = ctypes.c_int
    return entry


class PackedGemv:
    """The kernels, for float32 and bfloat16. Build them with :meth:`build`; a product runs
    here only if :meth:`takes` accepts it
    (:class:`~pagedkv.accel.cpu.packed_linear.PackedProduct` asks first)."""

    def __init__(self, library: ctypes.CDLL, amx: ctypes.CDLL | None = None) -> None:
        #: The entry point of each layout the kernel reads, by the layout's name.
        self._entries: dict[str, Any] = {
            layout: _entry(library, name)
            for layout, name in (
                ("AB16b64a", "gemv_f32"),
                ("AB16b32a2b", "gemv_bf16"),
                ("AB16b64a2b", "gemv_bf16_o64"),
            )
        }
        #: The entry points of 5 to WIDE_ROWS rows, by layout name, where this build has them
        #: (ENG-119).
        self._wide: dict[str, Any] = {
            layout: _entry(library, name)
            for layout, (name, ready) in WIDE_ENTRIES.items()
            if getattr(library, ready)() == 1
        }
        #: The AMX entry point, or None where the CPU (or Linux) gives no tiles.
        self._amx: Any = None
        if amx is not None and amx.amx_ready() == 1:
            self._amx = _entry(amx, "amx_gemm_bf16")

    @classmethod
    def build(
        cls, folder: Path | None = None, extra_flags: tuple[str, ...] = ()
    ) -> PackedGemv | BuildFailure:
        """The kernels, built if needed (with ``extra_flags``: ``-DPAGEDKV_PORTABLE`` builds
        the paths of a CPU without a bfloat16 dot product or AMX); the reason they cannot be.
        Where only the AMX kernel fails to build, products of more than :data:`MAX_ROWS` rows
        stay with oneDNN."""
        library = load_library(SOURCE, folder, extra_flags)
        if isinstance(library, BuildFailure):
            return library
        amx = load_library(AMX_SOURCE, folder, extra_flags)
        return cls(library, None if isinstance(amx, BuildFailure) else amx)

    def max_rows(self, layout: BlockedLayout) -> int:
        """The most rows a product with a weight in ``layout`` may have to run here."""
        if layout.name == AMX_LAYOUT.name and self._amx is not None:
            return AMX_ROWS
        if layout.name in self._wide:
            return WIDE_ROWS
        return MAX_ROWS

    def _entry(self, name: str, rows: int) -> Any:
        """The entry point of ``rows`` rows (1 or more) with a weight in the layout ``name``:
        the AMX kernel for all of its layout's where the tiles are there (ENG-118), else this
        file's for 1 to :data:`MAX_ROWS` and the wide entries' for more (ENG-119); ``None``
        where none takes that many."""
        if name == AMX_LAYOUT.name and self._amx is not None:
            return self._amx if rows <= AMX_ROWS else None
        if rows <= MAX_ROWS:
            return self._entries.get(name)
        return self._wide.get(name) if rows <= WIDE_ROWS else None

    def entry_address(self, layout: BlockedLayout, rows: int) -> int | None:
        """The entry point :meth:`product` calls for ``rows`` rows (1 or more) with a weight
        in ``layout``, for C code that calls it (``decode_layers.c``); ``None`` where no
        kernel here takes that many."""
        entry = self._entry(layout.name, rows)
        return None if entry is None else entry_address(entry)

    def reads(self, weight: PackedWeight | None) -> bool:
        """Whether the kernel reads ``weight``'s layout (``None``: a layout not known)."""
        return weight is not None and weight.layout.name in self._entries

    def takes(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> bool:
        """Whether the product of ``x`` ``[..., in]`` with ``weight`` runs here: at most
        :meth:`max_rows` rows of the weight's dtype on the CPU, each contiguous, a bias (if
        any) of that dtype, and not inside ``torch.compile``."""
        dtype = weight.layout.dtype
        return (
            x.dtype == dtype
            and x.device.type == "cpu"
            and x.stride(-1) == 1
            and x.numel() <= self.max_rows(weight.layout) * x.shape[-1]
            and (bias is None or bias.dtype == dtype)
            and not torch.compiler.is_compiling()
        )

    def product(
        self,
        x: torch.Tensor,
        weight: PackedWeight,
        out_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` ``[..., in]`` that :meth:`takes` accepts, ``W`` the
        ``[out_features, in]`` weight packed in ``weight``; a new ``[..., out_features]``."""
        in_features = x.shape[-1]
        rows = x.reshape(-1, in_features) if x.dim() != 2 else x
        if rows.shape[0] > 1 and rows.stride(0) < in_features:
            rows = rows.contiguous()
        # Every tensor whose pointer the kernel reads is held by a name until it returns.
        bias = None if bias is None else bias.detach().contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
        name = weight.layout.name
        if rows.shape[0] > 0:
            entry = self._entry(name, rows.shape[0])
            failed = entry is None or entry(
                weight.address,
                rows.data_ptr(),
                rows.stride(0),
                None if bias is None else bias.data_ptr(),
                out.data_ptr(),
                out.stride(0),
                rows.shape[0],
                out_features,
                in_features,
                torch.get_num_threads(),
            )
            if failed:
                most = self.max_rows(weight.layout)
                raise ValueError(
                    f"the packed product of {name} takes 1 to {most} rows, not "
                    f"{rows.shape[0]}, or its scratch could not be allocated"
                )
        return out.reshape(*x.shape[:-1], out_features)
