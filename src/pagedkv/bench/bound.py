"""The memory bound of generating tokens: the fewest bytes a workload's steps must read, over
the device's measured rate (ENG-207).

Every step that computes tokens reads every weight once (a tied LM head reads the embedding
table whole) and, for each sequence it computes, the K/V of that sequence's context. A
workload's requests each have a context before their first counted token and a number of
tokens counted; token ``t`` (from 0) of a request whose context before it is ``c`` attends
``c + t`` positions. No engine can take fewer steps than the longest request's tokens, nor
than the tokens over the sequences one step may hold. So the bytes are

    steps x weight bytes + K/V bytes per position x sum over requests of (n c + n (n - 1) / 2)

with ``steps = max(longest n, ceil(sum of n / max batch))``, and the bound's seconds are those
bytes over the device's rate. A system's fraction of the bound is the bound's seconds over the
seconds it took: 1.0 is as fast as the memory allows; prefill arithmetic, launches and host
work are what keep it below.

Pure arithmetic: no torch, so the formula is tested with known numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What one step of a model reads.

    Attributes:
        weight_bytes: bytes of the weights, each read once per step.
        kv_bytes_per_position: bytes of K and V of one position over every layer
            (``2 x layers x KV heads x head_dim x itemsize``).
    """

    weight_bytes: int
    kv_bytes_per_position: int

    @classmethod
    def of(
        cls, weight_bytes: int, *, layers: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> ModelBytes:
        """From a model's shape: the K/V bytes of one position are ``2 x layers x kv_heads x
        head_dim x itemsize``."""
        return cls(weight_bytes, 2 * layers * kv_heads * head_dim * itemsize)


@dataclass(frozen=True, slots=True)
class Span:
    """The tokens of one request a measurement counts.

    Attributes:
        context: positions before the first counted token (the prompt, for a run timed from
            the submission; the prompt plus one, for decode timed after the first token).
        tokens: tokens counted.
    """

    context: int
    tokens: int


def min_steps(spans: Sequence[Span], max_batch: int) -> int:
    """The fewest steps that produce ``spans``' tokens, ``max_batch`` sequences a step at most:
    ``max(longest, ceil(total / max_batch))``; 0 when no token is counted.

    Raises:
        InvalidRequest: ``max_batch`` below 1.
    """
    if max_batch < 1:
        raise InvalidRequest(f"max_batch must be >= 1, got {max_batch}")
    total = sum(s.tokens for s in spans)
    longest = max((s.tokens for s in spans), default=0)
    return max(longest, -(-total // max_batch))


def context_positions(spans: Sequence[Span]) -> int:
    """Positions of K/V the counted tokens attend, all together: ``n c + n (n - 1) / 2`` per
    span."""
    return sum(s.tokens * s.context + s.tokens * (s.tokens - 1) // 2 for s in spans)


def read_bytes(spans: Sequence[Span], model: ModelBytes, max_batch: int) -> int:
    """The fewest bytes the steps producing ``spans`` must read (see the module docstring)."""
    steps = min_steps(spans, max_batch)
    return steps * model.weight_bytes + context_positions(spans) * model.kv_bytes_per_position


def copy_rate(tensor_bytes: int, seconds: float) -> float:
    """Bytes per second a device copy of ``tensor_bytes`` moved in ``seconds``: it reads and
    writes each byte, so ``2 x tensor_bytes / seconds`` (the device's memory rate, which
    reads and writes share)."""
    return 2.0 * tensor_bytes / seconds if seconds > 0 else math.nan


def bound_seconds(nbytes: int, rate: float) -> float:
    """Seconds the memory takes to move ``nbytes`` at ``rate`` bytes per second."""
    return nbytes / rate if rate > 0 else math.nan


def fraction_of_bound(nbytes: int, rate: float, seconds: float) -> float:
    """The bound's seconds over the measured ``seconds``: 1.0 is the memory's pace; NaN when
    nothing was measured."""
    if not seconds > 0:
        return math.nan
    return bound_seconds(nbytes, rate) / seconds
