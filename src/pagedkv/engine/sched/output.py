"""What crosses between the scheduler and the engine each step: the work a step runs
(:class:`SchedulerOutput`, one :class:`ScheduledChunk` per request) and what was sampled for it
(:class:`SampledToken`, or :class:`SampleError` for a request whose sampling raised)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.request import Request
from pagedkv.plan import SeqChunk


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a step.

    Attributes:
        request: the request.
        start: position of the first token computed; positions before it have K/V cached (v1)
            or are recomputed within this chunk (v0, where ``start`` is always 0).
        num_tokens: positions computed this step.
        pages: the request's page table (v1), empty in v0.
    """

    request: Request
    start: int
    num_tokens: int
    pages: tuple[int, ...]

    @property
    def completes_sequence(self) -> bool:
        """Whether the chunk reaches the sequence's last token, so its logits are sampled."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        """Of the positions computed, those of the prompt (recomputation included)."""
        end = min(self.start + self.num_tokens, len(self.request.prompt_token_ids))
        return max(0, end - self.start)

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether the logits of every row are wanted, not only the last: the chunk computes
        prompt positions of a request asking for prompt log-probabilities (ENG-049)."""
        return (
            self.request.params.prompt_logprobs is not None
            and self.start < len(self.request.prompt_token_ids) - 1
        )

    @property
    def num_logits(self) -> int:
        """Rows of logits the step returns for the chunk (its last row is the sampled one)."""
        return self.num_tokens if self.wants_prompt_logits else 1

    def seq_chunk(self) -> SeqChunk:
        """The chunk as the plan builders take it."""
        tokens = self.request.token_ids[self.start : self.start + self.num_tokens]
        return SeqChunk(tuple(tokens), self.start, self.pages, self.wants_prompt_logits)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """A step's work: the chunks to run, and the requests preempted to make room."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        """Positions computed by the step."""
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token sampled for one completed chunk, and its log-probabilities if asked for.

    Attributes:
        token_id: the token.
        logprobs: its entry for the request's ``logprobs``, when asked for.
        logprob: its log-probability, added to the sequence's cumulative log-probability.
        forks: the first tokens of the sequences to fork from this one (its ``forks``, in
            order), sampled from the same logits; empty unless it has any.
    """

    token_id: int
    logprobs: TokenLogprobs | None
    logprob: float = 0.0
    forks: tuple[SampledToken | SampleError, ...] = ()


@dataclass(frozen=True, slots=True)
class SampleError:
    """A completed chunk whose sampling (or log-probabilities) raised: its request fails alone
    with this message (ENG-070)."""

    message: str
