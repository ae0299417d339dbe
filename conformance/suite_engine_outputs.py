"""Engine conformance tests of a request's outputs (specs/engine.md ENG-142, ENG-132), on the
hash model with a tokenizer whose text is the token ids. Subclass :class:`EngineOutputSuite` to run
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
    """What each ``CompletionOutput`` of a request holds; prompt log-probabilities whole or
    not at all."""

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

    @pytest.mark.spec("ENG-132", "ENG-012")
    def test_a_request_aborted_mid_prefill_reports_no_prompt_logprobs(
        self, backend: Backend
    ) -> None:
        """Prefilled in chunks of 4, aborted after two of its three chunks: its final output
        has no prompt log-probabilities rather than a list with holes; run whole, the same
        request reports one entry per prompt position."""
        prompt = PROMPT[:10] + [1]
        params = SamplingParams(max_tokens=2, prompt_logprobs=1)
        eut = build_engine(backend, max_num_batched_tokens=4)
        request_id = eut.engine.add_request(prompt, params)
        for _ in range(2):
            assert not [o for o in eut.engine.step() if o.token_ids], "sampled mid-prefill"
        out = eut.engine.abort(request_id)
        assert out is not None
        assert out.prompt_logprobs is None, "prompt log-probabilities of a partial prompt"
        assert out.token_ids == ()
        (whole,) = build_engine(backend, max_num_batched_tokens=4).run([prompt], params)
        assert whole.prompt_logprobs is not None
        assert len(whole.prompt_logprobs) == len(prompt)
