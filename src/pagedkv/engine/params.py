"""Sampling parameters of one request, validated when built."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.errors import InvalidRequest

#: Temperatures below this are sampled greedily (argmax), as vLLM does: dividing logits by a
#: smaller one can overflow float32 to ``inf`` and leave no distribution to sample from.
GREEDY_TEMPERATURE = 1e-5
#: Presence and frequency penalties lie in ``[-MAX_PENALTY, MAX_PENALTY]`` (OpenAI, vLLM).
MAX_PENALTY = 2.0
#: A logit bias lies in ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]`` (OpenAI).
MAX_LOGIT_BIAS = 100.0
#: The largest finite float32, the dtype the sampler computes in (ENG-177): a temperature or
#: repetition penalty above it is infinite there.
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest normal float32 (2**-126). A repetition penalty below it divides a logit of 1
#: past :data:`FLOAT32_MAX`; a ``top_p`` below it keeps exactly the most likely token, since no
#: float32 probability of a second token is smaller (ENG-177).
FLOAT32_TINY = 2.0**-126
#: The float fields of :class:`SamplingParams`, each checked finite (ENG-176).
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class InvalidSamplingParams(InvalidRequest):
    """A sampling parameter is out of range; the message names it."""


class OutputKind(StrEnum):
    """When ``step()`` returns a request's outputs (ENG-157; vLLM's ``RequestOutputKind``).

    There is no delta-only kind: every output carries both the tokens so far and the new ones.
    """

    #: After every step that advanced the request (ENG-013).
    EVERY_STEP = "every_step"
    #: Once, when the request has ended: a caller that reads only final outputs (``generate``)
    #: spares the engine building one per request per step.
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (ENG-040..ENG-046).

    Attributes:
        max_tokens: most tokens to generate, at least 1; ``None`` (vLLM's) for up to the
            context limit, ``max_model_len`` less the prompt (the engine resolves it, ENG-187).
        temperature: below :data:`GREEDY_TEMPERATURE` (0 included) means greedy (argmax);
            otherwise logits are divided by it; finite, at most :data:`FLOAT32_MAX`
            (ENG-176, ENG-177), with no other upper bound (as vLLM).
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``;
            in ``(0, 1]``. Below :data:`FLOAT32_TINY` (``5e-324`` included) that set is the
            most likely token alone, which the sampler keeps exactly (ENG-177).
        min_p: drop tokens whose probability is below ``min_p`` times the top one's; ``[0, 1]``.
        seed: seeds this request's own random generator, so a sampled output does not depend on
            what else is in the batch.
        stop_token_ids: generation ends after any of these tokens.
        stop: strings that end generation; the text is cut before the first one found.
        ignore_eos: keep generating past the model's EOS tokens.
        logprobs: also return the log-probabilities of this many most likely tokens per step
            (and of the chosen one); ``None`` for none.
        n: completions returned for the prompt (ENG-047); the prompt is computed once and its
            sequence forked for the others, on shared pages.
        best_of: sequences generated, ``n`` of which are returned, those of highest
            cumulative log-probability; ``None`` means ``n``.
        presence_penalty: subtracted once from the logit of every token the output already
            holds; in ``[-2, 2]`` (ENG-048).
        frequency_penalty: subtracted from each token's logit once per time the output holds
            it; in ``[-2, 2]``.
        repetition_penalty: divides the positive logits, and multiplies the negative ones, of
            every token in the prompt or the output; above 0, 1 for none; a normal float32
            (in ``[FLOAT32_TINY, FLOAT32_MAX]``, ENG-177).
        logit_bias: token id to a value in ``[-100, 100]`` added to its logit at every step
            (a mapping, stored as sorted ``(token, bias)`` pairs so the object stays hashable).
        min_tokens: no EOS or stop token can be sampled, and no stop string ends the output,
            before this many tokens are generated; at most ``max_tokens``.
        prompt_logprobs: the log-probability of every prompt token after the first (and the
            this many most likely tokens at each position); ``None`` for none.
        include_stop_str_in_output: keep the stop string that ended the output in its text.
        output_kind: when ``step()`` returns the request's outputs (:class:`OutputKind`, or its
            name).
        detokenize: ``False`` returns no text (and so takes no stop strings), as vLLM does.
        skip_special_tokens: ``False`` keeps special tokens in the text.
        spaces_between_special_tokens, allowed_token_ids, bad_words, truncate_prompt_tokens,
        guided_decoding, logits_processors: vLLM's; only their neutral
            values are accepted, anything else is refused naming the field and why (ENG-187).
        structured_outputs: a constraint the output must match (JSON schema, regex, choice,
            grammar; ENG-190); ``None`` for none.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = OutputKind.EVERY_STEP
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: object = None
    logits_processors: object = None

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, CLI) but store tuples: the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        object.__setattr__(self, "output_kind", _output_kind(self.output_kind))
        self._refuse_unsupported()
        self._check_finite()
        self._check_ranges()
        self._check_extensions()

    def _check_finite(self) -> None:
        """Every float field is a finite number (ENG-176): NaN passes no range comparison
        written carelessly, and infinity passes ``>= 0``."""
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            try:
                finite = math.isfinite(value)
            except TypeError:
                raise InvalidSamplingParams(f"{name} must be a number, got {value!r}") from None
            if not finite:
                raise InvalidSamplingParams(f"{name} must be a finite number, got {value}")
        for token, bias in self.logit_bias:  # type: ignore[misc]
            if not math.isfinite(bias):
                raise InvalidSamplingParams(
                    f"logit_bias of token {token} must be a finite number, got {bias}"
                )

    def _refuse_unsupported(self) -> None:
        """vLLM's fields pagedkv does not implement: refused unless neutral (ENG-187)."""
        reasons = {
            "spaces_between_special_tokens": (
                self.spaces_between_special_tokens is not True,
                "special tokens are decoded as the tokenizer joins them",
            ),
            "allowed_token_ids": (
                self.allowed_token_ids is not None,
                "restricting the vocabulary is not supported",
            ),
            "bad_words": (self.bad_words not in (None, ()), "bad words are not supported"),
            "truncate_prompt_tokens": (
                self.truncate_prompt_tokens is not None,
                "prompts are never truncated",
            ),
            "guided_decoding": (
                self.guided_decoding is not None,
                "guided decoding is not supported",
            ),
            "logits_processors": (
                self.logits_processors not in (None, [], ()),
                "custom logits processors are not supported",
            ),
        }
        for name, (given, why) in reasons.items():
            if given:
                raise InvalidSamplingParams(f"{name} is not supported: {why}")
        if not self.detokenize and self.stop:
            raise InvalidSamplingParams("stop strings need detokenize=True")

    def _check_ranges(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > FLOAT32_MAX:
            raise InvalidSamplingParams(
                f"temperature must be at most {FLOAT32_MAX:.8g} (float32's largest; the sampler "
                f"divides logits by it in float32), got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InvalidSamplingParams(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise InvalidSamplingParams(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidSamplingParams(f"logprobs must be >= 0, got {self.logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingParams("stop_token_ids must be non-negative token ids")
        if any(not s for s in self.stop):
            raise InvalidSamplingParams("stop strings must be non-empty")

    def _check_extensions(self) -> None:
        """The ranges of parallel sampling, penalties, bias and prompt log-probabilities."""
        if self.n < 1:
            raise InvalidSamplingParams(f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidSamplingParams(f"best_of must be >= n={self.n}, got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidSamplingParams(
                f"repetition_penalty must be positive and finite, got {self.repetition_penalty}"
            )
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise InvalidSamplingParams(
                f"repetition_penalty must be in [{FLOAT32_TINY:.8g}, {FLOAT32_MAX:.8g}] (a "
                "normal float32: the sampler divides logits by it in float32), got "
                f"{self.repetition_penalty}"
            )
        for token, bias in self.logit_bias:  # type: ignore[misc]
            if token < 0:
                raise InvalidSamplingParams(f"logit_bias names a negative token id {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParams(
                    f"logit_bias of token {token} must be in [-100, 100], got {bias}"
                )
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise InvalidSamplingParams(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise InvalidSamplingParams(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidSamplingParams(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )

    @property
    def token_limit(self) -> int:
        """``max_tokens`` once the engine has resolved it (ENG-187).

        Raises:
            InvalidSamplingParams: ``max_tokens`` is still ``None``.
        """
        if self.max_tokens is None:
            raise InvalidSamplingParams("max_tokens=None is resolved by the engine")
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        """Whether the next token is always the argmax (ENG-046)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the prompt: ``best_of`` if given, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as the sorted ``(token, bias)`` pairs it is stored as."""
        return self.logit_bias  # type: ignore[return-value]

    @property
    def has_penalties(self) -> bool:
        """Whether any presence, frequency or repetition penalty applies."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


def _output_kind(value: OutputKind | str) -> OutputKind:
    """``value`` as an :class:`OutputKind` (a kind, or its name)."""
    try:
        return OutputKind(value)
    except ValueError:
        names = ", ".join(kind.value for kind in OutputKind)
        raise InvalidSamplingParams(f"output_kind must be one of {names}, got {value!r}") from None
