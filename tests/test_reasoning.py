"""The qwen3 reasoning parser on text: whole replies and every way of streaming them
(SRV-091, SRV-092)."""

from __future__ import annotations

import pytest

from pagedkv.entrypoints.server.reasoning import (
    Reasoning,
    ReasoningParser,
    ThinkTags,
    reasoning_parser,
)
from pagedkv.errors import InvalidRequest

START, END = 7, 8
PARSER = ReasoningParser("qwen3", ThinkTags("<think>", "</think>", START, END))
#: Prompts leaving the reply outside a block, inside one, and after a closed (empty) one.
OUTSIDE, INSIDE, CLOSED = [1, 2, 3], [1, START, 2], [1, START, 2, END, 3]

CASES: list[tuple[list[int], str, Reasoning]] = [
    # the model thinks, then answers (Qwen3 with enable_thinking)
    (
        OUTSIDE,
        "<think>\nLet me see.\n</think>\n\nIt is 4.",
        Reasoning("\nLet me see.\n", "\n\nIt is 4."),
    ),
    # no tags at all: only content
    (OUTSIDE, "It is 4.", Reasoning(None, "It is 4.")),
    # enable_thinking false: the prompt closed an empty block, tags in the reply are content
    (CLOSED, "It is 4.", Reasoning(None, "It is 4.")),
    # a thinking-only model: the prompt opened the block
    (INSIDE, "Let me see.</think>It is 4.", Reasoning("Let me see.", "It is 4.")),
    # stopped while thinking (max_tokens): reasoning only
    (OUTSIDE, "<think>Let me", Reasoning("Let me", None)),
    (INSIDE, "Let me", Reasoning("Let me", None)),
    # thinking with nothing after it
    (OUTSIDE, "<think>hm</think>", Reasoning("hm", None)),
    (OUTSIDE, "<think></think>4", Reasoning("", "4")),
    # text before the block stays content; after the block everything is content
    (
        OUTSIDE,
        "Sure. <think>hm</think>4 <think>x</think>",
        Reasoning("hm", "Sure. 4 <think>x</think>"),
    ),
    # a lone closing tag outside a block is content
    (OUTSIDE, "a</think>b", Reasoning(None, "a</think>b")),
    # near-tags are text
    (OUTSIDE, "<thin>k <think>a</thin</think>b<", Reasoning("a</thin", "<thin>k b<")),
]


@pytest.mark.spec("SRV-091")
@pytest.mark.parametrize(("prompt", "text", "expected"), CASES)
def test_whole_reply_split(prompt: list[int], text: str, expected: Reasoning) -> None:
    assert PARSER.split(text, prompt) == expected


@pytest.mark.spec("SRV-092")
@pytest.mark.parametrize(("prompt", "text", "expected"), CASES)
def test_every_streaming_of_a_reply_gives_the_same_split(
    prompt: list[int], text: str, expected: Reasoning
) -> None:
    """Deltas of each kind, concatenated, equal the whole-reply split, for every chunking into
    two or three pieces and one character at a time."""
    chunkings = [
        [text[:i], text[i:j], text[j:]]
        for i in range(len(text) + 1)
        for j in range(i, len(text) + 1)
    ]
    chunkings.append(list(text))
    for chunks in chunkings:
        splitter = PARSER.splitter(prompt)
        reasoning, content = "", ""
        for chunk in chunks:
            r, c = splitter.feed(chunk)
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        reasoning, content = reasoning + r, content + c
        assert (reasoning if splitter.opened else None) == expected.reasoning, chunks
        assert ((content or None) if splitter.opened else content) == expected.content, chunks


class FakeTokenizer:
    """Single-token ids for a few texts; decoding drops the ones listed as special."""

    def __init__(self, vocab: dict[str, int], special: frozenset[str] = frozenset()) -> None:
        self.vocab = vocab
        self.special = special

    def token_id(self, text: str) -> int | None:
        return self.vocab.get(text)

    def decode(self, token_ids: list[int]) -> str:
        names = {v: k for k, v in self.vocab.items()}
        return "".join(names[t] for t in token_ids if names[t] not in self.special)


@pytest.mark.spec("SRV-090")
def test_the_parser_needs_the_think_tokens() -> None:
    tags = {"<think>": 5, "</think>": 6}
    parser = reasoning_parser("qwen3", FakeTokenizer(tags))
    assert (parser.tags.start_id, parser.tags.end_id) == (5, 6)
    with pytest.raises(InvalidRequest, match="deepseek"):
        reasoning_parser("deepseek", FakeTokenizer(tags))
    with pytest.raises(InvalidRequest, match="tokenizer"):
        reasoning_parser("qwen3", None)
    with pytest.raises(InvalidRequest, match="'</think>'"):
        reasoning_parser("qwen3", FakeTokenizer({"<think>": 5}))
    with pytest.raises(InvalidRequest, match="'<think>'"):
        reasoning_parser("qwen3", FakeTokenizer(tags, special=frozenset({"<think>"})))
