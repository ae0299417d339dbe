"""Engine conformance tests (specs/engine.md), run on the hash model stand-in.

Subclass :class:`EngineSuite` in your own test module to run these against an engine of yours,
or run the whole suite with ``--backend module:factory``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import pytest

from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import InvalidSamplingParams, SamplingParams
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Backend
from pagedkv.testing.hash_runner import hash_logits, next_token

from .engine_harness import (
    VOCAB,
    build_engine,
    greedy,
    prompts_with_shared_prefix,
    solo_greedy,
)
from .sampling_reference import filtered_distribution

#: Tokens each request of the sampling test draws (four requests).
SAMPLES = 80


def filtered_top(vocab: int) -> float:
    """The hash model's probability of its own next token (logits fall by 0.5 per step)."""
    return 1.0 / sum(math.exp(-0.5 * d) for d in range(vocab))


@pytest.mark.requires("engine")
class EngineSuite:
    """Every engine requirement that can be checked without a real model."""

    # -- outputs are those of the plain path ----------------------------------------------

    @pytest.mark.spec("ENG-001")
    def test_v1_feeds_only_uncached_positions(self, backend: Backend) -> None:
        """One prompt of 13 tokens, 6 generated: the model sees 13 positions, then 1 a step."""
        eut = build_engine(backend)
        prompt = list(range(13))
        (out,) = eut.run([prompt], greedy(max_tokens=6))
        assert list(out.token_ids) == solo_greedy(prompt, 6)
        assert eut.runner.tokens_per_step == [13, 1, 1, 1, 1, 1]

    @pytest.mark.spec("ENG-001", "ENG-003")
    def test_v0_recomputes_everything(self, backend: Backend) -> None:
        """v0 feeds the whole sequence every step and yields the same tokens as v1."""
        eut = build_engine(backend, mode="v0")
        prompt = list(range(13))
        (out,) = eut.run([prompt], greedy(max_tokens=6))
        assert list(out.token_ids) == solo_greedy(prompt, 6)
        assert eut.runner.tokens_per_step == [13, 14, 15, 16, 17, 18]

    @pytest.mark.spec("ENG-002", "ENG-003")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    @pytest.mark.parametrize("page_size", [1, 4, 5, 16])
    def test_batch_equals_solo(self, backend: Backend, mode: str, page_size: int) -> None:
        """Greedy outputs of a ragged batch equal each request's solo run, in v0 and v1."""
        prompts = prompts_with_shared_prefix(7, prefix_len=11, seed=page_size)
        prompts.append(list(range(2 * page_size)))  # a length that is a multiple of the page
        eut = build_engine(backend, page_size=page_size, num_pages=512, mode=mode)
        outs = eut.run(prompts, greedy(max_tokens=9))
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.token_ids) == solo_greedy(prompt, 9)

    # -- requests ------------------------------------------------------------------------

    @pytest.mark.spec("ENG-010")
    def test_invalid_prompts_raise_and_queue_nothing(self, backend: Backend) -> None:
        eut = build_engine(backend)
        engine = eut.engine
        with pytest.raises(InvalidRequest):
            engine.add_request([], greedy())
        with pytest.raises(InvalidRequest):
            engine.add_request([1, VOCAB], greedy())
        with pytest.raises(InvalidRequest):
            engine.add_request([1, -1], greedy())
        with pytest.raises(InvalidRequest):
            engine.add_request("text needs a tokenizer", greedy())
        assert not engine.has_unfinished_requests()
        rid = engine.add_request([1, 2, 3], greedy(), request_id="same")
        with pytest.raises(InvalidRequest):
            engine.add_request([4, 5], greedy(), request_id="same")
        assert rid == "same"
        (out,) = eut.finish([rid])
        assert list(out.token_ids) == solo_greedy([1, 2, 3], 12)

    @pytest.mark.spec("ENG-011")
    def test_budgets_are_respected_and_steps_mix(self, backend: Backend) -> None:
        """No step exceeds the token or sequence budget; some step mixes decode and prefill."""
        eut = build_engine(backend, max_num_batched_tokens=16, max_num_seqs=3, num_pages=256)
        prompts = prompts_with_shared_prefix(6, prefix_len=9, seed=3, max_suffix=20)
        outs = eut.run(prompts, greedy(max_tokens=5))
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.token_ids) == solo_greedy(prompt, 5)
        assert all(sum(step) <= 16 for step in eut.runner.steps)
        assert all(len(step) <= 3 for step in eut.runner.steps)
        mixed = [s for s in eut.runner.steps if 1 in s and any(n > 1 for n in s)]
        assert mixed, f"no step mixed decode and prefill: {eut.runner.steps}"

    @pytest.mark.spec("ENG-011", "ENG-022", "ENG-050")
    def test_v0_respects_the_budgets_and_caches_nothing(self, backend: Backend) -> None:
        """v0 recomputes whole sequences under the budgets: a 20-token budget admits two
        10-token prompts (exactly filling it) but not a third; running sequences grow past it
        and still admit nobody; the third runs alone after them. Nothing is cached, and the
        pool counters are all zero."""
        eut = build_engine(backend, mode="v0", max_num_batched_tokens=20, max_num_seqs=3)
        prompts = [list(range(10)), list(range(20, 30)), [7, 7, 7, 7, 7]]
        outs = eut.run(prompts, greedy(max_tokens=2))
        assert eut.runner.steps == [[10, 10], [11, 11], [5], [6]]
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.token_ids) == solo_greedy(prompt, 2)
            assert out.metrics.cached_tokens == 0
        stats = eut.engine.stats()
        assert (stats.num_pages, stats.pages_in_use, stats.pages_free, stats.pages_cached) == (
            0,
            0,
            0,
            0,
        )
        assert (stats.query_tokens, stats.hit_tokens, stats.hit_rate) == (0, 0, 0.0)

    @pytest.mark.spec("ENG-011")
    def test_a_budget_of_two_serves_two_decoders_every_step(self, backend: Backend) -> None:
        """With a 2-token budget and two decoding requests, every step carries both."""
        eut = build_engine(backend, max_num_batched_tokens=2, max_num_seqs=2)
        outs = eut.run([[1], [2]], greedy(max_tokens=3))
        assert eut.runner.steps == [[1, 1]] * 3
        assert [list(o.token_ids) for o in outs] == [solo_greedy([1], 3), solo_greedy([2], 3)]

    @pytest.mark.spec("ENG-026", "ENG-031")
    def test_a_prompt_extending_a_running_prefill_waits_for_it(self, backend: Backend) -> None:
        """A waiting prompt that extends the prompt a running request is still prefilling in
        chunks is admitted once those pages are committed, and reuses them."""
        eut = build_engine(backend, max_num_batched_tokens=4)
        short = list(range(60, 70))
        longer = short + list(range(80, 90))
        outs = eut.run([short, longer], greedy(max_tokens=2))
        assert outs[1].metrics.cached_tokens == 8
        assert list(outs[0].token_ids) == solo_greedy(short, 2)
        assert list(outs[1].token_ids) == solo_greedy(longer, 2)

    @pytest.mark.spec("ENG-012", "ENG-015")
    def test_abort_frees_every_page(self, backend: Backend) -> None:
        eut = build_engine(backend)
        engine = eut.engine
        ids = [engine.add_request(p, greedy(max_tokens=50)) for p in [[1] * 30, [2] * 9]]
        engine.step()
        engine.step()
        assert engine.stats().pages_in_use > 0
        first = engine.abort(ids[0])
        assert first is not None
        assert first.finished
        assert first.finish_reason is FinishReason.ABORT
        assert first.new_token_ids == []
        engine.check_invariants()
        engine.abort(ids[1])
        assert engine.stats().pages_in_use == 0
        assert not engine.has_unfinished_requests()
        assert engine.abort(ids[1]) is None  # already gone
        waiting = engine.add_request([3] * 5, greedy())
        aborted = engine.abort(waiting)  # never scheduled: still leaves nothing behind
        assert aborted is not None
        assert aborted.finish_reason is FinishReason.ABORT
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-013")
    def test_stream_yields_tokens_in_order(self, backend: Backend) -> None:
        eut = build_engine(backend)
        other = eut.engine.add_request([7, 7, 7], greedy(max_tokens=30))
        prompt = [5, 4, 3, 2, 1]
        streamed: list[int] = []
        outputs = list(eut.engine.stream(prompt, greedy(max_tokens=8)))
        for output in outputs:
            streamed.extend(output.new_token_ids)
        assert streamed == solo_greedy(prompt, 8)
        assert [o.finished for o in outputs] == [False] * 7 + [True]
        assert list(outputs[-1].token_ids) == streamed
        eut.engine.abort(other)

    @pytest.mark.spec("ENG-013", "ENG-015")
    def test_closing_a_stream_aborts_it(self, backend: Backend) -> None:
        eut = build_engine(backend)
        stream = eut.engine.stream([1, 2, 3, 4, 5, 6], greedy(max_tokens=40))
        next(stream)
        next(stream)
        stream.close()
        assert not eut.engine.has_unfinished_requests()
        assert eut.engine.stats().pages_in_use == 0

    # -- prefix caching ------------------------------------------------------------------

    @pytest.mark.spec("ENG-020", "ENG-022")
    def test_shared_three_page_prefix_computes_only_the_suffix(self, backend: Backend) -> None:
        eut = build_engine(backend, page_size=4)
        prefix = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]  # 3 full pages
        first, second = prefix + [40, 41], prefix + [50, 51, 52]
        (a,) = eut.run([first], greedy(max_tokens=4))
        fed_before = len(eut.runner.steps)
        (b,) = eut.run([second], greedy(max_tokens=4))
        assert list(b.token_ids) == solo_greedy(second, 4)
        assert a.metrics.cached_tokens == 0
        assert b.metrics.cached_tokens == 12
        assert eut.runner.steps[fed_before] == [3]  # only the suffix was fed
        stats = eut.engine.stats()
        assert stats.hit_tokens == 12
        assert stats.query_tokens == len(first) + len(second)
        assert math.isclose(stats.hit_rate, 12 / (len(first) + len(second)))

    @pytest.mark.spec("ENG-021")
    def test_cached_pages_survive_until_evicted(self, backend: Backend) -> None:
        eut = build_engine(backend, page_size=4, num_pages=8)
        prompt = list(range(13))
        eut.run([prompt], greedy(max_tokens=2))
        assert eut.engine.stats().pages_cached > 0
        (again,) = eut.run([prompt + [1]], greedy(max_tokens=2))
        assert again.metrics.cached_tokens == 12
        eut.run([[99] * 25], greedy(max_tokens=6))  # needs every page: evicts the cache
        (after,) = eut.run([prompt + [1]], greedy(max_tokens=2))
        assert after.metrics.cached_tokens == 0
        assert list(after.token_ids) == solo_greedy(prompt + [1], 2)

    @pytest.mark.spec("ENG-023")
    def test_cache_salt_isolates(self, backend: Backend) -> None:
        eut = build_engine(backend)
        prompt = list(range(20))
        eut.run([prompt], greedy(max_tokens=2), cache_salt="tenant-a")
        (other,) = eut.run([prompt], greedy(max_tokens=2), cache_salt="tenant-b")
        (same,) = eut.run([prompt], greedy(max_tokens=2), cache_salt="tenant-a")
        assert other.metrics.cached_tokens == 0
        assert same.metrics.cached_tokens == 16

    @pytest.mark.spec("ENG-023", "ENG-013")
    def test_a_stream_keeps_its_cache_salt(self, backend: Backend) -> None:
        """A streamed request hits the pages of its own salt, and only those."""
        eut = build_engine(backend)
        prompt = list(range(30, 50))
        eut.run([prompt], greedy(max_tokens=2), cache_salt="tenant-a")
        same = list(eut.engine.stream(prompt, greedy(max_tokens=2), cache_salt="tenant-a"))
        other = list(eut.engine.stream(prompt, greedy(max_tokens=2), cache_salt="tenant-b"))
        assert same[-1].metrics.cached_tokens == 16
        assert other[-1].metrics.cached_tokens == 0

    @pytest.mark.spec("ENG-024")
    def test_prefix_caching_off_changes_only_the_work(self, backend: Backend) -> None:
        prompts = prompts_with_shared_prefix(6, prefix_len=21, seed=5)
        results = {}
        for enabled in (True, False):
            eut = build_engine(backend, enable_prefix_caching=enabled, max_num_seqs=1)
            outs = eut.run(prompts, greedy(max_tokens=6))
            results[enabled] = ([list(o.token_ids) for o in outs], eut.engine.stats())
        (on_tokens, on), (off_tokens, off) = results[True], results[False]
        assert on_tokens == off_tokens
        assert off.hit_tokens == 0
        assert on.hit_tokens == 5 * 20  # five later prompts each reuse 5 pages of 4
        assert off.prefill_tokens_computed - on.prefill_tokens_computed == on.hit_tokens

    @pytest.mark.spec("ENG-025", "ENG-026")
    @pytest.mark.parametrize("budget", [256, 8])
    def test_a_burst_prefills_its_common_prefix_once(self, backend: Backend, budget: int) -> None:
        """Two requests sharing 16 tokens arrive together: the second waits until the first's
        pages are written and committed, then reuses them, also when the first prefills in
        chunks. (The hash model fails any read of a slot nothing was written to.)"""
        eut = build_engine(backend, max_num_batched_tokens=budget)
        prompt = list(range(17))
        outs = eut.run([prompt + [1], prompt + [2]], greedy(max_tokens=3))
        assert [o.metrics.cached_tokens for o in outs] == [0, 16]
        for suffix, out in zip((1, 2), outs, strict=True):
            assert list(out.token_ids) == solo_greedy(prompt + [suffix], 3)
        stats = eut.engine.stats()
        assert stats.prefill_tokens_computed == 18 + 2  # the prefix once, then the suffix
        if budget == 256:
            assert eut.runner.steps[:2] == [[18], [1, 2]]

    # -- scheduling ----------------------------------------------------------------------

    @pytest.mark.spec("ENG-030")
    def test_first_come_first_served(self, backend: Backend) -> None:
        eut = build_engine(backend, max_num_seqs=1)
        ids = [eut.engine.add_request([i + 1] * 3, greedy(max_tokens=3)) for i in range(4)]
        order: list[str] = []
        while eut.engine.has_unfinished_requests():
            order.extend(o.request_id for o in eut.engine.step() if o.finished)
        assert order == ids

    @pytest.mark.spec("ENG-030", "ENG-032")
    def test_a_preempted_request_keeps_its_place_in_line(self, backend: Backend) -> None:
        """A and B run, C arrives and waits for a seat; B is then preempted. B arrived before
        C, so B resumes before C starts, although C alone would fit first."""
        eut = build_engine(backend, page_size=4, num_pages=8, max_num_seqs=2)
        engine = eut.engine
        prompts = [list(range(12)), list(range(20, 28)), [50, 51, 52]]
        a = engine.add_request(prompts[0], greedy(max_tokens=12))
        b = engine.add_request(prompts[1], greedy(max_tokens=12))
        engine.step()
        c = engine.add_request(prompts[2], greedy(max_tokens=2))
        steps: dict[str, list[int]] = {a: [], b: [], c: []}
        final: dict[str, RequestOutput] = {}
        preempted_at: int | None = None
        for step in itertools.count(1):
            if not engine.has_unfinished_requests():
                break
            assert step < 1000, "the engine never finished"
            for output in engine.step():
                steps[output.request_id].append(step)
                if output.finished:
                    final[output.request_id] = output
            if preempted_at is None and engine.stats().preemptions:
                preempted_at = step
        assert preempted_at is not None, "nothing was preempted: the case proves nothing"
        assert final[b].metrics.preemptions == 1
        resumed = min(s for s in steps[b] if s > preempted_at)
        assert resumed <= min(steps[c]), (
            f"C (arrived after B) started at step {min(steps[c])}, before B resumed at {resumed}"
        )
        for rid, prompt, n in zip((a, b, c), prompts, (12, 12, 2), strict=True):
            assert list(final[rid].token_ids) == solo_greedy(prompt, n)

    @pytest.mark.spec("ENG-012", "ENG-032")
    def test_aborting_a_preempted_request_ends_it(self, backend: Backend) -> None:
        """A request aborted while it waits to be recomputed is gone: it never runs again,
        and the others finish as they would alone."""
        eut = build_engine(backend, page_size=4, num_pages=8, max_num_seqs=2)
        engine = eut.engine
        a = engine.add_request(list(range(12)), greedy(max_tokens=12))
        b = engine.add_request(list(range(20, 28)), greedy(max_tokens=12))
        for _ in range(100):
            engine.step()
            if engine.stats().preemptions:
                break
        aborted = engine.abort(b)
        assert aborted is not None
        assert aborted.finish_reason is FinishReason.ABORT
        assert engine.stats().waiting == 0, "the aborted request is still queued"
        later: list[RequestOutput] = []
        while engine.has_unfinished_requests():
            later.extend(engine.step())
        assert {o.request_id for o in later} == {a}
        assert list(later[-1].token_ids) == solo_greedy(list(range(12)), 12)
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-031")
    def test_chunked_prefill(self, backend: Backend) -> None:
        eut = build_engine(backend, max_num_batched_tokens=5)
        prompt = list(range(23))
        (out,) = eut.run([prompt], greedy(max_tokens=3))
        assert list(out.token_ids) == solo_greedy(prompt, 3)
        assert eut.runner.tokens_per_step == [5, 5, 5, 5, 3, 1, 1]

    @pytest.mark.spec("ENG-032", "ENG-015")
    def test_preemption_keeps_outputs(self, backend: Backend) -> None:
        prompts = prompts_with_shared_prefix(6, prefix_len=6, seed=11)
        eut = build_engine(backend, page_size=4, num_pages=14, max_num_seqs=6)
        outs = eut.run(prompts, greedy(max_tokens=20))
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.token_ids) == solo_greedy(prompt, 20)
        assert eut.engine.stats().preemptions > 0
        assert outs[0].metrics.preemptions == 0  # the oldest request is never the victim
        assert any(o.metrics.preemptions for o in outs[1:])
        assert eut.engine.stats().preemptions == sum(o.metrics.preemptions for o in outs)
        assert eut.engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-033")
    def test_requests_that_can_never_fit_are_refused(self, backend: Backend) -> None:
        eut = build_engine(backend, page_size=4, num_pages=8, max_model_len=64)
        with pytest.raises(InvalidRequest):  # 8 pages hold 32 positions
            eut.engine.add_request(list(range(30)), greedy(max_tokens=5))
        long = build_engine(backend, num_pages=512, max_model_len=20)
        with pytest.raises(InvalidRequest):
            long.engine.add_request(list(range(16)), greedy(max_tokens=5))
        assert not eut.engine.has_unfinished_requests()
        (fits,) = eut.run([list(range(27))], greedy(max_tokens=5))  # exactly 32 positions
        assert len(fits.token_ids) == 5

    # -- sampling ------------------------------------------------------------------------

    @pytest.mark.spec("ENG-040")
    @pytest.mark.parametrize(
        "params",
        [
            SamplingParams(max_tokens=SAMPLES, temperature=1.0, top_k=3),
            SamplingParams(max_tokens=SAMPLES, temperature=2.0, top_p=0.6),
            SamplingParams(max_tokens=SAMPLES, temperature=1.0, min_p=0.5),
            SamplingParams(max_tokens=SAMPLES, temperature=1.0, top_k=1),
            SamplingParams(max_tokens=SAMPLES, temperature=0.7),
        ],
        ids=["top_k=3", "top_p=0.6", "min_p=0.5", "top_k=1", "no-filter"],
    )
    def test_sampling_draws_exactly_what_the_filters_keep(
        self, backend: Backend, params: SamplingParams
    ) -> None:
        """The hash model's logits fall by 0.5 per step of distance from its next token, so
        every step draws from the same distribution over distances. Checked against the
        filters written from their definitions (``sampling_reference``): never a token they
        drop (a filter keeping too many fails), every token they keep with probability 3 % or
        more drawn at least once (a filter keeping too few fails), and the frequencies within
        0.1 of theirs in total variation."""
        want = filtered_distribution(hash_logits(0, VOCAB).tolist(), params)
        eut = build_engine(backend)
        prompts = [[3, 1, 4, 1, 5], [2, 7], [9, 9, 9, 9], [6]]
        per_request = [dataclasses.replace(params, seed=seed) for seed in range(len(prompts))]
        counts = Counter[int]()
        for prompt, out in zip(prompts, eut.run(prompts, per_request), strict=True):
            context = list(prompt)
            for token in out.token_ids:
                counts[(token - next_token(context, VOCAB)) % VOCAB] += 1
                context.append(token)
        total = sum(counts.values())
        dropped = sorted(d for d in counts if want[d] == 0.0)
        assert not dropped, f"drew distances {dropped}, which the filters drop"
        missing = [d for d, p in enumerate(want) if p >= 0.03 and counts[d] == 0]
        assert not missing, f"never drew distances {missing}, which the filters keep"
        variation = sum(abs(counts[d] / total - p) for d, p in enumerate(want)) / 2
        assert variation < 0.1, (variation, sorted(counts.items()))

    @pytest.mark.spec("ENG-041")
    def test_seeded_sampling_ignores_batch_composition(self, backend: Backend) -> None:
        params = SamplingParams(max_tokens=15, temperature=1.5, seed=1234)
        prompt = [2, 7, 1, 8, 2, 8]
        (alone,) = build_engine(backend).run([prompt], params)
        crowd = build_engine(backend, max_num_batched_tokens=7)
        others = prompts_with_shared_prefix(5, prefix_len=4, seed=9)
        mixed = [SamplingParams(max_tokens=9, temperature=1.0, seed=i) for i in range(5)]
        outs = crowd.run([*others[:2], prompt, *others[2:]], [*mixed[:2], params, *mixed[2:]])
        assert outs[2].token_ids == alone.token_ids
        (again,) = build_engine(backend).run([prompt], params)
        assert again.token_ids == alone.token_ids

    @pytest.mark.spec("ENG-042")
    def test_stop_conditions(self, backend: Backend) -> None:
        prompt = [10, 20, 30]
        expected = solo_greedy(prompt, 10)
        eut = build_engine(backend, eos_ids=frozenset({expected[4]}))
        (by_eos,) = eut.run([prompt], greedy(max_tokens=10))
        assert list(by_eos.token_ids) == expected[:5]
        assert by_eos.finish_reason is FinishReason.STOP
        (ignored,) = eut.run(
            [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        )
        assert list(ignored.token_ids) == expected
        assert ignored.finish_reason is FinishReason.LENGTH
        stop_at = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(expected[2],))
        (by_token,) = build_engine(backend).run([prompt], stop_at)
        assert list(by_token.token_ids) == expected[: expected.index(expected[2]) + 1]
        assert by_token.finish_reason is FinishReason.STOP

    @pytest.mark.spec("ENG-133")
    def test_outputs_without_a_tokenizer_have_empty_text(self, backend: Backend) -> None:
        eut = build_engine(backend)
        eut.engine.add_request([10, 20, 30], greedy(max_tokens=3))
        outputs: list[RequestOutput] = []
        while eut.engine.has_unfinished_requests():
            outputs.extend(eut.engine.step())
        assert len(outputs) == 3
        for output in outputs:
            assert [(c.text, c.new_text) for c in output.outputs] == [("", "")]

    @pytest.mark.spec("ENG-044")
    @pytest.mark.parametrize("n", [0, 1])
    def test_logprobs_of_the_chosen_token_only_or_one_more(self, backend: Backend, n: int) -> None:
        """``logprobs=0`` reports the chosen token's log-probability and no list; ``1`` one
        pair, the chosen (greedy) token itself."""
        params = SamplingParams(max_tokens=3, temperature=0, logprobs=n)
        (out,) = build_engine(backend).run([[4, 5, 6]], params)
        assert out.logprobs is not None
        assert len(out.logprobs) == 3
        for token, entry in zip(out.token_ids, out.logprobs, strict=True):
            assert entry.token_id == token
            assert len(entry.top) == n
            assert math.isclose(entry.logprob, math.log(filtered_top(VOCAB)), abs_tol=1e-5)
            assert [t for t, _ in entry.top] == [token] * n

    @pytest.mark.spec("ENG-044")
    def test_logprobs(self, backend: Backend) -> None:
        params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
        (out,) = build_engine(backend).run([[1, 2, 3]], params)
        assert out.logprobs is not None
        assert len(out.logprobs) == 4
        for token, entry in zip(out.token_ids, out.logprobs, strict=True):
            assert entry.token_id == token
            assert len(entry.top) == 3
            assert entry.top[0][0] == token  # greedy picks the most likely
            values = [v for _, v in entry.top]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6
            assert math.isclose(entry.logprob, values[0], abs_tol=1e-6)
            assert math.isclose(values[0] - values[1], 0.5, abs_tol=1e-4)

    @pytest.mark.spec("ENG-045")
    @pytest.mark.parametrize(
        "bad",
        [
            {"max_tokens": 0},
            {"temperature": -0.1},
            {"temperature": float("nan")},
            {"top_p": 0.0},
            {"top_p": 1.5},
            {"top_k": -2},
            {"min_p": 1.5},
            {"logprobs": -1},
            {"stop": ("",)},
            {"stop_token_ids": (-3,)},
        ],
    )
    def test_invalid_sampling_params(self, bad: dict[str, object]) -> None:
        with pytest.raises(InvalidSamplingParams):
            SamplingParams(**bad)  # type: ignore[arg-type]

    # -- metrics -------------------------------------------------------------------------

    @pytest.mark.spec("ENG-050")
    def test_metrics(self, backend: Backend) -> None:
        eut = build_engine(backend)
        prompt = list(range(9))
        eut.run([prompt], greedy(max_tokens=3))
        (out,) = eut.run([prompt + [1]], greedy(max_tokens=5))
        m = out.metrics
        assert m.prompt_tokens == 10
        assert m.cached_tokens == 8
        assert m.generated_tokens == 5
        assert out.finish_reason is FinishReason.LENGTH
        assert m.ttft is not None
        assert m.ttft >= 0
        assert m.decode_time is not None
        assert m.decode_time >= 0
        stats = eut.engine.stats()
        assert stats.pages_in_use == 0
        assert stats.pages_free + stats.pages_cached == stats.num_pages == 64
        assert stats.peak_pages_in_use == 4  # 14 positions computed at the last step
        assert stats.steps == 8
        assert stats.tokens_computed == 9 + 2 + 2 + 4
        assert math.isclose(stats.tokens_per_step, stats.tokens_computed / 8)
        assert stats.preemptions == 0
        assert (stats.running, stats.waiting) == (0, 0)
