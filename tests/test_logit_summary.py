"""Greedy tokens and chosen log-probabilities from one summary pass over the logits
(ENG-158)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from test_fused_norms import Counted

from pagedkv.engine.logit_summary import LogitSummary
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import SampleRow, sample_batch, sample_rows
from pagedkv.testing.tiny_qwen3 import torch_threads

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def _two_torch_threads() -> Iterator[None]:
    with torch_threads(2):
        yield


def kernel(portable: bool = False) -> LogitSummary:
    built = LogitSummary.build(portable=portable)
    assert isinstance(built, LogitSummary), built
    return built


def tied_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, each then given its largest value at two or three places: in one lane of
    two 16-wide blocks, in two lanes of one block, in the tail past the last whole block, at
    position 0, and a row of a single maximum."""
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randn(6, vocab + 5, generator=generator)[:, :vocab]  # rows vocab + 5 apart
    places = [[3, 19], [20, 17], [vocab - 1, vocab - 2], [0, vocab - 1], [vocab // 2], [5, 21, 37]]
    for row, where in enumerate(places):
        for position in where:
            if position < vocab:
                rows[row, position] = 9.0
    rows[4, : vocab // 3] = float("-inf")  # a run of impossible tokens
    return rows.to(dtype)


@pytest.mark.spec("ENG-158", "ENG-040")
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 151, 1000])
def test_the_summary_gives_argmax_and_log_softmax(
    vocab: int, dtype: torch.dtype, portable: bool
) -> None:
    logits = tied_rows(vocab, dtype)
    summarise = kernel(portable)
    assert summarise.takes(logits)
    summary = summarise(logits)
    wide = logits.float()
    assert torch.equal(summary.index, wide.argmax(dim=1))
    assert torch.equal(summary.largest, wide.amax(dim=1))
    tokens = torch.randint(0, vocab, (logits.shape[0],), generator=torch.Generator().manual_seed(1))
    tokens[4] = vocab - 1  # a finite logit: the -inf run ends below it
    want = torch.log_softmax(wide.double(), dim=1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(summary.logprobs(logits, tokens).double(), want, atol=1e-5, rtol=0)


@pytest.mark.spec("ENG-158")
def test_the_kernel_takes_only_what_it_reads() -> None:
    summarise = kernel()
    assert not summarise.takes(torch.randn(4, 10, dtype=torch.float64))
    assert not summarise.takes(torch.randn(4, 10, dtype=torch.float16))
    assert not summarise.takes(torch.randn(10, 4).t())  # rows not contiguous
    assert not summarise.takes(torch.randn(10))
    assert not summarise.takes(torch.randn(4, 0))


def rows_of(params: list[SamplingParams]) -> list[SampleRow]:
    generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    return [SampleRow(p, g, (1, 2), (3,)) for p, g in zip(params, generators, strict=True)]


@pytest.mark.spec("ENG-158", "ENG-041")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_summarised_batch_samples_what_the_torch_path_samples(dtype: torch.dtype) -> None:
    """Greedy and seeded rows side by side: the same tokens, log-probabilities within 1e-5,
    and the kernel called once for the batch."""
    logits = tied_rows(1000, dtype)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, min_p=0.1, seed=8),
    ]
    summarise = kernel()
    counted = Counted(summarise._entry)
    summarise._entry = counted
    fast = sample_batch(logits, rows_of(params), frozenset(), summarise)
    slow = sample_rows(logits, rows_of(params), frozenset())
    assert counted.calls == 1
    assert [s.token_id for s in fast] == [s.token_id for s in slow]
    for got, want in zip(fast, slow, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert got.top == want.top == ()


@pytest.mark.spec("ENG-158")
@pytest.mark.parametrize(
    "other",
    [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.0, min_tokens=4),
    ],
    ids=["logprobs", "penalty", "bias", "min_tokens"],
)
def test_a_batch_with_controls_or_top_logprobs_takes_the_torch_path(
    other: SamplingParams,
) -> None:
    logits = tied_rows(1000, torch.float32)[:2]
    params = [SamplingParams(temperature=0.0), other]
    summarise = kernel()
    counted = Counted(summarise._entry)
    summarise._entry = counted
    got = sample_batch(logits, rows_of(params), frozenset({7}), summarise)
    assert counted.calls == 0
    assert got == sample_rows(logits, rows_of(params), frozenset({7}))


@pytest.mark.spec("ENG-158", "ENG-070")
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 16, 17, 151, 1000])
def test_a_row_holding_nan_has_a_nan_largest_value(
    vocab: int, dtype: torch.dtype, portable: bool
) -> None:
    """NaN at position 0, in a lane of a later 16-wide block, in the tail past the last whole
    block and at the row's largest value: exactly those rows read NaN; the others keep their
    summary."""
    logits = tied_rows(vocab, dtype)
    clean = logits.clone()
    poisoned = {0: 0, 2: min(vocab - 1, 21), 3: vocab - 1, 5: min(vocab - 1, 5)}
    for row, position in poisoned.items():
        logits[row, position] = float("nan")
    summarise = kernel(portable)
    summary, want = summarise(logits), summarise(clean)
    assert torch.isnan(summary.largest).tolist() == [r in poisoned for r in range(6)]
    kept = [r for r in range(6) if r not in poisoned]
    for field in ("largest", "index", "log_sum"):
        assert torch.equal(getattr(summary, field)[kept], getattr(want, field)[kept])


@pytest.mark.spec("ENG-158", "ENG-040")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_greedy_batch_takes_its_logprobs_from_the_summary_to_the_bit(
    dtype: torch.dtype,
) -> None:
    """Every row greedy: tokens are the argmax and each log-probability is the summary's
    ``(x[t] - largest) - log_sum`` exactly, the sign of a zero included (a row of one possible
    token); a batch holding a row whose largest value is infinite keeps that formula's NaN."""
    logits = tied_rows(1000, dtype)
    logits[4] = float("-inf")
    logits[4, 7] = 5.0  # log_sum 0: its token's log-probability is +0.0
    summarise = kernel()
    for infinite in (False, True):
        if infinite:
            logits[1, 40] = float("inf")
        rows = rows_of([SamplingParams(temperature=0.0)] * logits.shape[0])
        summary = summarise(logits)
        got = sample_batch(logits, rows, frozenset(), summarise)
        want = summary.logprobs(logits, summary.index).tolist()
        assert [s.token_id for s in got] == logits.float().argmax(dim=1).tolist()
        assert summary.log_sum[4].item() == 0.0
        for row, value in enumerate(want):
            if math.isnan(value):
                assert infinite
                assert row == 1
                assert math.isnan(got[row].logprob)
                continue
            assert got[row].logprob == value
            assert math.copysign(1.0, got[row].logprob) == math.copysign(1.0, value)
