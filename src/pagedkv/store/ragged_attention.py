"""Causal attention over a ragged batch, planned once per step and run once per layer.

A step's sequences own consecutive query rows; sequence ``b`` has ``q_len`` rows, the last of
its ``context_len`` positions, so its row ``j`` sees positions ``0..context_len - q_len + j``.
Its keys and values sit anywhere in a flat K/V tensor (a page pool, or the step's own rows)
at indices the caller gives. :func:`plan_attention` turns that into an
:class:`AttentionLayout`, host work and all, once per step, and moves it to the device in one
copy; :func:`ragged_attention` runs the layout for one layer with no host synchronisation.

The layout batches what shapes allow: sequences with one query row (decoding) are sorted by
context length and cut into runs whose shortest context is at least :data:`DECODE_FILL` of the
longest, each run one call over a gather padded to its longest context (the padding masked and
re-reading the sequence's own position 0, written, so finite): at least that fraction of every
gathered position is real, where one call padded to the longest context of a mixed batch read
about half padding; prefill chunks of equal query and context lengths attend together, a few at
a time (:data:`GROUP_ROWS` rows), so short chunks share a call while long ones keep a working
set that fits the caches. On the CPU the store hands a kernel for decode groups
(:mod:`pagedkv.store.native_decode`, :mod:`pagedkv.store.decode_attention`), which reads the
positions where they lie instead.

This module imports torch; :mod:`pagedkv.kv` does not import it (KVM-040).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.store.decode_attention import DecodeKernel
from pagedkv.store.gather import gather_rows
from pagedkv.store.one_copy import move_once

#: Most query rows of one batched prefill call: equal-shape chunks are grouped up to this many
#: rows (a chunk longer than it runs alone). Measured on CPU: short chunks gain up to 2x from
#: sharing a call; past a few hundred rows a bigger batch no longer helps.
GROUP_ROWS = 128

#: Smallest share of real positions in a decode group's gather: a decoding sequence joins the
#: group of longer contexts while its context is at least this fraction of the group's longest.
#: Contexts spanning a factor ``r`` take at most ``1 + log(r) / log(1 / DECODE_FILL)`` calls.
DECODE_FILL = 0.7

#: The 16-bit float dtypes, whose decode attention runs in float32 on the CPU (PST-018).
HALF_DTYPES = (torch.bfloat16, torch.float16)

#: ``kv_index(seq_ids, width)``: ``[len(seq_ids), width]`` int64 flat K/V index of positions
#: ``0..width-1`` of each sequence (indices past a sequence's context are never read unmasked),
#: on the host: :func:`plan_attention` moves every group's indices to the device at once.
KVIndex = Callable[[list[int], int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended in one call.

    Attributes:
        num_seqs: sequences in the group.
        q_len: query rows of each.
        width: context positions gathered for each (the longest context of the group).
        rows: ``[num_seqs * q_len]`` int64 query rows, sequence by sequence.
        span: ``(start, stop)`` when ``rows`` are one contiguous range (then they are sliced,
            not gathered), else ``None``.
        kv_index: ``[num_seqs, width]`` int64 flat K/V index of each gathered position.
        mask: boolean mask broadcastable to ``[num_seqs, heads, q_len, width]`` (``True``
            attends), ``None`` when ``is_causal`` says it all or nothing is padded (a decode
            group whose every context is its width).
        is_causal: plain top-left causal masking (every chunk of the group is its whole
            context).
        context_lens: a decode group's ``[num_seqs]`` int64 contexts (its ``mask`` is
            ``arange(width) < context_lens``); ``None`` for prefill chunks.
    """

    num_seqs: int
    q_len: int
    width: int
    rows: torch.Tensor
    span: tuple[int, int] | None
    kv_index: torch.Tensor
    mask: torch.Tensor | None
    is_causal: bool
    context_lens: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Every group of one step, shared by all its layers. Immutable.

    Attributes:
        num_rows: query rows of the step.
        groups: the groups; together they cover every row once.
    """

    num_rows: int
    groups: tuple[AttentionGroup, ...]


def plan_attention(
    starts: Sequence[int],
    contexts: Sequence[int],
    kv_index: KVIndex,
    device: torch.device,
    group_rows: int = GROUP_ROWS,
    decode_fill: float = DECODE_FILL,
) -> AttentionLayout:
    """The layout of a batch whose sequence ``b`` owns rows ``starts[b]:starts[b+1]`` and
    attends over ``contexts[b]`` positions; decoding sequences share calls whose gathers are at
    least ``decode_fill`` real (0: one call for all), equal-shape prefill chunks share calls of
    at most ``group_rows`` rows (1: a call per chunk). Preconditions (checked by the caller):
    ``1 <= q_len <= context_len`` for every sequence; ``kv_index`` returns host tensors.

    Every group's index tensors are built on the host and reach ``device`` in ONE copy
    (PST-054): pinned and non-blocking on CUDA, where a copy per tensor from pageable memory
    would synchronise with the device each time; on the CPU nothing moves at all. The masks
    are made on the device from the moved lengths (a few positions each, never copied)."""
    num_seqs = len(contexts)
    q_lens = [starts[b + 1] - starts[b] for b in range(num_seqs)]
    groups: list[AttentionGroup] = []
    decode = [b for b in range(num_seqs) if q_lens[b] == 1]
    for seqs in _by_length(decode, contexts, decode_fill):
        groups.append(_decode_group(seqs, starts, contexts, kv_index))
    by_shape: dict[tuple[int, int], list[int]] = {}
    for b in range(num_seqs):
        if q_lens[b] > 1:
            by_shape.setdefault((q_lens[b], contexts[b]), []).append(b)
    for (q_len, context), seqs in by_shape.items():
        per_call = max(1, group_rows // q_len)
        for i in range(0, len(seqs), per_call):
            groups.append(_chunk_group(seqs[i : i + per_call], q_len, context, starts, kv_index))
    return AttentionLayout(num_rows=starts[-1], groups=_moved(groups, device))


def _moved(groups: list[AttentionGroup], device: torch.device) -> tuple[AttentionGroup, ...]:
    """``groups`` (built on the host) on ``device``: their rows, indices and lengths in one
    copy, their masks made there; the groups themselves on the CPU."""
    if device.type == "cpu" or not groups:
        return tuple(groups)
    parts: list[torch.Tensor] = []
    for group in groups:
        parts += [group.rows, group.kv_index.reshape(-1)]
        if group.context_lens is not None:
            parts.append(group.context_lens)
    moved = iter(move_once(parts, device))
    out = []
    for group in groups:
        rows, index = next(moved), next(moved).view(group.kv_index.shape)
        lengths = None if group.context_lens is None else next(moved)
        mask = None
        if group.mask is not None:
            if lengths is not None:
                mask = _padding_mask(lengths, group.width)
            else:
                mask = _causal_tail(group.q_len, group.width, device)
        out.append(
            dataclasses.replace(group, rows=rows, kv_index=index, mask=mask, context_lens=lengths)
        )
    return tuple(out)


def _by_length(seqs: list[int], contexts: Sequence[int], fill: float) -> list[list[int]]:
    """``seqs`` cut, longest context first, into runs whose every context is at least ``fill``
    of the run's longest; each run in batch order."""
    runs: list[list[int]] = []
    longest = 0
    for b in sorted(seqs, key=lambda s: -contexts[s]):
        if not runs or contexts[b] < fill * longest:
            runs.append([])
            longest = contexts[b]
        runs[-1].append(b)
    return [sorted(run) for run in runs]


