"""A model stand-in whose next token is a hash of the whole context, read through the plan.

It stores token ids (instead of K/V) at the plan's slots and reads each sequence's context back
through its page table, exactly as attention reads K/V. So any mistake in slots, page tables,
positions, prefix reuse or preemption changes its output, and engine tests run in milliseconds
instead of running a transformer.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from pagedkv.errors import InvalidRequest
from pagedkv.plan import StepPlan

_MODULUS = (1 << 61) - 1


def next_token(context: list[int], vocab_size: int) -> int:
    """The token that follows ``context``: a polynomial hash of every token and its position."""
    h = 0
    for token in context:
        h = (h * 1_000_003 + token + 1) % _MODULUS
    return h % vocab_size


class HashRunner:
    """A :class:`~pagedkv.engine.engine.StepRunner` with one "layer" that stores token ids.

    Logits peak at :func:`next_token` and fall off linearly (mod vocab), so greedy decoding is
    exact and sampling has a real distribution to draw from.
    """

    def __init__(self, vocab_size: int, num_pages: int = 0, page_size: int = 1) -> None:
        if vocab_size < 2:
            raise InvalidRequest("vocab_size must be >= 2")
        self._vocab = vocab_size
        self.page_size = page_size
        self.slots = torch.zeros(num_pages * page_size, dtype=torch.int64)
        self.written = torch.zeros(num_pages * page_size, dtype=torch.bool)
        #: Per step, the number of positions each scheduled sequence fed to the model.
        self.steps: list[list[int]] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_positions(self) -> None:
        """A hash has no trained length."""
        return None

    @property
    def tokens_per_step(self) -> list[int]:
        """Positions fed to the model at each step, all sequences together."""
        return [sum(step) for step in self.steps]

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.peaked_logits(self.row_targets(plan, self.contexts(plan)))

    @staticmethod
    def row_of(plan: StepPlan, row: int) -> tuple[int, int]:
        """``(sequence, rows after it in its chunk)`` of the step's query row ``row``."""
        starts = plan.attention.query_start.tolist()
        b = bisect.bisect_right(starts, row) - 1
        return b, starts[b + 1] - 1 - row

    def row_targets(self, plan: StepPlan, contexts: list[list[int]]) -> list[int]:
        """The next token at each row of ``plan.logits_indices``: each sequence's last row,
        or every row of a chunk asking for all its logits (prompt log-probabilities)."""
        targets = []
        for row in plan.logits_indices.tolist():
            b, later = self.row_of(plan, row)
            targets.append(next_token(contexts[b][: len(contexts[b]) - later], self._vocab))
        return targets

    def contexts(self, plan: StepPlan) -> list[list[int]]:
        """Run the cache side of ``plan``: store its tokens at its slots, then read each
        sequence's whole context back through its page table (v1), or take the chunk itself
        (v0). Records the step in :attr:`steps`."""
        batch = plan.attention
        starts = batch.query_start.tolist()
        self.steps.append([b - a for a, b in itertools.pairwise(starts)])
        if plan.page_copies is not None:  # a fork's partial pages, before any write
            offsets = torch.arange(self.page_size)
            src, dst = (pages.unsqueeze(1) * self.page_size + offsets for pages in plan.page_copies)
            self.slots[dst] = self.slots[src]
            self.written[dst] = self.written[src]
        if plan.slot_mapping is not None:
            self.slots[plan.slot_mapping] = plan.input_ids
            self.written[plan.slot_mapping] = True
        contexts: list[list[int]] = []
        for b, context_len in enumerate(batch.context_lens.tolist()):
            if batch.page_tables is None:
                context = plan.input_ids[starts[b] : starts[b + 1]]
            else:
                pages = batch.page_tables[b]
                positions = torch.arange(context_len)
                slot = pages[positions // self.page_size] * self.page_size
                slot = slot + positions % self.page_size
                if not bool(self.written[slot].all()):
                    raise InvalidRequest(f"sequence {b} reads a slot nothing was written to")
                context = self.slots[slot]
            contexts.append(context.tolist())
        return contexts

    def peaked_logits(self, targets: list[int]) -> torch.Tensor:
        """``[len(targets), vocab]`` logits peaking at each target (0) and falling off by 0.5
        a token (mod vocab)."""
        target = torch.tensor(targets).unsqueeze(1)
        distance = (torch.arange(self._vocab).unsqueeze(0) - target) % self._vocab
        return -0.5 * distance.to(torch.float32)
