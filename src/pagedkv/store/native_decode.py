"""Paged decode attention as a small C kernel, built on first use with the machine's C compiler.

The kernel (``native/paged_decode.c``) takes one query row per sequence and each sequence's
slots, and reads every key and value row once where it lies in the pool, in its own dtype
(float32 or bfloat16), converting to float32 as it goes; positions past a sequence's context
are never read. Its work is shared over torch's own OpenMP threads (see
:mod:`pagedkv.native.build`), at ``torch.get_num_threads()`` threads, a task per sequence
(per part of its KV heads where sequences are few). Where the CPU has AVX-512 and the head
dimension is a multiple of 16 it runs 16-lane code (holding a head's rows in registers up to
128 channels, Qwen3's), else portable loops (PST-041).

It is faster than the other two paths (gathered into SDPA, and compiled by inductor:
:class:`~pagedkv.store.decode_attention.CompiledDecode`) in both dtypes, for one sequence as
for many, so groups of any size use it. In a model's pool, larger than the cache, the kernel
asks for rows a few positions ahead (``AHEAD`` in the source); with the 16-lane code and the
task per sequence, one layer's bfloat16 decode of 32 sequences reads at about the machine's
rate (PST-041's rationale; ``bench/kernels.md`` has the figures).

The library is built on first use by :mod:`pagedkv.native.build` (once per source, compiler
and CPU, with ``-O3 -march=native``); where it cannot be built, :meth:`NativeDecode.build`
returns the :class:`~pagedkv.native.build.BuildFailure` with the reason, and the store falls
back. Inside ``torch.compile`` (a compiled decode step, ENG-115) the kernel hands over to
:func:`~pagedkv.store.decode_attention.decode_attention`, which inductor compiles into the
step, since a foreign call would break the graph.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from pagedkv.native.build import BuildFailure, entry_address, load_library
from pagedkv.store.decode_attention import decode_attention

#: The kernel's C source, shipped with the package.
SOURCE = Path(__file__).with_name("native") / "paged_decode.c"

#: Pool dtypes the kernel reads: the entry point's first argument for each.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

#: The entry point's argument types: the pool's and the query's dtype codes, six pointers,
#: five sizes, scale, threads.
_ARGTYPES: list[Any] = (
    [ctypes.c_int] * 2
    + [ctypes.c_void_p] * 6
    + [ctypes.c_int64] * 5
    + [ctypes.c_float, ctypes.c_int]
)


class NativeDecode:
    """The C kernel for one pool dtype, as a
    :class:`~pagedkv.store.decode_attention.DecodeKernel`. Build it with :meth:`build`."""

    #: Even one sequence reads faster here than gathered (see the module docstring).
    min_seqs = 1
    #: Positions at or past a sequence's length are never read.
    reads_each_context = True

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._entry = library.paged_decode
        self._entry.argtypes = _ARGTYPES
        self._entry.restype = ctypes.c_int
        self._code = DTYPE_CODES[dtype]

    @property
    def address(self) -> int:
        """The kernel's entry point, for C code that calls it (``decode_layers.c``)."""
        return entry_address(self._entry)

    @classmethod
    def build(cls, dtype: torch.dtype, folder: Path | None = None) -> NativeDecode | BuildFailure:
        """The kernel for pools of ``dtype``, built if needed; the reason it cannot be."""
        if dtype not in DTYPE_CODES:
            return BuildFailure(f"the C kernel reads float32 and bfloat16 pools, not {dtype}")
        library = load_library(SOURCE, folder)
        return library if isinstance(library, BuildFailure) else cls(library, dtype)

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        kv_index: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """See :func:`~pagedkv.store.decode_attention.decode_attention`; ``keys`` and
        ``values`` are contiguous CPU pools of this kernel's dtype (the store's own)."""
        if torch.compiler.is_compiling():
            return decode_attention(query, keys, values, kv_index, lengths, scale)
        n, width = kv_index.shape
        heads, dim = query.shape[1], query.shape[2]
        # A bfloat16 query is read, and its result written, by the kernel itself (PST-009).
        query_code = DTYPE_CODES.get(query.dtype, 0)
        q = (query if query_code else query.to(torch.float32)).contiguous()
        index = kv_index.contiguous()
        lens = lengths.to(torch.int64).contiguous()
        out = torch.empty(n, heads, dim, dtype=q.dtype)
        failed = self._entry(
            self._code,
            query_code,
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            index.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            n,
            width,
            heads,
            keys.shape[1],
            dim,
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("paged decode attention could not allocate its score buffers")
        return out if out.dtype == query.dtype else out.to(query.dtype)
