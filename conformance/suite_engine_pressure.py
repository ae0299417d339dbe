"""Engine conformance tests of parallel samples under memory pressure (specs/engine.md
ENG-130, ENG-215), on the hash model.

A request with ``n`` above 1 computes its prompt once and forks its sequence when the prompt's
first token is sampled (ENG-047). In a pool too small for every fork, a fork that finds no page
waits, to be recomputed, at the head of the queue: ahead of requests that arrived after its
request, like a preempted request (ENG-030), and counted as one preemption. Subclass
:class:`EnginePressureSuite` to run these against an engine of yours.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend, Engine, EngineBackend, StepRunner
from pagedkv.plan import StepPlan
from pagedkv.testing.delegating_runner import DelegatingRunner
from pagedkv.testing.faults import FaultyRunner
from pagedkv.testing.hash_runner import HashRunner

from .engine_harness import VOCAB, build_engine, solo_greedy
from .suite_engine_parallel import PROMPT, solo_runs

#: Four samples of :data:`PROMPT` (10 tokens: two full pages of 4 and a partial one), three
#: tokens each, so no sample grows past the prompt's third page.
FORKED = SamplingParams(max_tokens=3, temperature=1.3, seed=77, ignore_eos=True, n=4)
#: A later request of 16 tokens (four pages) and 4 new ones: five pages, the whole pool.
LATER = list(range(40, 56))
LATER_TOKENS = 4


#: Two samples of :data:`PROMPT`; the first sample's first token is made a stop token by the
#: copy tests, so the parent sequence ends at the fork while the second goes on.
TWO = SamplingParams(max_tokens=2, temperature=1.3, seed=5, ignore_eos=True, n=2)
#: The second sample's seed (ENG-047: ``seed + 1``).
SECOND_SEED = 6


class CopyRecordingRunner(DelegatingRunner):
    """Records, per call, the page copies (source, target) its plan carries."""

    def __init__(self, inner: StepRunner) -> None:
        super().__init__(inner)
        self.copies: list[list[tuple[int, int]]] = []

    def execute(self, plan: StepPlan) -> torch.Tensor:
        pairs = plan.page_copies
        made = [] if pairs is None else list(zip(pairs[0].tolist(), pairs[1].tolist(), strict=True))
        self.copies.append(made)
        return self.inner.execute(plan)


def engine_over(backend: Backend, runner: StepRunner, num_pages: int) -> Engine:
    """An engine of ``backend`` over ``runner``: pages of 4, prefix caching on."""
    if not isinstance(backend, EngineBackend):
        raise TypeError(f"backend {backend.name!r} declares 'engine' but has no create_engine")
    config = EngineConfig(page_size=4, num_pages=num_pages, max_num_seqs=8)
    return backend.create_engine(runner, config)


def run_out(engine: Engine) -> dict[str, RequestOutput]:
    """Step ``engine`` until it is idle, checking its invariants; the final outputs."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_invariants()
    raise AssertionError("the engine never finished")


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

    @pytest.mark.spec("ENG-215", "KVM-037")
    def test_no_copy_is_made_for_forks_aborted_before_it(self, backend: Backend) -> None:
        """``n=4`` on a 10-token prompt (a partial last page): its prefill forks three
        sequences, whose copies of that page the next step makes — as an engine left alone
        shows. Aborted right after that prefill, no later plan copies anything (the pages the
        copies would write are free, maybe another request's already), a later request gets
        its solo greedy run, and no page stays in use. Fails an engine that keeps the copies
        of ended forks for its next plan."""
        control = CopyRecordingRunner(HashRunner(VOCAB, 16, 4))
        left_alone = engine_over(backend, control, 16)
        left_alone.add_request(PROMPT, FORKED)
        run_out(left_alone)
        assert any(control.copies), "the forks of a partial page never copied it"
        runner = CopyRecordingRunner(HashRunner(VOCAB, 16, 4))
        engine = engine_over(backend, runner, 16)
        forked = engine.add_request(PROMPT, FORKED)
        engine.step()
        assert engine.abort(forked) is not None
        later = engine.add_request(LATER, SamplingParams(max_tokens=LATER_TOKENS, temperature=0))
        finals = run_out(engine)
        assert runner.copies[1:], "no step ran after the abort"
        assert not any(runner.copies[1:]), (
            f"plans after the abort copied {runner.copies[1:]}: pages of ended forks"
        )
        assert list(finals[later].token_ids) == solo_greedy(LATER, LATER_TOKENS)
        assert engine.stats().pages_in_use == 0

    @pytest.mark.spec("ENG-215", "ENG-071", "KVM-037")
    def test_a_copy_source_stays_held_until_the_copy_is_made(self, backend: Backend) -> None:
        """``n=2`` on a 10-token prompt in a pool of 5 pages of 4, the first sample's first
        token a stop token: the parent ends at the fork and its partial page is the source of
        the second sample's copy. A request of 8 tokens (two pages) arrives, and the next
        step raises after the model ran (copy made, K/V written). The step after makes the
        copy again: had the source page gone to the later request, which wrote its K/V there,
        the second sample would read the later request's tokens as its prompt's last two.
        So the second sample equals its solo run, the later request its solo greedy run, and
        no page stays in use. Fails an engine that frees a copy's source before the copy is
        made."""
        first, second = solo_runs(backend, TWO, 2)
        assert first[0] != second[0], "the samples' first tokens must differ"
        params = dataclasses.replace(TWO, stop_token_ids=(first[0],))
        (alone,) = solo_runs(backend, dataclasses.replace(params, seed=SECOND_SEED), 1)
        later_prompt = list(range(60, 68))
        inner = HashRunner(VOCAB, 5, 4)
        runner = FaultyRunner(inner, fail_calls={1})
        engine = engine_over(backend, runner, 5)
        forked = engine.add_request(PROMPT, params)
        engine.step()
        later = engine.add_request(later_prompt, SamplingParams(max_tokens=1, temperature=0))
        finals = run_out(engine)
        assert runner.faults == [1]
        samples = finals[forked].outputs
        assert samples[0].finish_reason is FinishReason.STOP
        assert list(samples[0].token_ids) == [first[0]]
        assert list(samples[1].token_ids) == alone, "the fork's copy read another request's K/V"
        assert list(finals[later].token_ids) == solo_greedy(later_prompt, 1)
        assert engine.stats().pages_in_use == 0
