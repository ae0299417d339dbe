"""The sampling filters of ENG-040 and the controls of ENG-048, written from their definitions
in plain float64 Python.

The engine tests compare what an engine samples with these, not with another run of the same
engine, so a filter that is consistently wrong (keeping one token too few or too many) fails.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pagedkv.engine.params import SamplingParams


def _softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) if x != -math.inf else 0.0 for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def top_k_support(logits: Sequence[float], top_k: int) -> set[int]:
    """The ``top_k`` most likely tokens (ties at the k-th value all kept); all for 0 or -1."""
    if top_k <= 0 or top_k >= len(logits):
        return set(range(len(logits)))
    kth = sorted(logits, reverse=True)[top_k - 1]
    return {i for i, x in enumerate(logits) if x >= kth}


def top_p_support(probs: Sequence[float], top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches ``top_p``: a token is kept
    while the mass of the tokens more likely than it is below ``top_p``."""
    if top_p >= 1.0:
        return {i for i, p in enumerate(probs) if p > 0}
    kept: set[int] = set()
    before = 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if before >= top_p or probs[i] == 0:
            break
        kept.add(i)
        before += probs[i]
    return kept


def min_p_support(probs: Sequence[float], min_p: float) -> set[int]:
    """Tokens whose probability is at least ``min_p`` times the most likely one's."""
    top = max(probs)
    return {i for i, p in enumerate(probs) if p > 0 and p >= min_p * top}


def allowed_tokens(logits: Sequence[float], params: SamplingParams) -> set[int]:
    """Tokens each filter of ``params`` keeps, each applied to the temperature-scaled
    distribution on its own; filters applied in sequence keep a subset of this."""
    if params.greedy:
        top = max(logits)
        return {i for i, x in enumerate(logits) if x == top}
    scaled = [x / params.temperature for x in logits]
    probs = _softmax(scaled)
    return (
        top_k_support(scaled, params.top_k)
        & top_p_support(probs, params.top_p)
        & min_p_support(probs, params.min_p)
    )


def filtered_distribution(logits: Sequence[float], params: SamplingParams) -> list[float]:
    """The distribution sampling must draw from when ``params`` sets one filter (or none):
    the temperature-scaled softmax restricted to what the filter keeps, renormalised."""
    active = [params.top_k > 0, params.top_p < 1.0, params.min_p > 0.0]
    if sum(active) > 1:
        raise ValueError("one filter at a time: their composition order is not specified")
    kept = allowed_tokens(logits, params)
    probs = _softmax([x / params.temperature for x in logits])
    mass = sum(probs[i] for i in kept)
    return [probs[i] / mass if i in kept else 0.0 for i in range(len(probs))]


def controlled_logits(
    logits: Sequence[float],
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    stop_ids: frozenset[int] = frozenset(),
) -> list[float]:
    """One row's logits after the controls of ENG-048, by their definitions, in vLLM's order.

    ``output`` is what the sequence generated before this position; ``stop_ids`` the model's
    EOS tokens. ``min_tokens`` masks EOS and the stop tokens while ``output`` is shorter than
    it; ``logit_bias`` adds; ``repetition_penalty`` divides a positive and multiplies a negative
    logit of every token in the prompt or the output; ``frequency_penalty`` is subtracted once
    per occurrence in the output and ``presence_penalty`` once per token the output holds.
    """
    x = [float(v) for v in logits]
    if len(output) < params.min_tokens:
        for token in stop_ids | set(params.stop_token_ids):
            if 0 <= token < len(x):
                x[token] = -math.inf
    for token, bias in params.bias:
        x[token] += bias
    counts = Counter(output)
    seen = set(prompt) | set(output)
    rp = params.repetition_penalty
    for token in range(len(x)):
        if token in seen and x[token] != -math.inf:
            x[token] = x[token] / rp if x[token] > 0 else x[token] * rp
        x[token] -= params.frequency_penalty * counts[token]
        x[token] -= params.presence_penalty * (counts[token] > 0)
    return x
