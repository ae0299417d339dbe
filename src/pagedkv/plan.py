"""The step plan: everything the model needs to run one step, and nothing else.

The engine builds a :class:`StepPlan` each step; the model reads and writes the KV cache only by
what the plan says. The v0 path (no cache: the whole sequence recomputed every step) and the v1
path (paged KV cache: only uncached tokens computed) run the same model code and differ only in
the plan: a v0 plan has no slots and no page tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch


@dataclass(frozen=True)
class StepPlan:
    """One step's flattened, ragged batch.

    ``T`` is the number of token positions computed this step (all sequences together) and
    ``B`` the number of sequences.

    Attributes:
        input_ids: ``[T]`` int64 token ids, sequence by sequence.
        positions: ``[T]`` int64 position of each token in its own sequence.
        slot_mapping: ``[T]`` int64 flat KV slot each token's K/V is written to, or ``None``
            for a step that uses no cache (v0): then attention sees only this step's tokens.
        attention: which rows belong to which sequence, their context lengths and page tables.
        logits_indices: ``[B]`` int64 rows whose logits are wanted (each sequence's last row).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor | None
    attention: AttentionBatch
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """``T``: token positions computed this step."""
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        """``B``: sequences in the step."""
        return int(self.logits_indices.shape[0])

    @property
    def uses_cache(self) -> bool:
        """Whether K/V are written to and read from a PagedStore (v1) or not (v0)."""
        return self.slot_mapping is not None


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step, before it is flattened into a plan.

    Attributes:
        token_ids: the tokens to compute this step.
        start_position: position of ``token_ids[0]`` in the sequence; the tokens before it
            already have K/V in the cache (v1) or are absent (v0, where it is always 0).
        pages: the sequence's page table (physical pages), empty for v0.
    """

    token_ids: tuple[int, ...]
    start_position: int
    pages: tuple[int, ...] = ()


def build_plan(
    chunks: list[SeqChunk], page_size: int | None, device: torch.device | str = "cpu"
) -> StepPlan:
    """Flatten ``chunks`` into a :class:`StepPlan`.

    ``page_size=None`` builds a cache-less (v0) plan, which requires every chunk to start at
    position 0. Otherwise each chunk's pages must cover its context.
    """
    if not chunks:
        raise InvalidRequest("a step plan needs at least one sequence")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens: list[int] = []
    for chunk in chunks:
        if not chunk.token_ids:
            raise InvalidRequest("every scheduled sequence must compute at least one token")
        end = chunk.start_position + len(chunk.token_ids)
        ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_position, end))
        starts.append(len(ids))
        context_lens.append(end)
        if page_size is None:
            if chunk.start_position != 0:
                raise InvalidRequest("a cache-less plan recomputes whole sequences from 0")
            continue
        if len(chunk.pages) * page_size < end:
            raise InvalidRequest(f"{len(chunk.pages)} pages cannot hold {end} positions")
        slots.extend(
            chunk.pages[p // page_size] * page_size + p % page_size
            for p in range(chunk.start_position, end)
        )

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    page_tables: torch.Tensor | None = None
    if page_size is not None:
        width = max(len(c.pages) for c in chunks)
        page_tables = tensor(
            [p for c in chunks for p in (*c.pages, *([0] * (width - len(c.pages))))]
        ).view(len(chunks), width)
    query_start = tensor(starts)
    return StepPlan(
        input_ids=tensor(ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots) if page_size is not None else None,
        attention=AttentionBatch(
            query_start=query_start,
            context_lens=tensor(context_lens),
            page_tables=page_tables,
        ),
        logits_indices=query_start[1:] - 1,
    )
