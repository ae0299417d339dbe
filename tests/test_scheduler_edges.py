"""The scheduler's edges that the conformance suite reaches only through whole workloads:
forks stopped by their first token, forks that are not preemptions, preemption counters and stop
reasons (specs/engine.md). Over the hash stand-in model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pagedkv.backend import reference_backend
from pagedkv.engine import engine as engine_module
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import Sampled, SampleRow
from pagedkv.errors import InvariantViolation
from pagedkv.testing.hash_runner import HashRunner, next_token

VOCAB = 64


def engine(mode: str = "v1", **fields: int) -> LLMEngine:
    config = EngineConfig(**{"page_size": 4, "num_pages": 32, **fields}, mode=mode)  # type: ignore[arg-type]
    built = reference_backend().create_engine(HashRunner(VOCAB, config.num_pages, 4), config)
    assert isinstance(built, LLMEngine)
    return built


@pytest.mark.spec("ENG-047", "ENG-042")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_completions_stopped_by_their_first_token_finish_there(mode: str) -> None:
    """n samples of one token each: every completion ends after its first token with reason
    length, none is preempted or left running."""
    eut = engine(mode)
    params = SamplingParams(n=3, max_tokens=1, temperature=1.0, seed=7)
    (out,) = run_to_completion(eut, [[1, 2, 3, 4, 5]], params)
    assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]
    assert [c.finish_reason for c in out.outputs] == [FinishReason.LENGTH] * 3
    assert eut.stats().preemptions == 0
    assert not eut.has_unfinished_requests()


@pytest.mark.spec("ENG-047", "ENG-050")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_forks_that_find_room_are_not_preemptions(mode: str) -> None:
    eut = engine(mode)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3)
    (out,) = run_to_completion(eut, [[1, 2, 3, 4, 5, 6]], params)
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    assert eut.stats().preemptions == 0
    assert out.metrics.preemptions == 0


@pytest.mark.spec("ENG-031", "ENG-050")
def test_a_preempted_request_counts_its_preemption() -> None:
    """Two requests outgrow a pool of 5 pages: the newer is preempted once and recomputed;
    its metrics and the engine's count say so, and every metric of both is filled in."""
    eut = engine(num_pages=5)
    outs = run_to_completion(eut, [[1, 2, 3, 4], [5, 6, 7, 8]], SamplingParams(max_tokens=8))
    assert [o.metrics.preemptions for o in outs] == [0, 1]
    assert eut.stats().preemptions == 1
    for out in outs:
        assert out.metrics.generated_tokens == len(out.token_ids) == 8
        assert out.metrics.finished_time is not None
        assert out.metrics.first_token_time is not None
        assert out.metrics.finished_time >= out.metrics.first_token_time


@pytest.mark.spec("ENG-042")
def test_a_stop_token_is_the_stop_reason() -> None:
    prompt = [1, 2, 3]
    first = next_token(prompt, VOCAB)
    (out,) = run_to_completion(
        engine(), [prompt], SamplingParams(max_tokens=8, stop_token_ids=(first,))
    )
    assert out.token_ids == [first]
    assert out.finish_reason is FinishReason.STOP
    assert out.outputs[0].stop_reason == first


def fork_without_room() -> tuple[LLMEngine, str]:
    """An ``n=3`` request in a pool of 2 pages: its prompt fills both, so neither fork finds a
    page for its copy of the partial last page after the first step; both wait to be
    recomputed."""
    eut = engine(num_pages=2)
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=5)
    request_id = eut.add_request([1, 2, 3, 4, 5], params)
    eut.step()
    return eut, request_id


@pytest.mark.spec("ENG-130", "ENG-047")
def test_forks_without_a_page_wait_and_count_as_preemptions() -> None:
    eut, _ = fork_without_room()
    stats = eut.stats()
    assert (stats.running, stats.waiting, stats.preemptions) == (1, 2, 2)
    outs = []
    while eut.has_unfinished_requests():
        outs.extend(eut.step())
    (final,) = [o for o in outs if o.finished]
    assert [len(c.token_ids) for c in final.outputs] == [3, 3, 3]
    assert final.metrics.preemptions == eut.stats().preemptions == 2


