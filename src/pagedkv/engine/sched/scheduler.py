"""The scheduler: picks each step's work and is the only writer of request progress.

Each step the engine asks it for the work (:meth:`Scheduler.schedule`) and for the step plan of
that work (:meth:`Scheduler.build_plan`); once the model has run and the engine has sampled, it
hands the sampled tokens back (:meth:`Scheduler.update_from_output`): the scheduler appends
them, advances each request's computed positions, commits the pages whose K/V are now written,
applies the token-level stop conditions, and finishes and frees those requests. Requests are
admitted first come, first served (ENG-030).

Failures are the scheduler's to apply too, one request at a time: a request whose own sampling,
text or stop handling raised is failed alone (:meth:`Scheduler.fail`, ENG-070); a step whose
model run raised is applied as nothing at all (ENG-071) and charged to its cause before anyone
is counted a retry (ENG-072): a failed step of several requests is run again in halves, each
failing half halved in turn, and only a step that ran one request alone counts against it
(:meth:`Scheduler.update_from_failure`). A poisoned request's neighbours lose no tries to it.

Two implementations, one per cache mode, chosen once by
:func:`~pagedkv.engine.sched.factory.make_scheduler`:
:class:`~pagedkv.engine.sched.paged.PagedScheduler` (v1, the only caller of the KVManager) and
:class:`~pagedkv.engine.sched.recompute.RecomputeScheduler` (v0, no cache).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence

import torch

from pagedkv.accel.cuda.staging import PlanStaging
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import FinishReason
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sched.output import SampledToken, SampleError, ScheduledChunk, SchedulerOutput
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import KVStats
from pagedkv.plan import StepPlan


class Scheduler(ABC):
    """The waiting queue, the running list and every request's progress.

    Args:
        config: the step budgets.
        eos_ids: tokens that end a request (unless it ignores EOS).
        max_model_len: most positions one sequence may reach; a request reaching it ends
            with reason ``length``.
    """

    def __init__(self, config: EngineConfig, eos_ids: frozenset[int], max_model_len: int) -> None:
        self.config = config
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_failed_steps = 0
        #: Groups of requests a failed step held, to be run by themselves in order (the search
        #: for its cause, ENG-072); the first is the one being run.
        self._suspects: deque[tuple[Request, ...]] = deque()
        #: The suspect group the last scheduled step was cut down to, else ``None``.
        self._testing: tuple[Request, ...] | None = None
        #: The buffers every plan is staged through to its device (ENG-224), made at the
        #: first plan and kept: each plan is run and dropped before the next is built.
        self._staging: PlanStaging | None = None

    def staging_for(self, device: torch.device) -> PlanStaging:
        """The persistent staging of this scheduler's plans for ``device`` (ENG-224): the
        same one step after step, a new one only if the device changes."""
        if self._staging is None or self._staging.device != torch.device(device):
            self._staging = PlanStaging(device)
        return self._staging

    def add(self, request: Request) -> None:
        """Queue a new request: last (``fcfs``), or behind every waiting request of lower or
        equal priority key (``priority``, ENG-189)."""
        self.requeue(request, new=True)

    def requeue(self, request: Request, *, new: bool = False) -> None:
        """Put ``request`` in the waiting queue: a preempted one at the head under ``fcfs``
        (it arrived before everything waiting), by its priority key under ``priority``."""
        if self.config.scheduling_policy == "priority":
            key = request.priority_key
            index = next(
                (i for i, w in enumerate(self.waiting) if w.priority_key > key),
                len(self.waiting),
            )
            self.waiting.insert(index, request)
        elif new:
            self.waiting.append(request)
        else:
            self.waiting.appendleft(request)

    def preemption_victim(self) -> Request:
        """The running request to preempt when one must go: the most recently admitted
        (``fcfs``), or the one of highest priority key (``priority``, ENG-189)."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: r.priority_key)
        return self.running[-1]

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    # -- the mode's part ------------------------------------------------------------------

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Never returns an empty step while a request is running or
        can be admitted."""

    @abstractmethod
    def build_plan(self, scheduled: SchedulerOutput, device: torch.device) -> StepPlan:
        """The step plan of ``scheduled``, its tensors on ``device``."""

    @abstractmethod
    def kv_stats(self) -> KVStats:
        """The page pool's accounting (all zero without a cache)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise :class:`~pagedkv.errors.InvariantViolation` if the bookkeeping is
        inconsistent."""

    @abstractmethod
    def _computed(self, chunk: ScheduledChunk) -> None:
        """The chunk's K/V are written: advance the request and publish what it filled."""

    @abstractmethod
    def _release(self, request: Request) -> None:
        """Free whatever a running request holds."""

    @abstractmethod
    def _open_fork(self, parent: Request, child: Request) -> bool:
        """Give ``child`` a copy of ``parent``'s computed prompt (shared pages in v1); whether
        it could. Called with the parent's prompt just computed and nothing sampled yet."""

    # -- after the model ran --------------------------------------------------------------

    def update_from_output(
        self, scheduled: SchedulerOutput, sampled: Sequence[SampledToken | SampleError | None]
    ) -> list[Request]:
        """Apply a step's results: ``sampled[i]`` is the token of ``scheduled.chunks[i]``,
        ``None`` for a chunk that does not complete its sequence, or a :class:`SampleError`.

        Advances every chunk's request (committing the pages it filled), appends the sampled
        tokens, and finishes and frees the requests a token stops (EOS, a stop token,
        ``max_tokens`` or ``max_model_len``). A chunk whose sampling failed fails its request
        alone, publishing none of the pages it filled (ENG-070). Returns the requests that got
        a token or failed, in chunk order.
        """
        if len(sampled) != len(scheduled.chunks):
            raise InvalidRequest(f"{len(sampled)} results for {len(scheduled.chunks)} chunks")
        now = time.perf_counter()
        self._acquit()
        advanced: list[Request] = []
        for chunk, token in zip(scheduled.chunks, sampled, strict=True):
            chunk.request.step_failures = 0
            if isinstance(token, SampleError):
                self.fail(chunk.request, token.message)
                advanced.append(chunk.request)
                continue
            self._computed(chunk)
            if token is None:
                continue
            request = chunk.request
            children = self._fork(request, token.forks, now) if request.forks else []
            self._append(request, token, now)
            advanced.append(request)
            advanced.extend(children)
        return advanced

    def _append(self, request: Request, token: SampledToken, now: float) -> None:
        """Append a sampled token to a sequence; finish it if the token stops it."""
        self._add_token(request, token, now)
        reason = self._stop_reason(request, token.token_id)
        if reason is not None:
            self.finish(request, reason)

    @staticmethod
    def _add_token(request: Request, token: SampledToken, now: float) -> None:
        request.token_ids.append(token.token_id)
        request.cumulative_logprob += token.logprob
        if request.first_token_time is None:
            request.first_token_time = now
        if request.logprobs is not None and token.logprobs is not None:
            request.logprobs.append(token.logprobs)

    def _fork(
        self, parent: Request, tokens: Sequence[SampledToken | SampleError], now: float
    ) -> list[Request]:
        """Bring ``parent``'s unborn sequences to life, each with its first token (ENG-047).

        A sequence that token already stops never holds anything. The others share the
        parent's computed prompt; one the pool has no page for goes to the head of the queue
        to be recomputed, like a preempted request (with prefix caching, from the parent's
        committed pages).
        """
        children, parent.forks = parent.forks, []
        if len(tokens) != len(children):
            raise InvalidRequest(f"{len(tokens)} first tokens for {len(children)} forks")
        unplaced: list[Request] = []
        for child, token in zip(children, tokens, strict=True):
            child.token_ids = list(parent.token_ids)
            child.cached_tokens = parent.cached_tokens
            if isinstance(token, SampleError):
                self.fail(child, token.message)
                continue
            self._add_token(child, token, now)
            reason = self._stop_reason(child, token.token_id)
            if reason is not None:
                self.finish(child, reason)
            elif self._open_fork(parent, child):
                child.status = RequestStatus.RUNNING
                child.num_computed_tokens = parent.num_computed_tokens
                self.running.append(child)
            else:
                child.status = RequestStatus.WAITING
                child.preemptions += 1
                self.num_preemptions += 1
                unplaced.append(child)
        self.waiting.extendleft(reversed(unplaced))  # in index order, ahead of the others
        return children

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """Why ``token``, just appended to ``request``, ends it; records a stop token as its
        stop reason."""
        params = request.params
        if not params.ignore_eos and token in self.eos_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            request.stop_reason = token
            return FinishReason.STOP
        if request.num_output_tokens >= params.token_limit:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def update_from_failure(self, scheduled: SchedulerOutput, error: str) -> list[Request]:
        """Apply a step whose model run raised (``error`` says how): as nothing.

        No request advances and no page the step wrote is published (ENG-071): each request
        keeps the pages it holds and runs the same positions again. A step of several requests
        counts against none of them: they are split into two halves, run by themselves next,
        the first half first (ENG-072). A step of one request counts one more failed step
        against it; one past ``max_step_retries`` fails it with reason ``error`` and frees it.
        Returns the requests failed, in chunk order.
        """
        self.num_failed_steps += 1
        self._acquit()
        requests = list(dict.fromkeys(chunk.request for chunk in scheduled.chunks))
        if len(requests) > 1:
            half = (len(requests) + 1) // 2
            self._suspects.appendleft(tuple(requests[half:]))
            self._suspects.appendleft(tuple(requests[:half]))
            return []
        failed: list[Request] = []
        for request in requests:
            request.step_failures += 1
            if request.step_failures > self.config.max_step_retries:
                tries = request.step_failures
                self.fail(request, f"{tries} steps running it alone failed, the last with {error}")
                failed.append(request)
        return failed

    def _acquit(self) -> None:
        """The suspect group the last step ran is done with: it succeeded (no cause in it) or
        has just been split (the caller pushes its halves)."""
        testing, self._testing = self._testing, None
        if testing is not None and self._suspects and self._suspects[0] is testing:
            self._suspects.popleft()

    def fail(self, request: Request, error: str) -> None:
        """End ``request`` with reason ``error`` and the message ``error``, freeing what it
        holds (ENG-070). A request already finished (its last token stopped it) keeps its
        pages freed and now reports the error."""
        request.error = error
        self.finish(request, FinishReason.ERROR)

    def _narrowed(self, scheduled: SchedulerOutput) -> SchedulerOutput:
        """``scheduled``, cut down while a failed step's cause is searched for (ENG-072,
        ENG-131); the chunks left out run in a later step (their requests stay running,
        holding what they were given).

        A request whose last step failed with it alone runs alone again (of several, the one
        that has generated the fewest tokens, the earliest admitted among equals: a request
        that never completed a step is the likelier cause). Otherwise the step holds only the
        first suspect group's requests; a group none of whose requests is scheduled now
        (finished, preempted, still waiting) is dropped: a step that fails later holding them
        is searched anew.
        """
        self._testing = None
        retried = [c for c in scheduled.chunks if c.request.step_failures > 0]
        if retried:
            chunk = min(retried, key=lambda c: c.request.num_output_tokens)
            return SchedulerOutput((chunk,), scheduled.preempted)
        while self._suspects:
            group = {id(request) for request in self._suspects[0]}
            chunks = tuple(c for c in scheduled.chunks if id(c.request) in group)
            if chunks:
                self._testing = self._suspects[0]
                return SchedulerOutput(chunks, scheduled.preempted)
            self._suspects.popleft()
        return scheduled

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a waiting or running request now (a stop, a stop string, an abort), freeing
        what it holds at once (ENG-012). Its unborn forks end with it (ENG-047)."""
        for child in request.forks:
            child.error = request.error
            self.finish(child, reason)
        request.forks = []
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.perf_counter()

    def _start(self, request: Request, num_cached_tokens: int) -> None:
        """Move the head of the queue to the running list."""
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        if request.cached_tokens is None:
            request.cached_tokens = num_cached_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.perf_counter()
        self.running.append(request)
