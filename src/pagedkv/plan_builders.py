"""The step plan's builders: chunks flattened into the tensors of a :class:`StepPlan`.

Each cache mode has its builder: :func:`build_paged_plan` (v1: only uncached tokens are
computed, their K/V written at the plan's slots and read back through its page tables) and
:func:`build_recompute_plan` (v0: every sequence is recomputed from position 0 and the plan has
no slots and no page tables). Both validate their chunks here, once, so the model and the store
never re-check a plan's ranges per layer.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.device import DEFAULT_DEVICE
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PageCopy
from pagedkv.plan import AttentionBatch, SeqChunk, StepPlan


@dataclass(frozen=True, slots=True)
class _Flat:
    """The mode-independent part of a plan, as host lists."""

    ids: list[int]
    positions: list[int]
    starts: list[int]
    context_lens: list[int]
    logits_rows: list[int]


def _flatten(chunks: Sequence[SeqChunk]) -> _Flat:
    if not chunks:
        raise InvalidRequest("a step plan needs at least one sequence")
    flat = _Flat([], [], [0], [], [])
    for chunk in chunks:
        if not chunk.token_ids:
            raise InvalidRequest("every scheduled sequence must compute at least one token")
        if chunk.start_position < 0:
            raise InvalidRequest(f"start position {chunk.start_position} is negative")
        end = chunk.start_position + len(chunk.token_ids)
        flat.ids.extend(chunk.token_ids)
        if len(chunk.token_ids) == 1:  # a decode row: no ranges to build
            flat.positions.append(chunk.start_position)
            flat.logits_rows.append(len(flat.ids) - 1)
        else:
            flat.positions.extend(range(chunk.start_position, end))
            first = len(flat.ids) - len(chunk.token_ids) if chunk.all_logits else len(flat.ids) - 1
            flat.logits_rows.extend(range(first, len(flat.ids)))
        flat.starts.append(len(flat.ids))
        flat.context_lens.append(end)
    return flat


def _tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``values`` as a 1-D int64 tensor on ``device``, read from an ``array`` of C integers:
    ``torch.tensor`` would walk a Python list element by element, several times slower."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(array("q", values), dtype=torch.int64)
    return host if torch.device(device).type == "cpu" else host.to(device)


def _plan(
    flat: _Flat,
    device: torch.device | str,
    page_tables: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> StepPlan:
    query_start = _tensor(flat.starts, device)
    return StepPlan(
        input_ids=_tensor(flat.ids, device),
        positions=_tensor(flat.positions, device),
        attention=AttentionBatch(
            query_start=query_start,
            context_lens=_tensor(flat.context_lens, device),
            page_tables=page_tables,
            slot_mapping=slot_mapping,
        ),
        logits_indices=_tensor(flat.logits_rows, device),
    )


def build_paged_plan(
    chunks: Sequence[SeqChunk],
    page_size: int,
    device: torch.device | str = DEFAULT_DEVICE,
    copies: Sequence[PageCopy] = (),
) -> StepPlan:
    """Flatten ``chunks`` into a plan over a paged KV cache (v1).

    Each chunk's pages must cover its context (positions ``0..start + len(token_ids) - 1``);
    the slots of its new tokens are computed here from its pages. ``copies`` are made before
    the step writes anything.

    Raises:
        InvalidRequest: no chunk, an empty chunk, a negative start, or pages that do not cover
            a chunk's context.
    """
    if page_size < 1:
        raise InvalidRequest(f"page_size must be >= 1, got {page_size}")
    flat = _flatten(chunks)
    slots: list[int] = []
    for chunk, end in zip(chunks, flat.context_lens, strict=True):
        pages = chunk.pages
        if len(pages) * page_size < end:
            raise InvalidRequest(f"{len(pages)} pages cannot hold {end} positions")
        if end - chunk.start_position == 1:  # a decode row's one slot
            slots.append(pages[(end - 1) // page_size] * page_size + (end - 1) % page_size)
            continue
        slots.extend(
            pages[p // page_size] * page_size + p % page_size
            for p in range(chunk.start_position, end)
        )
    width = max(len(c.pages) for c in chunks)
    tables: list[int] = []
    for chunk in chunks:
        tables.extend(chunk.pages)
        tables.extend([0] * (width - len(chunk.pages)))
    page_tables = _tensor(tables, device).view(len(chunks), width)
    plan = _plan(flat, device, page_tables, _tensor(slots, device))
    if not copies:
        return plan
    pairs = [c.src for c in copies] + [c.dst for c in copies]
    return dataclasses.replace(plan, page_copies=_tensor(pairs, device).view(2, len(copies)))


def build_recompute_plan(
    chunks: Sequence[SeqChunk], device: torch.device | str = DEFAULT_DEVICE
) -> StepPlan:
    """Flatten ``chunks`` into a cache-less plan (v0): every chunk is a whole sequence from
    position 0, and attention sees only the step's own rows.

    Raises:
        InvalidRequest: no chunk, an empty chunk, or a chunk not starting at position 0.
    """
    for chunk in chunks:
        if chunk.start_position != 0:
            raise InvalidRequest("a cache-less plan recomputes whole sequences from 0")
    return _plan(_flatten(chunks), device, None, None)
