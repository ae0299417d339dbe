"""Engine conformance tests of salts carried by prompt dicts (specs/engine.md ENG-062, ENG-023).

A prompt given as ``{"prompt_token_ids": ids, "cache_salt": s}`` or ``{"prompt": text,
"cache_salt": s}`` is salted as a request given ``cache_salt=s`` is: it reuses the pages cached
under ``s`` and nothing cached under another salt or under none. An engine that drops the dict's
salt serves one tenant's cached prompt to every other; these tests see it in the prompt tokens
each request reports as served from the cache. Subclass :class:`EngineSaltSuite` to run them
against an engine of yours.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import TextPrompt, TokensPrompt
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Backend

from .engine_harness import EngineUnderTest, build_engine, greedy, solo_greedy
from .suite_engine_text import text_engine

#: 20 tokens: five full pages of 4, of which a repeat hits four (one token is computed).
PROMPT = list(range(40, 60))
HIT = 16
TEXT = "The page table maps each sequence to the pages holding its keys and values.\n"


def tokens_prompt(salt: str | None) -> TokensPrompt:
    """:data:`PROMPT` as a dict, with ``salt`` where given."""
    if salt is None:
        return {"prompt_token_ids": PROMPT}
    return {"prompt_token_ids": PROMPT, "cache_salt": salt}


def text_prompt(salt: str | None) -> TextPrompt:
    """:data:`TEXT` as a dict, with ``salt`` where given."""
    if salt is None:
        return {"prompt": TEXT}
    return {"prompt": TEXT, "cache_salt": salt}


def send(eut: EngineUnderTest, prompt: TokensPrompt | TextPrompt, how: str) -> RequestOutput:
    """Run ``prompt`` to its end alone, added (``add_request``) or streamed (``stream``)."""
    params = greedy(max_tokens=2)
    if how == "stream":
        return list(eut.engine.stream(prompt, params))[-1]
    (out,) = eut.finish([eut.engine.add_request(prompt, params)])
    return out


@pytest.mark.requires("engine", "prefix_caching")
class EngineSaltSuite:
    """ENG-062's prompt dicts with a ``cache_salt``: tenant isolation through the prompt."""

    @pytest.mark.spec("ENG-062", "ENG-023")
    @pytest.mark.parametrize("how", ["prompt_token_ids", "stream"])
    def test_a_prompt_dicts_salt_isolates_its_prefix(self, backend: Backend, how: str) -> None:
        """One prompt as a dict salted ``tenant-a``, then salted ``tenant-b``, then unsalted:
        none reuses another's pages. Again salted ``tenant-a``, it hits the first one's
        pages; as a plain list with the argument ``cache_salt="tenant-b"``, the second's."""
        eut = build_engine(backend)
        first = send(eut, tokens_prompt("tenant-a"), how)
        other = send(eut, tokens_prompt("tenant-b"), how)
        unsalted = send(eut, tokens_prompt(None), how)
        assert [o.metrics.cached_tokens for o in (first, other, unsalted)] == [0, 0, 0]
        same = send(eut, tokens_prompt("tenant-a"), how)
        assert same.metrics.cached_tokens == HIT
        (by_argument,) = eut.run([PROMPT], greedy(max_tokens=2), cache_salt="tenant-b")
        assert by_argument.metrics.cached_tokens == HIT
        outs = (first, other, unsalted, same, by_argument)
        assert all(list(o.token_ids) == solo_greedy(PROMPT, 2) for o in outs)
        assert eut.engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-062", "ENG-023")
    def test_a_text_prompt_dicts_salt_isolates_its_prefix(
        self, backend: Backend, tokenizer: Tokenizer
    ) -> None:
        """The same with ``{"prompt": text, "cache_salt": ...}``, tokenized by the engine."""
        eut = text_engine(backend, tokenizer)
        length = len(tokenizer.encode(TEXT))
        hit = (length - 1) // eut.config.page_size * eut.config.page_size
        assert hit >= 2 * eut.config.page_size, "the text should fill a few pages"
        first = send(eut, text_prompt("tenant-a"), "prompt")
        other = send(eut, text_prompt("tenant-b"), "prompt")
        unsalted = send(eut, text_prompt(None), "prompt")
        assert [o.metrics.cached_tokens for o in (first, other, unsalted)] == [0, 0, 0]
        same = send(eut, text_prompt("tenant-a"), "prompt")
        assert same.metrics.cached_tokens == hit
        assert len({tuple(o.token_ids) for o in (first, other, unsalted, same)}) == 1

    @pytest.mark.spec("ENG-062")
    def test_a_dict_salt_and_another_cache_salt_argument_are_refused(
        self, backend: Backend
    ) -> None:
        """A dict salted ``tenant-a`` with ``cache_salt="tenant-b"`` raises
        ``InvalidRequest`` and queues nothing; with the same salt both ways it runs, salted."""
        eut = build_engine(backend)
        with pytest.raises(InvalidRequest):
            eut.engine.add_request(tokens_prompt("tenant-a"), cache_salt="tenant-b")
        assert not eut.engine.has_unfinished_requests()
        eut.run([PROMPT], greedy(max_tokens=2), cache_salt="tenant-a")
        params = SamplingParams(max_tokens=2, temperature=0.0)
        request_id = eut.engine.add_request(
            tokens_prompt("tenant-a"), params, cache_salt="tenant-a"
        )
        (both,) = eut.finish([request_id])
        assert both.metrics.cached_tokens == HIT
