"""The engine's own share of a step: everything but the runner's ``execute``.

The engine reports each step's parts to its step observers (:class:`StepReport`, on the
``time.perf_counter`` clock):

* schedule: the scheduler's ``schedule`` (scheduler and KVManager);
* plan: building the step plan;
* execute: the runner (the model, its paged attention and the logits copy);
* postprocess: sampling, the scheduler's update (commit, stop checks, frees) and the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.outputs import StepReport
from pagedkv.interfaces import Engine


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

    def add(self, report: StepReport) -> None:
        """Count one step."""
        self.steps += 1
        self.total_s += report.total_s
        self.schedule_s += report.schedule_s
        self.plan_s += report.plan_s
        self.execute_s += report.execute_s
        self.postprocess_s += report.sample_s + report.update_s + report.output_s

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


def decode_step_breakdown(engine: Engine, batch: int) -> StepBreakdown:
    """Step ``engine`` to the end; the breakdown of its decode steps of exactly ``batch``
    sequences (one position each)."""
    breakdown = StepBreakdown()

    def observe(report: StepReport) -> None:
        if report.num_seqs == batch and report.num_tokens == batch:
            breakdown.add(report)

    engine.add_step_observer(observe)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.remove_step_observer(observe)
    return breakdown
