"""Fixed-seed request sets: token-id prompts and output lengths drawn from fixed distributions.

Prompts are random token ids, not text: every system is fed the same ids, no tokenizer time is
measured, and every request generates exactly its ``max_tokens`` (EOS is ignored), so each
system does the same work.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload.

    Attributes:
        prompt: prompt token ids.
        max_tokens: tokens to generate, exactly (EOS ignored).
    """

    prompt: tuple[int, ...]
    max_tokens: int

    @property
    def total_len(self) -> int:
        """Positions the sequence reaches: prompt plus generated tokens."""
        return len(self.prompt) + self.max_tokens


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """A log-normal length, clipped: ``clip(round(median * exp(sigma * N(0, 1))), low, high)``.

    Attributes:
        median: median length, tokens.
        sigma: standard deviation of the log length.
        low: smallest length, tokens.
        high: largest length, tokens.
    """

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        """One length."""
        value = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return max(self.low, min(self.high, value))


@dataclass(frozen=True, slots=True)
class MixedSpec:
    """A mixed workload: ``num_requests`` with prompt and output lengths from distributions."""

    num_requests: int
    prompt: LengthDistribution
    output: LengthDistribution

    @property
    def max_total_len(self) -> int:
        """The longest sequence the distributions allow, tokens."""
        return self.prompt.high + self.output.high


def random_tokens(rng: random.Random, count: int, vocab: int) -> tuple[int, ...]:
    """``count`` token ids uniform in ``[0, vocab)``."""
    return tuple(rng.randrange(vocab) for _ in range(count))


def mixed_requests(spec: MixedSpec, vocab: int, seed: int) -> list[BenchRequest]:
    """The requests of ``spec``, the same for the same seed and vocabulary."""
    rng = random.Random(seed)
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = spec.prompt.sample(rng)
        output_len = spec.output.sample(rng)
        requests.append(BenchRequest(random_tokens(rng, prompt_len, vocab), output_len))
    return requests


def uniform_requests(
    count: int, prompt_len: int, max_tokens: int, vocab: int, seed: int
) -> list[BenchRequest]:
    """``count`` requests of identical lengths with random prompts."""
    rng = random.Random(seed)
    return [BenchRequest(random_tokens(rng, prompt_len, vocab), max_tokens) for _ in range(count)]
