"""The most bytes of input text one token can stand for, read from a tokenizer's definition.

A text of more than ``max_model_len x bound`` UTF-8 bytes encodes to more than
``max_model_len`` tokens whatever it holds, so it can be refused without being tokenized
(SRV-116): its size alone proves it too long. The bound must hold for every text, so it is
given only where it can be proved from the tokenizer's ``tokenizer.json``:

- the model is BPE: a token stands for its vocabulary string, whose characters are bytes with a
  ``ByteLevel`` pre-tokenizer and at most their UTF-8 encoding otherwise (``<0x41>`` or ``▁``
  stand for fewer bytes than they spell); an unknown character becomes one unknown token (at
  most 4 bytes) unless unknown tokens are fused or merged, which makes no bound;
- added tokens (``<|im_start|>``) stand for their content;
- the normalizer can shrink text only by a known factor: none 1, NFC and NFD 3 (U+1FEF, or a
  Hangul syllable from three jamo), NFKC and NFKD 4 (U+107A5, a 4-byte letter to a 1-byte
  one), a sequence the product; any other normalizer (``Strip``, ``Replace``, ...) can delete
  text, so there is no bound;
- the pre-tokenizer keeps every byte: ``ByteLevel``, ``Metaspace``, ``Digits``, ``Split``
  and ``Punctuation`` that do not remove what they match, or a sequence of them (``Whitespace``
  drops spaces: no bound).

Without a bound the text is still tokenized away from the engine and refused afterwards if it
does not fit; only the early refusal is lost. torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: How many times fewer UTF-8 bytes a text may have after each Unicode normalization.
NORMALIZER_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4}

#: Pre-tokenizers that keep every byte of their input (with ``Split`` and ``Punctuation``
#: only when their behavior is not ``Removed``).
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"})

#: Most UTF-8 bytes of one character (an unknown character becomes one unknown token).
MAX_CHAR_BYTES = 4


def _shrink(normalizer: Mapping[str, Any] | None) -> int | None:
    """How many times fewer bytes ``normalizer`` may leave, or ``None`` when unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", ()):
            step = _shrink(inner)
            if step is None:
                return None
            factor *= step
        return factor
    return NORMALIZER_SHRINK.get(str(kind))


def _keeps_bytes(pre_tokenizer: Mapping[str, Any] | None) -> bool:
    """Whether ``pre_tokenizer`` passes on every byte of its input."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_bytes(inner) for inner in pre_tokenizer.get("pretokenizers", ()))
    return kind in KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _byte_level(pre_tokenizer: Mapping[str, Any] | None) -> bool:
    """Whether ``pre_tokenizer`` is, or holds, ``ByteLevel`` (one character per byte)."""
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_byte_level(inner) for inner in pre_tokenizer.get("pretokenizers", ()))


def _merged(model: Mapping[str, Any]) -> bool:
    """Whether a merge of the BPE ``model`` takes its unknown token (unknown characters
    would then merge into one token)."""
    unknown = model.get("unk_token")
    for merge in model.get("merges", ()):
        parts = merge.split(" ") if isinstance(merge, str) else merge
        if unknown in parts:
            return True
    return False


def bytes_per_token(definition: Mapping[str, Any]) -> int | None:
    """The most UTF-8 bytes of input text one token of the tokenizer ``definition`` (the
    parsed ``tokenizer.json``) can stand for, times its normalizer's shrink factor; ``None``
    when no bound can be proved (see the module)."""
    model = definition.get("model") or {}
    unknown = model.get("unk_token")
    if model.get("type") != "BPE" or (unknown and (model.get("fuse_unk") or _merged(model))):
        return None
    pre_tokenizer = definition.get("pre_tokenizer")
    shrink = _shrink(definition.get("normalizer"))
    if shrink is None or not _keeps_bytes(pre_tokenizer):
        return None
    byte_level = _byte_level(pre_tokenizer)
    vocab: Mapping[str, int] = model.get("vocab") or {}
    longest = max(
        (len(token) if byte_level else len(token.encode("utf-8")) for token in vocab), default=1
    )
    for added in definition.get("added_tokens", ()):
        longest = max(longest, len(str(added.get("content", "")).encode("utf-8")))
    if model.get("unk_token"):
        longest = max(longest, MAX_CHAR_BYTES)
    return longest * shrink


def bytes_per_token_of(tokenizer_json: str) -> int | None:
    """:func:`bytes_per_token` of a ``tokenizer.json`` text (``Tokenizer.to_str()``)."""
    definition = json.loads(tokenizer_json)
    return bytes_per_token(definition) if isinstance(definition, dict) else None
