"""Varlen paged attention for prefill and chunked prefill: many sequences in one launch.

The design of vLLM's Triton unified attention: the step's new K/V are written to the pages
first (the store kernel), so every key a query row sees is read from the pages through the
sequence's page table, whether an earlier chunk or this one wrote it. Sequence ``b`` owns
query rows ``query_start[b]:query_start[b+1]``, its last ``q_len`` positions of
``context_len``; its row ``j`` is position ``context_len - q_len + j`` and sees positions up to
it (causal among the new rows, everything before them).

Grid ``(sequences, kv_heads, query tiles)``: a program takes ``BLOCK_Q`` query rows of one
sequence together with every query head of one KV head, the ``BLOCK_Q * group`` (row, head)
pairs being the rows of its ``tl.dot`` tiles (GQA: each K/V tile is loaded once for the whole
group), and walks the context a tile of ``BLOCK_N`` positions at a time with an online
softmax, stopping after the last position its last row sees. Query tiles past a sequence's
rows return at once: the grid is sized by the step's longest chunk, no buffer is padded.
Scores and sums are float32; tiles enter ``tl.dot`` in the pool's dtype (float32 at IEEE
precision), the weights rounded to it as flash attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.accel.cuda.kernel_shapes import DOT_MIN, block_of

#: Context positions per tile.
BLOCK_N = 32
#: (row, head) pairs per program: ``BLOCK_Q = BLOCK_M // group`` query rows (at least one).
BLOCK_M = 32


@triton.jit  # type: ignore[untyped-decorator]
def _prefill_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    key_pool_ptr,
    value_pool_ptr,
    out_ptr,
    page_tables_ptr,
    context_lens_ptr,
    query_start_ptr,
    seqs_ptr,
    stride_query_row,
    stride_query_head,
    stride_out_row,
    stride_out_head,
    stride_pool_slot,
    stride_pool_head,
    stride_table,
    scale,
    GROUP: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    query_tile = tl.program_id(2)
    seq = tl.load(seqs_ptr + item).to(tl.int64)
    first_row = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_ptr + seq + 1) - first_row).to(tl.int32)
    if query_tile * BLOCK_Q >= q_len:
        return
    context = tl.load(context_lens_ptr + seq).to(tl.int32)
    before = context - q_len  # positions of earlier chunks

    pairs = tl.arange(0, BLOCK_M)
    local = query_tile * BLOCK_Q + pairs // GROUP_BLOCK  # row of the chunk
    member = pairs % GROUP_BLOCK  # query head within the KV head's group
    heads = kv_head * GROUP + member
    pair_ok = (local < q_len) & (member < GROUP)
    rows = first_row + local
    seen = before + local  # the last position each row sees
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    kv_type = tl.float32 if UPCAST else key_pool_ptr.dtype.element_ty
    query = tl.load(
        query_ptr
        + rows[:, None] * stride_query_row
        + heads[:, None] * stride_query_head
        + dims[None, :],
        mask=pair_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(kv_type)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = page_tables_ptr + seq * stride_table
    last_row = tl.minimum(q_len, (query_tile + 1) * BLOCK_Q) - 1
    stop = before + last_row + 1  # positions the tile's last row sees
    for tile in range(0, stop, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        inside = positions < stop
        pages = tl.load(table + positions // PAGE_SIZE, mask=inside, other=0).to(tl.int64)
        slots = pages * PAGE_SIZE + positions % PAGE_SIZE
        at = slots[:, None] * stride_pool_slot + kv_head * stride_pool_head + dims[None, :]
        tile_mask = inside[:, None] & dim_ok[None, :]
        keys = tl.load(key_pool_ptr + at, mask=tile_mask, other=0.0).to(kv_type)
        scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * scale
        visible = inside[None, :] & (positions[None, :] <= seen[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Position 0 is in the first tile and every row sees it, so each row's maximum is
        # finite from the first tile on; a row that sees nothing of a later tile keeps it.
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        weights = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        values = tl.load(value_pool_ptr + at, mask=tile_mask, other=0.0).to(kv_type)
        acc = acc * rescale[:, None] + tl.dot(
            weights.to(kv_type), values, input_precision=PRECISION
        )
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=pair_ok[:, None] & dim_ok[None, :],
    )


def paged_prefill(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    page_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    seqs: torch.Tensor,
    longest: int,
    out: torch.Tensor,
    scale: float,
    page_size: int,
    upcast: bool = False,
) -> None:
    """Causal attention of the rows of sequences ``seqs`` (each its rows
    ``query_start[b]:query_start[b+1]``, the last of its ``context_lens[b]`` positions) over
    their paged context, written to the same rows of ``out``.

    Args:
        query: ``[T, heads, head_dim]``, the last dimension contiguous.
        key_pool, value_pool: ``[num_slots, kv_heads, head_dim]``, contiguous, holding every
            position of each context, this step's included; ``kv_heads`` divides ``heads``.
        page_tables: ``[B, max_pages]`` integer pages of each sequence.
        context_lens: ``[B]`` integer positions of each sequence.
        query_start: ``[B+1]`` integer row offsets.
        seqs: ``[n]`` integer sequences to attend.
        longest: the most rows any of them has (sizes the grid).
        out: ``[T, heads, head_dim]``, the last dimension contiguous; only their rows are
            written.
        scale: the scores' factor.
        page_size: positions per page.
        upcast: convert the tiles to float32 before each product (Triton's interpreter
            multiplies bfloat16 tiles as their raw bits; a GPU multiplies them natively).

    Preconditions (checked by the store's ``prepare``): ``1 <= q_len <= context_len`` and
    every page a context reaches lies in the pool. No host synchronisation.
    """
    count = seqs.shape[0]
    if count == 0:
        return
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key_pool.shape[1]
    group = heads // kv_heads
    group_block = block_of(group, 1)
    block_m = max(BLOCK_M, group_block, DOT_MIN)
    block_q = block_m // group_block
    tiles = -(-longest // block_q)
    _prefill_kernel[(count, kv_heads, tiles)](
        query,
        key_pool,
        value_pool,
        out,
        page_tables,
        context_lens,
        query_start,
        seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        page_tables.stride(0),
        scale,
        GROUP=group,
        GROUP_BLOCK=group_block,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=block_of(head_dim),
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if key_pool.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
    )
