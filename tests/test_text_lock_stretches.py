"""Big texts hold the interpreter's lock only in short stretches (SRV-141): a fast tokenizer
encodes through its backend's batch call, into transformers' own ids, and ``/tokenize``
builds its response without validating the ids again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import Running, post_json, running

from pagedkv.assets import default_model_dir, has_default_model
from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.entrypoints.server.protocol import TokenizeResponse

pytestmark = pytest.mark.skipif(not has_default_model(), reason="needs the embedded model")

#: Pieces a text is made of: the tokenizer's special tokens among ordinary text.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def bos_tokenizer() -> Tokenizer:
    """The embedded tokenizer, with a post-processor that adds a BOS: ``add_special_tokens``
    then changes the ids."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer(default_model_dir())
    bos = "<|endoftext|>"
    tokenizer.hf.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.hf.convert_tokens_to_ids(bos))]
    )
    return tokenizer


class _BatchOnly:
    """A backend that records its batch calls and forwards them to the real one."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.batches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.batches += 1
        return self._inner.encode_batch(*args, **kwargs)


class _NoEncode:
    """transformers' tokenizer with its own ``encode`` refused and its backend recorded."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.backend_tokenizer = _BatchOnly(inner.backend_tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, *_: Any, **__: Any) -> list[int]:
        raise AssertionError("encoded through transformers, not the backend's batch call")


@pytest.mark.spec("SRV-141")
@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.one_of(st.text(max_size=12), st.sampled_from(SPECIALS)), max_size=8),
    add_special_tokens=st.booleans(),
)
def test_the_same_ids_as_transformers_encode(
    tokenizer: Tokenizer, bos_tokenizer: Tokenizer, pieces: list[str], add_special_tokens: bool
) -> None:
    """Catches the backend's call differing from transformers' ``encode``: special tokens in
    the text, ``add_special_tokens`` dropped (the BOS-adding tokenizer's ids change with it),
    any text the generator finds."""
    text = "".join(pieces)
    for each in (tokenizer, bos_tokenizer):
        expected = each.hf.encode(text, add_special_tokens=add_special_tokens)
        assert each.encode(text, add_special_tokens) == expected


@pytest.mark.spec("SRV-141")
def test_a_fast_tokenizer_encodes_by_its_backends_batch_call(tokenizer: Tokenizer) -> None:
    """Catches texts encoded through transformers' ``encode``, which holds the lock for its
    conversions (48 ms at a stretch for a megabyte)."""
    spy = Tokenizer.__new__(Tokenizer)
    spy._tok = _NoEncode(tokenizer.hf)
    assert spy.encode("def add(a, b):") == tokenizer.hf.encode("def add(a, b):")
    assert spy._tok.backend_tokenizer.batches == 1


@pytest.mark.spec("SRV-141")
def test_a_backend_set_to_truncate_is_not_called_directly(tokenizer: Tokenizer) -> None:
    """Catches the backend called whatever its state: truncation set on it (by another user
    of the same tokenizer) would cut the ids transformers' ``encode`` gives in full."""
    text = "def add(a, b):\n    return a + b\n" * 4
    expected = tokenizer.hf.encode(text)
    backend = tokenizer.hf.backend_tokenizer
    backend.enable_truncation(5)
    try:
        assert tokenizer.encode(text) == expected
    finally:
        backend.no_truncation()
    assert len(expected) > 5


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    engine = reference_backend().load_engine(None, EngineConfig(num_pages=32, page_size=16))
    app = create_app(engine, "m", config=ServerConfig(log_stats_interval_s=None))
    with running(app) as server:
        yield server


@pytest.mark.spec("SRV-141")
def test_tokenize_answers_without_validating_the_ids_again(
    served: Running, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches ``/tokenize`` building its response through the validating constructor, a
    pass over every id (22 ms for a megabyte's ids, the lock held)."""

    def validating(*_: Any, **__: Any) -> None:
        raise AssertionError("the response was validated again")

    monkeypatch.setattr(TokenizeResponse, "__init__", validating)
    text = "def fibonacci(n):\n"
    answer = post_json(f"{served.url}/tokenize", {"model": "m", "prompt": text})
    assert answer.status_code == 200, answer.text
    ids = tokenizer.encode(text)
    assert answer.json() == {
        "count": len(ids),
        "max_model_len": answer.json()["max_model_len"],
        "tokens": ids,
        "token_strs": None,
    }
