"""Engine conformance tests of parallel sampling (specs/engine.md ENG-047), on the hash model.

A request with ``n`` or ``best_of`` above 1 computes its prompt once and forks its sequence
(KVM-037). The hash stand-in reads every context back through the plan's page tables, so a fork
whose partial page was not copied, or that reads another sequence's page, changes its tokens.
Each sequence ``i`` must produce what the same prompt produces alone with ``n=1`` and seed
``seed + i``. Subclass :class:`EngineParallelSuite` to run these against an engine of yours.
"""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.engine.outputs import FinishReason
from pagedkv.engine.params import InvalidSamplingParams, SamplingParams
from pagedkv.interfaces import Backend, EngineBackend
from pagedkv.testing.faults import PoisonedRunner

from .engine_harness import VOCAB, build_engine, solo_greedy

#: 10 tokens: two full pages of 4 and a partial one.
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
SAMPLED = SamplingParams(max_tokens=9, temperature=1.3, seed=77, ignore_eos=True)


def solo_runs(
    backend: Backend, params: SamplingParams, count: int, prompt: list[int] = PROMPT
) -> list[list[int]]:
    """The tokens of ``prompt`` run alone with ``n=1`` and seeds ``seed + i``."""
    assert params.seed is not None
    eut = build_engine(backend)
    single = dataclasses.replace(params, n=1, best_of=None)
    outs = eut.run(
        [prompt] * count,
        [dataclasses.replace(single, seed=params.seed + i) for i in range(count)],
    )
    return [list(o.token_ids) for o in outs]


