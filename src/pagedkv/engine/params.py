"""Sampling parameters of one request, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidRequest

#: Temperatures below this are sampled greedily (argmax), as vLLM does: dividing logits by a
#: smaller one can overflow float32 to ``inf`` and leave no distribution to sample from.
GREEDY_TEMPERATURE = 1e-5


class InvalidSamplingParams(InvalidRequest):
    """A sampling parameter is out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (ENG-040..ENG-046).

    Attributes:
        max_tokens: most tokens to generate, at least 1.
        temperature: below :data:`GREEDY_TEMPERATURE` (0 included) means greedy (argmax);
            otherwise logits are divided by it.
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``;
            in ``(0, 1]``.
        min_p: drop tokens whose probability is below ``min_p`` times the top one's; ``[0, 1]``.
        seed: seeds this request's own random generator, so a sampled output does not depend on
            what else is in the batch.
        stop_token_ids: generation ends after any of these tokens.
        stop: strings that end generation; the text is cut before the first one found.
        ignore_eos: keep generating past the model's EOS tokens.
        logprobs: also return the log-probabilities of this many most likely tokens per step
            (and of the chosen one); ``None`` for none.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, CLI) but store tuples: the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
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

    @property
    def greedy(self) -> bool:
        """Whether the next token is always the argmax (ENG-046)."""
        return self.temperature < GREEDY_TEMPERATURE
