"""Tiny temperatures sample greedily instead of overflowing (specs/engine.md ENG-046)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import GREEDY_TEMPERATURE, SamplingParams
from pagedkv.engine.sampler import sample
from pagedkv.interfaces import Engine
from pagedkv.plan import StepPlan
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 64
CONFIG = EngineConfig(page_size=4, num_pages=64, max_model_len=128)


class RaisedLogitsRunner(HashRunner):
    """The hash stand-in with its logits lifted to a real model's size: the top one is +40, so
    dividing by 1e-40 overflows float32."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return super().execute(plan) + 40.0


def engine() -> Engine:
    runner = RaisedLogitsRunner(VOCAB, num_pages=CONFIG.num_pages, page_size=CONFIG.page_size)
    return reference_backend().create_engine(runner, CONFIG)


@pytest.mark.spec("ENG-046")
@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-30, GREEDY_TEMPERATURE / 2])
def test_a_temperature_below_the_epsilon_is_greedy(temperature: float) -> None:
    # logits of the size a real model gives: dividing them by 1e-40 overflows float32
    logits = torch.tensor([3.0, 40.0, -25.0, 39.5])
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert sample(logits, params, torch.Generator().manual_seed(0)) == 1


@pytest.mark.spec("ENG-046")
def test_the_epsilon_itself_still_samples() -> None:
    params = SamplingParams(temperature=GREEDY_TEMPERATURE)
    assert not params.greedy
    logits = torch.tensor([3.0, 40.0, -25.0, 39.5])
    assert sample(logits, params, torch.Generator().manual_seed(0)) == 1


@pytest.mark.spec("ENG-046")
def test_a_tiny_temperature_in_a_batch_never_fails_a_step() -> None:
    prompts: list[str | list[int]] = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]]
    greedy = run_to_completion(
        engine(), prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    mixed = engine()
    ids = [
        mixed.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=1e-40)),
        mixed.add_request(prompts[1], SamplingParams(max_tokens=12, temperature=0.0)),
        mixed.add_request(prompts[2], SamplingParams(max_tokens=12, temperature=0.8, seed=3)),
    ]
    finals = {}
    while mixed.has_unfinished_requests():
        for output in mixed.step():
            if output.finished:
                finals[output.request_id] = output
    assert set(finals) == set(ids)
    assert finals[ids[0]].token_ids == greedy[0].token_ids
    assert finals[ids[1]].token_ids == greedy[1].token_ids
    assert len(finals[ids[2]].token_ids) == 12
    assert mixed.stats().pages_in_use == 0
