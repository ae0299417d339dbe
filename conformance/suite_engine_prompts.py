"""Engine conformance tests of the prompt forms ``add_request`` takes (specs/engine.md
ENG-062, ENG-152), on the hash model: token ids as a list or a tuple, bare or in a prompt dict,
and what is refused. Subclass :class:`EnginePromptSuite` to run these against an engine of
yours.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.engine.params import SamplingParams
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Backend

from .engine_harness import build_engine, solo_greedy

PROMPT = [5, 17, 29, 3, 41, 8, 13, 2, 77]
GREEDY = SamplingParams(max_tokens=4, temperature=0)

#: Token ids that are not a list or tuple of ints.
NOT_TOKEN_IDS: list[Any] = [b"\x05\x11", {5, 17}, {5: 17}, 5, 5.0, [True, False], [5.0, 17.0]]


@pytest.mark.requires("engine")
class EnginePromptSuite:
    """Prompts as token ids and prompt dicts; refusals queue nothing."""

    @pytest.mark.spec("ENG-152")
    def test_token_ids_are_a_list_or_tuple_of_ints(self, backend: Backend) -> None:
        """A list and a tuple of ints, bare or as ``prompt_token_ids``, give the prompt's
        greedy tokens; bytes, a set, a dict, a number, bools or floats, bare or as
        ``prompt_token_ids``, raise ``InvalidRequest`` and queue nothing."""
        eut = build_engine(backend)
        forms: list[Any] = [
            PROMPT,
            tuple(PROMPT),
            {"prompt_token_ids": PROMPT},
            {"prompt_token_ids": tuple(PROMPT)},
        ]
        ids = [eut.engine.add_request(form, GREEDY) for form in forms]
        for out in eut.finish(ids):
            assert list(out.token_ids) == solo_greedy(PROMPT, 4)
        for ids in NOT_TOKEN_IDS:
            wrapped: Any = {"prompt_token_ids": ids}
            for prompt in (ids, wrapped):
                with pytest.raises(InvalidRequest):
                    eut.engine.add_request(prompt, GREEDY)
                assert not eut.engine.has_unfinished_requests(), f"{prompt!r} was queued"

    @pytest.mark.spec("ENG-062", "ENG-023")
    def test_a_prompt_dict_has_one_prompt_and_maybe_a_salt(self, backend: Backend) -> None:
        """``{"prompt_token_ids": ids, "cache_salt": s}`` runs salted (a second request with
        that salt hits the first's pages, one without it does not); a dict with another key,
        with both ``prompt`` and ``prompt_token_ids`` or with neither raises
        ``InvalidRequest`` and queues nothing."""
        eut = build_engine(backend)
        prompt = list(range(1, 14))
        salted: Any = {"prompt_token_ids": prompt, "cache_salt": "a"}
        eut.finish([eut.engine.add_request(salted, GREEDY)])
        again, unsalted = eut.finish(
            [eut.engine.add_request(salted, GREEDY), eut.engine.add_request(prompt, GREEDY)]
        )
        assert again.num_cached_tokens > 0
        assert unsalted.num_cached_tokens == 0
        bad: list[Any] = [
            {"prompt_token_ids": prompt, "prompt_ids": prompt},
            {"prompt_token_ids": prompt, "salt": "a"},
            {"prompt": "some text", "prompt_token_ids": prompt},
            {"cache_salt": "a"},
            {},
        ]
        for prompt_dict in bad:
            with pytest.raises(InvalidRequest):
                eut.engine.add_request(prompt_dict, GREEDY)
            assert not eut.engine.has_unfinished_requests(), f"{prompt_dict!r} was queued"
