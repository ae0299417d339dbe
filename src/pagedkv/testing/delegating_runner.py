"""A StepRunner that hands everything to another: the base of runners that watch or alter
plans on their way to the model (test recorders, the conformance suite's mutants)."""

from __future__ import annotations

import torch

from pagedkv.interfaces import StepRunner
from pagedkv.plan import StepPlan


class DelegatingRunner:
    """Satisfies :class:`~pagedkv.interfaces.StepRunner` by delegating to ``inner``;
    subclasses override what they watch or change."""

    def __init__(self, inner: StepRunner) -> None:
        self.inner = inner

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
        return self.inner.execute(plan)
