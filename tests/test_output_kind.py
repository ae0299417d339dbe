"""ENG-157: ``SamplingParams.output_kind`` says when ``step()`` returns a request's outputs.

``final_only`` returns one output, at the end, equal to the last ``every_step`` output but for
its deltas (the whole completion); ``run_to_completion`` runs every request that way. Over the
hash model stand-in, in well under a second.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import InvalidSamplingParams, OutputKind, SamplingParams
from pagedkv.testing.faults import IdTokenizer
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 101
CONFIG = EngineConfig(page_size=4, num_pages=64, max_num_batched_tokens=256, max_num_seqs=8)
PROMPTS = ([5, 17, 29, 3, 41, 8, 13, 2, 77], [9, 4, 60, 21], [33, 2, 18, 90, 7, 7])
#: Several sequences, log-probabilities and sampling: everything an output carries.
PARAMS = SamplingParams(max_tokens=7, temperature=0.8, seed=11, logprobs=2, n=2)


def make_engine() -> LLMEngine:
    runner = HashRunner(VOCAB, CONFIG.num_pages, CONFIG.page_size)
    return reference_backend().create_engine(runner, CONFIG, tokenizer=IdTokenizer())


def every_output(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Each request's outputs, step by step, until nothing is left."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    seen: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return {f"r{i}": seen[rid] for i, rid in enumerate(ids)}
        for output in engine.step():
            seen[output.request_id].append(output)
    raise AssertionError("the engine is still busy")


def without_deltas(output: RequestOutput) -> RequestOutput:
    """``output`` less what differs by kind: its deltas (and its id, engine-given)."""
    plain = [replace(c, new_token_ids=(), new_text="") for c in output.outputs]
    return replace(output, request_id="", outputs=tuple(plain))


@pytest.mark.spec("ENG-157")
def test_final_only_returns_one_output_equal_to_the_last_of_every_step() -> None:
    kinds = [OutputKind.FINAL_ONLY, OutputKind.EVERY_STEP, OutputKind.FINAL_ONLY]
    mixed = every_output(make_engine(), [replace(PARAMS, output_kind=k) for k in kinds])
    alike = every_output(make_engine(), [PARAMS] * len(PROMPTS))
    for name, kind in zip(mixed, kinds, strict=True):
        stepwise = alike[name]
        assert len(stepwise) > 1
        if kind is OutputKind.EVERY_STEP:
            assert len(mixed[name]) == len(stepwise)
            continue
        (final,) = mixed[name]
        assert final.finished
        assert without_deltas(final) == replace(without_deltas(stepwise[-1]), metrics=final.metrics)
        assert final.metrics.generated_tokens == stepwise[-1].metrics.generated_tokens
        for completion in final.outputs:
            assert completion.finish_reason is FinishReason.LENGTH
            assert completion.new_token_ids == completion.token_ids
            assert completion.new_text == completion.text != ""


@pytest.mark.spec("ENG-157")
def test_an_aborted_final_only_request_returns_its_output_from_abort() -> None:
    engine = make_engine()
    final_only = replace(PARAMS, max_tokens=50, output_kind=OutputKind.FINAL_ONLY)
    rid = engine.add_request(PROMPTS[0], final_only)
    for _ in range(3):
        assert engine.step() == []
    output = engine.abort(rid)
    assert output is not None
    assert output.finished
    assert [c.finish_reason for c in output.outputs] == [FinishReason.ABORT] * 2
    assert all(len(c.new_token_ids) == len(c.token_ids) > 0 for c in output.outputs)
    assert engine.stats().pages_in_use == 0


@pytest.mark.spec("ENG-157", "ENG-014")
def test_run_to_completion_runs_every_request_final_only() -> None:
    engine = make_engine()
    returned: list[RequestOutput] = []
    step = engine.step

    def watched() -> list[RequestOutput]:
        outputs = step()
        returned.extend(outputs)
        return outputs

    engine.step = watched  # type: ignore[method-assign]
    prompts = [tuple(p) for p in PROMPTS]
    finals = run_to_completion(engine, prompts, PARAMS)
    assert [o.finished for o in returned] == [True] * len(PROMPTS)
    stepwise = every_output(make_engine(), [PARAMS] * len(PROMPTS))
    for final, outputs in zip(finals, stepwise.values(), strict=True):
        last = outputs[-1]
        assert [c.token_ids for c in final.outputs] == [c.token_ids for c in last.outputs]
        assert [c.text for c in final.outputs] == [c.text for c in last.outputs]


@pytest.mark.spec("ENG-157")
def test_output_kind_takes_a_kind_or_its_name_and_refuses_others() -> None:
    assert SamplingParams(output_kind="final_only").output_kind is OutputKind.FINAL_ONLY  # type: ignore[arg-type]
    assert SamplingParams().output_kind is OutputKind.EVERY_STEP
    with pytest.raises(InvalidSamplingParams, match="output_kind"):
        SamplingParams(output_kind="sometimes")  # type: ignore[arg-type]
