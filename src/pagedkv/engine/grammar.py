"""Grammar compilation and per-sequence matching for structured outputs (ENG-190..ENG-195).

The engine is llguidance (see the ``pyproject.toml`` commit for the measurement): it reads the
Hugging Face ``tokenizer.json`` as it is, builds no per-grammar token table (a grammar compiles
in well under a millisecond, where a compiler that precomputes one per schema spends tens of
milliseconds on Qwen3's 151,936 tokens), and computes one sequence's mask in tens of
microseconds.

A :class:`GrammarMatcher` belongs to one sequence. Its state is a function of the sequence's
output tokens alone: :meth:`GrammarMatcher.sync` advances it by the tokens it has not seen, and
rebuilds it from the tokens where its history differs from them, so that no preemption,
recomputation or fork can leave it out of step with the sequence (ENG-193).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

from pagedkv.engine.structured import InvalidStructuredOutputs, StructuredOutputsParams

#: Bits per word of a packed token mask.
WORD_BITS = 32


def _grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``params`` (not yet validated)."""
    import llguidance

    matcher = llguidance.LLMatcher
    options = {"whitespace_flexible": not params.disable_any_whitespace}
    kind = params.kind
    if kind == "json":
        assert isinstance(params.json, str)
        return str(matcher.grammar_from_json_schema(params.json, defaults=options))  # type: ignore[arg-type]
    if kind == "json_object":
        return str(matcher.grammar_from_json_schema('{"type": "object"}', defaults=options))  # type: ignore[arg-type]
    if kind == "regex":
        assert params.regex is not None
        return str(llguidance.grammar_from("regex", params.regex))
    if kind == "choice":
        assert params.choice is not None
        return str(llguidance.grammar_from("choice", list(params.choice)))  # type: ignore[arg-type]
    assert params.grammar is not None
    return str(llguidance.grammar_from("grammar", params.grammar))


class GrammarCompiler:
    """Compiles constraints against one tokenizer; one per engine (no global state).

    Args:
        tokenizer_json: the Hugging Face ``tokenizer.json`` text.
        vocab_size: the model's vocabulary (rows of its logits); token ids the tokenizer does
            not define are never allowed.
        eos_ids: the tokens that end the output once the grammar is complete.

    Raises:
        InvalidStructuredOutputs: no EOS token is known.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance

        if not eos_ids:
            raise InvalidStructuredOutputs("structured outputs need the model's EOS token")
        words = json.loads(tokenizer_json)
        known = len(words.get("model", {}).get("vocab", {})) + len(words.get("added_tokens", []))
        self.vocab_size = vocab_size
        self._tokenizer: Any = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=max(vocab_size, known), eos_token=sorted(eos_ids)
        )
        self._compiled: dict[StructuredOutputsParams, str] = {}

    def compile(self, params: StructuredOutputsParams) -> str:
        """The validated grammar of ``params`` (cached by constraint).

        Raises:
            InvalidStructuredOutputs: the constraint cannot be compiled; the message says why.
        """
        found = self._compiled.get(params)
        if found is not None:
            return found
        import llguidance

        try:
            grammar = _grammar_text(params)
        except (ValueError, TypeError) as exc:
            raise InvalidStructuredOutputs(
                f"structured_outputs.{params.kind} cannot be compiled: {exc}"
            ) from None
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if error:
            problem = "; ".join(messages) or "invalid"
            raise InvalidStructuredOutputs(
                f"structured_outputs.{params.kind} cannot be compiled: {problem}"
            )
        if len(self._compiled) >= 256:  # bounded: forget the oldest
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[params] = grammar
        return grammar

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher of a grammar :meth:`compile` returned."""
        return GrammarMatcher(self._tokenizer, grammar, self.vocab_size)

    def bitmasks(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """The packed masks (:meth:`GrammarMatcher.bitmask`) of ``matchers``, one row each of
        one tensor. Filled row by row: llguidance's parallel executor took 14.5 ms for 16
        rows of a 151,936-token vocabulary where one call per row took 3.3 ms, on a 2-core
        machine (``scripts/measure_grammar_engines.py``'s tokenizer, a JSON schema).

        Raises:
            InvalidStructuredOutputs: a matcher is in an error state.
        """
        words = (self._tokenizer.vocab_size + WORD_BITS - 1) // WORD_BITS
        masks = torch.zeros((len(matchers), words), dtype=torch.int32)
        for row, matcher in enumerate(matchers):
            matcher.fill(masks[row])
        return masks


class GrammarMatcher:
    """Where one sequence stands in its grammar.

    Attributes:
        consumed: the output tokens the matcher has taken, oldest first.
    """

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int) -> None:
        import llguidance

        self._tokenizer = tokenizer
        self._grammar = grammar
        self._matcher: Any = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._vocab_size = vocab_size
        self._words = (tokenizer.vocab_size + WORD_BITS - 1) // WORD_BITS
        self.consumed: list[int] = []

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Bring the matcher to the state after ``output_token_ids``: take the tokens it has
        not seen, or, where its history is not a prefix of them, rebuild it from them all.

        Raises:
            InvalidStructuredOutputs: a token the grammar does not allow.
        """
        seen = len(self.consumed)
        if seen > len(output_token_ids) or list(output_token_ids[:seen]) != self.consumed:
            self._matcher.reset()
            self.consumed = []
            seen = 0
        for token in output_token_ids[seen:]:
            if not self._matcher.consume_token(int(token)):
                raise InvalidStructuredOutputs(
                    f"token {token} breaks the grammar: {self._matcher.get_error()}"
                )
            self.consumed.append(int(token))

    def fill(self, words: torch.Tensor) -> None:
        """Write :meth:`bitmask` into ``words`` (a contiguous ``int32`` row of its size).

        Raises:
            InvalidStructuredOutputs: the matcher is in an error state.
        """
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self._matcher.is_error():
            raise InvalidStructuredOutputs(f"the grammar failed: {self._matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        """Whether the grammar can take no further token: the output is complete."""
        return bool(self._matcher.is_stopped())

    def bitmask(self) -> torch.Tensor:
        """The tokens allowed next, packed: ``int32[ceil(vocab / 32)]``, bit ``t % 32`` of word
        ``t // 32`` set for an allowed token ``t``.

        Raises:
            InvalidStructuredOutputs: the matcher is in an error state.
        """
        words = torch.zeros(self._words, dtype=torch.int32)
        self.fill(words)
        return words


@cache
def _clear_bits(device: torch.device) -> torch.Tensor:
    """``bool[256, 8]`` on ``device``: whether bit ``j`` of byte ``b`` is clear (a constant
    table, made once per device)."""
    byte = torch.arange(256, device=device).unsqueeze(1)
    return ((byte >> torch.arange(8, device=device)) & 1) == 0


def refused_tokens(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``bool[R, vocab]``, true for each token packed masks ``int32[R, W]``
    (:meth:`GrammarMatcher.bitmask`) do not allow; tokens past ``32 * W`` are refused. One
    table lookup per byte (on a little-endian machine, which torch's CPU builds all are, a
    word's bytes hold its bits in order). On ``words``' device."""
    as_bytes = words.contiguous().view(torch.uint8).long()
    refused = _clear_bits(words.device)[as_bytes].reshape(words.shape[0], -1)
    if refused.shape[1] >= vocab:
        return refused[:, :vocab]
    pad = torch.ones(
        words.shape[0], vocab - refused.shape[1], dtype=torch.bool, device=words.device
    )
    return torch.cat([refused, pad], dim=1)
