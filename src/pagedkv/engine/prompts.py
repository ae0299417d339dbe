"""The prompt forms the engine and ``LLM`` take, as vLLM names them (ENG-062).

A prompt is text, a sequence of token ids, ``{"prompt": text}`` (vLLM's ``TextPrompt``) or
``{"prompt_token_ids": [...]}`` (``TokensPrompt``); either dict may carry a ``cache_salt``. Any
other key (``multi_modal_data``, ...) is refused by name rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

from pagedkv.errors import InvalidRequest


class TextPrompt(TypedDict):
    """``{"prompt": text}``, tokenized by the model's tokenizer."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """``{"prompt_token_ids": [...]}``, used as given."""

    prompt_token_ids: Sequence[int]
    cache_salt: NotRequired[str]


#: Every form of one prompt.
PromptType = str | Sequence[int] | TextPrompt | TokensPrompt

#: The keys a prompt dict may hold.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """A prompt in one shape: exactly one of ``text`` and ``token_ids`` is set.

    Attributes:
        text: the prompt's text, when given as text.
        token_ids: the prompt's token ids, when given as ids.
        cache_salt: the salt a prompt dict carried.
    """

    text: str | None
    token_ids: tuple[int, ...] | None
    cache_salt: str | None = None


def _token_ids(value: object, where: str) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidRequest(f"{where} must be a list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest(f"{where} must hold only integer token ids")
    return tuple(int(t) for t in value)


def parse_prompt(prompt: object) -> ParsedPrompt:
    """The one prompt ``prompt`` is, in one shape.

    Raises:
        InvalidRequest: an unknown dict key (named), a dict with both or neither of ``prompt``
            and ``prompt_token_ids``, a non-string salt, or a sequence that is not of ints.
    """
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, Mapping):
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise InvalidRequest(f"unsupported prompt fields: {', '.join(unknown)}")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest("a prompt's cache_salt must be a string")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequest("a prompt dict takes exactly one of prompt, prompt_token_ids")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidRequest("a prompt dict's prompt must be text")
            return ParsedPrompt(text, None, salt)
        return ParsedPrompt(None, _token_ids(prompt["prompt_token_ids"], "prompt_token_ids"), salt)
    return ParsedPrompt(None, _token_ids(prompt, "a prompt"))


def is_one_prompt(prompts: object) -> bool:
    """Whether ``prompts`` is one prompt rather than a list of them: text, a dict, or a
    sequence of token ids (an empty list counts as one empty prompt)."""
    if isinstance(prompts, str | Mapping):
        return True
    if isinstance(prompts, Sequence):
        return all(isinstance(t, int) for t in prompts)
    return False
