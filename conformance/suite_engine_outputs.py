"""Engine conformance tests of a request's completions (specs/engine.md ENG-142), on the hash
model with a tokenizer whose text is the token ids. Subclass :class:`EngineOutputSuite` to run
these against an engine of yours.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend
from pagedkv.testing.faults import IdTokenizer

from .engine_harness import build_engine

PROMPT = [5, 17, 29, 3, 41, 8, 13, 2, 77]


@pytest.mark.requires("engine")
class EngineOutputSuite:
    """What each ``CompletionOutput`` of a request holds."""

    @pytest.mark.spec("ENG-142")
    def test_completions_of_several_sequences(self, backend: Backend) -> None:
        """Each of ``n=3`` completions has its index, its own tokens and the text decoded from
        them, ``logprobs`` ``None`` when none were asked for, and ``finished()`` false before
        its end and true after; with ``logprobs=1`` each generated position has its entry."""
        eut = build_engine(backend, tokenizer=IdTokenizer())
        engine = eut.engine
        rid = engine.add_request(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3))
        outputs: list[RequestOutput] = []
        while engine.has_unfinished_requests():
            outputs.extend(o for o in engine.step() if o.request_id == rid)
        assert not any(c.finished() for c in outputs[0].outputs)
        final = outputs[-1]
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert len({c.token_ids for c in final.outputs}) == 3
        for completion in final.outputs:
            assert completion.finished()
            assert completion.logprobs is None, "logprobs reported though none were asked for"
            assert completion.text == IdTokenizer().decode(completion.token_ids)
        (asked,) = eut.run([PROMPT], SamplingParams(max_tokens=2, logprobs=1))
        (completion,) = asked.outputs
        assert completion.logprobs is not None
        assert len(completion.logprobs) == 2
