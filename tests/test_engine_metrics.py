"""When a request was first scheduled (specs/engine.md ENG-053)."""

from __future__ import annotations

import itertools

import pytest

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.testing.hash_runner import HashRunner


@pytest.mark.spec("ENG-053")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_first_scheduled_time_is_when_a_request_left_the_queue(mode: str) -> None:
    """One sequence a step: each request is first scheduled after the one before it finished,
    and between its own arrival and first token; the queue time is the difference."""
    config = EngineConfig(
        page_size=4, num_pages=32, max_num_seqs=1, mode="v1" if mode == "v1" else "v0"
    )
    engine = reference_backend().create_engine(HashRunner(64, 32, 4), config)
    aborted = engine.abort(engine.add_request([4, 5], SamplingParams(max_tokens=3)))  # queued
    assert aborted is not None
    assert aborted.metrics.first_scheduled_time is None
    assert aborted.metrics.queue_time is None
    outs = run_to_completion(engine, [[1, 2, 3], [4, 5, 6], [7, 8]], SamplingParams(max_tokens=4))
    for before, after in itertools.pairwise(outs):
        assert before.metrics.finished_time is not None
        assert after.metrics.first_scheduled_time is not None
        assert after.metrics.first_scheduled_time >= before.metrics.finished_time
    for out in outs:
        metrics = out.metrics
        assert metrics.first_scheduled_time is not None
        assert metrics.first_token_time is not None
        assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
        assert metrics.queue_time == metrics.first_scheduled_time - metrics.arrival_time
