"""An engine whose runner can run no more ends, and a closed engine stays closed (TP-022,
TP-023), shown with a stand-in runner: the tensor-parallel tests show the same with worker
processes, too slow for every run of the engine's mutation tests."""

from __future__ import annotations

import pytest
import torch

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.params import SamplingParams
from pagedkv.errors import RunnerFailed
from pagedkv.interfaces import Engine
from pagedkv.plan import StepPlan
from pagedkv.testing.delegating_runner import DelegatingRunner
from pagedkv.testing.hash_runner import HashRunner

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PAGE_SIZE = 4
NUM_PAGES = 32


class EndingRunner(DelegatingRunner):
    """Raises ``failure`` from call ``fail_at`` on (0-based); records whether it was closed."""

    def __init__(self, fail_at: int, failure: RunnerFailed) -> None:
        super().__init__(HashRunner(vocab_size=64, num_pages=NUM_PAGES, page_size=PAGE_SIZE))
        self.fail_at = fail_at
        self.failure = failure
        self.calls = 0
        self.closed = 0

    def execute(self, plan: StepPlan) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.fail_at:
            raise self.failure
        return super().execute(plan)

    def close(self) -> None:
        self.closed += 1


def engine_over(runner: EndingRunner) -> Engine:
    config = EngineConfig(page_size=PAGE_SIZE, num_pages=NUM_PAGES)
    return reference_backend().create_engine(runner, config)


@pytest.mark.spec("TP-022")
def test_a_runner_that_can_run_no_more_ends_the_engine() -> None:
    failure = RunnerFailed("rank 1 is gone")
    runner = EndingRunner(fail_at=1, failure=failure)
    engine = engine_over(runner)
    first = engine.add_request([1, 2, 3, 4, 5], GREEDY)
    engine.step()
    engine.add_request([6, 7, 8], GREEDY)
    assert engine.stats().pages_in_use > 0
    with pytest.raises(RunnerFailed) as raised:
        engine.step()
    assert raised.value is failure
    assert engine.stats().pages_in_use == 0  # every unfinished request ended, its pages freed
    assert not engine.has_unfinished_requests()
    assert engine.abort(first) is None  # already ended
    with pytest.raises(RunnerFailed) as again:
        engine.step()
    assert again.value is failure
    with pytest.raises(RunnerFailed) as refused:
        engine.add_request([9], GREEDY)
    assert refused.value is failure


@pytest.mark.spec("TP-023")
def test_closing_ends_the_requests_and_the_runner_once() -> None:
    runner = EndingRunner(fail_at=100, failure=RunnerFailed("unused"))
    engine = engine_over(runner)
    engine.add_request([1, 2, 3, 4, 5], GREEDY)
    engine.step()
    assert engine.stats().pages_in_use > 0
    engine.close()
    assert runner.closed == 1
    assert engine.stats().pages_in_use == 0
    assert not engine.has_unfinished_requests()
    with pytest.raises(RunnerFailed, match="closed") as closed:
        engine.step()
    engine.close()  # closing twice ends nothing more: the engine keeps its first error
    assert runner.closed == 2  # the runner's own close is idempotent (TP-023)
    with pytest.raises(RunnerFailed) as still:
        engine.add_request([6], GREEDY)
    assert still.value is closed.value
