"""Failure isolation in the reference engine (specs/engine.md ENG-070..073): the conformance
suite can fail, and a real Qwen3 model's failed steps change no output.

Each mutant below is the reference engine with one plausible isolation bug, built behind a
backend as a third party's engine would be; the suite test named beside it must fail on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_chaos import run_engine_chaos

from pagedkv.backend import ReferenceBackend, reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import FinishReason
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request
from pagedkv.engine.sched.output import SampledToken, SampleError, SchedulerOutput
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import StepRunner
from pagedkv.plan import StepPlan
from pagedkv.testing.faults import (
    FaultyRunner,
    FaultyTokenizer,
    IdTokenizer,
    PoisonedRunner,
    TracingHashRunner,
)
from pagedkv.testing.hash_runner import HashRunner
from pagedkv.testing.tiny_qwen3 import TinySpec, build_tiny_checkpoint
from pagedkv_conformance.engine_harness import solo_greedy
from pagedkv_conformance.suite_engine_isolation import EngineIsolationSuite

# -- mutants -------------------------------------------------------------------------------------


def unguarded_sampling(engine: LLMEngine) -> None:
    """A row whose sampling raises makes the whole step raise."""

    def sample(scheduled: SchedulerOutput, logits: torch.Tensor) -> list[Any]:
        return [
            engine._sample_row(c.request, logits[row]) if c.completes_sequence else None
            for row, c in enumerate(scheduled.chunks)
        ]

    engine._sample = sample  # type: ignore[method-assign]


def unguarded_text(engine: LLMEngine) -> None:
    """A request whose text raises makes the whole step raise."""
    engine._guarded_output = engine._detokenize  # type: ignore[method-assign]


def publishes_failed_rows(engine: LLMEngine) -> None:
    """A row whose sampling failed still publishes the pages its step filled."""
    scheduler = engine.scheduler
    update = scheduler.update_from_output

    def update_from_output(
        scheduled: SchedulerOutput, sampled: Sequence[SampledToken | SampleError | None]
    ) -> list[Request]:
        for chunk, token in zip(scheduled.chunks, sampled, strict=True):
            if isinstance(token, SampleError):
                scheduler._computed(chunk)
        return update(scheduled, sampled)

    scheduler.update_from_output = update_from_output  # type: ignore[method-assign]


def raises_failed_steps(engine: LLMEngine) -> None:
    """A step whose model run raised raises out of ``step()``, as before isolation."""

    def update_from_failure(scheduled: SchedulerOutput, error: str) -> list[Request]:
        raise RuntimeError(error)

    engine.scheduler.update_from_failure = update_from_failure  # type: ignore[method-assign]


def applies_failed_steps(engine: LLMEngine) -> None:
    """A failed step still advances its requests and publishes the pages it wrote."""
    scheduler = engine.scheduler
    update = scheduler.update_from_failure

    def update_from_failure(scheduled: SchedulerOutput, error: str) -> list[Request]:
        for chunk in scheduled.chunks:
            scheduler._computed(chunk)
        return update(scheduled, error)

    scheduler.update_from_failure = update_from_failure  # type: ignore[method-assign]


def charges_neighbours(engine: LLMEngine) -> None:
    """A failed step of several requests counts one failure against each of them before it is
    halved: a request whose neighbour failed loses tries it never used."""
    scheduler = engine.scheduler
    update = scheduler.update_from_failure

    def update_from_failure(scheduled: SchedulerOutput, error: str) -> list[Request]:
        requests = {id(c.request): c.request for c in scheduled.chunks}
        if len(requests) > 1:
            for request in requests.values():
                request.step_failures += 1
        return update(scheduled, error)

    scheduler.update_from_failure = update_from_failure  # type: ignore[method-assign]


def ignores_retries(engine: LLMEngine) -> None:
    """``max_step_retries`` is ignored: the first failed step fails its requests."""
    engine.scheduler.config = dataclasses.replace(engine.config, max_step_retries=0)


def never_bisects(engine: LLMEngine) -> None:
    """A failed step is never halved: every request of it counts a failure and runs in the
    same batch again, so an innocent request fails beside the culprit."""
    scheduler = engine.scheduler
    scheduler._narrowed = lambda scheduled: scheduled  # type: ignore[method-assign]

    def update_from_failure(scheduled: SchedulerOutput, error: str) -> list[Request]:
        scheduler.num_failed_steps += 1
        failed = []
        for chunk in scheduled.chunks:
            chunk.request.step_failures += 1
            if chunk.request.step_failures > scheduler.config.max_step_retries:
                scheduler.fail(chunk.request, error)
                failed.append(chunk.request)
        return failed

    scheduler.update_from_failure = update_from_failure  # type: ignore[method-assign]


def off_by_one_retry(engine: LLMEngine) -> None:
    """One retry more than configured."""
    engine.scheduler.config = dataclasses.replace(
        engine.config, max_step_retries=engine.config.max_step_retries + 1
    )


def leaks_failed_requests(engine: LLMEngine) -> None:
    """A failed request is marked finished but keeps its pages."""
    scheduler = engine.scheduler

    def fail(request: Request, error: str) -> None:
        if request in scheduler.running:
            scheduler.running.remove(request)
        request.status = type(request.status).FINISHED
        request.finish_reason = FinishReason.ERROR
        request.error = error

    scheduler.fail = fail  # type: ignore[method-assign]


@dataclass(frozen=True)
class MutantEngineBackend(ReferenceBackend):
    """The reference backend, its engines broken by ``mutate``."""

    mutate: Callable[[LLMEngine], None] = lambda engine: None

    def create_engine(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> LLMEngine:
        engine = super().create_engine(runner, config, tokenizer=tokenizer, eos_ids=eos_ids)
        self.mutate(engine)
        return engine


#: Each mutant and a suite test (with its parameters) that must fail on it.
MUTANTS: dict[str, tuple[Callable[[LLMEngine], None], str, dict[str, Any]]] = {
    "unguarded_sampling": (
        unguarded_sampling,
        "test_a_row_whose_sampling_raises_fails_alone",
        {"mode": "v1"},
    ),
    "unguarded_text": (
        unguarded_text,
        "test_a_request_whose_text_fails_fails_alone",
        {"stop": ("never printed",)},
    ),
    "publishes_failed_rows": (
        publishes_failed_rows,
        "test_a_failed_rows_pages_are_not_published",
        {},
    ),
    "raises_failed_steps": (
        raises_failed_steps,
        "test_a_failed_step_is_run_again_unchanged",
        {"mode": "v0"},
    ),
    "applies_failed_steps": (
        applies_failed_steps,
        "test_a_failed_step_is_run_again_unchanged",
        {"mode": "v1"},
    ),
    "ignores_retries": (
        ignores_retries,
        "test_failed_steps_publish_nothing_and_fail_after_the_retries",
        {"retries": 2},
    ),
    "off_by_one_retry": (
        off_by_one_retry,
        "test_failed_steps_publish_nothing_and_fail_after_the_retries",
        {"retries": 1},
    ),
    "never_bisects": (
        never_bisects,
        "test_a_request_no_step_can_run_fails_alone",
        {"mode": "v1"},
    ),
    "charges_neighbours": (
        charges_neighbours,
        "test_random_step_faults_fail_only_requests_out_of_tries",
        {"mode": "v1", "seed": 1},
    ),
    "leaks_failed_requests": (
        leaks_failed_requests,
        "test_a_request_no_step_can_run_fails_alone",
        {"mode": "v1"},
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_isolation_suite_fails_on_mutant(name: str) -> None:
    """The suite test named for the mutant fails on it (and passes on the reference: run by
    the conformance suite itself)."""
    mutate, test, kwargs = MUTANTS[name]
    run = getattr(EngineIsolationSuite(), test)
    run(reference_backend(), **kwargs)  # the same call passes on the reference
    with pytest.raises(Exception) as caught:  # noqa: PT011 - any failure of the test counts
        run(MutantEngineBackend(mutate=mutate), **kwargs)
    assert not isinstance(caught.value, TypeError), caught.value  # a failure, not a misuse


class ShortLogitsRunner(HashRunner):
    """Returns one row of logits too few at its first call."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        logits = super().execute(plan)
        return logits[:-1] if len(self.steps) == 1 else logits


