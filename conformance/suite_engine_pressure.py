"""Engine conformance tests of parallel samples under memory pressure (specs/engine.md
ENG-130), on the hash model.

A request with ``n`` above 1 computes its prompt once and forks its sequence when the prompt's
first token is sampled (ENG-047). In a pool too small for every fork, a fork that finds no page
waits, to be recomputed, at the head of the queue: ahead of requests that arrived after its
request, like a preempted request (ENG-030), and counted as one preemption. Subclass
:class:`EnginePressureSuite` to run these against an engine of yours.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend

from .engine_harness import build_engine, solo_greedy
from .suite_engine_parallel import PROMPT, solo_runs

#: Four samples of :data:`PROMPT` (10 tokens: two full pages of 4 and a partial one), three
#: tokens each, so no sample grows past the prompt's third page.
FORKED = SamplingParams(max_tokens=3, temperature=1.3, seed=77, ignore_eos=True, n=4)
#: A later request of 16 tokens (four pages) and 4 new ones: five pages, the whole pool.
LATER = list(range(40, 56))
LATER_TOKENS = 4


@pytest.mark.requires("engine", "fork")
class EnginePressureSuite:
    """ENG-130: where a fork that finds no page waits, and what it counts."""

    @pytest.mark.spec("ENG-130", "ENG-047", "ENG-030")
    def test_a_fork_without_a_page_waits_ahead_of_later_requests(self, backend: Backend) -> None:
        """A pool of 5 pages of 4: ``n=4`` on a 10-token prompt takes 3 pages, and a request
        arriving after it (four pages) waits. When the prompt's first token forks it, two
        forks get a page for their partial page and the third finds none: it waits at the
        head of the queue, ahead of the later request. So once the two forks and the parent
        finish, the waiting fork is recomputed (hitting the prompt's cached pages) and its
        request finishes before the later request, which needs the whole pool, gets its first
        token. The waiting fork counts as one preemption of its request and of the engine;
        every sample is its solo run, the later request its solo greedy run."""
        eut = build_engine(backend, num_pages=5)
        forked = eut.engine.add_request(PROMPT, FORKED)
        later = eut.engine.add_request(
            LATER, SamplingParams(max_tokens=LATER_TOKENS, temperature=0)
        )
        first_token_step: dict[str, int] = {}
        finals: dict[str, RequestOutput] = {}
        finished_step: dict[str, int] = {}
        step = 0
        while eut.engine.has_unfinished_requests():
            step += 1
            assert step < 100, "the engine never finished"
            for output in eut.engine.step():
                if output.outputs and any(c.token_ids for c in output.outputs):
                    first_token_step.setdefault(output.request_id, step)
                if output.finished:
                    finals[output.request_id] = output
                    finished_step[output.request_id] = step
            eut.engine.check_invariants()
        assert finished_step[forked] < first_token_step[later], (
            f"the later request got its first token at step {first_token_step[later]}, before "
            f"the forked request's waiting fork finished (step {finished_step[forked]}): the "
            "fork did not wait at the head of the queue"
        )
        assert [c.token_ids for c in finals[forked].outputs] == solo_runs(backend, FORKED, 4)
        assert list(finals[later].token_ids) == solo_greedy(LATER, LATER_TOKENS)
        assert finals[forked].metrics.preemptions == 1
        assert finals[later].metrics.preemptions == 0
        assert eut.engine.stats().preemptions == 1
        assert eut.engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-130", "ENG-012")
    def test_aborting_a_request_ends_its_waiting_fork(self, backend: Backend) -> None:
        """The pool and requests of the test above: once a fork waits for a page (the engine
        counts its preemption), aborting its request ends that fork too: only the later
        request is left waiting, no output of the aborted request comes after its final one,
        the later request gets its solo greedy run, and no page stays in use."""
        eut = build_engine(backend, num_pages=5)
        forked = eut.engine.add_request(PROMPT, FORKED)
        later = eut.engine.add_request(
            LATER, SamplingParams(max_tokens=LATER_TOKENS, temperature=0)
        )
        for _ in range(100):
            if eut.engine.stats().preemptions == 1:
                break
            eut.engine.step()
        assert eut.engine.stats().preemptions == 1, "no fork ever waited for a page"
        assert eut.engine.stats().waiting == 2, "the waiting fork and the later request"
        final = eut.engine.abort(forked)
        assert final is not None
        assert final.finished
        eut.engine.check_invariants()
        assert eut.engine.stats().waiting == 1, "a fork of the aborted request is still queued"
        finals: dict[str, RequestOutput] = {}
        for _ in range(100):
            if not eut.engine.has_unfinished_requests():
                break
            for output in eut.engine.step():
                assert output.request_id != forked, "output of an aborted request"
                if output.finished:
                    finals[output.request_id] = output
            eut.engine.check_invariants()
        assert list(finals[later].token_ids) == solo_greedy(LATER, LATER_TOKENS)
        assert eut.engine.stats().pages_in_use == 0
