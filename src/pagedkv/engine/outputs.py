"""What the engine returns: per-step request outputs and per-request metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a request ended."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # failed alone (ENG-070..072); ``RequestOutput.error`` says why


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one generated position (natural log, over the model's raw logits).

    Attributes:
        token_id: the token chosen.
        logprob: its log-probability.
        top: the ``n`` most likely ``(token_id, logprob)`` pairs, most likely first.
        rank: the token's rank in the distribution (1 for the most likely), where computed
            (prompt log-probabilities).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


class Logprob:
    """vLLM's ``Logprob``: one token's log-probability at a position (ENG-186).

    Attributes:
        logprob: natural log, over the model's raw distribution.
        rank: 1 for the most likely token; ``None`` where not computed (a sampled token
            outside the top ones).
        decoded_token: the token's text (special tokens kept), ``None`` without a tokenizer.
            Given a ``decode`` function and the ``token_id``, the text is decoded when first
            read, not when the output is built: the engine builds outputs on its step, and a
            server that never reads the text (it decodes token texts apart from the engine
            thread, SRV-115) costs the step no decoding.

    Immutable, and equal to another with the same three values, like vLLM's dataclass.
    """

    __slots__ = ("_decode", "_text", "_token_id", "logprob", "rank")

    logprob: float
    rank: int | None
    _text: str | None
    _decode: Callable[[int], str] | None
    _token_id: int | None

    def __init__(
        self,
        logprob: float,
        rank: int | None = None,
        decoded_token: str | None = None,
        *,
        decode: Callable[[int], str] | None = None,
        token_id: int | None = None,
    ) -> None:
        set_slot = object.__setattr__
        set_slot(self, "logprob", logprob)
        set_slot(self, "rank", rank)
        set_slot(self, "_text", decoded_token)
        set_slot(self, "_decode", decode if token_id is not None else None)
        set_slot(self, "_token_id", token_id)

    @property
    def decoded_token(self) -> str | None:
        """The token's text, decoded on first read where a decode function was given."""
        if self._decode is not None and self._token_id is not None:
            object.__setattr__(self, "_text", self._decode(self._token_id))
            object.__setattr__(self, "_decode", None)
        return self._text

    def _values(self) -> tuple[float, int | None, str | None]:
        return (self.logprob, self.rank, self.decoded_token)

    def __reduce__(self) -> tuple[type[Logprob], tuple[float, int | None, str | None]]:
        # pickled with its text decoded: the decode function belongs to this process (SRV-142)
        return type(self), self._values()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Logprob is immutable: cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Logprob) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={self.logprob!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )


