"""The reference sampler's filter at its boundaries (specs/engine.md ENG-040)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import filtered_probs


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
