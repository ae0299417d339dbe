"""The engine's private, mutable state of one request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from pagedkv.engine.grammar import GrammarMatcher
from pagedkv.engine.outputs import FinishReason, TokenLogprobs
from pagedkv.engine.params import SamplingParams


class RequestStatus(Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued: holds no pages (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds pages and is scheduled every step
    FINISHED = "finished"
    UNBORN = "unborn"  # a parallel sample waiting for its parent's prompt (ENG-047)


@dataclass(eq=False)
class Request:
    """One request as the scheduler and postprocessor see it.

    ``token_ids`` holds the prompt then the generated tokens. ``num_computed_tokens`` counts its
    leading tokens whose K/V are in the cache; the rest still have to be fed to the model. A
    preempted request drops to 0 and is recomputed (from the prefix cache where it can be).

    A request generating several completions (``n``, ``best_of``) is one ``Request`` per
    sequence, all with the same ``request_id``: the first computes the prompt and holds the
    others in ``forks`` (status ``UNBORN``) until its first token is sampled, when the
    scheduler forks it into them (ENG-047).

    Attributes beyond the obvious:
        index: the sequence's index among its request's completions.
        forks: the sequences to fork from this one once its prompt is computed.
        cumulative_logprob: sum of its sampled tokens' log-probabilities.
        stop_reason: the stop token or stop string that ended it.
        publish: commit its pages to the prefix cache (off for a request whose prompt
            log-probabilities are computed: it neither hits nor publishes, ENG-049).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    seq_id: int | None = None
    num_computed_tokens: int = 0
    cached_tokens: int | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0
    forks: list[Request] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    publish: bool = True
    first_scheduled_time: float | None = None
    #: Consecutive steps it was in whose model run raised (ENG-072); 0 after a step succeeds.
    step_failures: int = 0
    #: Why it failed, once finished with reason ``error``.
    error: str | None = None
    #: Its priority under the ``priority`` scheduling policy: lower values are admitted first
    #: and preempted last (ENG-189).
    priority: int = 0

    @property
    def priority_key(self) -> tuple[int, float]:
        """Its place under the ``priority`` policy: priority, then arrival (ENG-189)."""
        return (self.priority, self.arrival_time)

    #: Where its output stands in its structured-output grammar (ENG-193); ``None`` without one.
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens, oldest first."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Positions of the sequence so far: prompt then generated tokens."""
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed to the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def width(self) -> int:
        """Sequences this request runs once its forks are born."""
        return 1 + len(self.forks)
