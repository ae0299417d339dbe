"""Paged decode attention, split over the context (split-K), read through the page table.

The design of vLLM's Triton decode attention (itself from LightLLM and SGLang): a decoding
sequence has one query row, too little work for one program per sequence and head to keep a
GPU busy at small batches, so each sequence's context is cut into splits that run in
parallel.

* Stage 1, grid ``(sequences, kv_heads, splits)``: a program takes every query head of
  one KV head (GQA: the K/V tile is loaded once for the group, the heads being the rows of a
  ``tl.dot``), walks its split of the context a tile of ``BLOCK_N`` positions at a time,
  finding each position's slot through the page table (``page_tables[seq, pos // page_size]
  * page_size + pos % page_size``), and keeps an online softmax (running max, running sum,
  rescaled accumulator). It writes the split's normalised output and its log-sum-exp.
* Stage 2, grid ``(sequences, heads)``: merges the splits, each weighted by
  ``exp(lse_split - max_lse) / sum``: the rescale by the largest log-sum-exp keeps the merge
  exact and finite whatever the scores' range.

Only positions below a sequence's context are read: the page table's padding and the stale
tail of its last page never are. A sequence of context 0 (a padded row of a fixed-size batch)
reads nothing and gets zeros. Every tile enters ``tl.dot`` in float32 at IEEE precision (not
TF32): a decode is bound by its reads, not its products, and a 16-bit result is then the
float32 one rounded once (PST-018). The number of splits is the smallest power of two, at
most :data:`~pagedkv.accel.cuda.kernel_shapes.MAX_DECODE_SPLITS`, whose splits of one tile
each cover the step's longest decoding context
(:func:`~pagedkv.accel.cuda.kernel_shapes.decode_splits`): a short step is not cut into
programs that read nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.accel.cuda.kernel_shapes import DECODE_BLOCK_N, block_of

#: The log-sum-exp of an empty split: finite, so the merge needs no special case, and so far
#: below any real one that its weight is exactly 0.
EMPTY_LSE = -1.0e30


@triton.jit  # type: ignore[untyped-decorator]
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    key_pool_ptr,
    value_pool_ptr,
    page_tables_ptr,
    context_lens_ptr,
    rows_ptr,
    seqs_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_query_row,
    stride_query_head,
    stride_pool_slot,
    stride_pool_head,
    stride_table,
    stride_part_seq,
    stride_part_head,
    stride_part_split,
    stride_lse_seq,
    stride_lse_head,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EMPTY_LSE: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seqs_ptr + item).to(tl.int64)
    row = tl.load(rows_ptr + item).to(tl.int64)
    context = tl.load(context_lens_ptr + seq).to(tl.int32)
    share = tl.cdiv(context, NUM_SPLITS)
    length = tl.cdiv(share, BLOCK_N) * BLOCK_N
    start = split * length
    end = tl.minimum(start + length, context)

    group = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    query = tl.load(
        query_ptr + row * stride_query_row + heads[:, None] * stride_query_head + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = page_tables_ptr + seq * stride_table
    for tile in range(start, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        inside = positions < end
        pages = tl.load(table + positions // PAGE_SIZE, mask=inside, other=0).to(tl.int64)
        slots = pages * PAGE_SIZE + positions % PAGE_SIZE
        at = slots[:, None] * stride_pool_slot + kv_head * stride_pool_head + dims[None, :]
        tile_mask = inside[:, None] & dim_ok[None, :]
        keys = tl.load(key_pool_ptr + at, mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.dot(query, tl.trans(keys), input_precision="ieee") * scale
        scores = tl.where(inside[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        weights = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        # Everything stays float32 (a decode is bound by its reads, not its products), so a
        # 16-bit result is rounded once, at the end (PST-018).
        values = tl.load(value_pool_ptr + at, mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision="ieee")
        running_max = new_max

    filled = running_sum > 0.0
    out = acc / tl.where(filled, running_sum, 1.0)[:, None]
    lse = tl.where(filled, running_max + tl.log(tl.where(filled, running_sum, 1.0)), EMPTY_LSE)
    item64 = item.to(tl.int64)
    part = item64 * stride_part_seq + heads * stride_part_head + split * stride_part_split
    tl.store(
        part_out_ptr + part[:, None] + dims[None, :], out, mask=head_ok[:, None] & dim_ok[None, :]
    )
    lse_at = item64 * stride_lse_seq + heads * stride_lse_head + split
    tl.store(part_lse_ptr + lse_at, lse, mask=head_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_merge_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,
    part_lse_ptr,
    rows_ptr,
    out_ptr,
    stride_part_seq,
    stride_part_head,
    stride_part_split,
    stride_lse_seq,
    stride_lse_head,
    stride_out_row,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + item).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    item64 = item.to(tl.int64)
    lse_base = part_lse_ptr + item64 * stride_lse_seq + head * stride_lse_head
    splits = tl.arange(0, NUM_SPLITS)
    lses = tl.load(lse_base + splits)
    largest = tl.max(lses, 0)
    shares = tl.exp(lses - largest)
    # A split that read nothing has EMPTY_LSE: weight 0 beside any real split; where every
    # split is empty (context 0) all shares are 1 and every part is 0, so the output is 0.
    total = tl.sum(shares, 0)
    base = part_out_ptr + item64 * stride_part_seq + head * stride_part_head
    parts = tl.load(
        base + splits[:, None] * stride_part_split + dims[None, :],
        mask=dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * shares[:, None], 0) / total
    tl.store(
        out_ptr + row * stride_out_row + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def paged_decode(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    page_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows: torch.Tensor,
    seqs: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    page_size: int,
    num_splits: int,
) -> None:
    """Attention of the decode rows ``rows[i]`` of ``query`` (sequence ``seqs[i]``, over its
    first ``context_lens[seqs[i]]`` positions), written to the same rows of ``out``.

    Args:
        query: ``[T, heads, head_dim]``, the last dimension contiguous.
        key_pool, value_pool: ``[num_slots, kv_heads, head_dim]``, contiguous; ``kv_heads``
            divides ``heads``.
        page_tables: ``[B, max_pages]`` integer pages of each sequence.
        context_lens: ``[B]`` integer positions of each sequence (0: a padded row, zeros out).
        rows, seqs: ``[n]`` integer query rows and their sequences.
        out: ``[T, heads, head_dim]``, the last dimension contiguous; only ``rows`` are written.
        scale: the scores' factor.
        page_size: positions per page.
        num_splits: splits of each context, a power of two
            (:func:`~pagedkv.accel.cuda.kernel_shapes.decode_splits`).

    Preconditions (checked by the store's ``prepare``): every page a sequence's context
    reaches lies in the pool. No host synchronisation.
    """
    count = rows.shape[0]
    if count == 0:
        return
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key_pool.shape[1]
    group = heads // kv_heads
    block_d = block_of(head_dim)
    parts = torch.empty(
        (count, heads, num_splits, block_d), dtype=torch.float32, device=query.device
    )
    lses = torch.empty((count, heads, num_splits), dtype=torch.float32, device=query.device)
    _decode_split_kernel[(count, kv_heads, num_splits)](
        query,
        key_pool,
        value_pool,
        page_tables,
        context_lens,
        rows,
        seqs,
        parts,
        lses,
        query.stride(0),
        query.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        page_tables.stride(0),
        parts.stride(0),
        parts.stride(1),
        parts.stride(2),
        lses.stride(0),
        lses.stride(1),
        scale,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        BLOCK_H=block_of(group),
        BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N,
        EMPTY_LSE=EMPTY_LSE,
    )
    _decode_merge_kernel[(count, heads)](
        parts,
        lses,
        rows,
        out,
        parts.stride(0),
        parts.stride(1),
        parts.stride(2),
        lses.stride(0),
        lses.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_D=block_d,
    )
