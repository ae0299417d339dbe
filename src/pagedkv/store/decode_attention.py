"""Decode attention in one pass over the pool: the gather fused into the products (PST-008).

A decode group is ``n`` sequences with one query row each, over ``W`` gathered positions. The
plain path (:func:`pagedkv.store.ragged_attention.ragged_attention`) copies those positions
out of the pool (``n * W`` rows of K and of V), converts a 16-bit copy to float32 (PST-018) and
hands the copies to SDPA: every K/V byte is written once and read three times. Here the same
attention is written as elementwise products and reductions over ``keys[kv_index]``, and
compiled by inductor with dynamic shapes: inductor turns the indexing into indirect loads
inside the reduction loops, so each position is read from the pool once, in its own dtype, and
converted in registers: faster than the gathered path in both dtypes (``bench/kernels.md`` has
the figures). The fused pass still reads far below the memory's rate: inductor puts the loop
over the width inside the 16-lane loop over the head dimension, so every 16 values cost an
indirect load and its scalar index work.

One compiled function serves every shape: dynamic shapes, so a new batch size or width reuses
the compiled kernel; inductor compiles again only for another dtype, head shape or a size of 1
(which it specialises), seconds each, the first in a process tens of seconds with a cold
cache. Groups of fewer than :attr:`CompiledDecode.min_seqs` sequences keep the gathered path,
and so does every group where inductor finds no C++ compiler (:func:`can_compile`). The store
uses this pass for float16 pools; float32 and bfloat16 pools read through the C kernel of
:mod:`pagedkv.store.native_decode`, which hands over to :func:`decode_attention` inside
``torch.compile``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch._inductor.cpp_builder import get_cpp_compiler


class DecodeKernel(Protocol):
    """A decode group's attention without a gathered copy (PST-008); see
    :func:`decode_attention` for the arguments and the result."""

    #: Fewest sequences of a group worth this kernel (smaller groups are gathered).
    min_seqs: int
    #: Whether it reads only each sequence's first ``lengths[b]`` positions, so that a
    #: group's slot index padded to any width costs no reads: the store then lays every
    #: decoding sequence of a step out as one group (PST-017).
    reads_each_context: bool

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        kv_index: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_index: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query row per sequence over its gathered context, in float32.

    Args:
        query: ``[n, heads, D]``.
        keys, values: the flat pool ``[N, kv_heads, D]`` (``kv_heads`` divides ``heads``).
        kv_index: ``[n, W]`` int64 slots of each sequence's positions; every entry a slot of
            the pool (a padded entry re-reads a written one, PST-013).
        lengths: ``[n]`` int64 context of each sequence, in ``1..W``: position ``p`` attends
            while ``p < lengths[b]``.
        scale: the scores' factor.

    Returns:
        ``[n, heads, D]`` in ``query``'s dtype, rounded once from float32.
    """
    n, width = kv_index.shape
    kv_heads, dim = keys.shape[1], keys.shape[2]
    group = query.shape[1] // kv_heads
    q = query.reshape(n, 1, kv_heads, group, dim).float()
    k = keys[kv_index].reshape(n, width, kv_heads, 1, dim).float()
    scores = (q * k).sum(-1) * scale  # [n, W, kv_heads, group]
    past = torch.arange(width, device=lengths.device)[None, :] >= lengths[:, None]
    scores = scores.masked_fill(past.reshape(n, width, 1, 1), float("-inf"))
    weights = torch.softmax(scores, dim=1)
    v = values[kv_index].reshape(n, width, kv_heads, 1, dim).float()
    out = (weights[..., None] * v).sum(1)  # [n, kv_heads, group, D]
    return out.reshape(n, kv_heads * group, dim).to(query.dtype)


def can_compile() -> bool:
    """Whether inductor finds the C++ compiler it builds the fused kernel with."""
    try:
        get_cpp_compiler()
    except Exception:  # inductor's InvalidCxxCompiler, or the search's own failure
        return False
    return True


class CompiledDecode:
    """:func:`decode_attention` compiled by inductor with dynamic shapes (compiled on its
    first call)."""

    #: A lone sequence's gather is small, and the compiled call's own cost (guards and
    #: launch, about 0.15 ms per layer) made float32 batch-1 decode 3-5% slower compiled.
    min_seqs = 2
    #: The formulation reads every position of the group's width, masking the padding.
    reads_each_context = False

    def __init__(self) -> None:
        self._compiled = torch.compile(decode_attention, dynamic=True)

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        kv_index: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        out: torch.Tensor = self._compiled(query, keys, values, kv_index, lengths, scale)
        return out
