"""Parallel sampling over a KVManager that cannot fork (no ``fork`` capability): pagedkv's
engine recomputes each further sample from the prefix cache instead (specs/engine.md ENG-047)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import ForkingKVManager, KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.testing.hash_runner import HashRunner

CONFIG = EngineConfig(page_size=4, num_pages=64, max_model_len=128)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
PARAMS = SamplingParams(max_tokens=7, temperature=1.3, seed=5, n=3)


class NoFork:
    """The reference KVManager without its ``fork``, as a third-party manager may be."""

    def __init__(self, config: KVManagerConfig) -> None:
        self._manager = ReferenceKVManager(config)

    def __getattr__(self, name: str) -> object:
        if name == "fork":
            raise AttributeError(name)
        return getattr(self._manager, name)


def engine(kv: object) -> LLMEngine:
    runner = HashRunner(101, CONFIG.num_pages, CONFIG.page_size)
    return LLMEngine(runner, CONFIG, kv_manager=kv)  # type: ignore[arg-type]


@pytest.mark.spec("ENG-047")
def test_samples_are_recomputed_when_the_manager_cannot_fork() -> None:
    plain = NoFork(KVManagerConfig(CONFIG.num_pages, CONFIG.page_size))
    assert not isinstance(plain, ForkingKVManager)
    (out,) = run_to_completion(engine(plain), [PROMPT], PARAMS)
    forking = ReferenceKVManager(KVManagerConfig(CONFIG.num_pages, CONFIG.page_size))
    (forked,) = run_to_completion(engine(forking), [PROMPT], PARAMS)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in forked.outputs]
    single = dataclasses.replace(PARAMS, n=1)
    solo = run_to_completion(
        engine(ReferenceKVManager(KVManagerConfig(CONFIG.num_pages, CONFIG.page_size))),
        [PROMPT] * 3,
        [dataclasses.replace(single, seed=5 + i) for i in range(3)],
    )
    assert [c.token_ids for c in out.outputs] == [o.token_ids for o in solo]
    assert out.metrics.preemptions == 2  # each further sample went back to the queue
    assert plain.stats().pages_in_use == 0  # type: ignore[attr-defined]
