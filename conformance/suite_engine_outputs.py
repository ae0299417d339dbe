"""Engine conformance tests of a request's outputs (specs/engine.md ENG-142, ENG-049, ENG-132),
on the hash model (with a tokenizer whose text is the token ids where text matters). Subclass
:class:`EngineOutputSuite` to run these against an engine of yours.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend
from pagedkv.plan import SeqChunk
from pagedkv.plan_builders import build_recompute_plan
from pagedkv.testing.faults import IdTokenizer
from pagedkv.testing.hash_runner import HashRunner

from .engine_harness import build_engine

PROMPT = [5, 17, 29, 3, 41, 8, 13, 2, 77]
#: A small vocabulary, so the most likely tokens of a prompt position are few and distinct.
SMALL_VOCAB = 29
LOGPROB_PROMPT = [4, 8, 15, 16, 23, 4, 2, 11, 7, 19, 3]


def hash_log_probs(context: list[int]) -> torch.Tensor:
    """The hash model's log-probabilities of the token after ``context``, computed here."""
    plan = build_recompute_plan([SeqChunk(tuple(context), 0)])
    return torch.log_softmax(HashRunner(SMALL_VOCAB).execute(plan)[0], dim=0)


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
        assert len({tuple(c.token_ids) for c in final.outputs}) == 3
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
        assert out.token_ids == []
        (whole,) = build_engine(backend, max_num_batched_tokens=4).run([prompt], params)
        assert whole.prompt_logprobs is not None
        assert len(whole.prompt_logprobs) == len(prompt)

    @pytest.mark.spec("ENG-049")
    @pytest.mark.parametrize("budget", [256, 4, 3])
    def test_each_prompt_token_gets_its_log_probability(
        self, backend: Backend, budget: int
    ) -> None:
        """Whole, in chunks of 4, or of 3 (the last chunk then starts one before the last
        position): position 0 has none; every later one the token's log-probability after
        the tokens before it, its rank and the 2 most likely tokens, against the hash model's
        distribution computed here."""
        eut = build_engine(backend, vocab=SMALL_VOCAB, max_num_batched_tokens=budget)
        params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
        (out,) = eut.run([LOGPROB_PROMPT], params)
        entries = out.prompt_logprobs
        assert entries is not None
        assert len(entries) == len(LOGPROB_PROMPT)
        assert entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            assert entry is not None, f"position {position} has no entry"
            token = LOGPROB_PROMPT[position]
            want = hash_log_probs(LOGPROB_PROMPT[:position])
            assert entry.token_id == token, f"position {position} reports another token"
            assert entry.logprob == pytest.approx(float(want[token]), abs=1e-5)
            assert entry.rank == int((want > want[token]).sum()) + 1
            top = torch.topk(want, 2)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
