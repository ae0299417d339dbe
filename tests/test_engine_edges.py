"""The reference engine at its edges: seeds, a batch whose sampling raises, failed siblings,
cache salts given twice, step timings, peak pages and the limits of EngineConfig.

Each test runs over the hash model stand-in (``pagedkv.testing.hash_runner``) in well under a
second; they are in the engine packages' mutation test selection (``scripts/mutation.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pagedkv.backend import reference_backend
from pagedkv.engine import engine as engine_module
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import FinishReason, RequestOutput, StepReport
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import Sampled, SampleRow
from pagedkv.errors import InvalidRequest
from pagedkv.testing.faults import FaultyRunner, IdTokenizer
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 101
CONFIG = EngineConfig(page_size=4, num_pages=64, max_num_batched_tokens=256, max_num_seqs=8)
PROMPT = [5, 17, 29, 3, 41, 8, 13, 2, 77]


def make_engine(
    config: EngineConfig = CONFIG,
    *,
    runner: HashRunner | FaultyRunner | None = None,
    eos_ids: frozenset[int] = frozenset(),
) -> LLMEngine:
    runner = runner or HashRunner(VOCAB, config.num_pages, config.page_size)
    return reference_backend().create_engine(
        runner, config, tokenizer=IdTokenizer(), eos_ids=eos_ids
    )


def run(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Step until nothing is left; the final output of each request."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    raise AssertionError("the engine is still busy")


def tokens_of(engine: LLMEngine, params: SamplingParams, prompt: Sequence[int] = PROMPT) -> list:
    rid = engine.add_request(list(prompt), params)
    final = run(engine)[rid]
    return [list(c.token_ids) for c in final.outputs]


# -- seeds -------------------------------------------------------------------------------------


@pytest.mark.spec("ENG-140")
def test_unseeded_requests_leave_the_global_generator_alone() -> None:
    """An engine draws the seeds of unseeded requests from a generator of its own: torch's
    global generator gives a program the same numbers with or without an engine sampling next
    to it."""
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    engine = make_engine()
    for _ in range(3):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=1.0))
    run(engine)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.spec("ENG-140")
def test_unseeded_requests_sample_apart() -> None:
    """Forty unseeded requests of one prompt draw forty seeds of their own: no two of them
    sample the same tokens (seeds from a range of 2^62 values; a narrow range would repeat)."""
    engine = make_engine(EngineConfig(page_size=4, num_pages=256, max_num_seqs=64))
    params = SamplingParams(max_tokens=10, temperature=2.0)
    ids = [engine.add_request(PROMPT, params) for _ in range(40)]
    finals = run(engine)
    samples = {tuple(finals[rid].token_ids) for rid in ids}
    assert len(samples) == 40


@pytest.mark.spec("ENG-141", "ENG-047")
def test_seeds_equal_modulo_two_to_the_64_sample_alike() -> None:
    """Any integer seed is taken modulo 2^64: seeds -1 and 2^64 - 1 sample alike, and the
    second sequence of a request seeded 2^64 - 1 samples as one seeded 0."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 1, n=2)
    wrapped = tokens_of(make_engine(), params)
    negative = tokens_of(make_engine(), SamplingParams(max_tokens=6, temperature=1.0, seed=-1))
    zero = tokens_of(make_engine(), SamplingParams(max_tokens=6, temperature=1.0, seed=0))
    assert wrapped[0] == negative[0]
    assert wrapped[1] == zero[0]


# -- sampling that raises ------------------------------------------------------------------------