@pytest.mark.spec("ENG-071")
def test_logits_of_the_wrong_shape_fail_the_step() -> None:
    """A runner's logits with a row missing are a failed step, not a sampling error of the
    last request: its first half is run again (ENG-072) and every request gets its solo
    tokens."""
    runner = ShortLogitsRunner(101, 64, 4)
    engine = reference_backend().create_engine(runner, EngineConfig(page_size=4, num_pages=64))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0)) for p in prompts]
    outs = _finals(engine, ids)
    assert engine.stats().failed_steps == 1
    assert runner.steps[1] == runner.steps[0][:2]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason is FinishReason.LENGTH
        assert list(out.token_ids) == solo_greedy(prompt, 4)


# -- the order of the last tries ------------------------------------------------------------------


@pytest.mark.spec("ENG-074", "ENG-072", "ENG-131")
def test_a_failed_step_is_halved_until_its_cause_runs_alone() -> None:
    """Three requests decode; a poisoned one joins them and their step fails. The engine runs
    the first half (two clean requests, fine), then the second (a clean one and the poisoned
    one, failing), halves that (the clean one, fine; the poisoned one, failing alone), and the
    poisoned request fails after three failed steps alone; the three others go on together.
    Catches a search that counts the batch's failure against the clean requests, that never
    halves (they would fail beside it) or that runs the halves in another order."""
    config = EngineConfig(page_size=4, num_pages=64)
    runner = PoisonedRunner(101, 64, 4, poison=(100, 99), kind="raise", key_len=1)
    engine = reference_backend().create_engine(runner, config)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for first in (1, 2, 3):
        engine.add_request([first, 5, 6, 7], params)
    engine.step()
    engine.step()
    engine.add_request([100, 99, 8], params)
    while engine.has_unfinished_requests():
        engine.step()
    held = [sorted(k[0] for k in keys) for keys in runner.keys]
    assert held[2:9] == [[1, 2, 3, 100], [1, 2], [3, 100], [3], [100], [100], [100]]
    assert runner.raised == [2, 4, 6, 7, 8]
    assert all(len(keys) == 3 for keys in held[9:])


