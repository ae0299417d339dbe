"""Decode steps over the Triton kernels on shapes fixed by the batch size alone (ENG-228).

The reference store's fixed-shape steps (:mod:`pagedkv.accel.static_decode`) gather every
context into a dense tensor, so their shape also holds the gather's width and a graph is
captured per pair of batch size and width, on first use. The Triton kernels read each context
in place through its page table, up to its length, so here the page table is an input of a
fixed width (the most pages one sequence can hold) and a step's shape is its padded batch size
alone: the sizes 1, 2, 4, ... up to the largest batch (ENG-206). On CUDA, every size's graph is
captured when the object is built (when the engine starts), into one memory pool, and a step
only replays one.

One set of buffers, sized for the largest batch, serves every size: a size's step reads their
first rows. Each step copies its plan into them on the device (no host synchronisation) and
pads the rows past its batch: slot -1, which the store kernel skips (PST-042), and context 0,
which the decode kernel answers with zeros (a padded row writes nothing and reads nothing);
their logits are dropped. The number of splits of the decode kernel is fixed too (that of the
longest context), since it is a dimension of the kernel's grid; a split past a shorter context
reads nothing and weighs nothing in the merge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.accel.cuda.graphs import capture_pool, captured
from pagedkv.accel.cuda.kernel_shapes import decode_splits
from pagedkv.accel.cuda.triton_store import TritonAttentionMetadata, TritonPagedStore
from pagedkv.accel.static_decode import capture_sizes, padded_size
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, AttentionMetadata
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention
from pagedkv.plan import StepPlan

#: The slot of a padded row: negative, so the store kernel writes nothing for it (PST-042).
PADDED_SLOT = -1


@dataclass(frozen=True, slots=True)
class _Buffers:
    """The inputs and output of every fixed-shape step, sized for the largest batch; a step of
    ``Bp`` rows uses the first ``Bp`` of each."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slots: torch.Tensor  # [max_batch] int64, PADDED_SLOT past the batch
    context_lens: torch.Tensor  # [max_batch] int32, 0 past the batch
    page_tables: torch.Tensor  # [max_batch, max_pages] int32
    rows: torch.Tensor  # [max_batch + 1] int32 = arange: query offsets, rows and sequences
    logits: torch.Tensor  # [max_batch, vocab] float32

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, vocab: int, device: torch.device) -> _Buffers:
        return cls(
            input_ids=torch.zeros(max_batch, dtype=torch.int64, device=device),
            positions=torch.zeros(max_batch, dtype=torch.int64, device=device),
            slots=torch.full((max_batch,), PADDED_SLOT, dtype=torch.int64, device=device),
            context_lens=torch.zeros(max_batch, dtype=torch.int32, device=device),
            page_tables=torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device),
            rows=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            logits=torch.zeros(max_batch, vocab, dtype=torch.float32, device=device),
        )