@pytest.mark.spec("ENG-130", "ENG-012")
def test_aborting_forks_that_wait_for_a_page_ends_them() -> None:
    eut, request_id = fork_without_room()
    final = eut.abort(request_id)
    assert final is not None
    assert [str(c.finish_reason) for c in final.outputs] == ["abort"] * 3
    stats = eut.stats()
    assert (stats.running, stats.waiting, stats.pages_in_use) == (0, 0, 0)
    assert not eut.has_unfinished_requests()
    eut.check_invariants()


@pytest.mark.spec("ENG-047", "ENG-070")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_a_fork_whose_first_token_fails_fails_its_request(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling raises for the second sample only (its generator, seeded ``seed + 1``), so the
    fork fails at its first token, in the step that forks it: its whole request ends with
    reason error and the message, no completion gets a new token, and the request beside it
    finishes with its tokens."""
    seed = 11
    sample_batch = engine_module.sample_batch

    def failing(logits: torch.Tensor, rows: Sequence[SampleRow], *rest: Any) -> list[Sampled]:
        if any(r.generator is not None and r.generator.initial_seed() == seed + 1 for r in rows):
            raise RuntimeError("injected sampling fault")
        return sample_batch(logits, rows, *rest)

    monkeypatch.setattr(engine_module, "sample_batch", failing)
    eut = engine(mode)
    beside = eut.add_request([9, 8, 7], SamplingParams(max_tokens=4, temperature=0.0))
    failed = eut.add_request([1, 2, 3, 4, 5], SamplingParams(n=3, max_tokens=4, seed=seed))
    outs = eut.step()
    (out,) = [o for o in outs if o.request_id == failed]
    assert out.finished
    assert out.error is not None
    assert "injected sampling fault" in out.error
    assert [c.finish_reason for c in out.outputs] == [FinishReason.ERROR] * 3
    assert all(c.new_token_ids == [] for c in out.outputs)
    finals: list[RequestOutput] = []
    while eut.has_unfinished_requests():
        finals.extend(o for o in eut.step() if o.finished)
    assert [o.request_id for o in finals] == [beside]
    assert len(finals[0].token_ids) == 4
    assert eut.stats().pages_in_use == 0
    eut.check_invariants()


@pytest.mark.spec("ENG-011", "ENG-047")
def test_forks_beyond_the_token_budget_wait_for_a_step_with_room() -> None:
    """A budget of 2 positions and ``n=3``: once forked, three sequences decode but a step
    holds two; the third waits, with nothing scheduled for it, and every step succeeds."""
    eut = engine(max_num_batched_tokens=2)
    sizes: list[int] = []
    eut.add_step_observer(lambda report: sizes.append(report.num_tokens))
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=2)
    (out,) = run_to_completion(eut, [[1, 2]], params)
    assert [c.finish_reason for c in out.outputs] == [FinishReason.LENGTH] * 3
    assert [len(c.token_ids) for c in out.outputs] == [3, 3, 3]
    assert eut.stats().failed_steps == 0
    assert max(sizes) == 2


@pytest.mark.spec("ENG-073")
@pytest.mark.parametrize("field", ["seq_id", "num_computed_tokens"])
def test_v0_invariants_catch_cache_state(field: str) -> None:
    """A cache-less engine's check fails on a running request that claims a sequence id or
    computed positions, either one alone."""
    eut = engine("v0")
    eut.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    eut.step()
    eut.check_invariants()
    (request,) = eut.scheduler.running
    setattr(request, field, 3)
    with pytest.raises(InvariantViolation):
        eut.check_invariants()


@pytest.mark.spec("ENG-047", "ENG-042")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_forks_whose_first_token_is_a_stop_token_stop_there(mode: str) -> None:
    """Greedy ``n=3`` with the first token a stop token: every completion, the forks too, ends
    after it with reason stop and that token as its stop reason."""
    prompt = [1, 2, 3, 4, 5]
    first = next_token(prompt, VOCAB)
    params = SamplingParams(n=3, max_tokens=4, temperature=0.0, stop_token_ids=(first,))
    (out,) = run_to_completion(engine(mode), [prompt], params)
    assert [c.token_ids for c in out.outputs] == [[first]] * 3
    assert [c.finish_reason for c in out.outputs] == [FinishReason.STOP] * 3
    assert [c.stop_reason for c in out.outputs] == [first] * 3