def charged_as_before(engine: LLMEngine) -> None:
    """The engine before failed steps were halved: every request of a failed step counted a
    failure, and only a request on its last try ran alone (where a random fault ended it)."""
    scheduler = engine.scheduler

    def update_from_failure(scheduled: SchedulerOutput, error: str) -> list[Request]:
        scheduler.num_failed_steps += 1
        failed = []
        for chunk in scheduled.chunks:
            chunk.request.step_failures += 1
            if chunk.request.step_failures > scheduler.config.max_step_retries:
                scheduler.fail(chunk.request, error)
                failed.append(chunk.request)
        if len(scheduled.chunks) == 1 and failed:
            for request in (*scheduler.running, *scheduler.waiting):
                request.step_failures = 0
        return failed

    def narrowed(scheduled: SchedulerOutput) -> SchedulerOutput:
        retries = scheduler.config.max_step_retries
        last = [c for c in scheduled.chunks if retries and c.request.step_failures >= retries]
        if not last or len(scheduled.chunks) == 1:
            return scheduled
        chunk = min(last, key=lambda c: c.request.num_output_tokens)
        return SchedulerOutput((chunk,), scheduled.preempted)

    scheduler.update_from_failure = update_from_failure  # type: ignore[method-assign]
    scheduler._narrowed = narrowed  # type: ignore[method-assign]


#: A seed of the engine chaos run where the engine before halving failed an innocent request.
CHAOS_SEED = 1


@pytest.mark.spec("ENG-179", "ENG-072")
def test_a_never_runnable_request_costs_no_innocent_request_a_try() -> None:
    """600 requests arriving two per step, one of them poisoned (every step holding it
    raises), and 2% of steps failing at random: only the poisoned request fails. Catches the
    engine that charged a failed step to every request in it (below: on this seed it failed an
    innocent request whose two tries the poisoned neighbour spent, then a random fault on its
    last, solo, try)."""
    report = run_engine_chaos(requests=600, fault_rate=0.02, seed=CHAOS_SEED, compare=False)
    assert report.poisoned_failed
    assert report.random_faults >= 5
    assert report.innocent_failures == 0
    assert report.pages_in_use_after == 0
    assert report.ok


@pytest.mark.spec("ENG-179")
def test_the_engine_chaos_figure_catches_the_engine_before_halving() -> None:
    """The same run on the engine as it was before failed steps were halved fails an innocent
    request: the figure the test above holds at 0 can move."""
    report = run_engine_chaos(
        requests=600, fault_rate=0.02, seed=CHAOS_SEED, compare=False, mutate=charged_as_before
    )
    assert report.innocent_failures > 0
    assert not report.ok


# -- a real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(TinySpec(vocab=128, seed=3), tmp_path_factory.mktemp("tiny"))


