"""Float sampling fields mean what they say in float32, the dtype the sampler computes in
(ENG-176..178): non-finite values and values float32 cannot hold are refused naming the field,
and every accepted value samples a token the filtered distribution holds. The engine-level run
over every edge value is the suite's (``pagedkv_conformance.suite_engine_param_edges``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.params import (
    FLOAT32_TINY,
    FLOAT_FIELDS,
    InvalidSamplingParams,
    SamplingParams,
)
from pagedkv.engine.sampler import SampleRow, filtered_probs, processed_logits, sample_rows
from pagedkv_conformance.suite_engine_param_edges import FLOAT_EDGES, edge_params

VOCAB = 64


@pytest.mark.spec("ENG-176")
@pytest.mark.parametrize("field", [*FLOAT_FIELDS, "logit_bias"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused_naming_the_field(field: str, value: float) -> None:
    """Catches a check written as ``value >= 0`` (infinity passes it: ``temperature:
    Infinity`` was accepted) or one that NaN slips past; the message must start with the
    field's name, which the server answers as ``param``."""
    with pytest.raises(InvalidSamplingParams) as caught:
        edge_params(field, value)
    assert str(caught.value).startswith(field)


@pytest.mark.spec("ENG-176")
@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 3.0},
        {"temperature": 1e30},
        {"top_p": 1e-10},
        {"top_p": 5e-324},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1e-30},
        {"repetition_penalty": 1e30},
        {"logit_bias": {1: -100.0, 2: 100.0}},
    ],
)
def test_values_vllm_takes_are_accepted(kwargs: dict[str, object]) -> None:
    """Catches a range narrower than vLLM's (an upper bound on temperature, say): a request
    a vLLM client sends, finite in float32, is never refused."""
    SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.spec("ENG-177")
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e39),
        ("temperature", 1e308),
        ("repetition_penalty", 5e-324),
        ("repetition_penalty", 1e-40),
        ("repetition_penalty", 1e39),
    ],
)
def test_values_float32_cannot_hold_are_refused(field: str, value: float) -> None:
    """Catches the float64-only check: ``repetition_penalty=5e-324`` is above 0 in float64 but
    0 in float32, where the sampler divides by it and the reply was one empty token with
    finish reason ``stop``."""
    with pytest.raises(InvalidSamplingParams) as caught:
        edge_params(field, value)
    assert str(caught.value).startswith(field)


@pytest.mark.spec("ENG-177")
@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-40, FLOAT32_TINY, 1e-10])
def test_top_p_below_float32s_smallest_keeps_the_top_token_exactly(top_p: float) -> None:
    """Catches a ``top_p`` rounded to 0 in float32: every token has mass before it of at
    least 0, so all were dropped and the distribution was empty (NaN). The set that reaches a
    ``top_p`` this small is the most likely token alone."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    probs = filtered_probs(logits, SamplingParams(top_p=top_p))
    expected = torch.zeros(VOCAB)
    expected[int(logits.argmax())] = 1.0
    assert torch.equal(probs, expected)


def _rows(params: SamplingParams) -> list[SampleRow]:
    """Two rows with a history (so penalties apply), each with its own generator."""
    return [
        SampleRow(params, torch.Generator().manual_seed(i), [1, 2, 3, 5], [7, 3, 3])
        for i in range(2)
    ]


@pytest.mark.spec("ENG-178")
@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from([*FLOAT_FIELDS, "logit_bias"]),
    value=st.sampled_from(FLOAT_EDGES) | st.floats(allow_nan=True, allow_infinity=True),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1e-4, 1e30]),
    scale=st.sampled_from([1.0, 30.0, 1e4]),
)
def test_every_float_edge_is_refused_or_samples_a_kept_token(
    field: str, value: float, temperature: float, scale: float
) -> None:
    """Catches any float edge that passes validation but empties or NaNs the filtered
    distribution (a token the model did not choose, or an empty ``stop``): each value is
    refused naming its field, or every row samples a token of positive filtered probability,
    from finite probabilities."""
    others: dict[str, object] = {} if field == "temperature" else {"temperature": temperature}
    refused: InvalidSamplingParams | None = None
    try:
        params = edge_params(field, value, **others)
    except InvalidSamplingParams as exc:
        refused = exc
    if refused is not None:
        assert str(refused).startswith(field)
        return
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * scale
    sampled = sample_rows(logits, _rows(params))
    assert len(sampled) == 2
    for row, result in zip(range(2), sampled, strict=True):
        assert 0 <= result.token_id < VOCAB
        if not params.greedy:
            processed = processed_logits(logits, _rows(params))[row]
            probs = filtered_probs(processed, params)
            assert bool(torch.isfinite(probs).all())
            assert float(probs[result.token_id]) > 0.0


@pytest.mark.spec("ENG-176")
@pytest.mark.parametrize("top_k", [5.5, math.inf, math.nan, True])
def test_top_k_takes_only_integers(top_k: object) -> None:
    """Catches a float ``top_k`` accepted (``5.5`` or ``inf`` passes ``>= -1``) and then
    used as a tensor index in the sampler."""
    with pytest.raises(InvalidSamplingParams, match=r"^top_k"):
        SamplingParams(top_k=top_k)  # type: ignore[arg-type]
