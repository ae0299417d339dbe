"""The reference backend: what ``make conformance`` tests when no ``BACKEND`` is given.

A backend is any object satisfying :class:`pagedkv.interfaces.Backend`, returned by a
zero-argument factory named ``module:factory`` (``--backend`` / ``PAGEDKV_BACKEND``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.interfaces import KVManager, KVManagerConfig, PagedStore, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.tokenizer import Tokenizer
    from pagedkv.interfaces import Engine, StepRunner


@dataclass(frozen=True)
class ReferenceBackend:
    """pagedkv's own implementations."""

    name: str = "pagedkv reference"
    capabilities: frozenset[str] = frozenset(
        {"prefix_caching", "eviction", "reset", "paged_store", "model", "engine", "cuda"}
    )

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

    def create_paged_store(self, config: StoreConfig) -> PagedStore:
        from pagedkv.kv.paged_store import TorchPagedStore

        return TorchPagedStore(config)

    def create_model_runner(
        self,
        model_dir: str,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> StepRunner:
        from pagedkv.engine.runner import ModelRunner

        return ModelRunner.from_model_dir(
            model_dir, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )


def reference_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:reference_backend``."""
    return ReferenceBackend()
