"""Reasoning parsers: split a model's thinking from its answer, as vLLM's
``--reasoning-parser qwen3`` does.

Qwen3 thinks inside ``<think>`` ... ``</think>`` before answering. Its chat template decides
where the block starts: with ``enable_thinking`` the model writes ``<think>`` itself; with
``enable_thinking: false`` the template closes an empty block in the prompt
(``<think>\\n\\n</think>\\n\\n``) and the model answers directly; thinking-only checkpoints (the
2507 "Thinking" models) open the block in the prompt and the model writes only ``</think>``.
So the split starts from the prompt: if the last think tag in the prompt is ``<think>``, the
output begins inside the block.

Rules, over the generated text: outside a block, text is content and ``<think>`` opens one;
inside, text is reasoning and the first ``</think>`` closes it; after that everything is
content, tags included. The tags themselves belong to neither. A generation that stops inside
the block (``max_tokens``) reports what it thought as reasoning and no content.

The streamed split is the same as the whole-text one: :class:`ReasoningSplitter` holds back a
tail that could be the start of a tag until the next text or the end, so the deltas of each
kind concatenate to the non-streamed fields whatever the chunking. (vLLM's non-streamed parser
reports an unclosed block as content and drops text before ``<think>``, while its streamed one
reports them as reasoning and content: pagedkv follows the streamed behaviour in both.)
torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.errors import InvalidRequest

#: Reasoning parsers by name (``pagedkv serve --reasoning-parser NAME``).
REASONING_PARSERS = ("qwen3",)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A reply split in two: ``reasoning`` is ``None`` when no think block was open, and
    ``content`` is ``None`` when a block was open and nothing followed it."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """The tags delimiting reasoning, and their token ids in the model's vocabulary.

    Attributes:
        start, end: tag texts.
        start_id, end_id: their single-token ids.
    """

    start: str
    end: str
    start_id: int
    end_id: int

    def opens_in_prompt(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves a block open: its last think tag is the start tag."""
        for token in reversed(prompt_token_ids):
            if token == self.start_id:
                return True
            if token == self.end_id:
                return False
        return False


class ReasoningSplitter:
    """Splits one reply's text, fed as it grows, into reasoning and content deltas.

    Args:
        tags: the think tags.
        inside: whether the reply starts inside a block (see :meth:`ThinkTags.opens_in_prompt`).
    """

    _BEFORE, _INSIDE, _AFTER = "before", "inside", "after"

    def __init__(self, tags: ThinkTags, inside: bool) -> None:
        self._tags = tags
        self._state = self._INSIDE if inside else self._BEFORE
        self._held = ""
        self.opened = inside

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` released by this piece of text (either may be empty)."""
        buffer = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buffer:
            if self._state == self._AFTER:
                content.append(buffer)
                break
            tag = self._tags.start if self._state == self._BEFORE else self._tags.end
            out = content if self._state == self._BEFORE else reasoning
            at = buffer.find(tag)
            if at < 0:
                keep = _partial_tag_suffix(buffer, tag)
                out.append(buffer[: len(buffer) - keep])
                self._held = buffer[len(buffer) - keep :]
                break
            out.append(buffer[:at])
            buffer = buffer[at + len(tag) :]
            if self._state == self._BEFORE:
                self._state, self.opened = self._INSIDE, True
            else:
                self._state = self._AFTER
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """``(reasoning, content)`` still held back, released at the end of the reply."""
        held, self._held = self._held, ""
        return (held, "") if self._state == self._INSIDE else ("", held)


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A named reasoning parser bound to a model's think tags."""

    name: str
    tags: ThinkTags

    def splitter(self, prompt_token_ids: Sequence[int]) -> ReasoningSplitter:
        """A splitter for one reply to a prompt of ``prompt_token_ids``."""
        return ReasoningSplitter(self.tags, self.tags.opens_in_prompt(prompt_token_ids))

    def split(self, text: str, prompt_token_ids: Sequence[int]) -> Reasoning:
        """The whole reply ``text`` split (the same as its streamed deltas joined)."""
        splitter = self.splitter(prompt_token_ids)
        reasoning, content = splitter.feed(text)
        tail_reasoning, tail_content = splitter.finish()
        reasoning, content = reasoning + tail_reasoning, content + tail_content
        if not splitter.opened:
            return Reasoning(None, content)
        return Reasoning(reasoning, content or None)


class TagLookup(Protocol):
    """What a parser needs of a tokenizer: single-token ids and decoding."""

    def token_id(self, text: str) -> int | None: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def reasoning_parser(name: str, tokenizer: TagLookup | None) -> ReasoningParser:
    """The parser ``name`` for a model's tokenizer.

    Raises:
        InvalidRequest: an unknown name, no tokenizer, or a tokenizer without the think tags as
            single tokens that survive decoding (the message names what is missing).
    """
    if name not in REASONING_PARSERS:
        raise InvalidRequest(
            f"unknown reasoning parser {name!r}; available: {', '.join(REASONING_PARSERS)}"
        )
    if tokenizer is None:
        raise InvalidRequest(f"reasoning parser {name!r} needs a model with a tokenizer")
    ids = []
    for tag in ("<think>", "</think>"):
        token = tokenizer.token_id(tag)
        if token is None or tokenizer.decode([token]) != tag:
            raise InvalidRequest(
                f"reasoning parser {name!r} needs {tag!r} as one token of the vocabulary that "
                "decoding keeps; this model's tokenizer has none"
            )
        ids.append(token)
    return ReasoningParser(name, ThinkTags("<think>", "</think>", ids[0], ids[1]))
