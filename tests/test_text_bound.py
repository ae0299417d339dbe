"""The most bytes one token can stand for, read from ``tokenizer.json`` (SRV-116).

The bound is sound when no text of more than ``n x bound`` bytes encodes to ``n`` tokens or
fewer; the tokenizers here are built so that a bound missing a factor (the normalizer's shrink)
or given where none holds (a pre-tokenizer or normalizer that deletes text) is caught.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from pagedkv.assets import default_model_dir, has_default_model
from pagedkv.engine.text_bound import bytes_per_token, bytes_per_token_of
from pagedkv.engine.tokenizer import Tokenizer as ModelTokenizer

#: Texts that shrink under normalization, or match the longest tokens.
HARD_TEXTS = (
    "\u212a" * 64,  # KELVIN SIGN: 3 bytes, NFC and NFKC make it "K"
    "\u1fef" * 64,  # GREEK VARIA: 3 bytes, NFC makes it "`"
    "\U000107a5" * 64,  # 4 bytes, NFKC makes it one byte
    "\u1100\u1161\u11a8" * 32,  # three jamo (9 bytes) compose to one syllable (3)
    " " * 500,
    "K" * 500,
    "<|im_start|>" * 20,
)


def kelvin_tokenizer(normalizer: Any = None, pre_tokenizer: Any = None) -> Tokenizer:
    """A BPE whose longest token is ``KKKKKKKK`` (8 bytes) plus an added token of 12."""
    vocab = {"[UNK]": 0, "K": 1, "KK": 2, "KKKK": 3, "KKKKKKKK": 4, "`": 5, " ": 6}
    vocab.update({c: len(vocab) + i for i, c in enumerate("\u1100\u1161\u11a8")})
    vocab.update({chr(0xAC00 + i): len(vocab) + i for i in range(11172)})  # Hangul syllables
    merges = [("K", "K"), ("KK", "KK"), ("KKKK", "KKKK")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="[UNK]"))
    tokenizer.add_special_tokens(["<|im_start|>"])
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


def assert_sound(tokenizer: Tokenizer, bound: int) -> None:
    for text in HARD_TEXTS:
        tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert tokens * bound >= len(text.encode("utf-8")), (text[:3], tokens, bound)


@pytest.mark.spec("SRV-116")
@pytest.mark.parametrize(
    ("normalizer", "factor"),
    [
        (None, 1),
        (normalizers.NFC(), 3),
        (normalizers.NFD(), 3),
        (normalizers.NFKC(), 4),
        (normalizers.Sequence([normalizers.NFC(), normalizers.NFKC()]), 12),
    ],
)
def test_the_bound_counts_the_longest_token_and_the_normalizers_shrink(
    normalizer: Any, factor: int
) -> None:
    """The longest token is the added one (12 bytes); NFC turns 3-byte KELVIN SIGNs into
    ``K``s, eight to a token: a bound without the normalizer's factor fails the soundness
    check."""
    tokenizer = kelvin_tokenizer(normalizer)
    bound = bytes_per_token_of(tokenizer.to_str())
    assert bound == len("<|im_start|>") * factor
    assert_sound(tokenizer, bound)
    if normalizer is not None:
        with pytest.raises(AssertionError):
            assert_sound(tokenizer, len("<|im_start|>"))  # the longest token alone is not


@pytest.mark.spec("SRV-116")
@pytest.mark.parametrize(
    ("normalizer", "pre_tokenizer"),
    [
        (normalizers.Strip(), None),
        (normalizers.Replace(" ", ""), None),
        (normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]), None),
        (None, pre_tokenizers.Whitespace()),
        (None, pre_tokenizers.Split(" ", behavior="removed")),
        (None, pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Whitespace()])),
    ],
)
def test_a_tokenizer_that_can_delete_text_has_no_bound(normalizer: Any, pre_tokenizer: Any) -> None:
    """A text of spaces encodes to no token at all through these: any bound would be false."""
    tokenizer = kelvin_tokenizer(normalizer, pre_tokenizer)
    assert bytes_per_token_of(tokenizer.to_str()) is None


@pytest.mark.spec("SRV-116")
def test_other_models_and_fused_unknowns_have_no_bound() -> None:
    """An unknown word of any length is one token of WordLevel, or of a BPE fusing unknown
    characters or merging its unknown token (``K`` here: 64 unknown signs, 8 tokens)."""
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert bytes_per_token_of(word_level.to_str()) is None
    fused = json.loads(kelvin_tokenizer().to_str())
    fused["model"]["fuse_unk"] = True
    assert bytes_per_token(fused) is None
    merging = json.loads(kelvin_tokenizer().to_str())
    merging["model"]["unk_token"] = "K"
    assert bytes_per_token(merging) is None
    assert bytes_per_token(json.loads(kelvin_tokenizer().to_str())) == 12
    assert bytes_per_token_of("[]") is None


@pytest.mark.spec("SRV-116")
@pytest.mark.skipif(not has_default_model(), reason="the embedded model is not built")
def test_the_embedded_models_bound_is_its_longest_token_times_nfc() -> None:
    """Byte-level: a vocabulary token's characters are bytes (``Ġ`` is one space), so the
    longest token is counted in characters, then times 3 for its NFC normalizer."""
    definition = json.loads((default_model_dir() / "tokenizer.json").read_text())
    assert definition["normalizer"]["type"] == "NFC"
    longest = max(len(token) for token in definition["model"]["vocab"])
    tokenizer = ModelTokenizer(default_model_dir())
    assert tokenizer.bytes_per_token() == longest * 3
    for text in HARD_TEXTS:
        assert len(tokenizer.encode(text)) * longest * 3 >= len(text.encode("utf-8"))
