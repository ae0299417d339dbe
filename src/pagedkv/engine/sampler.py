"""The sampler: one call per step turns the logits of every sequence that completed into its
next token, applying each row's sampling controls as tensor operations over the whole batch.

Order, as in vLLM: the structured-output mask of the constrained rows (ENG-191),
``min_tokens`` (EOS and stop tokens masked), ``logit_bias``, the repetition,
frequency and presence penalties, then greedy rows take the argmax and the others go through
temperature, top-k, top-p and min-p and draw. The draw is the exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``, an exact sample of ``p``); each row's noise comes from
its own ``torch.Generator``, so a seeded request's tokens do not depend on what else shares the
batch (ENG-041). Log-probabilities are those of the model's raw distribution, before any
control (vLLM's default ``raw_logprobs``).

Everything runs on the logits' device (ENG-216): each helper tensor is made there from a host
list in one copy, and whether a filter applies is decided from the parameters on the host, so
the only values read back are the batch's results, one copy each (ENG-217).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.grammar import refused_tokens
from pagedkv.engine.logit_summary import LogitSummary, RowSummary
from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.params import FLOAT32_MAX, FLOAT32_TINY, SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What the sampler needs of one sequence to sample.

    Attributes:
        params: its sampling parameters.
        generator: its random generator (``None`` only for greedy rows), on the logits'
            device (ENG-218).
        prompt_token_ids: its prompt (for the repetition penalty).
        output_token_ids: what it generated so far (penalties, ``min_tokens``).
        allowed: the tokens its grammar allows next, packed (``int32[ceil(vocab / 32)]``, see
            :meth:`~pagedkv.engine.grammar.GrammarMatcher.bitmask`); ``None`` when it has no
            structured-output constraint.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    allowed: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Sampled:
    """One row's result.

    Attributes:
        token_id: the token chosen.
        logprob: its log-probability under the raw distribution.
        top: the ``params.logprobs`` most likely ``(token, logprob)`` pairs, most likely first;
            empty when not asked for.
        rank: the token's rank in the raw distribution (1 + the tokens strictly more likely),
            where the row asked for log-probabilities (vLLM's ``Logprob.rank``, ENG-186).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None

    def token_logprobs(self) -> TokenLogprobs:
        """The entry a request's ``logprobs`` keeps for this position."""
        return TokenLogprobs(self.token_id, self.logprob, self.top, self.rank)


def _ranks(
    values: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SampleRow]
) -> list[int | None]:
    """Each chosen token's rank in its row of ``values`` (logits or log-probabilities: the
    same order), for the rows asking for log-probabilities; ``None`` for the others."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    ranks: list[int | None] = [None] * len(rows)
    if not want:
        return ranks
    picked = torch.tensor(want, dtype=torch.int64, device=values.device)
    chosen_rows = values.index_select(0, picked)
    chosen = chosen_rows.gather(1, tokens.index_select(0, picked).unsqueeze(1))
    counts = (chosen_rows > chosen).sum(dim=1).tolist()
    for i, count in zip(want, counts, strict=True):
        ranks[i] = int(count) + 1
    return ranks


def _saturated(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``after`` (computed from ``before``) with every value kept finite where ``before`` was
    not ``-inf`` (a masked token stays masked): a penalty or temperature that overflows float32
    saturates at its largest value instead of giving ``inf``, whose softmax is NaN (ENG-178)."""
    return torch.where(torch.isneginf(before), after, after.clamp(-FLOAT32_MAX, FLOAT32_MAX))


