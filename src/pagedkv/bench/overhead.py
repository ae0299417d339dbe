"""The engine's own share of a step: everything but the runner's ``execute``.

A :class:`TimedRunner` wraps the model runner and times each ``execute``; the scheduler's
``schedule`` is timed the same way. Per step, with ``t`` on the ``time.perf_counter`` clock:

* schedule: the scheduler's ``schedule`` (scheduler and KVManager);
* plan: from ``schedule`` returning to ``execute`` starting (building the step plan);
* execute: the runner (the model, its paged attention and the logits copy);
* postprocess: from ``execute`` returning to ``step`` returning (commit, sampling, stop checks,
  frees).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.interfaces import StepRunner
from pagedkv.plan import StepPlan


class TimedRunner:
    """A :class:`~pagedkv.interfaces.StepRunner` that times the runner it wraps."""

    def __init__(self, inner: StepRunner) -> None:
        self.inner = inner
        self.last_start = 0.0
        self.last_end = 0.0
        self.last_num_tokens = 0
        self.last_num_seqs = 0

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.inner.max_positions

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the wrapped runner, recording when it started and ended and the plan's size."""
        self.last_num_tokens = plan.num_tokens
        self.last_num_seqs = plan.num_seqs
        self.last_start = time.perf_counter()
        logits = self.inner.execute(plan)
        self.last_end = time.perf_counter()
        return logits


@dataclass
class StepBreakdown:
    """Seconds spent in each part of the measured steps, summed over steps.

    Attributes:
        steps: steps measured.
        total_s, schedule_s, plan_s, execute_s, postprocess_s: seconds (see module doc).
    """

    steps: int = 0
    total_s: float = 0.0
    schedule_s: float = 0.0
    plan_s: float = 0.0
    execute_s: float = 0.0
    postprocess_s: float = 0.0

    @property
    def engine_share(self) -> float:
        """(step - execute) / step: the engine's share of the measured steps' time."""
        if self.total_s == 0:
            return float("nan")
        return (self.total_s - self.execute_s) / self.total_s

    def per_step_us(self) -> dict[str, float]:
        """Mean microseconds per step of each part."""
        n = max(self.steps, 1)
        return {
            "step": round(self.total_s / n * 1e6, 1),
            "schedule": round(self.schedule_s / n * 1e6, 1),
            "plan": round(self.plan_s / n * 1e6, 1),
            "execute": round(self.execute_s / n * 1e6, 1),
            "postprocess": round(self.postprocess_s / n * 1e6, 1),
        }


class _ScheduleTimer:
    """Stands in for a scheduler's ``schedule`` and times it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.end = 0.0
        self.duration = 0.0

    def __call__(self) -> SchedulerOutput:
        start = time.perf_counter()
        out = Scheduler.schedule(self.scheduler)
        self.end = time.perf_counter()
        self.duration = self.end - start
        return out


def decode_step_breakdown(engine: LLMEngine, runner: TimedRunner, batch: int) -> StepBreakdown:
    """Step ``engine`` to the end; the breakdown of its decode steps of exactly ``batch`` seqs.

    ``engine`` must run over ``runner``. Its scheduler's ``schedule`` is wrapped for the run.
    """
    timer = _ScheduleTimer(engine.scheduler)
    setattr(engine.scheduler, "schedule", timer)  # noqa: B010 (instance attribute on purpose)
    breakdown = StepBreakdown()
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            if runner.last_num_tokens != batch or runner.last_num_seqs != batch:
                continue  # a prefill or partly empty step
            if runner.last_start < timer.end:
                continue  # the step ran nothing
            breakdown.steps += 1
            breakdown.total_s += end - start
            breakdown.schedule_s += timer.duration
            breakdown.plan_s += runner.last_start - timer.end
            breakdown.execute_s += runner.last_end - runner.last_start
            breakdown.postprocess_s += end - runner.last_end
    finally:
        delattr(engine.scheduler, "schedule")
    return breakdown
