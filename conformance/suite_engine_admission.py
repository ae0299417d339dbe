"""Engine conformance tests of admission (specs/engine.md ENG-053, ENG-027, ENG-175;
specs/kv-manager.md KVM-034), on the hash model: when a request leaves the queue, and its
calls to the KVManager.

An admission attempt costs one prefix lookup, and ``allocate`` opens the sequence from that
match without looking again. Those are calls between an engine and its manager, so the suite
sees them only on a backend declaring ``supplied_kv_manager``: it builds the backend's own
KVManager, wraps it in a recorder (:mod:`pagedkv_conformance.kv_call_log`) and hands it to the
backend's engine. Subclass :class:`EngineAdmissionSuite` to run these against an engine of
yours.
"""

from __future__ import annotations

import itertools
import random

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend, KVManagerConfig, SuppliedKVEngineBackend
from pagedkv.testing.hash_runner import HashRunner

from .engine_harness import VOCAB, EngineUnderTest, build_engine, solo_greedy
from .kv_call_log import RecordingKVManager, recording

PAGE_SIZE = 4
NUM_PAGES = 96


def build_recorded_engine(backend: Backend) -> tuple[EngineUnderTest, RecordingKVManager]:
    """The backend's engine over the hash runner and a recorder around the backend's own
    KVManager (prefix caching on, a pool nothing here fills)."""
    if not isinstance(backend, SuppliedKVEngineBackend):
        raise TypeError(
            f"backend {backend.name!r} declares 'supplied_kv_manager' but has no create_engine"
        )
    config = EngineConfig(
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_num_batched_tokens=512,
        max_num_seqs=16,
        max_model_len=256,
    )
    kv = recording(backend.create_kv_manager(KVManagerConfig(NUM_PAGES, PAGE_SIZE)))
    runner = HashRunner(VOCAB, NUM_PAGES, PAGE_SIZE)
    engine = backend.create_engine(runner, config, kv_manager=kv)
    return EngineUnderTest(engine, runner, config), kv


@pytest.mark.requires("engine")
class EngineAdmissionSuite:
    """When a request leaves the queue (ENG-053), and what its admission asks of the
    KVManager (ENG-027): one lookup, its match handed to ``allocate``."""

    @pytest.mark.spec("ENG-053")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_first_scheduled_time_is_when_a_request_left_the_queue(
        self, backend: Backend, mode: str
    ) -> None:
        """One sequence at a time: a request aborted while queued was never scheduled; each
        of three requests is first scheduled after the one before it finished, and between its
        own arrival and its first token."""
        eut = build_engine(backend, max_num_seqs=1, mode=mode)
        queued = eut.engine.add_request([4, 5], SamplingParams(max_tokens=3))
        aborted = eut.engine.abort(queued)
        assert aborted is not None
        assert aborted.metrics.first_scheduled_time is None
        outs = eut.run([[1, 2, 3], [4, 5, 6], [7, 8]], SamplingParams(max_tokens=4))
        for before, after in itertools.pairwise(outs):
            assert before.metrics.finished_time is not None
            assert after.metrics.first_scheduled_time is not None
            assert after.metrics.first_scheduled_time >= before.metrics.finished_time, (
                "a request queued behind a full batch was first scheduled before the request "
                "it waited for finished"
            )
        for out in outs:
            metrics = out.metrics
            assert metrics.first_scheduled_time is not None
            assert metrics.first_token_time is not None
            assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time

    @pytest.mark.requires("supplied_kv_manager", "prefix_caching")
    @pytest.mark.spec("ENG-027", "KVM-034", "ENG-175")
    def test_each_admission_looks_up_once_and_allocates_from_that_match(
        self, backend: Backend
    ) -> None:
        """Four prompts, then, while they run, four more: three continue the first ones' cached
        pages and one is a first prompt again. Every request is admitted at its first attempt
        (the pool, the budget and the sequence limit hold them all, and no prompt shares a page
        in flight), so each ``allocate`` must follow exactly one lookup since the previous one
        and be given the very match that lookup returned; nothing else is ever looked up. The
        requests run on the supplied manager: the second wave hits its cache, every request
        gets its solo tokens and every page comes back to it."""
        eut, kv = build_recorded_engine(backend)
        rng = random.Random(27)
        first = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 12, 13, 6)]
        second = [first[0][:8] + [7, 7], first[1][:12] + [5], first[2][:4] + [1, 2, 3], first[3]]
        params = SamplingParams(max_tokens=6, temperature=0)
        ids = [eut.engine.add_request(p, params) for p in first]
        for _ in range(2):
            eut.engine.step()
        ids += [eut.engine.add_request(p, params) for p in second]
        finals = eut.finish(ids)
        for prompt, final in zip(first + second, finals, strict=True):
            assert list(final.token_ids) == solo_greedy(prompt, 6)
        log = kv.log
        assert len(log.allocations) == len(ids), "every request opens one sequence"
        assert [a.with_match for a in log.allocations] == [True] * len(ids), (
            "allocate must be given the admission's match (KVM-034)"
        )
        assert [a.lookups_before for a in log.allocations] == [1] * len(ids), (
            f"lookups before each allocate: {[a.lookups_before for a in log.allocations]}; "
            f"all lookups: {log.lookups}"
        )
        assert all(a.match_is_last_lookup for a in log.allocations), (
            "allocate must be given the very match the admission's lookup returned"
        )
        assert len(log.lookups) == len(ids), f"lookups after the last admission: {log.lookups}"
        assert sum(f.metrics.cached_tokens for f in finals[4:]) == 8 + 12 + 4 + 4
        assert kv.inner.stats().pages_in_use == 0