def _pairs(
    tokens: Sequence[Collection[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, token)`` index tensors on ``device`` of every token of ``tokens[row]`` inside
    the vocab (one copy from the host)."""
    index = [(i, t) for i, ids in enumerate(tokens) for t in ids if 0 <= t < vocab]
    if not index:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    pairs = torch.tensor(index, dtype=torch.int64, device=device)
    return pairs[:, 0], pairs[:, 1]


def _vector(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """``values`` as a ``[R, 1]`` column of ``like``'s dtype on its device (one copy)."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _float32(values: Sequence[float]) -> array[float]:
    """``values`` rounded to float32 on the host, as the tensors made of them hold them: a
    filter is applied where its float32 value asks for it, decided with no device read."""
    return array("f", values)


def apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SampleRow], stop_ids: frozenset[int]
) -> None:
    """Mask EOS and each row's stop tokens while it has fewer than ``min_tokens`` (in place)."""
    banned = [
        stop_ids | set(r.params.stop_token_ids)
        if len(r.output_token_ids) < r.params.min_tokens
        else ()
        for r in rows
    ]
    row, token = _pairs(banned, logits.shape[1], logits.device)
    if row.numel():
        logits.index_put_(
            (row, token), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        )


def apply_grammar(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Mask every token its grammar does not allow, in the constrained rows only (in place).
    The packed masks are stacked on the host and moved to the logits' device in one copy."""
    which = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not which:
        return
    words = torch.stack([rows[i].allowed for i in which]).to(logits.device)  # type: ignore[misc]
    refused = refused_tokens(words, logits.shape[1])
    for k, i in enumerate(which):  # in place, row by row: no copy of the constrained rows
        logits[i].masked_fill_(refused[k], float("-inf"))


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Add each row's ``logit_bias`` to the logits (in place)."""
    entries = [
        (i, t, b) for i, r in enumerate(rows) for t, b in r.params.bias if t < logits.shape[1]
    ]
    if not entries:
        return
    device = logits.device
    row = torch.tensor([e[0] for e in entries], dtype=torch.int64, device=device)
    token = torch.tensor([e[1] for e in entries], dtype=torch.int64, device=device)
    bias = torch.tensor([e[2] for e in entries], dtype=logits.dtype, device=device)
    logits.index_put_((row, token), bias, accumulate=True)


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device | None = None
) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float32 count of each token in each list, on ``device``
    (the CPU by default)."""
    device = torch.device("cpu") if device is None else device
    counts = torch.zeros(len(token_lists), vocab, device=device)
    row, token = _pairs(token_lists, vocab, device)
    if row.numel():
        counts.index_put_((row, token), torch.ones(row.shape[0], device=device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """The repetition, frequency and presence penalties of the rows that have any (in place).

    Repetition (prompt and output tokens): a positive logit is divided by the penalty, a
    negative one multiplied. Frequency: minus the penalty times the token's count in the
    output. Presence: minus the penalty once for every token the output holds.
    """
    which = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not which:
        return
    vocab, device = logits.shape[1], logits.device
    picked = torch.tensor(which, dtype=torch.int64, device=device)
    sub = logits.index_select(0, picked)
    output = token_counts([rows[i].output_token_ids for i in which], vocab, device)
    prompt = token_counts([rows[i].prompt_token_ids for i in which], vocab, device)
    seen = (output + prompt) > 0
    repetition = _vector([rows[i].params.repetition_penalty for i in which], sub)
    penalised = _saturated(sub, torch.where(sub > 0, sub / repetition, sub * repetition))
    sub = torch.where(seen, penalised, sub)
    frequency = _vector([rows[i].params.frequency_penalty for i in which], sub)
    presence = _vector([rows[i].params.presence_penalty for i in which], sub)
    sub = sub - frequency * output - presence * (output > 0).to(sub.dtype)
    logits.index_copy_(0, picked, sub)


def filtered_probs_batch(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities ``[R, vocab]`` after each row's temperature, top-k, top-p and min-p.

    Precondition: no row is greedy (every temperature is at least
    :data:`~pagedkv.engine.params.GREEDY_TEMPERATURE`).
    """
    vocab = logits.shape[1]
    scaled = _saturated(logits, logits / _vector([p.temperature for p in params], logits))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_k):
        ordered = torch.sort(scaled, dim=1, descending=True).values
        kth_index = torch.tensor(top_k, dtype=torch.int64, device=logits.device) - 1
        kth = ordered.gather(1, kth_index.unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=1)
    # A top_p below the smallest normal float32 (5e-324 would round to 0 and keep nothing)
    # keeps the most likely token alone, as its exact value does (ENG-177).
    top_p_values = _float32([max(p.top_p, FLOAT32_TINY) for p in params])
    if any(p < 1.0 for p in top_p_values):
        top_p = _vector(top_p_values, probs)
        sorted_probs, order = torch.sort(probs, dim=1, descending=True)
        before = torch.cumsum(sorted_probs, dim=1) - sorted_probs
        # Keep a token while the mass strictly before it is below top_p: the smallest set
        # reaching top_p, and always the most likely token.
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, before >= top_p)
        probs = probs.masked_fill(drop, 0.0)
    min_p_values = _float32([p.min_p for p in params])
    if any(p > 0.0 for p in min_p_values):
        min_p = _vector(min_p_values, probs)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=1, keepdim=True), 0.0)
    return probs / probs.sum(dim=1, keepdim=True)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`filtered_probs_batch` of one ``[vocab]`` row."""
    return filtered_probs_batch(logits.unsqueeze(0), [params])[0]


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs``: the exponential race, each row's noise from its own
    generator (on ``probs``' device)."""
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return torch.argmax(probs / noise, dim=1)


