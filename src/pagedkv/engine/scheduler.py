"""FCFS scheduler: picks each step's work under the token and sequence budgets.

Running requests go first, in admission order: each gets one decode token, or the next chunk of
its prompt. Waiting requests are then admitted in arrival order while the budgets and the page
pool allow, each taking its cached prefix and a first prefill chunk in one all-or-nothing
allocation. When a running request cannot grow, the most recently admitted running request is
preempted: its pages are freed and it goes back to the head of the queue, to be recomputed
(ENG-030..ENG-034).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.errors import InvariantViolation, OutOfPages
from pagedkv.interfaces import KVManager


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a step.

    Attributes:
        request: the request.
        start: position of the first token computed; positions before it have K/V cached (v1)
            or are recomputed within this chunk (v0, where ``start`` is always 0).
        num_tokens: positions computed this step.
        pages: the request's page table (v1), empty in v0.
    """

    request: Request
    start: int
    num_tokens: int
    pages: tuple[int, ...]

    @property
    def completes_sequence(self) -> bool:
        """Whether the chunk reaches the sequence's last token, so its logits are sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """A step's work: the chunks to run, and the requests preempted to make room."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        """Positions computed by the step."""
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Owns the waiting queue and the running list; the KVManager owns the pages."""

    def __init__(self, config: EngineConfig, kv: KVManager | None) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_seq_id = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a new request (FCFS)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Never returns an empty step while work is pending."""
        if self.kv is None:
            return self._schedule_recompute()
        return self._schedule_paged(self.kv)

    # -- v1: paged KV cache ----------------------------------------------------------------

    def _schedule_paged(self, kv: KVManager) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_uncomputed_tokens, budget)
            start = request.num_computed_tokens
            if not self._grow(kv, request, start + n, preempted):
                break  # the request preempted itself: nothing after it is running any more
            seq_id = self._seq_id(request)
            chunks.append(ScheduledChunk(request, start, n, kv.page_table(seq_id).pages))
            budget -= n
            i += 1
        if not preempted:
            self._admit(kv, budget, chunks)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _grow(self, kv: KVManager, request: Request, num_tokens: int, out: list[Request]) -> bool:
        """Reserve ``num_tokens`` positions for ``request``, preempting the newest as needed.

        Returns False if ``request`` itself had to be preempted.
        """
        while True:
            try:
                kv.grow(self._seq_id(request), num_tokens)
                return True
            except OutOfPages:
                victim = self.running[-1]
                self._preempt(kv, victim)
                out.append(victim)
                if victim is request:
                    return False

    def _admit(self, kv: KVManager, budget: int, chunks: list[ScheduledChunk]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = kv.cached_prefix_length(request.token_ids, request.cache_salt)
            if self._prefix_in_flight(request, cached, kv.page_size):
                break  # FCFS: admit it, and those behind it, once those pages are committed
            n = min(request.num_tokens - cached, budget)
            seq_id = self._next_seq_id
            try:
                allocation = kv.allocate(seq_id, request.token_ids, n, request.cache_salt)
            except OutOfPages:
                break  # FCFS: later requests wait behind this one
            self._next_seq_id += 1
            self.waiting.popleft()
            start = allocation.num_cached_tokens
            request.seq_id = seq_id
            request.num_computed_tokens = start
            request.status = RequestStatus.RUNNING
            if request.cached_tokens is None:
                request.cached_tokens = start
            self.running.append(request)
            chunks.append(ScheduledChunk(request, start, n, allocation.page_table.pages))
            budget -= n

    def _prefix_in_flight(self, request: Request, cached: int, page_size: int) -> bool:
        """Whether a running request is still computing full pages this one would reuse.

        Admitting it now would compute those pages a second time; waiting until they are
        committed (a step or a few chunks) prefills a burst's common prefix once (ENG-026).
        """
        if not self.config.enable_prefix_caching:
            return False
        tokens = request.token_ids
        reusable = len(tokens) - 1  # at least one token is always computed (KVM-025)
        for other in self.running:
            if other.cache_salt != request.cache_salt:
                continue
            if other.num_computed_tokens >= reusable:
                continue  # whatever it shares is committed already
            shared = _common_prefix(tokens, other.token_ids, reusable) // page_size * page_size
            if shared > cached and other.num_computed_tokens < shared:
                return True
        return False

    def _preempt(self, kv: KVManager, request: Request) -> None:
        kv.free(self._seq_id(request))
        self.running.remove(request)
        request.seq_id = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- v0: recompute everything ----------------------------------------------------------

    def _schedule_recompute(self) -> SchedulerOutput:
        """Every running request recomputes its whole sequence; admit while the budget allows.

        The first request of a step is always scheduled, whatever its length, so the engine
        cannot stall on a sequence longer than the token budget.
        """
        chunks = [ScheduledChunk(r, 0, r.num_tokens, ()) for r in self.running]
        budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if chunks and request.num_tokens > budget:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.cached_tokens is None:
                request.cached_tokens = 0
            self.running.append(request)
            chunks.append(ScheduledChunk(request, 0, request.num_tokens, ()))
            budget -= request.num_tokens
        return SchedulerOutput(tuple(chunks), ())

    # -- endings ---------------------------------------------------------------------------

    def release(self, request: Request) -> None:
        """Drop a finished or aborted request from the queues and free its pages at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            if self.kv is not None:
                self.kv.free(self._seq_id(request))
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.seq_id = None

    def _seq_id(self, request: Request) -> int:
        if request.seq_id is None:
            raise InvariantViolation(f"request {request.request_id} holds no pages")
        return request.seq_id


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
