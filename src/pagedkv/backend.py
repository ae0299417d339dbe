"""The reference backend: what ``make conformance`` tests when no ``BACKEND`` is given.

A backend is any object satisfying :class:`pagedkv.interfaces.Backend`, returned by a
zero-argument factory named ``module:factory`` (``--backend`` / ``PAGEDKV_BACKEND``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pagedkv.interfaces import KVManager, KVManagerConfig, PagedStore, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.kv.radix_index import RadixPrefixIndex

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.tokenizer import Tokenizer
    from pagedkv.interfaces import Engine, StepRunner


@dataclass(frozen=True)
class ReferenceBackend:
    """pagedkv's own implementations.

    Attributes:
        prefix_index: ``hash`` (chained hash, verified against token ids) or ``radix`` (a tree
            of pages keyed by token ids); the KVManager and engines built here use it.
    """

    name: str = "pagedkv reference"
    prefix_index: Literal["hash", "radix"] = "hash"
    capabilities: frozenset[str] = frozenset(
        {"prefix_caching", "eviction", "reset", "paged_store", "model", "engine", "cuda"}
    )

    @property
    def variants(self) -> dict[str, str]:
        """Choices where the spec leaves room (KVM-050), read by the conformance suite: an
        entry orphaned by its parent's eviction blocks its key in the chained-hash index and
        is detached in the radix tree."""
        return {"orphans": "detach" if self.prefix_index == "radix" else "block"}

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        if self.prefix_index == "radix":
            index = RadixPrefixIndex(config.num_pages, config.page_size)
            return ReferenceKVManager(config, index=index)
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

        kv = self.create_kv_manager(
            KVManagerConfig(config.num_pages, config.page_size, config.enable_prefix_caching)
        )
        return LLMEngine(runner, config, kv_manager=kv, tokenizer=tokenizer, eos_ids=eos_ids)

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


def radix_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:radix_backend``: the reference with its prefix
    index swapped for the radix tree, held to the same suite."""
    return ReferenceBackend(name="pagedkv reference, radix prefix index", prefix_index="radix")
