"""The v0 scheduler: no cache, every running request recomputes its whole sequence each step.

The baseline the paged cache is measured against (ENG-003): nothing is kept between steps, so
there are no pages to reserve, commit or free, and a request's computed positions stay 0.
"""

from __future__ import annotations

import torch

from pagedkv.engine.request import Request
from pagedkv.engine.sched.output import ScheduledChunk, SchedulerOutput
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.errors import InvariantViolation
from pagedkv.interfaces import KVStats
from pagedkv.plan import StepPlan
from pagedkv.plan_builders import build_recompute_plan

#: No KV pool: the statistics of a scheduler that keeps no cache.
NO_KV_STATS = KVStats(0, 0, 0, 0, 0, 0, 0, 0)


class RecomputeScheduler(Scheduler):
    """Admits while the token budget allows; each step recomputes every running sequence."""

    def schedule(self) -> SchedulerOutput:
        """Every running request recomputes its whole sequence; admit while the budget allows.

        The first request of a step is always scheduled, whatever its length, so the engine
        cannot stall on a sequence longer than the token budget.
        """
        chunks = [ScheduledChunk(r, 0, r.num_tokens, ()) for r in self.running]
        budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
        while (
            self.waiting and len(self.running) + self.waiting[0].width <= self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if chunks and request.num_tokens > budget:
                break
            self._start(request, 0)
            chunks.append(ScheduledChunk(request, 0, request.num_tokens, ()))
            budget -= request.num_tokens
        return self._narrowed(SchedulerOutput(tuple(chunks), ()))

    def build_plan(self, scheduled: SchedulerOutput, device: torch.device) -> StepPlan:
        chunks = [c.seq_chunk() for c in scheduled.chunks]
        return build_recompute_plan(chunks, device, self.staging_for(device))

    def _computed(self, chunk: ScheduledChunk) -> None:
        """Nothing is kept: the next step recomputes the sequence from position 0."""

    def _release(self, request: Request) -> None:
        """Nothing is held."""

    def _open_fork(self, parent: Request, child: Request) -> bool:
        """Nothing to share: the fork recomputes its whole sequence like any request."""
        return True

    def kv_stats(self) -> KVStats:
        return NO_KV_STATS

    def check_invariants(self) -> None:
        """No running request holds pages or claims computed positions."""
        for request in self.running:
            if request.seq_id is not None or request.num_computed_tokens:
                raise InvariantViolation(
                    f"request {request.request_id} holds cache state in a cache-less engine"
                )
