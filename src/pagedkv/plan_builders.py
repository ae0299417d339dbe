"""The step plan's builders: chunks flattened into the tensors of a :class:`StepPlan`.

Each cache mode has its builder: :func:`build_paged_plan` (v1: only uncached tokens are
computed, their K/V written at the plan's slots and read back through its page tables) and
:func:`build_recompute_plan` (v0: every sequence is recomputed from position 0 and the plan has
no slots and no page tables). Both validate their chunks here, once, so the model and the store
never re-check a plan's ranges per layer.

Every tensor is born on the host. Off the CPU the builders move them to the device in one copy,
through a :class:`Staging` when one is given (the schedulers give one, persistent:
:class:`~pagedkv.accel.cuda.staging.PlanStaging`, ENG-224), and keep the host tensors in the
plan's :attr:`~pagedkv.plan.AttentionBatch.host`, so that checks read them there and never read
a device tensor back (ENG-225, PST-051).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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


@dataclass(frozen=True, slots=True)
class Staged:
    """A step's tensors, staged: each part on the host and on the device.

    Attributes:
        host: each part, a 1-D host tensor, in the order given to :meth:`Staging.stage`.
        device: the same values on the device, in the same order.
    """

    host: tuple[torch.Tensor, ...]
    device: tuple[torch.Tensor, ...]


class Staging(Protocol):
    """Moves a step's host tensors to its device in one copy (ENG-224)."""

    @property
    def device(self) -> torch.device:
        """Where the staged tensors go."""
        ...

    def stage(self, parts: Sequence[torch.Tensor]) -> Staged:
        """``parts`` (1-D int64 host tensors) on the host and on :attr:`device`; valid until
        the next call."""
        ...


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


def _host(values: Sequence[int]) -> torch.Tensor:
    """``values`` as a 1-D int64 host tensor, read from an ``array`` of C integers:
    ``torch.tensor`` would walk a Python list element by element, several times slower."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _stage(
    parts: Sequence[torch.Tensor], device: torch.device | str, staging: Staging | None
) -> Staged:
    """``parts`` on the host and on ``device``: through ``staging`` when given; else the host
    tensors themselves on the CPU, or one concatenated copy to ``device`` cut into views."""
    if staging is not None:
        if staging.device != torch.device(device):
            raise InvalidRequest(f"a staging for {staging.device} cannot build a plan for {device}")
        return staging.stage(parts)
    host = tuple(parts)
    if torch.device(device).type == "cpu":
        return Staged(host, host)
    moved = torch.cat(host).to(device) if host else torch.empty(0, dtype=torch.int64)
    return Staged(host, tuple(torch.split(moved, [int(p.shape[0]) for p in host])))


def _plan(
    flat: _Flat,
    device: torch.device | str,
    staging: Staging | None,
    tables: tuple[list[int], int] | None = None,
    slots: list[int] | None = None,
    pairs: list[int] | None = None,
) -> StepPlan:
    """The plan of ``flat``, with (v1) its page tables (values and row width), slots and page
    copies (sources then targets), every tensor staged in one copy to ``device``."""
    lists = [flat.ids, flat.positions, flat.starts, flat.context_lens, flat.logits_rows]
    extra = [x for x in (None if tables is None else tables[0], slots, pairs) if x is not None]
    staged = _stage([_host(v) for v in [*lists, *extra]], device, staging)

    def batch(parts: tuple[torch.Tensor, ...], host: AttentionBatch | None) -> AttentionBatch:
        if tables is None:
            return AttentionBatch(parts[2], parts[3], None, None, host)
        return AttentionBatch(
            query_start=parts[2],
            context_lens=parts[3],
            page_tables=parts[5].view(-1, tables[1]),
            slot_mapping=parts[6],
            host=host,
        )

    same = staged.host is staged.device
    parts = staged.device
    copies = None if pairs is None else parts[7].view(2, -1)
    copies_host = None if pairs is None or same else staged.host[7].view(2, -1)
    return StepPlan(
        input_ids=parts[0],
        positions=parts[1],
        attention=batch(parts, None if same else batch(staged.host, None)),
        logits_indices=parts[4],
        page_copies=copies,
        page_copies_host=copies_host,
    )


def build_paged_plan(
    chunks: Sequence[SeqChunk],
    page_size: int,
    device: torch.device | str = DEFAULT_DEVICE,
    copies: Sequence[PageCopy] = (),
    staging: Staging | None = None,
) -> StepPlan:
    """Flatten ``chunks`` into a plan over a paged KV cache (v1).

    Each chunk's pages must cover its context (positions ``0..start + len(token_ids) - 1``);
    the slots of its new tokens are computed here from its pages. ``copies`` are made before
    the step writes anything. With ``staging``, the plan's tensors are views of its buffers,
    valid until it stages the next plan (ENG-224).

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
    pairs = [c.src for c in copies] + [c.dst for c in copies] if copies else None
    return _plan(flat, device, staging, (tables, width), slots, pairs)


def build_recompute_plan(
    chunks: Sequence[SeqChunk],
    device: torch.device | str = DEFAULT_DEVICE,
    staging: Staging | None = None,
) -> StepPlan:
    """Flatten ``chunks`` into a cache-less plan (v0): every chunk is a whole sequence from
    position 0, and attention sees only the step's own rows.

    Raises:
        InvalidRequest: no chunk, an empty chunk, or a chunk not starting at position 0.
    """
    for chunk in chunks:
        if chunk.start_position != 0:
            raise InvalidRequest("a cache-less plan recomputes whole sequences from 0")
    return _plan(_flatten(chunks), device, staging)
