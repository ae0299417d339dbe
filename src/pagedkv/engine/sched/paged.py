"""The v1 scheduler: FCFS over a paged KV cache, the only caller of the KVManager.

Running requests go first, in admission order: each gets one decode token, or the next chunk of
its prompt (ENG-031). Waiting requests are then admitted in arrival order while the budgets and
the page pool allow. Each admission attempt is one lookup (:meth:`KVManager.match_prefix`): a
prompt sharing full pages that a running request is still computing waits until they are
committed, so a burst prefills its common prefix once (ENG-026); otherwise ``allocate`` takes the
same match, its cached prefix and a first chunk in one all-or-nothing allocation (ENG-027). When
a running request cannot grow, the most recently admitted running request is preempted: its
pages are freed and it goes back to the head of the queue, to be recomputed (ENG-032).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sched.output import SampledToken, SampleError, ScheduledChunk, SchedulerOutput
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.errors import InvariantViolation, OutOfPages
from pagedkv.interfaces import ForkingKVManager, KVManager, KVStats, PageCopy, PageTable
from pagedkv.plan import StepPlan
from pagedkv.plan_builders import build_paged_plan


class PagedScheduler(Scheduler):
    """Owns the queues and every request's progress; the KVManager owns the pages.

    Args:
        config: the step budgets.
        kv: the page pool, used by nothing else.
        eos_ids: tokens that end a request.
        max_model_len: most positions one sequence may reach; capped here by the pool's
            capacity.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        eos_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        super().__init__(config, eos_ids, min(max_model_len, kv.num_pages * kv.page_size))
        self.kv = kv
        self._next_seq_id = 0
        #: Pages forks asked to copy; the next plan makes the copies before any write, and they
        #: are kept until a step that made them succeeds (ENG-215).
        self._copies: list[PageCopy] = []
        #: Ended or preempted sequences whose pages a pending copy still reads: freed once no
        #: pending copy reads them (ENG-215).
        self._parked: list[int] = []

    # -- scheduling -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_uncomputed_tokens, budget)
            start = request.num_computed_tokens
            table = self._grow(request, start + n, preempted)
            if table is None:
                break  # the request preempted itself: nothing after it is running any more
            chunks.append(ScheduledChunk(request, start, n, table.pages))
            budget -= n
            i += 1
        if not preempted:
            self._admit(budget, chunks)
        return self._narrowed(SchedulerOutput(tuple(chunks), tuple(preempted)))

    def _grow(self, request: Request, num_tokens: int, out: list[Request]) -> PageTable | None:
        """Reserve ``num_tokens`` positions for ``request``, preempting the newest as needed.

        Returns its page table, or ``None`` if ``request`` itself had to be preempted.
        """
        while True:
            try:
                return self.kv.grow(self._seq_id(request), num_tokens)
            except OutOfPages:
                victim = self.preemption_victim()
                self._preempt(victim)
                out.append(victim)
                if victim is request:
                    return None

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if len(self.running) + request.width > self.config.max_num_seqs:
                break  # its forks will run too (ENG-047)
            match = self.kv.match_prefix(request.token_ids, request.cache_salt)
            if match.num_in_flight_tokens:
                break  # FCFS: admit it, and those behind it, once those pages are committed
            n = min(request.num_tokens - match.num_cached_tokens, budget)
            seq_id = self._next_seq_id
            try:
                allocation = self.kv.allocate(
                    seq_id, request.token_ids, n, request.cache_salt, match=match
                )
            except OutOfPages:
                break  # FCFS: later requests wait behind this one
            self._next_seq_id += 1
            request.seq_id = seq_id
            start = allocation.num_cached_tokens
            self._start(request, start)
            chunks.append(ScheduledChunk(request, start, n, allocation.page_table.pages))
            budget -= n

    def _preempt(self, request: Request) -> None:
        self._free(self._seq_id(request))
        self.running.remove(request)
        request.seq_id = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.preemptions += 1
        self.num_preemptions += 1
        self.requeue(request)

    def build_plan(self, scheduled: SchedulerOutput, device: torch.device) -> StepPlan:
        chunks = [c.seq_chunk() for c in scheduled.chunks]
        return build_paged_plan(
            chunks, self.kv.page_size, device, self._copies, self.staging_for(device)
        )

    def update_from_output(
        self, scheduled: SchedulerOutput, sampled: Sequence[SampledToken | SampleError | None]
    ) -> list[Request]:
        """The step ran, so the copies its plan carried are made: forget them, then apply its
        results (which may fork again). A failed step keeps them for the next plan."""
        self._copies = []
        self._free_parked()
        return super().update_from_output(scheduled, sampled)

    # -- after the model ran --------------------------------------------------------------

    def _computed(self, chunk: ScheduledChunk) -> None:
        """Advance the request; publish the pages this step filled, now that their K/V are
        written (KVM-021, ENG-025)."""
        request = chunk.request
        end = chunk.start + chunk.num_tokens
        request.num_computed_tokens = end
        size = self.kv.page_size
        if request.publish and end // size > chunk.start // size:
            self.kv.commit(self._seq_id(request), request.token_ids[:end])

    def _open_fork(self, parent: Request, child: Request) -> bool:
        """Fork the parent's sequence onto shared pages; the partial page's copy is made by
        the next step (KVM-037). ``False`` when the KVManager cannot fork or has no page."""
        if not isinstance(self.kv, ForkingKVManager):
            return False
        try:
            fork = self.kv.fork(self._seq_id(parent), self._next_seq_id)
        except OutOfPages:
            return False
        child.seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._copies.extend(fork.copies)
        return True

    def _release(self, request: Request) -> None:
        self._free(self._seq_id(request))
        request.seq_id = None

    def _free(self, seq_id: int) -> None:
        """Free a sequence that ended or was preempted, minding the copies not yet made
        (ENG-215): a copy into its pages is dropped (nobody will read it, and the page may go
        to another request), and while a copy still reads its pages they stay held, so that
        no other request writes them before the copy is made (a failed step makes its copies
        again)."""
        pages = set(self.kv.page_table(seq_id).pages)
        self._copies = [c for c in self._copies if c.dst not in pages]
        self._parked.append(seq_id)
        self._free_parked()

    def _free_parked(self) -> None:
        """Free every parked sequence no pending copy reads."""
        read = {c.src for c in self._copies}
        kept: list[int] = []
        for seq_id in self._parked:
            if read.isdisjoint(self.kv.page_table(seq_id).pages):
                self.kv.free(seq_id)
            else:
                kept.append(seq_id)
        self._parked = kept

    # -- observation ----------------------------------------------------------------------

    def kv_stats(self) -> KVStats:
        return self.kv.stats()

    def check_invariants(self) -> None:
        """The KVManager's invariants, plus: the pages in use are exactly those of running
        requests, and a running request's reservation covers what it has computed."""
        self.kv.check_invariants()
        held: set[int] = set()
        for request in self.running:
            table = self.kv.page_table(self._seq_id(request))
            if table.num_tokens < request.num_computed_tokens:
                raise InvariantViolation(
                    f"request {request.request_id} computed {request.num_computed_tokens} "
                    f"positions but reserved {table.num_tokens}"
                )
            held.update(table.pages)
        for seq_id in self._parked:
            held.update(self.kv.page_table(seq_id).pages)
        in_use = self.kv.stats().pages_in_use
        if in_use != len(held):
            raise InvariantViolation(f"{in_use} pages in use but running requests hold {len(held)}")

    def _seq_id(self, request: Request) -> int:
        if request.seq_id is None:
            raise InvariantViolation(f"request {request.request_id} holds no pages")
        return request.seq_id
