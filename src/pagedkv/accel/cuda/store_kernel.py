"""The K/V store kernel: each new row's K and V written at its slot, padded rows skipped.

One program per row of the step: it reads the row's slot from the slot mapping and copies the
row's ``[kv_heads, head_dim]`` K and V into the pools' flat slot. Rows of another dtype than
the pool's are cast by ``Tensor.to`` first (rounding to nearest even; in a model the rows are
already of the pool's dtype, so no pass is added): Triton's interpreter truncates a float32
value cast to bfloat16 where a GPU rounds it, and the pool must hold the same bits on both.
A negative slot marks a padded row (a batch padded to a fixed size): the program returns
before touching the pools, so padding never overwrites a real row's K/V (nano-vllm's store
kernel does the same with ``-1``).
One launch per layer writes K and V together, where the reference store's two
``index_copy_`` calls are two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.accel.cuda.kernel_shapes import block_of


# Triton kernels are untyped to mypy (triton ships no type information): the decorator is Any.
@triton.jit  # type: ignore[untyped-decorator]
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    key_pool_ptr,
    value_pool_ptr,
    slots_ptr,
    stride_key_row,
    stride_key_head,
    stride_value_row,
    stride_value_head,
    stride_pool_slot,
    stride_pool_head,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # a padded row: nothing is written
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
    row64 = row.to(tl.int64)
    key = tl.load(
        key_ptr + row64 * stride_key_row + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + row64 * stride_value_row + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    at = slot * stride_pool_slot + heads[:, None] * stride_pool_head + dims[None, :]
    tl.store(key_pool_ptr + at, key, mask=mask)
    tl.store(value_pool_ptr + at, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write ``key[i]`` and ``value[i]`` at flat slot ``slots[i]`` of the pools; rows whose slot
    is negative are skipped.

    Preconditions (the store checks them in ``prepare``, once per step): ``key`` and ``value``
    ``[N, kv_heads, head_dim]`` (cast to the pools' dtype here where they differ); the pools
    ``[num_slots, kv_heads, head_dim]``, contiguous, on the device of the other tensors;
    ``slots`` ``[N]`` integer, each below ``num_slots`` and, where not negative, distinct. No
    host synchronisation.
    """
    rows, kv_heads, head_dim = key.shape
    if rows == 0:
        return
    key = key.to(key_pool.dtype)
    value = value.to(value_pool.dtype)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kv_kernel[(rows,)](
        key,
        value,
        key_pool,
        value_pool,
        slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_of(kv_heads, 1),
        BLOCK_D=block_of(head_dim, 1),
    )


def runs_interpreted() -> bool:
    """Whether the kernels of this package were defined for Triton's interpreter
    (``TRITON_INTERPRET`` set when their modules were imported): they then run on CPU tensors,
    and only there."""
    return isinstance(_store_kv_kernel, InterpretedFunction)