@pytest.mark.spec("ENG-071", "ENG-072", "ENG-073")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_failed_steps_of_a_real_model_change_no_output(tiny_model: Path, mode: str) -> None:
    """A tiny Qwen3 whose runner raises after writing the K/V of chosen steps (the first
    prefill, a decode step, and five steps in a row: a step halved twice, then three steps
    failing one request alone): the requests that were not failed get exactly the tokens of a
    run without faults, and no page is left."""
    config = EngineConfig(
        page_size=4,
        num_pages=48,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        mode="v1" if mode == "v1" else "v0",
    )
    backend = reference_backend()

    def engine(fail_calls: frozenset[int]) -> tuple[LLMEngine, FaultyRunner]:
        inner = backend.create_model_runner(
            str(tiny_model),
            num_pages=config.num_pages if mode == "v1" else None,
            page_size=config.page_size,
        )
        runner = FaultyRunner(inner, fail_calls=fail_calls)
        return backend.create_engine(runner, config), runner

    prompts = [[(7 * i + j) % 128 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    clean, _ = engine(frozenset())
    ids = [clean.add_request(p, params) for p in prompts]
    expected = _finals(clean, ids)
    faulty, runner = engine(frozenset({0, 5, 9, 10, 11, 12, 13}))
    ids = [faulty.add_request(p, params) for p in prompts]
    got = _finals(faulty, ids)
    failed = [i for i, out in enumerate(got) if out.finish_reason is FinishReason.ERROR]
    assert runner.faults == [0, 5, 9, 10, 11, 12, 13]
    assert len(failed) == 1, "calls 11..13 fail the request running alone from call 11"
    for i, (out, want) in enumerate(zip(got, expected, strict=True)):
        if i not in failed:
            assert out.token_ids == want.token_ids
            assert out.finish_reason is FinishReason.LENGTH
    assert faulty.stats().pages_in_use == 0


def _finals(engine: LLMEngine, ids: list[str]) -> list[Any]:
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            engine.check_invariants()
            if output.finished:
                done[output.request_id] = output
    return [done[i] for i in ids]


@pytest.mark.parametrize("tokenizer", [FaultyTokenizer, IdTokenizer])
def test_test_tokenizers_override_every_public_method(tokenizer: type[Tokenizer]) -> None:
    """They load no model files, so a method left to :class:`Tokenizer` would fail when
    called: a method added to it must be added to them too."""
    public = {name for name in vars(Tokenizer) if not name.startswith("_")}
    assert public
    assert public <= set(vars(tokenizer)), public - set(vars(tokenizer))


@pytest.mark.spec("ENG-072")
def test_negative_retries_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="max_step_retries"):
        EngineConfig(max_step_retries=-1)
    assert EngineConfig().max_step_retries == 2


class OneNanRunner(PoisonedRunner):
    """:class:`PoisonedRunner` whose poisoned rows hold a single NaN, among finite logits
    whose largest is elsewhere (so no maximum nor argmax alone shows it)."""

    def logits_of(self, contexts: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
        logits = TracingHashRunner.logits_of(self, contexts, positions)
        at, end = self.poison_at, self.poison_at + len(self.poison)
        for row, context in enumerate(contexts):
            if tuple(context[at:end]) == self.poison:
                logits[row, 3] = float("nan")
        return logits


@pytest.mark.spec("ENG-070", "ENG-158")
def test_a_greedy_row_holding_one_nan_fails_alone() -> None:
    """Greedy rows, whose summary (ENG-158) is where the engine looks for NaN: the request
    whose logits hold one NaN fails in its first step with the NaN message; the others of that
    step get the tokens they get alone."""
    poison = (100, 99, 98, 97, 96)
    config = EngineConfig(page_size=4, num_pages=64, max_num_batched_tokens=256, max_num_seqs=8)
    engine = reference_backend().create_engine(
        OneNanRunner(101, config.num_pages, config.page_size, poison=poison, kind="nan"), config
    )
    assert isinstance(engine, LLMEngine)
    assert engine._logit_summary is not None
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [[5, 6, 7], [8, 9]]
    ids = [engine.add_request(p, params) for p in prompts]
    poisoned = engine.add_request([*poison, 1, 2], params)
    finals = _finals(engine, [*ids, poisoned])
    assert finals[-1].finish_reason is FinishReason.ERROR
    assert finals[-1].token_ids == []
    assert "NaN" in (finals[-1].error or "")
    for prompt, final in zip(prompts, finals[:-1], strict=True):
        assert final.error is None
        assert list(final.token_ids) == solo_greedy(prompt, 5)
    assert engine.stats().pages_in_use == 0
