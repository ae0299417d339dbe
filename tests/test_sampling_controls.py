"""Sampling controls against a reference computation (specs/engine.md ENG-048).

The reference applies each control to one row in plain Python, in vLLM's order: ``min_tokens``
masks EOS and stop tokens, ``logit_bias`` adds, then the repetition, frequency and presence
penalties. The sampler must give the same logits for every row of a mixed batch in one call,
and the engine must pick, at every step, the argmax of the reference's logits (greedy).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pagedkv.backend import reference_backend
from pagedkv.engine import engine as engine_module
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import InvalidSamplingParams, SamplingParams
from pagedkv.engine.sampler import SampleRow, processed_logits, sample_rows
from pagedkv.plan import StepPlan
from pagedkv_conformance.sampling_reference import controlled_logits
from pagedkv_conformance.suite_engine_controls import ShiftedRunner, random_params

VOCAB = 37
CONFIG = EngineConfig(page_size=4, num_pages=64, max_model_len=128)
EOS = frozenset({5})


def engine(eos: frozenset[int] = EOS) -> LLMEngine:
    runner = ShiftedRunner(VOCAB, CONFIG.num_pages, CONFIG.page_size)
    return reference_backend().create_engine(runner, CONFIG, eos_ids=eos)


@pytest.mark.spec("ENG-048")
@pytest.mark.parametrize("seed", range(5))
def test_batched_controls_equal_the_reference(seed: int) -> None:
    """Eight rows with random controls and histories, processed in one call, each equal to
    its own reference computation."""
    rng = random.Random(seed)
    rows = []
    for _ in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
        rows.append(SampleRow(random_params(rng), None, prompt, output))
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    got = processed_logits(logits, rows, EOS)
    for i, row in enumerate(rows):
        want = controlled_logits(
            logits[i].tolist(), row.params, row.prompt_token_ids, row.output_token_ids, EOS
        )
        assert got[i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5), i
    greedy = sample_rows(logits, rows, EOS)
    assert [s.token_id for s in greedy] == [int(torch.argmax(got[i])) for i in range(8)]


def replay(prompt: Sequence[int], params: SamplingParams, tokens: Sequence[int]) -> None:
    """Every generated token is the argmax of the reference's logits at its step."""
    context = list(prompt)
    for step, token in enumerate(tokens):
        runner = ShiftedRunner(VOCAB)
        logits = runner.execute(_recompute_plan(context))[0].tolist()
        processed = controlled_logits(logits, params, prompt, tokens[:step], EOS)
        assert token == max(range(VOCAB), key=lambda t: processed[t]), (step, tokens)
        context.append(token)


def _recompute_plan(context: Sequence[int]) -> StepPlan:
    from pagedkv.plan import SeqChunk
    from pagedkv.plan_builders import build_recompute_plan

    return build_recompute_plan([SeqChunk(tuple(context), 0)])


@pytest.mark.spec("ENG-048")
@pytest.mark.parametrize("seed", range(4))
def test_the_engine_picks_the_reference_argmax(seed: int) -> None:
    """Greedy requests with random controls, batched together: at every step each picks the
    argmax of its reference logits; penalties and bias visibly change the outputs."""
    rng = random.Random(100 + seed)
    prompts: list[str | list[int]] = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(2, 11))] for _ in range(4)
    ]
    params = [random_params(rng) for _ in prompts]
    outs = run_to_completion(engine(), prompts, params)
    plain = run_to_completion(engine(), prompts, SamplingParams(max_tokens=20, temperature=0))
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert isinstance(prompt, list)
        replay(prompt, p, out.token_ids)
        assert len(out.token_ids) >= p.min_tokens
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


@pytest.mark.spec("ENG-048")
def test_a_negative_bias_on_the_greedy_token_moves_the_choice() -> None:
    """The reproduction: ``logit_bias`` -100 on the greedy token changes the output."""
    prompt: list[str | list[int]] = [[1, 2, 3, 4]]
    (free,) = run_to_completion(engine(), prompt, SamplingParams(max_tokens=1, temperature=0))
    first = free.token_ids[0]
    biased = SamplingParams(max_tokens=1, temperature=0, logit_bias={first: -100})
    (out,) = run_to_completion(engine(), prompt, biased)
    assert out.token_ids[0] != first
    assert out.token_ids[0] == (first + 1) % VOCAB  # the next most likely on the hash model


