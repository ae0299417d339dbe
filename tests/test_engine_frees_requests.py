"""ENG-198: every per-request structure of the engine is freed when its request ends.

A long-running server's memory must not grow with the requests it served; the engine's own
maps are where a forgotten request would stay. Shown with the hash stand-in runner over a mix
of requests: finished by length, by an EOS token, aborted while waiting or while running,
samples of ``n``, salted and unsalted, with prefix caching on and off.
"""

from __future__ import annotations

import pytest

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sched.paged import PagedScheduler
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 64
PAGE_SIZE = 4
NUM_PAGES = 64


def _engine(prefix_caching: bool) -> LLMEngine:
    config = EngineConfig(
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=prefix_caching,
    )
    runner = HashRunner(VOCAB, NUM_PAGES, PAGE_SIZE)
    return reference_backend().create_engine(runner, config, eos_ids=frozenset({3}))


def _held(engine: LLMEngine) -> dict[str, int]:
    """Entries the engine and what it owns hold for requests."""
    scheduler = engine.scheduler
    assert isinstance(scheduler, PagedScheduler)
    kv = scheduler.kv
    return {
        "request groups": len(engine._requests),
        "waiting": len(scheduler.waiting),
        "running": len(scheduler.running),
        "sequences": len(kv.sequences),
        "in-flight tracks": len(kv.in_flight),
        "in-flight roots": len(kv.in_flight._roots),
        "pages in use": kv.pool.num_in_use,
    }


@pytest.mark.spec("ENG-198")
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_nothing_is_held_for_requests_that_ended(prefix_caching: bool) -> None:
    """Catches an engine that keeps a finished or aborted request's group, a sequence its
    scheduler or KV manager never drops, or an in-flight record of a prompt whose sequence
    ended: each grows with every request a server serves."""
    engine = _engine(prefix_caching)
    empty = _held(engine)
    shared = list(range(10, 22))
    for round_ in range(3):
        ids = []
        for i in range(12):
            prompt = [*shared, *(5 + (7 * i + j + round_) % 50 for j in range(1 + i % 9))]
            params = SamplingParams(
                max_tokens=2 + i % 6,
                temperature=0.0 if i % 2 else 0.8,
                seed=i,
                n=1 + i % 3,
                ignore_eos=bool(i % 4),
            )
            salt = "tenant" if i % 5 == 0 else None
            ids.append(engine.add_request(prompt, params, cache_salt=salt))
        engine.abort(ids[-1])  # still waiting
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps == 3:
                engine.abort(ids[0])  # running
        assert _held(engine) == empty, (round_, _held(engine))
