"""The reference backend: what ``make conformance`` tests when no ``BACKEND`` is given.

A backend is any object satisfying :class:`pagedkv.interfaces.Backend`, returned by a
zero-argument factory named ``module:factory`` (``--backend`` / ``PAGEDKV_BACKEND``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.interfaces import KVManager, KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.tokenizer import Tokenizer
    from pagedkv.interfaces import Engine, StepRunner


@dataclass(frozen=True)
class ReferenceBackend:
    """pagedkv's own implementations."""

    name: str = "pagedkv reference"
    capabilities: frozenset[str] = frozenset({"prefix_caching", "eviction", "reset", "engine"})

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        return ReferenceKVManager(config)

    def create_engine(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> Engine:
        from pagedkv.engine.engine import LLMEngine

        return LLMEngine(runner, config, tokenizer=tokenizer, eos_ids=eos_ids)


def reference_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:reference_backend``."""
    return ReferenceBackend()
