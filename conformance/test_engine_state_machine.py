"""A Hypothesis state machine over the engine: add, step and abort in random orders.

After every step it checks that no page leaked and the engine's and KVManager's invariants
hold; every request that finishes must produce what it produces when run alone (greedy: the
hash model's solo decode; seeded sampling: a solo run on a fresh engine, and every sampled token
one that the filters, written from their definitions, keep).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend
from pagedkv.testing.hash_runner import hash_logits, next_token

from .engine_harness import VOCAB, EngineUnderTest, build_engine, solo_greedy
from .sampling_reference import allowed_tokens

PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5], [42])

SAMPLING = st.one_of(
    st.builds(
        SamplingParams,
        max_tokens=st.integers(1, 8),
        temperature=st.just(0.0),
    ),
    st.builds(
        SamplingParams,
        max_tokens=st.integers(1, 8),
        temperature=st.sampled_from([0.7, 1.0, 1.5]),
        top_k=st.sampled_from([0, 5]),
        top_p=st.sampled_from([1.0, 0.9]),
        min_p=st.sampled_from([0.0, 0.1]),
        seed=st.integers(0, 2**31),
    ),
)


def engine_config(backend: Backend) -> EngineUnderTest:
    """A small pool, so admission waits, preemption and eviction all happen."""
    return build_engine(
        backend, page_size=4, num_pages=16, max_num_batched_tokens=12, max_num_seqs=4
    )


class EngineMachine(RuleBasedStateMachine):
    backend: Backend

    def __init__(self) -> None:
        super().__init__()
        self.eut = engine_config(self.backend)
        self.live: dict[str, tuple[list[int], SamplingParams, str | None]] = {}

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=10),
        params=SAMPLING,
        salt=st.sampled_from([None, None, "tenant"]),
    )
    def add(
        self, prefix: list[int], suffix: list[int], params: SamplingParams, salt: str | None
    ) -> None:
        prompt = prefix + suffix
        rid = self.eut.engine.add_request(prompt, params, cache_salt=salt)
        self.live[rid] = (prompt, params, salt)

    @precondition(lambda self: bool(self.live))
    @rule()
    def step(self) -> None:
        for output in self.eut.engine.step():
            if output.finished:
                self._check_finished(output)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        output = self.eut.engine.abort(rid)
        assert output is not None
        assert output.finish_reason is FinishReason.ABORT
        del self.live[rid]

    def _check_finished(self, output: RequestOutput) -> None:
        prompt, params, salt = self.live.pop(output.request_id)
        assert output.finish_reason is FinishReason.LENGTH
        if params.greedy:
            assert list(output.token_ids) == solo_greedy(prompt, params.token_limit)
        else:
            (alone,) = engine_config(self.backend).run([prompt], params, cache_salt=salt)
            assert output.token_ids == alone.token_ids
            context = list(prompt)
            for token in output.token_ids:  # against the filters' definitions, not itself
                logits = hash_logits(next_token(context, VOCAB), VOCAB).tolist()
                assert token in allowed_tokens(logits, params), (token, context, params)
                context.append(token)

    @invariant()
    def bookkeeping_holds(self) -> None:
        self.eut.engine.check_invariants()
        stats = self.eut.engine.stats()
        assert stats.pages_in_use + stats.pages_free + stats.pages_cached == stats.num_pages
        if not self.eut.engine.has_unfinished_requests():
            assert stats.pages_in_use == 0, "pages leaked with no request left"

    def teardown(self) -> None:
        for _ in range(500):
            if not self.live:
                break
            self.step()
        assert not self.live, "requests never finished"
        assert self.eut.engine.stats().pages_in_use == 0


@pytest.mark.requires("engine")
@pytest.mark.spec("ENG-002", "ENG-012", "ENG-015", "ENG-032", "ENG-040", "ENG-041")
def test_engine_state_machine(backend: Backend) -> None:
    """Random add/step/abort sequences keep outputs exact and leak no page."""
    machine: Any = type("EngineMachineUnderTest", (EngineMachine,), {"backend": backend})
    machine.TestCase().runTest()
