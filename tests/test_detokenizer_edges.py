"""Incremental detokenization at its edges (specs/engine.md ENG-090, ENG-091), over stand-in
decoders: stop strings around ``min_tokens``, several stop strings at once, stop tokens, text
held back with ``include_stop_str_in_output``, the window decoder after a token without text,
and ``DecodeStream`` restarted after an invalid prefix.

Fast and without the embedded model: in the engine packages' mutation test selection.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from pagedkv.engine.detokenizer import DecodeStreamDecoder, IncrementalDetokenizer, WindowDecoder
from pagedkv.engine.params import SamplingParams

#: Token ids of the stand-in decoder: each is its text; ``EOS`` has none.
PIECES = ["a", "b", "c", "ab", "abc", "x", "y", ""]
A, B, C, AB, ABC, X, Y, EOS = range(len(PIECES))


def detokenizer(**params: object) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(PIECES.__getitem__, SamplingParams(**params))  # type: ignore[arg-type]


@pytest.mark.spec("ENG-048", "ENG-090", "ENG-091")
def test_a_stop_string_within_min_tokens_never_counts() -> None:
    """``min_tokens=1``: a stop string completed by the first token does not count, not when it
    arrives nor later, and it is not held back, since it can no longer end the request."""
    late = detokenizer(stop=("ab",), min_tokens=1)
    assert late.update([AB]) is None
    assert late.release(finished=False) == "ab"
    assert late.update([C]) is None
    assert late.release(finished=False) == "c"
    assert late.text == "abc"
    together = detokenizer(stop=("ab",), min_tokens=1)
    assert together.update([AB, C]) is None  # the same two tokens in one update
    assert together.text == "abc"
    counted = detokenizer(stop=("ab",), min_tokens=1)
    assert counted.update([C]) is None
    assert counted.update([AB]) == "ab"  # the second token: past min_tokens
    assert counted.text == "c"
    split = detokenizer(stop=("ab",), min_tokens=1)
    assert split.update([A]) is None
    assert split.update([B]) == "ab"  # ends in text added after the first min_tokens
    assert split.text == ""


@pytest.mark.spec("ENG-090")
def test_a_stop_string_ending_before_a_stop_token() -> None:
    """A stop string and the stop token after it, in one update: the stop string ends the
    text, and the stop token's (empty) text is left out."""
    ended = detokenizer(stop=("ab",))
    assert ended.update([AB, EOS], stop_token=True) == "ab"
    assert ended.text == ""
    late = detokenizer(stop=("ab",), min_tokens=1)
    assert late.update([A, B, EOS], stop_token=True) == "ab"  # "b" is past min_tokens
    assert late.text == ""


@pytest.mark.spec("ENG-144")
@pytest.mark.parametrize("include", [False, True])
def test_of_stop_strings_starting_together_the_first_listed_counts(include: bool) -> None:
    """One token completes ``ab`` and ``abc``, both starting at the same character: the one
    listed first ends the completion, and names it."""
    first = detokenizer(stop=("ab", "abc"), include_stop_str_in_output=include)
    assert first.update([C, ABC]) == "ab"
    assert first.text == ("cab" if include else "c")
    other = detokenizer(stop=("abc", "ab"), include_stop_str_in_output=include)
    assert other.update([C, ABC]) == "abc"
    assert other.text == ("cabc" if include else "c")
    earliest = detokenizer(stop=("bc", "abc"))
    assert earliest.update([ABC]) == "abc"  # starts before "bc"


@pytest.mark.spec("ENG-145", "ENG-090")
@pytest.mark.parametrize("stop", [(), ("xyz",)])
def test_nothing_is_held_back_when_stop_strings_stay_in_the_text(stop: tuple[str, ...]) -> None:
    """With ``include_stop_str_in_output`` every delta is released at once: a stop string would
    stay in the text, so no text waits for the next token."""
    kept = detokenizer(stop=stop, include_stop_str_in_output=True)
    deltas = []
    for token in (A, B, X, Y):
        kept.update([token])
        deltas.append(kept.release(finished=False))
    assert deltas == ["a", "b", "x", "y"]


def sentencepiece_decode(ids: Sequence[int]) -> str:
    """A SentencePiece-like decode: ``▁`` is a space, the text's leading space is dropped, and
    the special token 0 is skipped."""
    vocab = {0: "", 1: "▁x", 2: "▁hello", 3: "y"}
    return "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


@pytest.mark.spec("ENG-090")
def test_a_token_without_text_does_not_become_the_windows_context() -> None:
    """A special token decodes to nothing: the window keeps the token before it as context, so
    the next word keeps its leading space."""
    step = WindowDecoder(sentencepiece_decode)
    deltas = [step(token) for token in (1, 0, 2, 3)]
    assert "".join(deltas) == sentencepiece_decode([1, 0, 2, 3]) == "x helloy"
    assert deltas == ["x", "", " hello", "y"]


def stand_in_tokenizer() -> Tokenizer:
    """Tokens ``a b c`` and a special ``<eos>`` (id 4); the decoder joins the tokens and writes
    ``ab`` as ``X``, so the text of ``a b`` does not begin with that of ``a``."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    tokenizer.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    return tokenizer


@pytest.mark.spec("ENG-090")
def test_decode_stream_skips_special_tokens() -> None:
    step = DecodeStreamDecoder(stand_in_tokenizer())
    assert [step(t) for t in (3, 4, 3)] == ["c", "", "c"]


@pytest.mark.spec("ENG-090")
def test_decode_stream_restarts_after_an_invalid_prefix() -> None:
    """``DecodeStream`` raises once the text stops beginning with what it released: the
    decoder starts a new stream at that token, which still gets its text."""
    step = DecodeStreamDecoder(stand_in_tokenizer())
    assert [step(t) for t in (1, 2, 3, 3)] == ["a", "", "c", "c"]