class RaisingSampler:
    """``sample_batch`` that raises for any batch holding a row that ``bad`` picks."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.inner = engine_module.sample_batch
        self.raised = 0

    def picks(self, row: SampleRow) -> bool:
        generator = row.generator
        return isinstance(generator, torch.Generator) and generator.initial_seed() == self.bad

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], *rest: Any
    ) -> list[Sampled]:
        if any(self.picks(r) for r in rows):
            self.raised += 1
            raise ValueError("this row cannot be sampled")
        return self.inner(logits, rows, *rest)


@pytest.mark.spec("ENG-070")
def test_a_batch_whose_sampling_raises_fails_only_the_rows_that_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sampler raises for any batch holding one request's row: that request alone fails,
    with a message naming the error; the others of the batch, sampled then row by row, get the
    tokens they get alone (``min_tokens`` masking the model's EOS ids as in a batch)."""
    eos = frozenset(range(0, VOCAB, 2))  # every other token ends a request

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=5, temperature=1.0, seed=seed, min_tokens=4)

    alone = {seed: tokens_of(make_engine(eos_ids=eos), params(seed)) for seed in (1, 2)}
    assert all(len(tokens[0]) >= 4 for tokens in alone.values())
    sampler = RaisingSampler(bad=666)
    monkeypatch.setattr(engine_module, "sample_batch", sampler)
    engine = make_engine(eos_ids=eos)
    good = {seed: engine.add_request(PROMPT, params(seed)) for seed in (1, 2)}
    bad = engine.add_request(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=666))
    finals = run(engine)
    assert sampler.raised >= 2  # the batch, then the row alone
    assert finals[bad].finish_reason is FinishReason.ERROR
    assert finals[bad].token_ids == []
    assert isinstance(finals[bad].error, str)
    assert "ValueError" in finals[bad].error
    for seed, rid in good.items():
        assert finals[rid].error is None
        assert [list(finals[rid].token_ids)] == alone[seed]
    assert engine.stats().pages_in_use == 0


class LateRaisingSampler(RaisingSampler):
    """Raises only once the picked row has generated ``after`` tokens."""

    def __init__(self, bad: int, after: int) -> None:
        super().__init__(bad)
        self.after = after

    def picks(self, row: SampleRow) -> bool:
        return super().picks(row) and len(row.output_token_ids) >= self.after


@pytest.mark.spec("ENG-070", "ENG-047")
def test_a_failed_sequence_fails_its_whole_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second of two sequences fails after its third token: in that step the request
    finishes, both sequences with reason ``error``; another request is untouched."""
    other_prompt = [3, 4, 5, 6]
    other_alone = tokens_of(
        make_engine(), SamplingParams(max_tokens=8, temperature=0.0), other_prompt
    )
    monkeypatch.setattr(engine_module, "sample_batch", LateRaisingSampler(bad=1001, after=3))
    engine = make_engine()
    other = engine.add_request(other_prompt, SamplingParams(max_tokens=8, temperature=0.0))
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=1000, n=2))
    steps: list[list[RequestOutput]] = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
        engine.check_invariants()
    ours = [o for outputs in steps for o in outputs if o.request_id == rid]
    final = ours[-1]
    assert final.finished
    assert [c.finish_reason for c in final.outputs] == [FinishReason.ERROR] * 2
    assert final.error is not None
    assert len(final.outputs[1].token_ids) == 3
    assert len(final.outputs[0].token_ids) < 8
    assert sum(o.finished for o in ours) == 1
    assert engine.stats().pages_in_use == 0
    others = [o for outputs in steps for o in outputs if o.request_id == other]
    assert others[-1].finish_reason is FinishReason.LENGTH
    assert [list(others[-1].token_ids)] == other_alone


@pytest.mark.spec("ENG-070", "ENG-072")
def test_a_request_failed_by_failing_steps_names_the_error() -> None:
    """A request no step can run fails with a message naming the model run's error."""
    runner = FaultyRunner(HashRunner(VOCAB, CONFIG.num_pages, CONFIG.page_size))
    runner.failing = True
    engine = make_engine(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0.0))
    final = run(engine)[rid]
    assert final.finish_reason is FinishReason.ERROR
    assert final.error is not None
    assert "InjectedFault" in final.error


# -- cache salts -----------------------------------------------------------------------------


