"""The reference scheduler looks each waiting prompt up once per admission attempt (ENG-027):
a counting KVManager records every lookup the engine's scheduler makes."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import KVManagerConfig
from pagedkv.testing.counting_kv import ALLOCATE_WITHOUT_MATCH, CountingKVManager
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 101


def engine(config: EngineConfig) -> tuple[LLMEngine, CountingKVManager]:
    kv = CountingKVManager(KVManagerConfig(config.num_pages, config.page_size))
    runner = HashRunner(VOCAB, config.num_pages, config.page_size)
    return LLMEngine(runner, config, kv_manager=kv), kv


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.spec("ENG-027")
@pytest.mark.parametrize("running", [1, 16, 64])
def test_a_burst_costs_one_lookup_per_admission(running: int) -> None:
    """``running`` + 1 prompts sharing a committed 256-token prefix, admitted in one step: each
    admission is one match, taken by allocate; none looks up again."""
    config = EngineConfig(
        page_size=16,
        num_pages=(running + 2) * 20,
        max_num_batched_tokens=(running + 1) * 16,
        max_num_seqs=running + 1,
    )
    eng, kv = engine(config)
    prefix = [(7 * i + 3) % VOCAB for i in range(256)]
    eng.add_request([*prefix, 1], greedy(1))
    while eng.has_unfinished_requests():
        eng.step()
    kv.lookups.clear()
    for r in range(running + 1):
        eng.add_request([*prefix, *[(r + j) % VOCAB for j in range(16)]], greedy(2))
    eng.step()
    assert eng.stats().running == running + 1
    assert kv.lookups == Counter({"match_prefix": running + 1, "allocate": running + 1})


@pytest.mark.spec("ENG-027", "ENG-026")
@pytest.mark.parametrize("budget", [256, 8])
def test_waiting_on_pages_in_flight_costs_one_lookup_an_attempt(budget: int) -> None:
    """Three requests sharing 16 tokens arrive together: the later ones wait while the first
    computes them (in one step, or in chunks). Every match either admits (allocate takes it)
    or reports pages in flight and waits: no other lookup happens."""
    config = EngineConfig(page_size=4, num_pages=64, max_num_batched_tokens=budget)
    eng, kv = engine(config)
    prompt = list(range(17))
    for suffix in (1, 2, 3):
        eng.add_request([*prompt, suffix], greedy(3))
    while eng.has_unfinished_requests():
        eng.step()
    assert kv.lookups["cached_prefix_length"] == kv.lookups[ALLOCATE_WITHOUT_MATCH] == 0
    assert kv.lookups["allocate"] == 3
    if budget == 256:
        assert kv.in_flight_reports == 1, "the second request waited once for the first's pages"
    assert kv.lookups["match_prefix"] == kv.lookups["allocate"] + kv.in_flight_reports