class PositionLogprobs(dict[int, Logprob]):
    """vLLM's per-position log-probabilities: token id to :class:`Logprob`, the chosen token
    first, then the most likely ones by rank (ENG-186).

    It also names the chosen token (``token_id``, ``logprob``, ``rank``) and the most likely
    ``(token_id, logprob)`` pairs (``top``), read by pagedkv's server.
    """

    __slots__ = ("entry",)

    def __init__(self, entry: TokenLogprobs, decode: Callable[[int], str] | None = None) -> None:
        super().__init__()
        self.entry = entry
        ranks = {token: i + 1 for i, (token, _) in enumerate(entry.top)}
        chosen_rank = entry.rank if entry.rank is not None else ranks.get(entry.token_id)
        self[entry.token_id] = Logprob(
            entry.logprob, chosen_rank, decode=decode, token_id=entry.token_id
        )
        for token, logprob in entry.top:
            if token not in self:
                self[token] = Logprob(logprob, ranks[token], decode=decode, token_id=token)

    @property
    def token_id(self) -> int:
        """The chosen (or prompt) token."""
        return self.entry.token_id

    @property
    def logprob(self) -> float:
        """The chosen token's log-probability."""
        return self.entry.logprob

    @property
    def rank(self) -> int | None:
        """The chosen token's rank, where computed."""
        return self.entry.rank

    @property
    def top(self) -> tuple[tuple[int, float], ...]:
        """The most likely ``(token_id, logprob)`` pairs, most likely first."""
        return self.entry.top


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings in seconds (``time.perf_counter`` clock) and token counts of one request.

    Attributes:
        arrival_time: when ``add_request`` accepted it.
        first_token_time: when its first token was sampled, ``None`` before.
        finished_time: when it finished, ``None`` before.
        prompt_tokens: prompt length.
        cached_tokens: prompt tokens served from the prefix cache at its first admission.
        generated_tokens: tokens generated so far.
        preemptions: times it was preempted and later recomputed.
        first_scheduled_time: when it was first scheduled (left the waiting queue), ``None``
            before.
    """

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    preemptions: int
    first_scheduled_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first being scheduled, ``None`` before."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first token to the end, ``None`` until finished."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time


#: Why a completion stopped, beyond its finish reason (vLLM's ``stop_reason``): the stop string
#: or the stop token that ended it, ``None`` for EOS, a length limit or an abort.
StopReason = int | str | None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``); a request with ``n`` or
    ``best_of`` above 1 has several.

    Attributes:
        index: the completion's index among the request's ``n`` (by rank once ``best_of``
            has chosen them).
        text: the generated text so far (stop string trimmed); empty without a tokenizer.
        token_ids: every token generated so far (a list, as vLLM's).
        cumulative_logprob: sum of the generated tokens' log-probabilities (natural log, over
            the model's raw distribution); ``best_of`` ranks completions by it.
        logprobs: per generated position, when asked for: token id to :class:`Logprob`
            (ENG-186).
        finish_reason: why it ended, once it has.
        stop_reason: the stop string or stop token that ended it, else ``None``.
        new_token_ids: the tokens this step added (empty when the step did not advance it).
        new_text: the part of ``text`` this step added.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""

    def finished(self) -> bool:
        """Whether this completion has ended (a method, as in vLLM)."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step, shaped like vLLM's ``RequestOutput``.

    The fields of its first completion are also readable on the request itself (``text``,
    ``token_ids``, ``new_text``, ``new_token_ids``, ``finish_reason``, ``logprobs``), the
    names pagedkv had before it returned several completions.

    Attributes:
        request_id: the id ``add_request`` returned.
        prompt: the prompt's text when it was given as text, else ``None``.
        prompt_token_ids: the prompt (a list, as vLLM's).
        prompt_logprobs: with ``prompt_logprobs`` asked for, per prompt position: ``None``
            for the first, then token id to :class:`Logprob` for that token after the ones
            before it and the most likely alternatives (ENG-186); filled once the prompt is
            computed.
        outputs: the completions, by index.
        finished: whether every completion has ended.
        metrics: timings and counts.
        error: why the request failed, else ``None``: one completion that failed ends every
            other with reason ``error`` too (ENG-070).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (vLLM's name)."""
        return self.metrics.cached_tokens

    @property
    def first(self) -> CompletionOutput:
        """The completion of index 0."""
        return self.outputs[0]

    @property
    def text(self) -> str:
        """The first completion's text."""
        return self.outputs[0].text

    @property
    def new_text(self) -> str:
        """The text this step added to the first completion."""
        return self.outputs[0].new_text

    @property
    def token_ids(self) -> list[int]:
        """The first completion's tokens."""
        return self.outputs[0].token_ids

    @property
    def new_token_ids(self) -> list[int]:
        """The tokens this step added to the first completion."""
        return self.outputs[0].new_token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the first completion ended."""
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        """The first completion's log-probabilities."""
        return self.outputs[0].logprobs


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Engine-wide counters (ENG-050).

    Attributes:
        pages_in_use, pages_free, pages_cached, num_pages: the KV pool now (0 in v0 mode).
        peak_pages_in_use: the most pages in use at the end of any step.
        query_tokens, hit_tokens: prompt tokens looked up in and served by the prefix cache.
        prefill_tokens_computed: prompt positions the model computed (recomputation included).
        tokens_computed: every position the model computed.
        steps: steps run.
        preemptions: requests preempted.
        running, waiting: requests in each queue now.
        failed_steps: steps whose model run raised; their requests were retried or failed
            (ENG-073).
    """

    num_pages: int
    pages_in_use: int
    pages_free: int
    pages_cached: int
    peak_pages_in_use: int
    query_tokens: int
    hit_tokens: int
    prefill_tokens_computed: int
    tokens_computed: int
    steps: int
    preemptions: int
    running: int
    waiting: int
    failed_steps: int = 0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens over query tokens."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean positions computed per step."""
        return self.tokens_computed / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one engine step did, handed to step observers after the step (ENG-051).

    Times are seconds on the ``time.perf_counter`` clock; together they cover the whole step.

    Attributes:
        num_seqs: sequences the step ran.
        num_tokens: positions the model computed.
        num_prompt_tokens: of those, prompt positions (recomputation included).
        num_preempted: requests preempted to make room.
        num_finished: requests that finished in the step (aborts excluded).
        schedule_s: picking the work (scheduler and KVManager).
        plan_s: building the step plan.
        execute_s: the runner (model and attention) up to the logits on the CPU.
        sample_s: sampling the completed sequences' next tokens.
        update_s: applying them (progress, commits, stop conditions, frees).
        output_s: detokenizing and building the outputs.
        kv_positions: positions whose K/V the running requests hold after the step.
        stats: the engine's counters after the step.
    """

    num_seqs: int
    num_tokens: int
    num_prompt_tokens: int
    num_preempted: int
    num_finished: int
    schedule_s: float
    plan_s: float
    execute_s: float
    sample_s: float
    update_s: float
    output_s: float
    kv_positions: int
    stats: EngineStats

    @property
    def total_s(self) -> float:
        """The whole step."""
        return (
            self.schedule_s
            + self.plan_s
            + self.execute_s
            + self.sample_s
            + self.update_s
            + self.output_s
        )
