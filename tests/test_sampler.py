"""The reference sampler's filter at its boundaries (specs/engine.md ENG-040)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import SampleRow, filtered_probs, sample_rows


def kept(probs: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(probs).flatten()]


@pytest.mark.spec("ENG-040")
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=1.0, min_p=0.2),
    ],
)
def test_filtered_probabilities_sum_to_one(params: SamplingParams) -> None:
    probs = filtered_probs(torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0]), params)
    assert math.isclose(float(probs.sum()), 1.0, abs_tol=1e-6)


@pytest.mark.spec("ENG-040")
def test_top_p_stops_at_the_token_whose_mass_reaches_it() -> None:
    """Two equally likely tokens and top_p = 0.5: the first alone reaches it."""
    logits = torch.tensor([0.0, 0.0, -math.inf, -math.inf])
    assert kept(filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))) == [0]


@pytest.mark.spec("ENG-040")
def test_min_p_of_one_keeps_the_most_likely_tokens() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert kept(probs) == [1, 2]
    assert math.isclose(float(probs[1]), 0.5, abs_tol=1e-6)


@pytest.mark.spec("ENG-040", "ENG-048")
def test_a_batch_of_rows_filters_each_row_as_alone() -> None:
    """min-p, top-k and top-p of a batch act row by row: each row's probabilities are what
    filtering it alone gives, and each sums to 1 (rows with different maxima and sizes)."""
    from pagedkv.engine.sampler import filtered_probs_batch

    logits = torch.tensor([[4.0, 3.5, 1.0, 0.0, -1.0], [0.5, 0.4, 0.3, 0.2, 0.1]])
    params = [
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=0.8, min_p=0.8, top_k=4, top_p=0.95),
    ]
    batch = filtered_probs_batch(logits, params)
    for row, p in enumerate(params):
        torch.testing.assert_close(batch[row], filtered_probs(logits[row], p))
        assert math.isclose(float(batch[row].sum()), 1.0, abs_tol=1e-6)
    assert kept(batch[0]) == [0, 1]  # 0.3 of row 0's own maximum, not of the batch's
    assert kept(batch[1]) == [0, 1]


@pytest.mark.spec("ENG-041", "ENG-048")
def test_sample_draws_from_its_generator_with_no_history() -> None:
    """sample() is sample_rows() of one row with empty histories, its generator included:
    equal seeds draw equal tokens, and penalties find nothing to penalise."""
    from pagedkv.engine.sampler import SampleRow, sample, sample_rows

    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0)
    for seed in range(3):
        got = sample(logits, params, torch.Generator().manual_seed(seed))
        row = SampleRow(params, torch.Generator().manual_seed(seed), (), ())
        assert got == sample_rows(logits.unsqueeze(0), [row])[0].token_id


@pytest.mark.spec("ENG-045", "ENG-048")
def test_sampling_parameters_accept_their_bounds_and_store_tuples() -> None:
    """Every range is closed where OpenAI's and vLLM's are, and sequences are stored as
    tuples (a string stop is one stop string, not its characters)."""
    from pagedkv.engine.params import MAX_LOGIT_BIAS, MAX_PENALTY

    SamplingParams(presence_penalty=MAX_PENALTY, frequency_penalty=-MAX_PENALTY)
    SamplingParams(presence_penalty=-MAX_PENALTY, frequency_penalty=MAX_PENALTY)
    SamplingParams(logit_bias={3: MAX_LOGIT_BIAS, 4: -MAX_LOGIT_BIAS})
    SamplingParams(max_tokens=5, min_tokens=5)
    SamplingParams(n=3, best_of=3)
    SamplingParams(top_k=-1)
    params = SamplingParams(stop="ab", stop_token_ids=[5, 6])
    assert params.stop == ("ab",)
    assert params.stop_token_ids == (5, 6)
    assert SamplingParams(stop=["x", "y"]).stop == ("x", "y")


@pytest.mark.spec("ENG-040")
def test_top_p_of_one_keeps_every_token() -> None:
    """top_p = 1 keeps the whole distribution, even where the float32 cumulative mass of the
    most likely tokens rounds to 1 before the last ones (as it does over Qwen3's vocabulary):
    a token of non-zero probability keeps it."""
    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(0)) * 3
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=1.0))
    assert bool((probs > 0).all())
    torch.testing.assert_close(probs, torch.softmax(logits, dim=0))


@pytest.mark.spec("ENG-044", "ENG-049")
def test_log_probabilities_of_no_rows_are_none() -> None:
    """No rows, no targets: empty lists, not an error."""
    from pagedkv.engine.sampler import prompt_logprobs, top_logprobs

    empty = torch.zeros(0, 7)
    assert prompt_logprobs(empty, [], 3) == []
    assert top_logprobs(empty, []) == []


@pytest.mark.spec("ENG-040")
def test_greedy_takes_the_lowest_id_among_equal_maxima() -> None:
    """Ties anywhere in a Qwen3-sized row (a vectorised reduction sees them in different
    lanes) go to the lowest token id, as ``torch.argmax`` picks them."""
    vocab = 151936
    logits = torch.randn(4, vocab)
    for row, ties in enumerate([(100000, 5, 70000), (vocab - 1, 77777), (16, 17, 15), ()]):
        for token in ties:
            logits[row, token] = 9.0
    logits[3] = 0.0  # every token ties
    rows = [SampleRow(SamplingParams(temperature=0.0), None, (1,), ()) for _ in range(4)]
    assert [s.token_id for s in sample_rows(logits, rows)] == [5, 77777, 15, 0]
