"""Engine conformance tests of stop strings completed together and kept in the text
(specs/engine.md ENG-144, ENG-145), on the hash model with a tokenizer whose text is the token
ids (``decode([5, 17])`` is ``"5 17 "``). Subclass :class:`EngineStopStringSuite` to run these
against an engine of yours.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend
from pagedkv.testing.faults import IdTokenizer

from .engine_harness import build_engine, solo_greedy

TEXT = IdTokenizer()


def third_token_prompt() -> tuple[list[int], int]:
    """A prompt whose greedy third token's digits appear nowhere in the text before it, so the
    stop strings built from it are completed first by the step that adds it; with that token."""
    for first in range(1, 100):
        prompt = [first, 11, 23]
        t1, t2, t3 = solo_greedy(prompt, 3)
        if str(t3) not in TEXT.decode([t1, t2]) and t3 != t2:
            return prompt, t3
    raise AssertionError("no prompt of the form [k, 11, 23] has a distinct third token")


@pytest.mark.requires("engine")
class EngineStopStringSuite:
    """Which of several stop strings ends a completion; nothing held back when they stay."""

    @pytest.mark.spec("ENG-144", "ENG-043")
    @pytest.mark.parametrize(
        ("stop", "reason"),
        [
            (("{t3} ", "{t3}"), "{t3} "),  # same start: the one listed first
            (("{t3}", "{t3} "), "{t3}"),
            (("{t3} ", " {t3}"), " {t3}"),  # the one starting first, listed second
        ],
        ids=["same-start-listed-first", "same-start-listed-second", "earlier-start"],
    )
    def test_of_stop_strings_completed_together_the_first_starting_counts(
        self, backend: Backend, stop: tuple[str, str], reason: str
    ) -> None:
        """The third token's text completes both stop strings in one step: the one starting
        first ends the completion and is its ``stop_reason``, of two starting together the one
        listed first; the text ends where it starts."""
        prompt, t3 = third_token_prompt()
        strings = tuple(s.format(t3=t3) for s in stop)
        want = reason.format(t3=t3)
        eut = build_engine(backend, tokenizer=TEXT)
        (out,) = eut.run([prompt], SamplingParams(max_tokens=8, temperature=0, stop=strings))
        (completion,) = out.outputs
        assert completion.stop_reason == want, (
            f"stop {strings}: ended by {completion.stop_reason!r}"
        )
        whole = TEXT.decode(solo_greedy(prompt, 3))
        assert completion.text == whole[: whole.index(want)]

    @pytest.mark.spec("ENG-145", "ENG-013")
    def test_nothing_is_held_back_when_stop_strings_stay_in_the_text(
        self, backend: Backend
    ) -> None:
        """With ``include_stop_str_in_output`` and a stop string every token's text could
        begin, each output releases all the text so far: its text is the decode of its
        tokens, step by step, and the stop string stays in the final text."""
        prompt, t3 = third_token_prompt()
        stop = (f"{t3} ", " zz")  # every token's text ends with a space " zz" could begin
        params = SamplingParams(
            max_tokens=8, temperature=0, stop=stop, include_stop_str_in_output=True
        )
        eut = build_engine(backend, tokenizer=TEXT)
        request_id = eut.engine.add_request(prompt, params)
        seen = 0
        while eut.engine.has_unfinished_requests():
            for output in eut.engine.step():
                assert output.request_id == request_id
                (completion,) = output.outputs
                if completion.token_ids:
                    seen += 1
                    assert completion.text == TEXT.decode(completion.token_ids), (
                        f"text held back at token {len(completion.token_ids)}"
                    )
        assert seen == 3
        assert completion.text == TEXT.decode(solo_greedy(prompt, 3))
        assert completion.stop_reason == stop[0]
