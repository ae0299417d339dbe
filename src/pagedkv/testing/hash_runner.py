"""A model stand-in whose next token is a hash of the whole context, read through the plan.

It stores token ids and the plan's positions (instead of K/V) at the plan's slots and reads each
sequence's context back through its page table, exactly as attention reads K/V. So any mistake in
slots, page tables, positions, prefix reuse or preemption changes its output, and engine tests
run in milliseconds instead of running a transformer.

What it cannot see: attention itself (it never calls a PagedStore, so causal masking and the
K/V arithmetic are certified only by tests on a real model, ``conformance/suite_engine_model.py``)
and any row but each sequence's last.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from pagedkv.errors import InvalidRequest
from pagedkv.plan import StepPlan

_MODULUS = (1 << 61) - 1


def next_token(context: list[int], vocab_size: int, positions: list[int] | None = None) -> int:
    """The token that follows ``context``: a polynomial hash of every token and its position.

    ``positions`` are the positions the plan gave each token (default ``0..len-1``); a token
    given any other position than its index changes the hash.
    """
    h = 0
    for index, token in enumerate(context):
        shift = 0 if positions is None else (positions[index] - index) * 7_919
        h = (h * 1_000_003 + token + 1 + shift) % _MODULUS
    return h % vocab_size


def peaked_logits(targets: list[int], vocab_size: int) -> torch.Tensor:
    """``[len(targets), vocab]`` float32 logits peaking at each target (0) and falling by 0.5
    per step of distance (mod vocab)."""
    target = torch.tensor(targets, dtype=torch.int64).unsqueeze(1)
    distance = (torch.arange(vocab_size).unsqueeze(0) - target) % vocab_size
    return -0.5 * distance.to(torch.float32)


def hash_logits(target: int, vocab_size: int) -> torch.Tensor:
    """``[vocab]`` logits: what the runner returns for a context whose next token is
    ``target``."""
    return peaked_logits([target], vocab_size)[0]


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
        self.positions = torch.zeros(num_pages * page_size, dtype=torch.int64)
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
        contexts, positions = self.read_contexts(plan)
        return self.peaked_logits(self.row_targets(plan, contexts, positions))

    @staticmethod
    def row_of(plan: StepPlan, row: int) -> tuple[int, int]:
        """``(sequence, rows after it in its chunk)`` of the step's query row ``row``."""
        starts = plan.attention.query_start.tolist()
        b = bisect.bisect_right(starts, row) - 1
        return b, starts[b + 1] - 1 - row

    def row_targets(
        self, plan: StepPlan, contexts: list[list[int]], positions: list[list[int]]
    ) -> list[int]:
        """The next token at each row of ``plan.logits_indices``: each sequence's last row,
        or every row of a chunk asking for all its logits (prompt log-probabilities)."""
        targets = []
        for row in plan.logits_indices.tolist():
            b, later = self.row_of(plan, row)
            end = len(contexts[b]) - later
            targets.append(next_token(contexts[b][:end], self._vocab, positions[b][:end]))
        return targets

    def read_contexts(self, plan: StepPlan) -> tuple[list[list[int]], list[list[int]]]:
        """Run the cache side of ``plan``: store its tokens and positions at its slots, then
        read each sequence's whole context back through its page table (v1), or take the chunk
        itself (v0). Returns ``(tokens, positions)`` per sequence, the positions being those
        the plan fed each token. Records the step in :attr:`steps`."""
        batch = plan.attention
        starts = batch.query_start.tolist()
        self.steps.append([b - a for a, b in itertools.pairwise(starts)])
        if plan.page_copies is not None:  # a fork's partial pages, before any write
            offsets = torch.arange(self.page_size)
            src, dst = (pages.unsqueeze(1) * self.page_size + offsets for pages in plan.page_copies)
            self.slots[dst] = self.slots[src]
            self.positions[dst] = self.positions[src]
            self.written[dst] = self.written[src]
        if plan.slot_mapping is not None:
            self.slots[plan.slot_mapping] = plan.input_ids
            self.positions[plan.slot_mapping] = plan.positions
            self.written[plan.slot_mapping] = True
        contexts: list[list[int]] = []
        positions: list[list[int]] = []
        for b, context_len in enumerate(batch.context_lens.tolist()):
            if batch.page_tables is None:
                context = plan.input_ids[starts[b] : starts[b + 1]]
                fed = plan.positions[starts[b] : starts[b + 1]]
            else:
                pages = batch.page_tables[b]
                index = torch.arange(context_len)
                slot = pages[index // self.page_size] * self.page_size
                slot = slot + index % self.page_size
                if not bool(self.written[slot].all()):
                    raise InvalidRequest(f"sequence {b} reads a slot nothing was written to")
                context = self.slots[slot]
                fed = self.positions[slot]
            contexts.append(context.tolist())
            positions.append(fed.tolist())
        return contexts, positions

    def peaked_logits(self, targets: list[int]) -> torch.Tensor:
        """``[len(targets), vocab]`` logits peaking at each target (:func:`peaked_logits`)."""
        return peaked_logits(targets, self._vocab)
