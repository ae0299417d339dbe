"""Conformance tests of what an engine offers its users besides requests (specs/engine.md
ENG-051, ENG-052): step observers and their reports, the tokenizer and ``max_model_len``.

The server, the command line and the benchmarks live on these alone, so an engine is held to
them like to its outputs. Subclass :class:`EngineObserverSuite` to run them on an engine of
yours, or run the suite with ``--backend module:factory``.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.outputs import StepReport
from pagedkv.errors import RequestTooLong
from pagedkv.interfaces import Backend

from .engine_harness import build_engine, greedy, prompts_with_shared_prefix


@pytest.mark.requires("engine")
class EngineObserverSuite:
    """Step reports that match the steps, and the properties users read."""

    @pytest.mark.spec("ENG-051")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_each_step_reports_what_it_ran(self, backend: Backend, mode: str) -> None:
        """One report per step that ran, with the runner's sequences and positions; prompt
        positions, finished requests and preemptions add up to the engine's counters, and the
        last report's stats are the engine's."""
        eut = build_engine(backend, page_size=4, num_pages=14, max_num_seqs=6, mode=mode)
        reports: list[StepReport] = []
        eut.engine.add_step_observer(reports.append)
        prompts = prompts_with_shared_prefix(6, prefix_len=6, seed=11)
        outs = eut.run(prompts, greedy(max_tokens=20))
        stats = eut.engine.stats()
        assert len(reports) == len(eut.runner.steps) == stats.steps
        for report, fed in zip(reports, eut.runner.steps, strict=True):
            assert (report.num_seqs, report.num_tokens) == (len(fed), sum(fed))
            parts = (report.schedule_s, report.plan_s, report.execute_s, report.sample_s)
            assert min(*parts, report.update_s, report.output_s) >= 0
            assert report.total_s >= report.execute_s
        assert sum(r.num_prompt_tokens for r in reports) == stats.prefill_tokens_computed
        assert sum(r.num_finished for r in reports) == len(outs)
        assert sum(r.num_preempted for r in reports) == stats.preemptions
        if mode == "v1":
            assert stats.preemptions > 0, "the pool is small enough to preempt"
        assert reports[-1].stats == stats

    @pytest.mark.spec("ENG-051")
    @pytest.mark.parametrize(("mode", "cached"), [("v1", True), ("v0", False)])
    def test_reports_count_the_positions_held_in_the_cache(
        self, backend: Backend, mode: str, cached: bool
    ) -> None:
        """13 prompt tokens then one token a step: after step k the request holds 13 + k - 1
        positions (v1), none once it finished; v0 holds none."""
        eut = build_engine(backend, mode=mode)
        reports: list[StepReport] = []
        eut.engine.add_step_observer(reports.append)
        eut.run([list(range(13))], greedy(max_tokens=6))
        held = [r.kv_positions for r in reports]
        assert held == ([13, 14, 15, 16, 17, 0] if cached else [0] * 6)

    @pytest.mark.spec("ENG-051")
    def test_a_removed_observer_is_not_called(self, backend: Backend) -> None:
        eut = build_engine(backend)
        kept: list[StepReport] = []
        removed: list[StepReport] = []
        eut.engine.add_step_observer(kept.append)
        eut.engine.add_step_observer(removed.append)
        eut.run([[1, 2, 3]], greedy(max_tokens=2))
        eut.engine.remove_step_observer(removed.append)
        eut.run([[4, 5, 6]], greedy(max_tokens=3))
        assert (len(kept), len(removed)) == (5, 2)
        assert not eut.engine.has_unfinished_requests()
        eut.engine.step()  # nothing to run: no report
        assert len(kept) == 5

    @pytest.mark.spec("ENG-052", "ENG-033")
    def test_tokenizer_and_max_model_len(self, backend: Backend) -> None:
        """No tokenizer given, none exposed; ``max_model_len`` is the config's, capped by the
        pool's capacity (8 pages of 4), and exactly that many positions fit."""
        eut = build_engine(backend, page_size=4, num_pages=8, max_model_len=64)
        assert eut.engine.tokenizer is None
        assert eut.engine.max_model_len == 32
        with pytest.raises(RequestTooLong):
            eut.engine.add_request(list(range(28)), greedy(max_tokens=5))
        (out,) = eut.run([list(range(27))], greedy(max_tokens=5))
        assert len(out.token_ids) == 5
        roomy = build_engine(backend, num_pages=512, max_model_len=40)
        assert roomy.engine.max_model_len == 40
