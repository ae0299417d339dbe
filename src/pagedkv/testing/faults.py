"""Faults injected on purpose, to show that one request's failure stays its own (ENG-070..072).

* :class:`FaultyRunner` wraps any step runner and raises on chosen calls, at random at a seeded
  rate, or on every call while ``failing`` is set: a whole step fails. It raises after the
  wrapped runner has run the step, so the step's K/V were written: the case where publishing
  them, or advancing the requests, would be wrong.
* :class:`TracingHashRunner` is the hash stand-in model recording which requests each call
  held; with the calls a :class:`FaultyRunner` failed, :func:`out_of_tries` tells exactly which
  requests an engine must fail (ENG-072) and so which it must not.
* :class:`PoisonedRunner` is a tracing hash stand-in model hurting only the sequences whose
  prompt holds ``poison``: every step holding one raises (a request no step can run),
  their logits are NaN (their sampling raises), or their logits peak at reserved tokens that no
  other sequence can produce (so a tokenizer fault can pick them out).
* :class:`FaultyTokenizer` is a tokenizer whose ``decode`` raises on the ids a predicate picks:
  a request's text or stop strings fail.
* :class:`IdTokenizer` spells token ids as text, for an engine under test that needs a
  tokenizer and has no model files.

Every injected error is an :class:`InjectedFault`, so a test can tell it from a real bug.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import torch

from pagedkv.engine.detokenizer import DecodeStep, WindowDecoder
from pagedkv.engine.tokenizer import Message, Tokenizer
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import StepRunner
from pagedkv.plan import StepPlan
from pagedkv.testing.delegating_runner import DelegatingRunner
from pagedkv.testing.hash_runner import HashRunner, next_token


class InjectedFault(RuntimeError):
    """An error a test injected."""


class FaultyRunner(DelegatingRunner):
    """A :class:`~pagedkv.interfaces.StepRunner` that runs ``inner`` then raises
    :class:`InjectedFault` on some calls.

    Args:
        inner: the runner doing the work.
        fail_calls: 0-based indices of the calls that raise.
        rate: probability that any other call raises, drawn from ``random.Random(seed)``.
        seed: seeds the draws.
        max_in_a_row: at most this many calls in a row raise at random (``None``: no cap);
            ``fail_calls`` and ``failing`` are not capped.

    Attributes:
        failing: while set, every call raises (a lost device).
        calls: calls so far.
        faults: the indices of the calls that raised.
    """

    def __init__(
        self,
        inner: StepRunner,
        *,
        fail_calls: Collection[int] = (),
        rate: float = 0.0,
        seed: int = 0,
        max_in_a_row: int | None = None,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise InvalidRequest(f"rate must be in [0, 1], got {rate}")
        super().__init__(inner)
        self.fail_calls = frozenset(fail_calls)
        self.rate = rate
        self.max_in_a_row = max_in_a_row
        self.failing = False
        self.calls = 0
        self.faults: list[int] = []
        self._rng = random.Random(seed)
        self._in_a_row = 0

    def execute(self, plan: StepPlan) -> torch.Tensor:
        call = self.calls
        self.calls += 1
        logits = self.inner.execute(plan)
        if self._fails(call):
            self._in_a_row += 1
            self.faults.append(call)
            raise InjectedFault(f"injected fault at runner call {call}")
        self._in_a_row = 0
        return logits

    def _fails(self, call: int) -> bool:
        if self.failing or call in self.fail_calls:
            return True
        if self.max_in_a_row is not None and self._in_a_row >= self.max_in_a_row:
            return False
        return self.rate > 0.0 and self._rng.random() < self.rate


class TracingHashRunner(HashRunner):
    """The hash stand-in model, recording the requests each call holds.

    A request is known by the first ``key_len`` tokens of its context: give every request a
    prompt of its own of that many tokens or more, and a token budget that never cuts a first
    chunk shorter.

    Attributes:
        keys: per call, the key of every sequence it ran (also for a call that raised).
    """

    def __init__(
        self, vocab_size: int, num_pages: int = 0, page_size: int = 1, *, key_len: int = 1
    ) -> None:
        super().__init__(vocab_size, num_pages, page_size)
        self.key_len = key_len
        self.keys: list[tuple[tuple[int, ...], ...]] = []

    def execute(self, plan: StepPlan) -> torch.Tensor:
        contexts, positions = self.read_contexts(plan)
        self.keys.append(tuple(tuple(c[: self.key_len]) for c in contexts))
        return self.logits_of(contexts, positions)

    def logits_of(self, contexts: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
        """The logits of a call whose sequences have these contexts, fed at these positions."""
        return self.peaked_logits(
            [next_token(c, self.vocab_size, p) for c, p in zip(contexts, positions, strict=True)]
        )


def out_of_tries(
    keys: Sequence[Sequence[tuple[int, ...]]], failed_calls: Collection[int], retries: int
) -> set[tuple[int, ...]]:
    """The requests that ran alone in ``1 + retries`` failed calls in a row, counting only the
    calls that held them: those an engine with ``max_step_retries = retries`` must fail, and
    the only ones it may fail for failing steps (ENG-072). A failed call that held several
    requests counts against none of them (the engine halves it to find its cause); a call
    holding a request that succeeds starts its count again.

    Args:
        keys: :attr:`TracingHashRunner.keys`, one entry per call.
        failed_calls: the indices of the calls that raised (:attr:`FaultyRunner.faults`).
        retries: the engine's ``max_step_retries``.
    """
    failed = frozenset(failed_calls)
    streaks: dict[tuple[int, ...], int] = {}
    out: set[tuple[int, ...]] = set()
    for call, held in enumerate(keys):
        for key in held:
            if call not in failed:
                streaks[key] = 0
            elif len(held) == 1:
                streaks[key] = streaks.get(key, 0) + 1
                if streaks[key] > retries:
                    out.add(key)
    return out


#: How a :class:`PoisonedRunner` hurts the poisoned sequences.
PoisonKind = Literal["raise", "nan", "tokens"]


class PoisonedRunner(TracingHashRunner):
    """The hash stand-in model, hurting only the sequences that hold ``poison`` at position
    ``poison_at`` of their context.

    Args:
        vocab_size, num_pages, page_size, key_len: as :class:`TracingHashRunner`.
        poison: the prompt tokens that mark a poisoned request.
        poison_at: where they sit in its prompt.
        kind: ``raise``: every call holding a poisoned sequence raises :class:`InjectedFault`
            (after storing its tokens); ``nan``: poisoned rows' logits are NaN, so sampling
            them at a temperature raises; ``tokens``: the ``reserved`` tokens are never
            produced by other rows (their logits are -inf there) and top the poisoned rows,
            in order, so greedy decoding of a poisoned request yields ``reserved[0]`` only.
        reserved: the reserved tokens of ``tokens``.

    Attributes:
        poisoned_steps: calls that held a poisoned sequence.
        raised: the indices of the calls that raised.
    """

    def __init__(
        self,
        vocab_size: int,
        num_pages: int = 0,
        page_size: int = 1,
        *,
        poison: Sequence[int],
        kind: PoisonKind,
        poison_at: int = 0,
        reserved: Sequence[int] = (),
        key_len: int = 1,
    ) -> None:
        super().__init__(vocab_size, num_pages, page_size, key_len=key_len)
        if not poison:
            raise InvalidRequest("the poison is empty")
        if kind == "tokens" and not reserved:
            raise InvalidRequest("kind 'tokens' needs reserved tokens")
        self.poison = tuple(poison)
        self.poison_at = poison_at
        self.kind = kind
        self.reserved = tuple(reserved)
        self.poisoned_steps = 0
        self.raised: list[int] = []

    def logits_of(self, contexts: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
        at, end = self.poison_at, self.poison_at + len(self.poison)
        poisoned = [tuple(c[at:end]) == self.poison for c in contexts]
        if any(poisoned):
            self.poisoned_steps += 1
            if self.kind == "raise":
                self.raised.append(len(self.keys) - 1)
                raise InjectedFault("a poisoned sequence is in the step")
        logits = super().logits_of(contexts, positions)
        rows = torch.tensor(poisoned, dtype=torch.bool)
        if self.kind == "nan":
            logits[rows] = float("nan")
        elif self.kind == "tokens":
            logits[:, list(self.reserved)] = float("-inf")
            for rank, token in enumerate(self.reserved):  # above every hash logit (<= 0)
                logits[rows, token] = 1.0 - 0.25 * rank
        return logits


class FaultyTokenizer(Tokenizer):
    """``inner`` whose ``decode`` raises :class:`InjectedFault` on the ids ``fails`` picks.

    Every public method of :class:`Tokenizer` is delegated to ``inner`` (a test checks that
    none is left to the base class, which would read model files this object does not have).

    Attributes:
        faults: the decodes that raised.
    """

    def __init__(self, inner: Tokenizer, fails: Callable[[Sequence[int]], bool]) -> None:
        # everything is delegated to ``inner``: no model files are loaded here
        self._inner = inner
        self._fails = fails
        self.faults = 0

    @property
    def has_chat_template(self) -> bool:
        return self._inner.has_chat_template

    @property
    def eos_token_id(self) -> int | None:
        return self._inner.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._inner.encode(text, add_special_tokens)

    def use_chat_template(self, template: str) -> None:
        self._inner.use_chat_template(template)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fails(token_ids):
            self.faults += 1
            raise InjectedFault(f"injected fault decoding {list(token_ids)[:8]}")
        return self._inner.decode(token_ids, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        return self._inner.apply_chat_template(
            messages,
            template_kwargs,
            tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens,
        )

    def render_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        return self._inner.render_chat_template(
            messages,
            template_kwargs,
            tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    def bytes_per_token(self) -> int | None:
        return self._inner.bytes_per_token()

    def token_id(self, text: str) -> int | None:
        return self._inner.token_id(text)

    def tokenizer_json(self) -> str:
        return self._inner.tokenizer_json()

    @property
    def hf(self) -> Any:
        return self._inner.hf

    def incremental_decoder(
        self, *, window: bool = False, skip_special_tokens: bool = True
    ) -> DecodeStep:
        """Decodes through :meth:`decode`, so that its faults reach the text."""
        return WindowDecoder(lambda ids: self.decode(ids, skip_special_tokens))


class IdTokenizer(Tokenizer):
    """Token ids as text: ``decode([5, 17])`` is ``"5 17 "``, ``encode`` reads such text back.
    No chat template, no EOS. Overrides every public method of :class:`Tokenizer`."""

    def __init__(self) -> None:
        """Nothing to load."""

    @property
    def has_chat_template(self) -> bool:
        return False

    @property
    def eos_token_id(self) -> int | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(word) for word in text.split()]

    def use_chat_template(self, template: str) -> None:
        raise InvalidRequest("this tokenizer takes no chat template")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"{t} " for t in token_ids)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        raise InvalidRequest("this tokenizer has no chat template")

    def render_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        raise InvalidRequest("this tokenizer has no chat template")

    def bytes_per_token(self) -> int | None:
        """None: a word of digits is one token, of any length."""
        return None

    def token_id(self, text: str) -> int | None:
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    @property
    def hf(self) -> Any:
        """No Hugging Face tokenizer stands behind this one."""
        return None

    def tokenizer_json(self) -> str:
        """Refused: ids-as-text has no ``tokenizer.json`` for a grammar engine to read."""
        raise InvalidRequest("structured outputs need a tokenizer.json; this tokenizer has none")

    def incremental_decoder(
        self, *, window: bool = False, skip_special_tokens: bool = True
    ) -> DecodeStep:
        return WindowDecoder(self.decode)