class TritonStaticDecode:
    """Runs decode-only plans over a :class:`TritonPagedStore` on fixed shapes (see the
    module docstring).

    Args:
        model: the model (the runner's own copy).
        store: its Triton store.
        max_batch: the largest batch run this way; larger ones run the ordinary path.
        max_width: the longest context run this way, positions; the page table's width is
            the pages it takes.
        cuda_graphs: capture every size's step as a CUDA graph now (the model must be on a
            CUDA device); else each step runs eagerly on the same buffers.

    Raises:
        InvalidRequest: ``max_width`` below 1 (and :func:`capture_sizes`' own).
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        store: TritonPagedStore,
        *,
        max_batch: int,
        max_width: int,
        cuda_graphs: bool,
    ) -> None:
        if max_width < 1:
            raise InvalidRequest(f"the longest context must be >= 1 position, got {max_width}")
        self.model = model
        self.store = store
        self.max_batch = max_batch
        self.batch_sizes = capture_sizes(max_batch)
        self.max_width = max_width
        page_size = store.config.page_size
        self.max_pages = -(-max_width // page_size)
        self.num_splits = decode_splits(max_width)
        device = store.reference.key_pool(0).device
        self._buffers = _Buffers.allocate(
            max_batch, self.max_pages, model.config.vocab_size, device
        )
        self._steps: dict[int, Callable[[], None]] = {}
        pool = capture_pool() if cuda_graphs else None
        for size in self.batch_sizes:
            step = self._build(size)
            # Every buffer row is padded now: the capture's warm-up runs write no slot.
            self._steps[size] = step if pool is None else captured(step, device, pool)

    @property
    def shapes(self) -> list[int]:
        """The padded batch sizes whose steps are built (all of them, from the start)."""
        return sorted(self._steps)

    def fits(self, plan: StepPlan, metadata: AttentionMetadata) -> bool:
        """Whether ``plan`` is a decode step this object runs: one row per sequence, at most
        ``max_batch`` sequences, a page table of at most ``max_pages`` columns, prepared by
        a Triton store (whose checks this object trusts)."""
        if not isinstance(metadata, TritonAttentionMetadata):
            return False
        seqs = plan.num_seqs
        if plan.num_tokens != seqs or not 1 <= seqs <= self.max_batch:
            return False
        return int(metadata.page_tables.shape[1]) <= self.max_pages

    def run(self, plan: StepPlan, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32, on the model's device) of a plan that :meth:`fits`.

        Raises:
            InvalidRequest: a plan that does not fit.
        """
        if not self.fits(plan, metadata) or not isinstance(metadata, TritonAttentionMetadata):
            raise InvalidRequest(
                f"a fixed-shape Triton decode step takes one row for each of at most "
                f"{self.max_batch} sequences and page tables of at most {self.max_pages} pages"
            )
        slots = plan.slot_mapping
        if slots is None:
            raise InvalidRequest("a fixed-shape decode step needs a v1 plan (slots)")
        seqs = plan.num_seqs
        size = padded_size(seqs, self.batch_sizes)
        if size is None:  # fits() bounds seqs by max_batch, the largest size
            raise InvalidRequest(f"no fixed batch size holds {seqs} sequences")
        buffers = self._buffers
        buffers.input_ids[:seqs].copy_(plan.input_ids)
        buffers.positions[:seqs].copy_(plan.positions)
        buffers.slots[:seqs].copy_(slots)
        buffers.context_lens[:seqs].copy_(metadata.context_lens)
        columns = metadata.page_tables.shape[1]
        buffers.page_tables[:seqs, :columns].copy_(metadata.page_tables)
        # Rows an earlier, larger batch left here are padded again: their old slots may now
        # belong to other sequences.
        buffers.slots[seqs:size].fill_(PADDED_SLOT)
        buffers.context_lens[seqs:size].fill_(0)
        self._steps[size]()
        return buffers.logits[:seqs]

    def _build(self, size: int) -> Callable[[], None]:
        """The step of ``size`` padded rows over the buffers' first ``size`` rows."""
        buffers = self._buffers
        rows = buffers.rows[:size]
        metadata = TritonAttentionMetadata(
            num_slots=self.store.reference.num_slots,
            num_rows=size,
            query_start=buffers.rows[: size + 1],
            context_lens=buffers.context_lens[:size],
            page_tables=buffers.page_tables[:size],
            decode_seqs=rows,
            decode_rows=rows,
            prefill_seqs=buffers.rows[:0],
            longest_chunk=0,
            decode_splits=self.num_splits,
        )
        slots = buffers.slots[:size]
        plan = StepPlan(
            input_ids=buffers.input_ids[:size],
            positions=buffers.positions[:size],
            attention=AttentionBatch(
                query_start=metadata.query_start,
                context_lens=metadata.context_lens,
                page_tables=metadata.page_tables,
                slot_mapping=slots,
            ),
            logits_indices=rows.to(torch.int64),
        )
        attention = PagedStepAttention(self.store, metadata, slots)
        logits = buffers.logits[:size]

        def step() -> None:
            logits.copy_(self.model(plan, attention))

        return step