def processed_logits(
    logits: torch.Tensor, rows: Sequence[SampleRow], stop_ids: frozenset[int] = frozenset()
) -> torch.Tensor:
    """A copy of ``logits`` ``[R, vocab]`` with the grammar masks, ``min_tokens``,
    ``logit_bias`` and the penalties applied: what greedy rows take the argmax of and the
    others sample from."""
    out = logits.float().clone()
    apply_grammar(out, rows)
    apply_min_tokens(out, rows, stop_ids)
    apply_logit_bias(out, rows)
    apply_penalties(out, rows)
    return out


def sample_rows(
    logits: torch.Tensor, rows: Sequence[SampleRow], stop_ids: frozenset[int] = frozenset()
) -> list[Sampled]:
    """The next token of every row of ``logits`` ``[R, vocab]`` (float32), in one batch, on
    the logits' device; each row's generator is on that device too.

    ``stop_ids`` are the model's EOS tokens, masked with each row's stop tokens until it has
    ``min_tokens`` (vLLM masks EOS even when a request ignores it).
    """
    if not rows:
        return []
    logits = logits.float()
    # Without a control to apply, the logits are read as they are: no [R, vocab] copy.
    processed = processed_logits(logits, rows, stop_ids) if _controlled(rows) else logits
    # max's indices are argmax's (the first of equal maxima), in about half argmax's time.
    tokens = processed.max(dim=1).indices
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random:
        picked = torch.tensor(random, dtype=torch.int64, device=logits.device)
        probs = filtered_probs_batch(
            processed.index_select(0, picked), [rows[i].params for i in random]
        )
        tokens.index_copy_(0, picked, _draw(probs, [rows[i].generator for i in random]))
    raw = torch.log_softmax(logits, dim=1)
    chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    tops = top_logprobs(raw, [r.params.logprobs or 0 for r in rows])
    ranks = _ranks(raw, tokens, rows)
    return [
        Sampled(int(t), float(lp), top, rank)
        for t, lp, top, rank in zip(tokens.tolist(), chosen, tops, ranks, strict=True)
    ]


def sample_batch(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    stop_ids: frozenset[int] = frozenset(),
    kernel: LogitSummary | None = None,
    summary: RowSummary | None = None,
) -> list[Sampled]:
    """:func:`sample_rows`, for ``logits`` float32 or bfloat16. With ``kernel``, a batch whose
    rows have no control to apply and ask for no top logprobs takes greedy tokens and the
    chosen tokens' log-probabilities from the kernel's summary of the rows, with no float32
    copy of the logits and no log-softmax (ENG-158). ``summary``: that summary, where the
    caller has taken it already (:func:`summarise`, on these very rows)."""
    if summary is None:
        summary = summarise(logits, rows, kernel)
    if summary is not None:
        return _sample_summarised(logits, rows, summary)
    return sample_rows(logits, rows, stop_ids)


