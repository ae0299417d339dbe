"""Conformance tests of failure isolation (specs/engine.md ENG-070..073): one request's failure
is that request's alone.

Faults are injected with :mod:`pagedkv.testing.faults` into the engine's collaborators only (the
step runner it is given, the tokenizer it is given), never into the engine, so any backend's
engine can be held to these: a row whose sampling raises (NaN logits), a request whose text
cannot be decoded, steps whose model run raises once, at random, or whenever one poisoned
request is in them. Subclass :class:`EngineIsolationSuite` to run them on an engine of yours,
or run the suite with ``--backend module:factory``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import FinishReason, RequestOutput, StepReport
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.interfaces import Backend, Engine, EngineBackend, StepRunner
from pagedkv.testing.faults import (
    FaultyRunner,
    FaultyTokenizer,
    IdTokenizer,
    PoisonedRunner,
    TracingHashRunner,
    out_of_tries,
)
from pagedkv.testing.hash_runner import HashRunner

from .engine_harness import VOCAB, greedy, prompts_with_shared_prefix, solo_greedy

#: The prompt prefix of poisoned requests; no other prompt here starts with it.
POISON = (100, 99, 98, 97, 96)
#: The token only a poisoned request produces (``PoisonedRunner`` kind ``tokens``).
RESERVED = VOCAB - 1
#: Tokens that tell requests apart in :class:`TracingHashRunner`'s record.
KEY_LEN = 1
CONFIG = EngineConfig(page_size=4, num_pages=64, max_num_batched_tokens=256, max_num_seqs=8)


def create_engine(
    backend: Backend, runner: StepRunner, config: EngineConfig, tokenizer: Tokenizer | None = None
) -> Engine:
    """An engine of ``backend`` over ``runner``."""
    if not isinstance(backend, EngineBackend):
        raise TypeError(f"backend {backend.name!r} declares 'engine' but has no create_engine")
    return backend.create_engine(runner, config, tokenizer=tokenizer)


@dataclass
class Run:
    """Every output of every step, and the final output of each request."""

    steps: list[list[RequestOutput]] = field(default_factory=list)
    finals: dict[str, RequestOutput] = field(default_factory=dict)

    def step_of_failure(self, request_id: str) -> list[RequestOutput]:
        """The outputs of the step that failed ``request_id``."""
        for outputs in self.steps:
            if any(o.request_id == request_id and o.finished for o in outputs):
                return outputs
        raise AssertionError(f"{request_id} never finished")


def run_all(engine: Engine, max_steps: int = 2_000) -> Run:
    """Step until nothing is left, checking the invariants after every step (ENG-073); a
    failure never makes ``step()`` raise (ENG-070, ENG-071)."""
    run = Run()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return run
        outputs = engine.step()
        engine.check_invariants()
        run.steps.append(outputs)
        for output in outputs:
            if output.finished:
                run.finals[output.request_id] = output
    raise AssertionError(f"engine still busy after {max_steps} steps")


def add_all(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[str]:
    return [engine.add_request(list(p), params) for p in prompts]


def first_half(items: Sequence[int]) -> list[int]:
    """The first half of a failed step's rows (the larger half, for an odd count): what the
    engine runs next while it searches for the failure's cause (ENG-072)."""
    return list(items[: (len(items) + 1) // 2])


def assert_failed(output: RequestOutput) -> None:
    """``output`` ends its request with reason ``error``, a message and, in every completion, no
    new token and no new text."""
    assert output.finished
    assert output.finish_reason is FinishReason.ERROR, output
    assert isinstance(output.error, str)
    assert output.error
    for completion in output.outputs:
        assert completion.new_token_ids == []
        assert completion.new_text == ""


def assert_clean(output: RequestOutput, expected: Sequence[int]) -> None:
    """``output`` finished normally with exactly ``expected``."""
    assert output.finish_reason is FinishReason.LENGTH, (output.finish_reason, output.error)
    assert output.error is None
    assert list(output.token_ids) == list(expected)


@pytest.mark.requires("engine")
class EngineIsolationSuite:
    """A bad or unlucky request never fails, stalls or wedges another, and leaks nothing."""

    @pytest.mark.spec("ENG-070", "ENG-073")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_a_row_whose_sampling_raises_fails_alone(self, backend: Backend, mode: str) -> None:
        """One request's logits are NaN, so sampling it at a temperature raises: it alone fails,
        in its first step; the four requests sharing that step report their token of it, and
        finish as they would alone."""
        config = replace(CONFIG, mode="v1" if mode == "v1" else "v0")
        runner = PoisonedRunner(
            VOCAB, config.num_pages, config.page_size, poison=POISON, kind="nan"
        )
        engine = create_engine(backend, runner, config)
        prompts = prompts_with_shared_prefix(4, prefix_len=6, seed=2)
        ids = add_all(engine, prompts[:2], greedy(max_tokens=7))
        poisoned = engine.add_request([*POISON, 1, 2, 3], SamplingParams(max_tokens=7, seed=5))
        ids += add_all(engine, prompts[2:], greedy(max_tokens=7))
        run = run_all(engine)
        assert_failed(run.finals[poisoned])
        assert run.finals[poisoned].token_ids == []
        same_step = {o.request_id: o for o in run.step_of_failure(poisoned)}
        assert set(same_step) == {*ids, poisoned}
        for request_id, prompt in zip(ids, prompts, strict=True):
            reported = same_step[request_id]
            assert len(reported.new_token_ids) == 1
            assert list(reported.token_ids) == solo_greedy(prompt, len(reported.token_ids))
            assert_clean(run.finals[request_id], solo_greedy(prompt, 7))
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-070")
    def test_a_failed_rows_pages_are_not_published(self, backend: Backend) -> None:
        """The poisoned prompt spans two full pages; sampling it fails. A request with the same
        prompt afterwards finds none of its pages cached."""
        runner = PoisonedRunner(
            VOCAB, CONFIG.num_pages, CONFIG.page_size, poison=POISON, kind="nan"
        )
        engine = create_engine(backend, runner, CONFIG)
        prompt = [*POISON, 1, 2, 3, 4]
        first = engine.add_request(prompt, SamplingParams(max_tokens=3, seed=1))
        run = run_all(engine)
        second = engine.add_request(prompt, SamplingParams(max_tokens=3, seed=1))
        again = run_all(engine)
        assert_failed(run.finals[first])
        assert_failed(again.finals[second])
        assert again.finals[second].metrics.cached_tokens == 0
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-070", "ENG-073")
    @pytest.mark.parametrize("stop", [(), ("never printed",)], ids=["text", "stop-strings"])
    def test_a_request_whose_text_fails_fails_alone(
        self, backend: Backend, stop: tuple[str, ...]
    ) -> None:
        """The tokenizer raises on any text holding the poisoned request's first token (which
        only it produces): that request fails in its first step, with or without stop strings
        to match; the others finish with the tokens and text of a run without it."""
        prompts = prompts_with_shared_prefix(5, prefix_len=7, seed=8)
        params = SamplingParams(max_tokens=6, temperature=0.0, stop=stop)

        def engine_over(tokenizer: Tokenizer) -> Engine:
            runner = PoisonedRunner(
                VOCAB,
                CONFIG.num_pages,
                CONFIG.page_size,
                poison=POISON,
                kind="tokens",
                reserved=[RESERVED],
            )
            return create_engine(backend, runner, CONFIG, tokenizer)

        clean = engine_over(IdTokenizer())
        clean_ids = add_all(clean, prompts, params)
        expected = run_all(clean).finals
        tokenizer = FaultyTokenizer(IdTokenizer(), lambda ids: RESERVED in ids)
        engine = engine_over(tokenizer)
        ids = add_all(engine, prompts[:3], params)
        poisoned = engine.add_request([*POISON, 4, 4], params)
        ids += add_all(engine, prompts[3:], params)
        run = run_all(engine)
        assert tokenizer.faults >= 1
        assert_failed(run.finals[poisoned])
        same_step = {o.request_id for o in run.step_of_failure(poisoned)}
        assert same_step == {*ids, poisoned}
        for request_id, clean_id in zip(ids, clean_ids, strict=True):
            want = expected[clean_id]
            assert_clean(run.finals[request_id], want.token_ids)
            assert run.finals[request_id].text == want.text == IdTokenizer().decode(want.token_ids)
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-070", "ENG-073")
    def test_a_request_whose_last_token_text_fails_fails(self, backend: Backend) -> None:
        """With ``max_tokens=1`` the first token ends the request by length, and decoding its
        text raises: the request ends with reason error instead, and nothing leaks."""
        prompt = [3, 1, 4]
        token = solo_greedy(prompt, 1)[0]
        tokenizer = FaultyTokenizer(IdTokenizer(), lambda ids: token in ids)
        runner = HashRunner(VOCAB, CONFIG.num_pages, CONFIG.page_size)
        engine = create_engine(backend, runner, CONFIG, tokenizer)
        request_id = engine.add_request(prompt, greedy(max_tokens=1))
        run = run_all(engine)
        assert tokenizer.faults >= 1
        assert_failed(run.finals[request_id])
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-070", "ENG-091")
    def test_a_failed_request_releases_no_held_back_text(self, backend: Backend) -> None:
        """The first token's text begins a stop string, so it is held back; the next step
        fails (no retries), failing the request: its output carries no new text, and its text
        is what was released before, nothing."""
        config = replace(CONFIG, max_step_retries=0)
        runner = FaultyRunner(HashRunner(VOCAB, config.num_pages, config.page_size))
        engine = create_engine(backend, runner, config, IdTokenizer())
        prompt = [3, 1, 4, 1, 5]
        first = solo_greedy(prompt, 1)[0]
        params = SamplingParams(max_tokens=4, temperature=0.0, stop=(f"{first} x",))
        request_id = engine.add_request(prompt, params)
        (held,) = engine.step()
        assert held.token_ids == [first]
        assert held.new_text == held.text == ""
        runner.failing = True
        (failed,) = engine.step()
        assert failed.request_id == request_id
        assert_failed(failed)
        assert failed.text == ""
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-071", "ENG-073")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_a_failed_step_is_run_again_unchanged(self, backend: Backend, mode: str) -> None:
        """The first step (every prefill) and the third (a decode step) raise after the model
        wrote their K/V: the next step runs the same positions again (those of the first half
        of its requests, when it held several: ENG-072's search for the cause), and every
        output is the solo run's."""
        config = replace(CONFIG, mode="v1" if mode == "v1" else "v0")
        inner = HashRunner(VOCAB, config.num_pages, config.page_size)
        runner = FaultyRunner(inner, fail_calls={0, 2})
        engine = create_engine(backend, runner, config)
        prompts = prompts_with_shared_prefix(4, prefix_len=9, seed=4)
        ids = add_all(engine, prompts, greedy(max_tokens=5))
        run = run_all(engine)
        assert runner.faults == [0, 2]
        assert inner.steps[1] == first_half(inner.steps[0])
        assert inner.steps[3] == first_half(inner.steps[2])
        assert run.steps[0] == run.steps[2] == []  # a failed step reports nothing
        for request_id, prompt in zip(ids, prompts, strict=True):
            assert_clean(run.finals[request_id], solo_greedy(prompt, 5))
        stats = engine.stats()
        assert stats.failed_steps == 2
        assert stats.pages_in_use == 0

    @pytest.mark.spec("ENG-071", "ENG-072")
    @pytest.mark.parametrize("retries", [0, 1, 2])
    def test_failed_steps_publish_nothing_and_fail_after_the_retries(
        self, backend: Backend, retries: int
    ) -> None:
        """While the runner fails, a 13-token prompt's steps report nothing until the
        ``1 + retries``-th, which fails it. Once the runner works again, the same prompt finds
        none of its three full pages cached and gets the solo run's tokens."""
        config = replace(CONFIG, max_step_retries=retries)
        runner = FaultyRunner(HashRunner(VOCAB, config.num_pages, config.page_size))
        engine = create_engine(backend, runner, config)
        prompt = list(range(13))
        runner.failing = True
        first = engine.add_request(prompt, greedy(max_tokens=4))
        for _ in range(retries):
            assert engine.step() == []
        (failed,) = engine.step()
        assert failed.request_id == first
        assert_failed(failed)
        assert not engine.has_unfinished_requests()
        assert engine.stats().pages_in_use == 0
        assert engine.stats().failed_steps == retries + 1
        runner.failing = False
        second = engine.add_request(prompt, greedy(max_tokens=4))
        run = run_all(engine)
        assert_clean(run.finals[second], solo_greedy(prompt, 4))
        assert run.finals[second].metrics.cached_tokens == 0

    @pytest.mark.spec("ENG-072", "ENG-073")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_a_request_no_step_can_run_fails_alone(self, backend: Backend, mode: str) -> None:
        """Every step holding the poisoned request raises. It shares its first step with three
        others, and a fifth waits for a free sequence slot: the engine halves that step (the
        first half, two clean requests, succeeds; the second, the poisoned one and a clean
        one, fails and is halved again), then the poisoned request fails after three failed
        steps alone: five failed steps, only the poisoned request fails, and every other
        finishes as it would alone."""
        config = replace(CONFIG, max_num_seqs=5, mode="v1" if mode == "v1" else "v0")
        runner = PoisonedRunner(
            VOCAB, config.num_pages, config.page_size, poison=POISON, kind="raise"
        )
        engine = create_engine(backend, runner, config)
        prompts = prompts_with_shared_prefix(5, prefix_len=5, seed=6)
        ids = add_all(engine, prompts[:2], greedy(max_tokens=6))
        poisoned = engine.add_request([*POISON, 7], greedy(max_tokens=6))
        ids += add_all(engine, prompts[2:], greedy(max_tokens=6))  # the last one waits
        run = run_all(engine)
        assert_failed(run.finals[poisoned])
        for request_id, prompt in zip(ids, prompts, strict=True):
            assert_clean(run.finals[request_id], solo_greedy(prompt, 6))
        stats = engine.stats()
        assert stats.failed_steps == 5
        assert runner.poisoned_steps == 5
        alone = [held for held in runner.keys if len(held) == 1 and held[0][0] == POISON[0]]
        assert len(alone) == 3
        assert stats.pages_in_use == 0

    @pytest.mark.spec("ENG-072", "ENG-131", "ENG-051")
    @pytest.mark.parametrize("retries", [1, 2])
    def test_a_request_no_step_can_run_fails_alone_beside_one_other(
        self, backend: Backend, retries: int
    ) -> None:
        """A clean request and a poisoned one fail their first step together: that step counts
        against neither, and each then runs alone, the clean one first (a step of one
        sequence, which observers see), so only the poisoned one fails, after ``1 + retries``
        failed steps alone, and the clean one finishes as alone, with all its tries left."""
        config = replace(CONFIG, max_step_retries=retries)
        runner = PoisonedRunner(
            VOCAB, config.num_pages, config.page_size, poison=POISON, kind="raise"
        )
        engine = create_engine(backend, runner, config)
        reports: list[StepReport] = []
        engine.add_step_observer(reports.append)
        prompt = [1, 2, 3, 4, 5]
        clean = engine.add_request(prompt, greedy(max_tokens=4))
        poisoned = engine.add_request([*POISON, 7], greedy(max_tokens=4))
        run = run_all(engine)
        assert_failed(run.finals[poisoned])
        assert_clean(run.finals[clean], solo_greedy(prompt, 4))
        assert engine.stats().failed_steps == runner.poisoned_steps == retries + 2
        assert [r.num_seqs for r in reports] == [1] * 4
        assert all(r.num_preempted == 0 for r in reports)

    @pytest.mark.spec("ENG-131")
    @pytest.mark.parametrize("retries", [0, 2])
    def test_no_step_is_cut_down_without_a_last_try(self, backend: Backend, retries: int) -> None:
        """With no failed step (and with ``max_step_retries`` 0, where no request ever has a
        last try to run alone), every step holds every running request."""
        config = replace(CONFIG, max_step_retries=retries)
        engine = create_engine(
            backend, HashRunner(VOCAB, config.num_pages, config.page_size), config
        )
        reports: list[StepReport] = []
        engine.add_step_observer(reports.append)
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
        ids = add_all(engine, prompts, greedy(max_tokens=3))
        assert sorted(o.request_id for o in engine.step()) == sorted(ids)
        run = run_all(engine)
        assert [r.num_seqs for r in reports] == [3, 3, 3]
        for request_id, prompt in zip(ids, prompts, strict=True):
            assert_clean(run.finals[request_id], solo_greedy(prompt, 3))

    @pytest.mark.spec("ENG-071", "ENG-072", "ENG-073")
    @pytest.mark.parametrize(("mode", "seed"), [("v1", 1), ("v1", 2), ("v1", 5), ("v0", 3)])
    def test_random_step_faults_fail_only_requests_out_of_tries(
        self, backend: Backend, mode: str, seed: int
    ) -> None:
        """One step in four raises, over a small pool (preemption) and a small token budget
        (chunked prefill). Exactly the requests that were in three failed steps in a row fail
        (counted from the runner's record of what each call held); every other finishes as it
        would alone, greedy or seeded."""
        config = EngineConfig(
            page_size=4,
            num_pages=24,
            max_num_batched_tokens=16,
            max_num_seqs=6,
            mode="v1" if mode == "v1" else "v0",
        )
        inner = TracingHashRunner(VOCAB, config.num_pages, config.page_size, key_len=KEY_LEN)
        runner = FaultyRunner(inner, rate=0.25, seed=seed)
        engine = create_engine(backend, runner, config)
        rng = random.Random(seed)
        # told apart by their first token, the only one every chunk's context holds
        prompts = [
            [i] + [rng.randrange(VOCAB) for _ in range(rng.randint(4, 24))] for i in range(12)
        ]
        ids = add_all(engine, prompts[:-1], greedy(max_tokens=8))
        sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
        seeded = engine.add_request(prompts[-1], sampled)
        run = run_all(engine)
        solo = create_engine(backend, HashRunner(VOCAB, config.num_pages, config.page_size), config)
        alone = solo.add_request(prompts[-1], sampled)
        expected = [
            *(solo_greedy(p, 8) for p in prompts[:-1]),
            run_all(solo).finals[alone].token_ids,
        ]
        must_fail = out_of_tries(inner.keys, runner.faults, config.max_step_retries)
        assert len(runner.faults) >= 5
        for request_id, prompt, tokens in zip([*ids, seeded], prompts, expected, strict=True):
            if tuple(prompt[:KEY_LEN]) in must_fail:
                assert_failed(run.finals[request_id])
            else:
                assert_clean(run.finals[request_id], tokens)
        stats = engine.stats()
        assert stats.failed_steps == len(runner.faults)
        assert stats.pages_in_use == 0
