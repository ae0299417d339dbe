"""Turns one row of logits into the next token, under a request's sampling parameters.

Each request samples with its own ``torch.Generator`` from its own row, so a seeded request's
output does not depend on what else shares the batch (ENG-045).
"""

from __future__ import annotations

import torch

from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p; ``logits`` is ``[vocab]`` fp32.

    Precondition: not ``params.greedy``: the temperature is at least
    :data:`~pagedkv.engine.params.GREEDY_TEMPERATURE`, so logits of any realistic size stay
    finite once scaled.
    """
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep a token while the mass strictly before it is below top_p: the smallest set
        # reaching top_p, and always the most likely token.
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token id for one request; ``logits`` is its ``[vocab]`` fp32 row."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    """Log-probabilities of the model's raw distribution at one position."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, min(top_n, logprobs.shape[-1])) if top_n > 0 else None
    pairs: tuple[tuple[int, float], ...] = ()
    if top is not None:
        pairs = tuple(
            (int(i), float(v))
            for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        )
    return TokenLogprobs(token_id=token_id, logprob=float(logprobs[token_id]), top=pairs)
