"""How every layer of one step attends: one strategy per cache mode, prepared once per step.

The runner turns the step plan into a :class:`StepAttention` before the model runs; each
attention layer then calls it with its own layer index, query, key and value. Checks and host
work happen in the preparation, once; the calls do neither.

* :class:`PagedStepAttention` (v1): writes the layer's K/V to the PagedStore at the plan's slots
  and attends through its page tables, with the metadata the store prepared for the step.
* :class:`RecomputeStepAttention` (v0): each sequence's rows are its whole context, so attention
  is causal within them; nothing is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionMetadata, PagedStore
from pagedkv.plan import StepPlan
from pagedkv.store.ragged_attention import AttentionLayout, plan_attention, ragged_attention


class StepAttention(Protocol):
    """One step's attention, shared by every layer."""

    def __call__(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of layer ``layer``'s ``query`` ``[T, heads, D]``, given this step's
        ``key`` and ``value`` ``[T, kv_heads, D]``; returns ``[T, heads, D]``."""
        ...


@dataclass(frozen=True, slots=True)
class PagedStepAttention:
    """v1: this step's K/V go to the store, attention reads each sequence's paged context.

    Attributes:
        store: the K/V pool.
        metadata: what ``store.prepare`` computed for the step.
        slot_mapping: ``[T]`` slots of the step's K/V, checked by ``store.prepare``.
    """

    store: PagedStore
    metadata: AttentionMetadata
    slot_mapping: torch.Tensor

    @classmethod
    def prepare(cls, store: PagedStore, plan: StepPlan) -> PagedStepAttention:
        """Check the plan against the store and lay its attention out, once for the step.

        Raises:
            InvalidRequest: a cache-less plan, or a batch the store refuses.
        """
        slots = plan.slot_mapping
        if slots is None:
            raise InvalidRequest("a cache-less (v0) plan needs a runner without a PagedStore")
        return cls(store, store.prepare(plan.attention), slots)

    def __call__(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        self.store.write(layer, self.slot_mapping, key, value)
        return self.store.attention(layer, query, self.metadata, scale)


@dataclass(frozen=True, slots=True)
class RecomputeStepAttention:
    """v0: causal attention within each sequence's rows of the step.

    Attributes:
        layout: the step's groups, their gather indices being rows of the step.
    """

    layout: AttentionLayout

    @classmethod
    def prepare(cls, plan: StepPlan) -> RecomputeStepAttention:
        """Check that the plan recomputes whole sequences and lay its attention out.

        Raises:
            InvalidRequest: a plan that uses the KV cache, or a sequence with no rows or
                whose rows are not its whole context.
        """
        batch = plan.attention
        if plan.slot_mapping is not None or batch.page_tables is not None:
            raise InvalidRequest("a plan that uses the KV cache needs a PagedStore")
        host = batch.on_host  # read where the values were made, not back from the device
        if host.query_start.shape != batch.query_start.shape:
            raise InvalidRequest("the batch's host copy is not shaped as the batch")
        starts = [int(x) for x in host.query_start.tolist()]
        contexts = [int(x) for x in host.context_lens.tolist()]
        if len(starts) != len(contexts) + 1 or starts[0] != 0:
            raise InvalidRequest(f"query_start must be [B+1] offsets from 0, got {starts}")
        for b, context in enumerate(contexts):
            if not 1 <= starts[b + 1] - starts[b] == context:
                raise InvalidRequest(
                    f"sequence {b}: a cache-less plan computes its whole context of {context} "
                    f"positions, it has {starts[b + 1] - starts[b]} rows"
                )
        offsets = torch.tensor(starts[:-1], dtype=torch.int64)

        def rows_of(seqs: list[int], width: int) -> torch.Tensor:
            # On the host: plan_attention moves the whole layout in one copy (PST-054).
            first = offsets.index_select(0, torch.tensor(seqs, dtype=torch.int64))
            return first[:, None] + torch.arange(width)[None, :]

        return cls(plan_attention(starts, contexts, rows_of, plan.input_ids.device))

    def __call__(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return ragged_attention(query, key, value, self.layout, scale)
