"""Prompt log-probabilities (specs/engine.md ENG-049), on the hash model stand-in.

Each prompt token after the first must carry the log-probability the model gives it after the
tokens before it: the log-softmax of the hash model's logits for that context, which the test
computes itself. The prompt is computed whole, chunked or not, even when its prefix is cached.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.plan import SeqChunk
from pagedkv.plan_builders import build_recompute_plan
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 29
PROMPT = [4, 8, 15, 16, 23, 4, 2, 11, 7, 19, 3]


def engine(max_num_batched_tokens: int = 256) -> LLMEngine:
    config = EngineConfig(
        page_size=4, num_pages=32, max_model_len=64, max_num_batched_tokens=max_num_batched_tokens
    )
    runner = HashRunner(VOCAB, config.num_pages, config.page_size)
    return reference_backend().create_engine(runner, config)


def expected(position: int) -> torch.Tensor:
    """Log-probabilities the hash model gives the token at ``position`` of ``PROMPT``."""
    plan = build_recompute_plan([SeqChunk(tuple(PROMPT[:position]), 0)])
    return torch.log_softmax(HashRunner(VOCAB).execute(plan)[0], dim=0)


@pytest.mark.spec("ENG-049")
@pytest.mark.parametrize("budget", [256, 4, 3])
def test_each_prompt_token_gets_its_log_probability(budget: int) -> None:
    """Whole, in chunks of 4, or of 3 (the last chunk then starts one before the last
    position, so it fills just that one): position 0 has none; every later one the token's
    log-probability, its rank and the 2 most likely tokens."""
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    (out,) = run_to_completion(engine(budget), [PROMPT], params)
    entries = out.prompt_logprobs
    assert entries is not None
    assert len(entries) == len(PROMPT)
    assert entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry is not None
        want = expected(position)
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(float(want[PROMPT[position]]), abs=1e-5)
        assert entry.rank == int((want > want[PROMPT[position]]).sum()) + 1
        top = torch.topk(want, 2)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)


@pytest.mark.spec("ENG-049")
def test_a_cached_prefix_is_computed_again_and_nothing_is_published() -> None:
    e = engine()
    run_to_completion(e, [PROMPT], SamplingParams(max_tokens=1, temperature=0))
    before = e.stats()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, n=2)
    (out,) = run_to_completion(e, [PROMPT], params)
    after = e.stats()
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == len(PROMPT)
    assert out.num_cached_tokens == 0
    assert after.pages_cached == before.pages_cached  # it published nothing
    assert out.prompt_logprobs is not None
    assert all(entry is not None and entry.top == () for entry in out.prompt_logprobs[1:])
    (again,) = run_to_completion(e, [PROMPT], SamplingParams(max_tokens=1, temperature=0))
    assert again.num_cached_tokens == 8  # the first run's pages are still the ones hit


@pytest.mark.spec("ENG-132", "ENG-012")
def test_a_request_aborted_mid_prefill_reports_no_prompt_logprobs() -> None:
    """Prefilled in chunks of 4, aborted after two of its three chunks: its final output has
    no prompt log-probabilities rather than a list with holes."""
    e = engine(4)
    request_id = e.add_request(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert e.step() == e.step() == []  # two chunks of the prompt, nothing sampled yet
    out = e.abort(request_id)
    assert out is not None
    assert out.prompt_logprobs is None
    assert out.token_ids == []