@pytest.mark.spec("ENG-062", "ENG-023")
def test_a_prompts_cache_salt_and_the_one_given() -> None:
    """A prompt dict's cache_salt salts the request; given again as ``cache_salt`` it is the
    same salt, a different one is refused (by ``stream`` too), queuing nothing."""
    prompt = list(range(1, 14))
    engine = make_engine()
    first = engine.add_request({"prompt_token_ids": prompt, "cache_salt": "a"}, SamplingParams())
    run(engine)
    assert first
    same = engine.add_request(
        {"prompt_token_ids": prompt, "cache_salt": "a"}, SamplingParams(), cache_salt="a"
    )
    kwarg = engine.add_request(prompt, SamplingParams(max_tokens=2), cache_salt="a")
    finals = run(engine)
    assert finals[same].num_cached_tokens > 0
    assert finals[kwarg].num_cached_tokens > 0
    unsalted = engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert run(engine)[unsalted].num_cached_tokens == 0
    with pytest.raises(InvalidRequest, match="cache_salt"):
        engine.add_request({"prompt_token_ids": prompt, "cache_salt": "a"}, cache_salt="b")
    with pytest.raises(InvalidRequest, match="cache_salt"):
        next(engine.stream({"prompt_token_ids": prompt, "cache_salt": "a"}, cache_salt="b"))
    assert not engine.has_unfinished_requests()
    streamed = list(engine.stream(prompt, SamplingParams(max_tokens=2), cache_salt="a"))
    assert streamed[-1].num_cached_tokens > 0


# -- outputs and stats ---------------------------------------------------------------------------


@pytest.mark.spec("ENG-142", "ENG-061")
def test_completions_of_several_sequences() -> None:
    """Each of ``n`` completions has its index, its own text (the decode of its own tokens),
    ``logprobs`` ``None`` when none were asked for, and ``finished()`` as in vLLM."""
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == rid)
    assert not any(c.finished() for c in outputs[0].outputs)
    final = outputs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3
    for completion in final.outputs:
        assert completion.finished()
        assert completion.logprobs is None
        assert completion.text == IdTokenizer().decode(completion.token_ids)
    asked = engine.add_request(PROMPT, SamplingParams(max_tokens=2, logprobs=1))
    (completion,) = run(engine)[asked].outputs
    assert completion.logprobs is not None
    assert len(completion.logprobs) == 2


@pytest.mark.spec("ENG-050")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_peak_pages_start_at_zero(mode: str) -> None:
    """No page is in use before the first step, nor ever in v0 (no cache)."""
    engine = make_engine(
        EngineConfig(page_size=4, num_pages=64, mode="v1" if mode == "v1" else "v0")
    )
    assert engine.stats().peak_pages_in_use == 0
    engine.add_request(PROMPT, SamplingParams(max_tokens=3))
    run(engine)
    assert engine.stats().peak_pages_in_use == (3 if mode == "v1" else 0)


@pytest.mark.spec("ENG-051")
def test_step_report_times_are_the_durations_of_its_parts() -> None:
    """Each part's time is a duration: not negative, and all of them together no longer than
    the step."""
    engine = make_engine()
    reports: list[StepReport] = []
    engine.add_step_observer(reports.append)
    engine.add_request(PROMPT, SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        engine.step()
        took = time.perf_counter() - before
        report = reports[-1]
        parts = [
            report.schedule_s,
            report.plan_s,
            report.execute_s,
            report.sample_s,
            report.update_s,
            report.output_s,
        ]
        assert all(part >= 0 for part in parts), parts
        assert sum(parts) <= took, (parts, took)


# -- the configuration -------------------------------------------------------------------------


@pytest.mark.spec("ENG-143")
def test_the_shortest_max_model_len_is_two() -> None:
    """One prompt token and one generated: ``max_model_len=2`` is the least accepted."""
    config = EngineConfig(max_model_len=2)
    engine = make_engine(config)
    rid = engine.add_request([7], SamplingParams(max_tokens=1, temperature=0.0))
    assert len(run(engine)[rid].token_ids) == 1
    with pytest.raises(InvalidRequest, match="max_model_len"):
        EngineConfig(max_model_len=1)


@pytest.mark.spec("ENG-143")
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 0),
        ("num_pages", 0),
        ("max_num_batched_tokens", 0),
        ("max_num_seqs", 0),
        ("max_step_retries", -1),
        ("max_model_len", 1),
        ("mode", "v2"),
    ],
)
def test_configs_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    EngineConfig(**{field: {"max_model_len": 2, "max_step_retries": 0, "mode": "v0"}.get(field, 1)})  # type: ignore[arg-type]
