"""One backend class for every mutant: pagedkv's reference with one part swapped or wrapped.

A mutant replaces the KVManager class, wraps the PagedStore (the one ``create_paged_store``
returns and the one inside the model runner), wraps the StepRunner the engine is given, wraps
the engine, or adjusts a freshly built reference engine. Wrapping at the Protocols keeps the
mutants independent of the reference's internals; the few that cannot (a scheduler's queue
order, the sampler's filter) say so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.backend import ReferenceBackend
from pagedkv.interfaces import KVManager, KVManagerConfig, PagedStore, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.tokenizer import Tokenizer
    from pagedkv.interfaces import Engine, StepRunner

#: What the KVManager mutants declare (the plugin tests check this header line).
KV_CAPABILITIES = frozenset({"prefix_caching", "eviction", "reset"})
#: What the store, engine and sampler mutants declare: everything the reference does but CUDA.
ALL_CAPABILITIES = frozenset(
    {"prefix_caching", "eviction", "reset", "paged_store", "model", "engine"}
)


@dataclass(frozen=True)
class MutantBackend:
    """The reference backend with one part swapped (``manager``) or wrapped."""

    name: str
    manager: type[ReferenceKVManager] = ReferenceKVManager
    capabilities: frozenset[str] = KV_CAPABILITIES
    variants: Mapping[str, str] = field(default_factory=dict)
    store: Callable[[PagedStore], PagedStore] | None = None
    runner: Callable[[StepRunner], StepRunner] | None = None
    engine: Callable[[Engine], Engine] | None = None
    adjust: Callable[[LLMEngine], None] | None = None

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        return self.manager(config)

    def create_paged_store(self, config: StoreConfig) -> PagedStore:
        store = ReferenceBackend().create_paged_store(config)
        return self.store(store) if self.store is not None else store

    def create_model_runner(
        self,
        model_dir: str,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> StepRunner:
        runner: Any = ReferenceBackend().create_model_runner(
            model_dir, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        if self.store is not None and runner.store is not None:
            runner.store = self.store(runner.store)  # the reference ModelRunner's own store
        wrapped: StepRunner = runner
        return wrapped

    def create_engine(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> Engine:
        from pagedkv.engine.engine import LLMEngine

        if self.runner is not None:
            runner = self.runner(runner)
        kv = self.create_kv_manager(
            KVManagerConfig(config.num_pages, config.page_size, config.enable_prefix_caching)
        )
        engine = LLMEngine(runner, config, kv_manager=kv, tokenizer=tokenizer, eos_ids=eos_ids)
        if self.adjust is not None:
            self.adjust(engine)
        return self.engine(engine) if self.engine is not None else engine