def summarise(
    logits: torch.Tensor, rows: Sequence[SampleRow], kernel: LogitSummary | None
) -> RowSummary | None:
    """``kernel``'s summary of ``logits`` where :func:`sample_batch` samples the batch from
    it (ENG-158), else ``None``. A row holding a NaN has a NaN largest value in it."""
    if kernel is None or not kernel.takes(logits):
        return None
    if _controlled(rows) or any(r.params.logprobs for r in rows):
        return None
    return kernel(logits)


def _sample_summarised(
    logits: torch.Tensor, rows: Sequence[SampleRow], summary: RowSummary
) -> list[Sampled]:
    """:func:`sample_batch` for rows without controls or top logprobs: greedy rows take the
    summary's argmax, the others draw from their own rows (converted to float32 alone)."""
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    # Every row greedy: each token holds its row's largest value, so its log-probability
    # (x[t] - largest) - log_sum is 0.0 - log_sum, to the bit, where that value is finite.
    if not random and all(math.isfinite(value) for value in summary.largest.tolist()):
        greedy = zip(summary.index.tolist(), summary.log_sum.tolist(), rows, strict=True)
        # the argmax: no token is strictly more likely
        return [
            Sampled(t, 0.0 - s, (), None if row.params.logprobs is None else 1)
            for t, s, row in greedy
        ]
    tokens = summary.index.clone()
    if random:
        picked = torch.tensor(random, dtype=torch.int64, device=logits.device)
        probs = filtered_probs_batch(
            logits.index_select(0, picked).float(), [rows[i].params for i in random]
        )
        tokens.index_copy_(0, picked, _draw(probs, [rows[i].generator for i in random]))
    chosen = summary.logprobs(logits, tokens).tolist()
    ranks = _ranks(logits, tokens, rows)
    return [
        Sampled(int(t), float(lp), (), rank)
        for t, lp, rank in zip(tokens.tolist(), chosen, ranks, strict=True)
    ]


def _controlled(rows: Sequence[SampleRow]) -> bool:
    """Whether :func:`processed_logits` would change any row: a row with a grammar mask,
    still short of its ``min_tokens``, with a ``logit_bias`` or with a penalty."""
    return any(
        r.allowed is not None
        or r.params.bias
        or r.params.has_penalties
        or len(r.output_token_ids) < r.params.min_tokens
        for r in rows
    )


def top_logprobs(
    logprobs: torch.Tensor, counts: Sequence[int]
) -> list[tuple[tuple[int, float], ...]]:
    """The ``counts[i]`` most likely ``(token, logprob)`` pairs of each row, most likely first.
    Only the rows asking for some are ranked and read back (ENG-217)."""
    widest = min(max(counts, default=0), logprobs.shape[1])
    tops: list[tuple[tuple[int, float], ...]] = [() for _ in counts]
    if widest <= 0:
        return tops
    want = [i for i, k in enumerate(counts) if k > 0]
    picked = torch.tensor(want, dtype=torch.int64, device=logprobs.device)
    top = torch.topk(logprobs.index_select(0, picked), widest, dim=1)
    ids, values = top.indices.tolist(), top.values.tolist()
    for row, i in enumerate(want):
        tops[i] = tuple(zip(ids[row][: counts[i]], values[row][: counts[i]], strict=True))
    return tops


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token of one ``[vocab]`` row with no history (a convenience over
    :func:`sample_rows`)."""
    (result,) = sample_rows(logits.unsqueeze(0), [SampleRow(params, generator, (), ())])
    return result.token_id


def prompt_logprobs(
    logits: torch.Tensor, targets: Sequence[int], top_n: int
) -> list[TokenLogprobs]:
    """Log-probabilities of ``targets[i]`` under the raw distribution of ``logits[i]``
    (``[P, vocab]``), with their ranks and the ``top_n`` most likely tokens of each row."""
    raw = torch.log_softmax(logits.float(), dim=1)
    index = torch.tensor(list(targets), dtype=torch.int64, device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, index)
    ranks = ((raw > chosen).sum(dim=1) + 1).tolist()
    tops = top_logprobs(raw, [top_n] * len(targets))
    return [
        TokenLogprobs(int(t), float(lp), top, int(rank))
        for t, lp, top, rank in zip(targets, chosen.squeeze(1).tolist(), tops, ranks, strict=True)
    ]