@pytest.mark.spec("ENG-048", "ENG-042")
def test_min_tokens_holds_off_eos_and_stop_tokens() -> None:
    """EOS at the 3rd greedy token ends a plain request there; with ``min_tokens=6`` no EOS or
    stop token is generated before the 7th token."""
    prompt = [7, 8, 9]
    (free,) = run_to_completion(
        engine(frozenset()), [prompt], SamplingParams(max_tokens=12, temperature=0)
    )
    eos = frozenset({free.token_ids[2]})
    (early,) = run_to_completion(
        engine(eos), [prompt], SamplingParams(max_tokens=12, temperature=0)
    )
    assert len(early.token_ids) == 3
    held = SamplingParams(
        max_tokens=12, temperature=0, min_tokens=6, stop_token_ids=(free.token_ids[1],)
    )
    (late,) = run_to_completion(engine(eos), [prompt], held)
    assert len(late.token_ids) > 6
    assert not set(late.token_ids[:6]) & (eos | {free.token_ids[1]})


@pytest.mark.spec("ENG-048", "ENG-041")
def test_one_sampler_call_per_step_and_seeded_rows_ignore_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded, penalised request samples the same tokens alone and beside others with other
    controls; every step samples all its rows in one call."""
    calls: list[int] = []
    real = engine_module.sample_batch

    def counting(logits: torch.Tensor, rows: Sequence[SampleRow], *rest: Any) -> list:  # type: ignore[type-arg]
        calls.append(len(rows))
        return real(logits, rows, *rest)

    monkeypatch.setattr(engine_module, "sample_batch", counting)
    seeded = SamplingParams(
        max_tokens=10, temperature=1.2, seed=9, presence_penalty=0.7, repetition_penalty=1.3
    )
    (alone,) = run_to_completion(engine(frozenset()), [[4, 5, 6]], seeded)
    others = [
        SamplingParams(max_tokens=8, temperature=0.9, seed=i, frequency_penalty=1.0)
        for i in range(3)
    ]
    crowd = engine(frozenset())
    outs = run_to_completion(crowd, [[1], [4, 5, 6], [2, 2], [3]], [others[0], seeded, *others[1:]])
    assert outs[1].token_ids == alone.token_ids
    assert len(calls) == 10 + crowd.stats().steps
    assert max(calls) == 4


@pytest.mark.spec("ENG-048", "ENG-045")
@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")},
        {"logit_bias": {3: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"min_tokens": 17},
        {"min_tokens": -1},
        {"prompt_logprobs": -1},
        {"n": 0},
        {"n": 2, "best_of": 1},
    ],
)
def test_out_of_range_controls_raise(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**bad)  # type: ignore[arg-type]


@pytest.mark.spec("ENG-048")
def test_a_bias_outside_the_vocabulary_is_refused() -> None:
    e = engine()
    with pytest.raises(InvalidSamplingParams, match="logit_bias"):
        e.add_request([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert not e.has_unfinished_requests()


@pytest.mark.spec("ENG-120")
def test_stop_tokens_outside_the_vocabulary_are_accepted_and_mask_nothing() -> None:
    """Stop token ids at and past the vocabulary's end, with ``min_tokens``: the request runs as
    it does without them (the ids it can generate are still masked), and never fails."""
    prompt = [7, 8, 9]
    held = SamplingParams(max_tokens=8, temperature=0, min_tokens=5, stop_token_ids=(3,))
    (want,) = run_to_completion(engine(), [prompt], held)
    outside = SamplingParams(
        max_tokens=8, temperature=0, min_tokens=5, stop_token_ids=(3, VOCAB, VOCAB + 1)
    )
    (got,) = run_to_completion(engine(), [prompt], outside)
    assert got.error is None
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
