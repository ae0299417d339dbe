"""The step plan: everything the model needs to run one step, and nothing else.

The scheduler builds a :class:`StepPlan` each step (with the builders of
:mod:`pagedkv.plan_builders`); the model reads and writes the KV cache only by what the plan
says. These are the data crossing the StepRunner and PagedStore Protocols: they hold tensors
but this module imports no torch at run time, so :mod:`pagedkv.interfaces` can name them and
still import nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """The part of a step plan attention needs: who owns which query rows and which pages.

    Attributes:
        query_start: ``[B+1]`` int64 offsets of each sequence's rows in the step's tokens.
        context_lens: ``[B]`` int64 positions each sequence attends to, this step's included.
        page_tables: ``[B, max_pages]`` int64 physical pages, padded past each sequence's
            ``ceil(context_len / page_size)`` pages; ``None`` when the step uses no cache (v0).
        slot_mapping: ``[T]`` int64 flat slots the step's K/V are written to (``T`` the
            rows); ``None`` when the step uses no cache, or when the batch is only read.
            :meth:`~pagedkv.interfaces.PagedStore.prepare` checks them against the pool
            once, so that :meth:`~pagedkv.interfaces.PagedStore.write` need not.
        host: the same batch on the host, as the plan builders made it before moving it to
            the device (PST-051): ``prepare`` checks its values there and reads none back from
            the device. ``None`` when the tensors themselves are the ones to read (a batch
            built on the CPU, or by hand). Its tensors must hold the same values as this
            batch's, of the same shapes (PST-053); the builders guarantee it, and a caller
            building a batch by hand gives ``None``.
    """

    query_start: torch.Tensor
    context_lens: torch.Tensor
    page_tables: torch.Tensor | None
    slot_mapping: torch.Tensor | None = None
    host: AttentionBatch | None = None

    @property
    def on_host(self) -> AttentionBatch:
        """The batch whose values a check reads: :attr:`host` where there is one, else this
        batch itself."""
        return self if self.host is None else self.host


@dataclass(frozen=True)
class StepPlan:
    """One step's flattened, ragged batch.

    ``T`` is the number of token positions computed this step (all sequences together) and
    ``B`` the number of sequences.

    Attributes:
        input_ids: ``[T]`` int64 token ids, sequence by sequence.
        positions: ``[T]`` int64 position of each token in its own sequence.
        attention: which rows belong to which sequence, their context lengths, and (v1) their
            page tables and the slots this step's K/V are written to.
        logits_indices: int64 rows whose logits are wanted: each sequence's last row, or all
            its rows for a chunk whose ``all_logits`` is set, in sequence order.
        page_copies: ``[2, C]`` int64 pages to copy before the step writes anything: row 0
            the sources, row 1 the targets (the partial pages of forked sequences, KVM-037);
            ``None`` when there is nothing to copy.
        page_copies_host: the same ``[2, C]`` pages on the host, as the plan builders made
            them before moving them to the device (PST-055), so that a store checks them and
            reads nothing back; ``None`` when ``page_copies`` themselves are to be read (a plan
            built on the CPU, or by hand) or there is nothing to copy.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    logits_indices: torch.Tensor
    page_copies: torch.Tensor | None = None
    page_copies_host: torch.Tensor | None = None

    @property
    def page_copies_on_host(self) -> torch.Tensor | None:
        """The page copies whose values a store reads: :attr:`page_copies_host` where there is
        one, else :attr:`page_copies` themselves."""
        return self.page_copies if self.page_copies_host is None else self.page_copies_host

    @property
    def slot_mapping(self) -> torch.Tensor | None:
        """``[T]`` int64 flat KV slot each token's K/V is written to, or ``None`` for a step
        that uses no cache (v0): then attention sees only this step's tokens."""
        return self.attention.slot_mapping

    @property
    def num_tokens(self) -> int:
        """``T``: token positions computed this step."""
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        """``B``: sequences in the step."""
        return int(self.attention.context_lens.shape[0])


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step, before it is flattened into a plan.

    Attributes:
        token_ids: the tokens to compute this step.
        start_position: position of ``token_ids[0]`` in the sequence; the tokens before it
            already have K/V in the cache (v1) or are absent (v0, where it is always 0).
        pages: the sequence's page table (physical pages), empty for v0.
        all_logits: the logits of every row are wanted (prompt log-probabilities), not only
            the last row's.
    """

    token_ids: tuple[int, ...]
    start_position: int
    pages: tuple[int, ...] = ()
    all_logits: bool = False