@pytest.mark.requires("engine")
class EngineParallelSuite:
    """``n`` and ``best_of``: one prompt computation, forks on shared pages."""

    @pytest.mark.spec("ENG-047")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_each_sample_equals_its_solo_run(self, backend: Backend, mode: str) -> None:
        """``n=4``: four completions, each the solo run of seed ``seed + i``, in v1 and v0;
        v1 feeds the prompt to the model once."""
        eut = build_engine(backend, mode=mode)
        (out,) = eut.run([PROMPT], dataclasses.replace(SAMPLED, n=4))
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert [c.token_ids for c in out.outputs] == solo_runs(backend, SAMPLED, 4)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "the samples should differ"
        if mode == "v1":
            assert eut.runner.tokens_per_step[:2] == [len(PROMPT), 4]
        assert eut.engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-047")
    @pytest.mark.parametrize("caching", [True, False])
    def test_samples_share_the_prompt_pages(self, backend: Backend, caching: bool) -> None:
        """Prefill computes the prompt once, and the peak pages are those of one prompt plus
        one page per fork for the partial page. Four independent requests compute the prompt
        four times without prefix caching (and take four prompts' pages); with it they wait
        for the first one's pages and still compute each one's partial page."""
        forked = build_engine(backend, enable_prefix_caching=caching)
        params = dataclasses.replace(SAMPLED, max_tokens=2)
        forked.run([PROMPT], dataclasses.replace(params, n=4))
        apart = build_engine(backend, enable_prefix_caching=caching)
        apart.run([PROMPT] * 4, params)
        stats, alone = forked.engine.stats(), apart.engine.stats()
        assert stats.prefill_tokens_computed == len(PROMPT)
        assert stats.peak_pages_in_use == 2 + 4  # 2 shared full pages, 4 partial pages
        if caching:  # the others wait for the first's prompt pages, then hit them
            assert alone.prefill_tokens_computed == len(PROMPT) + 3 * 2
        else:
            assert alone.prefill_tokens_computed == 4 * len(PROMPT)
            assert alone.peak_pages_in_use == 4 * 3

    @pytest.mark.spec("ENG-047")
    def test_greedy_samples_are_the_greedy_run(self, backend: Backend) -> None:
        (out,) = build_engine(backend).run(
            [PROMPT], SamplingParams(max_tokens=6, temperature=0, n=3)
        )
        assert [list(c.token_ids) for c in out.outputs] == [solo_greedy(PROMPT, 6)] * 3

    @pytest.mark.spec("ENG-047")
    def test_best_of_returns_the_most_likely(self, backend: Backend) -> None:
        """``best_of=4, n=2``: the two of the four solo runs of highest cumulative
        log-probability, best first, and no output before all four finish."""
        params = dataclasses.replace(SAMPLED, n=2, best_of=4, logprobs=0)
        eut = build_engine(backend)
        request_id = eut.engine.add_request(PROMPT, params)
        outputs = []
        while eut.engine.has_unfinished_requests():
            outputs += [o for o in eut.engine.step() if o.request_id == request_id]
        (final,) = outputs
        assert final.finished
        runs = solo_runs(backend, params, 4)
        best = sorted(final.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))
        assert list(final.outputs) == best
        assert [c.index for c in final.outputs] == [0, 1]
        assert all(c.token_ids in runs for c in final.outputs)
        totals = [
            sum(e.logprob for e in c.logprobs or ()) for c in final.outputs
        ]  # the chosen tokens' log-probabilities add up to the cumulative one
        assert totals == pytest.approx([c.cumulative_logprob for c in final.outputs])
        assert final.metrics.generated_tokens == 4 * params.token_limit

    @pytest.mark.spec("ENG-047", "ENG-032")
    @pytest.mark.parametrize("num_pages", [5, 7])
    def test_samples_survive_preemption_and_a_full_pool(
        self, backend: Backend, num_pages: int
    ) -> None:
        """With a pool too small for four samples at once (5 pages: the third fork finds no
        page and goes back to the queue; 7: forks are preempted as they grow), samples are
        recomputed: every completion is still its solo run."""
        eut = build_engine(backend, num_pages=num_pages, max_num_batched_tokens=16)
        params = dataclasses.replace(SAMPLED, n=4, max_tokens=8)
        (out,) = eut.run([PROMPT], params)
        assert [c.token_ids for c in out.outputs] == solo_runs(backend, params, 4)
        assert eut.engine.stats().preemptions > 0
        assert eut.engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-047", "ENG-012")
    @pytest.mark.parametrize("steps", [0, 1, 3])
    def test_abort_ends_every_sample(self, backend: Backend, steps: int) -> None:
        """Aborted before the prompt ran, right after the fork, or mid-way: every completion
        ends with reason abort and no page stays in use."""
        eut = build_engine(backend)
        request_id = eut.engine.add_request(PROMPT, dataclasses.replace(SAMPLED, n=3))
        for _ in range(steps):
            eut.engine.step()
        final = eut.engine.abort(request_id)
        assert final is not None
        assert final.finished
        assert [str(c.finish_reason) for c in final.outputs] == ["abort"] * 3
        assert not eut.engine.has_unfinished_requests()
        assert eut.engine.stats().pages_in_use == 0
        eut.engine.check_invariants()

    @pytest.mark.spec("ENG-047", "ENG-045")
    def test_more_samples_than_sequences_raise(self, backend: Backend) -> None:
        eut = build_engine(backend, max_num_seqs=4)
        with pytest.raises(InvalidSamplingParams):
            eut.engine.add_request(PROMPT, dataclasses.replace(SAMPLED, n=2, best_of=5))
        with pytest.raises(InvalidSamplingParams):
            SamplingParams(n=3, best_of=2)
        assert not eut.engine.has_unfinished_requests()

    @pytest.mark.spec("ENG-047", "ENG-070")
    @pytest.mark.parametrize("fails_at", ["first token", "fork"])
    def test_a_failed_sample_fails_its_request_alone(self, backend: Backend, fails_at: str) -> None:
        """One sample of an ``n=3`` request hits NaN logits, at its first token (before the
        fork: every sample shares that row) or, as the third fork, in the step after: the
        whole request ends with reason ``error``, the request beside it gets its solo
        tokens, and no page stays in use."""
        assert isinstance(backend, EngineBackend)
        eut = build_engine(backend)
        params = dataclasses.replace(SAMPLED, n=3, max_tokens=6)
        poison: tuple[int, ...]
        if fails_at == "first token":
            prompt, poison, at = [100, 99, 98, 5, 6], (100, 99, 98), 0
        else:
            prompt = [5, 6, 7, 8]
            firsts = [run[0] for run in solo_runs(backend, params, 3, prompt)]
            assert firsts[2] not in firsts[:2], "pick a seed whose third sample starts apart"
            poison, at = (firsts[2],), len(prompt)
        runner = PoisonedRunner(
            VOCAB,
            eut.config.num_pages,
            eut.config.page_size,
            poison=poison,
            poison_at=at,
            kind="nan",
        )
        engine = backend.create_engine(runner, eut.config)
        bad = engine.add_request(prompt, params)
        good = engine.add_request([7, 8, 9], SamplingParams(max_tokens=6, temperature=0))
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            engine.check_invariants()
        failed = finals[bad]
        assert failed.error
        assert {c.finish_reason for c in failed.outputs} == {FinishReason.ERROR}
        assert list(finals[good].token_ids) == solo_greedy([7, 8, 9], 6)
        assert engine.stats().pages_in_use == 0