def _rows(
    seqs: list[int], q_len: int, starts: Sequence[int]
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """The host rows of ``seqs``' chunks of ``q_len`` rows, and their span when contiguous."""
    first = starts[seqs[0]]
    contiguous = all(starts[b] == first + i * q_len for i, b in enumerate(seqs))
    span = (first, first + len(seqs) * q_len) if contiguous else None
    offsets = torch.tensor([starts[b] for b in seqs], dtype=torch.int64)
    rows = (offsets[:, None] + torch.arange(q_len)[None, :]).reshape(-1)
    return rows, span


def _padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, 1, 1, width]``: position ``p`` of sequence ``i`` attends when ``p < lengths[i]``;
    made where ``lengths`` lie."""
    valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    return valid[:, None, None, :]


def _causal_tail(q_len: int, context: int, device: torch.device) -> torch.Tensor:
    """``[q_len, context]`` bottom-right causal mask: row ``j`` sees ``0..context-q_len+j``."""
    positions = torch.arange(context, device=device)
    last_seen = torch.arange(context - q_len, context, device=device)
    return positions[None, :] <= last_seen[:, None]


def _decode_group(
    seqs: list[int],
    starts: Sequence[int],
    contexts: Sequence[int],
    kv_index: KVIndex,
) -> AttentionGroup:
    width = max(contexts[b] for b in seqs)
    rows, span = _rows(seqs, 1, starts)
    index = kv_index(seqs, width)
    mask = None  # every context is the width: nothing is padded (and SDPA runs unmasked)
    ctx = torch.tensor([contexts[b] for b in seqs], dtype=torch.int64)
    if any(contexts[b] < width for b in seqs):
        mask = _padding_mask(ctx, width)
        # Padding re-reads the sequence's own position 0 (always written, so finite) rather
        # than whatever the padded index holds; the mask zeroes its weight (PST-013).
        index = torch.where(mask[:, 0, 0, :], index, index[:, :1])
    return AttentionGroup(
        num_seqs=len(seqs),
        q_len=1,
        width=width,
        rows=rows,
        span=span,
        kv_index=index,
        mask=mask,
        is_causal=False,
        context_lens=ctx,
    )


def _chunk_group(
    seqs: list[int],
    q_len: int,
    context: int,
    starts: Sequence[int],
    kv_index: KVIndex,
) -> AttentionGroup:
    rows, span = _rows(seqs, q_len, starts)
    mask = None
    if q_len < context:  # a continuing chunk: bottom-right causal, shared by the group
        mask = _causal_tail(q_len, context, torch.device("cpu"))
    return AttentionGroup(
        num_seqs=len(seqs),
        q_len=q_len,
        width=context,
        rows=rows,
        span=span,
        kv_index=kv_index(seqs, context),
        mask=mask,
        is_causal=q_len == context,
    )


def ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: AttentionLayout,
    scale: float,
    decode: DecodeKernel | None = None,
) -> torch.Tensor:
    """Run ``layout`` for one layer: ``query`` ``[T, heads, D]`` over flat ``keys`` and
    ``values`` ``[N, kv_heads, D]`` (``kv_heads`` divides ``heads``); decode groups of at least
    ``decode.min_seqs`` sequences through ``decode`` when given
    (:mod:`pagedkv.store.decode_attention`), others gathered into SDPA.
    Returns ``[T, heads, D]`` in ``query``'s dtype (a group covering every row returns its
    own result, uncopied). No host synchronisation."""
    groups = layout.groups
    if len(groups) == 1 and groups[0].span == (0, layout.num_rows):
        return _group_attention(query, keys, values, groups[0], scale, decode)
    out = torch.empty_like(query)
    for group in groups:
        attended = _group_attention(query, keys, values, group, scale, decode)
        if group.span is not None:
            out[group.span[0] : group.span[1]] = attended
        else:
            out.index_copy_(0, group.rows, attended)
    return out


def _group_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    decode: DecodeKernel | None,
) -> torch.Tensor:
    """One group's rows attended: through ``decode`` where it takes the group, else gathered."""
    lengths = group.context_lens
    if decode is not None and lengths is not None and group.num_seqs >= decode.min_seqs:
        return decode(_query_rows(query, group), keys, values, group.kv_index, lengths, scale)
    return _attend(query, keys, values, group, scale)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    n, q_len, width = group.num_seqs, group.q_len, group.width
    q = _query_rows(query, group).view(n, q_len, *query.shape[1:]).transpose(1, 2)
    # index_select on flat indices gathers about 2x faster than advanced indexing.
    flat = group.kv_index.reshape(-1)
    k = gather_rows(keys, flat).view(n, width, *keys.shape[1:])
    v = gather_rows(values, flat).view(n, width, *values.shape[1:])
    compute = _compute_dtype(query, q_len)
    k = k.to(compute).transpose(1, 2)  # [n, KV, width, D]
    v = v.to(compute).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.to(compute),
        k,
        v,
        attn_mask=group.mask,
        is_causal=group.is_causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.to(query.dtype).transpose(1, 2).reshape(n * q_len, *query.shape[1:])


def _query_rows(query: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's rows of ``query``, ``[num_seqs * q_len, heads, D]``: sliced when contiguous."""
    if group.span is not None:
        return query[group.span[0] : group.span[1]]
    return query.index_select(0, group.rows)


def _compute_dtype(query: torch.Tensor, q_len: int) -> torch.dtype:
    """The dtype a group's attention runs in: the query's, except decode groups (one query row
    each) of 16-bit queries on the CPU, which run in float32. torch's CPU flash attention in
    bfloat16 is slow on one query row: 32 decoding sequences of 150 positions (Qwen3-0.6B's
    heads) took 12 ms per layer in bfloat16 against 1.2 ms converted to float32 and back
    (torch 2.13, 2 threads, a CPU without AMX); float32 also rounds less."""
    if q_len == 1 and query.device.type == "cpu" and query.dtype in HALF_DTYPES:
        return torch.float32
    return query.dtype
