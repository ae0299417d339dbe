"""One backend class for every mutant: pagedkv's reference with one part swapped or wrapped.

A mutant replaces the KVManager class, wraps the PagedStore (the one ``create_paged_store``
returns and the one inside the model runner), wraps the StepRunner the engine is given, wraps
the engine, or adjusts a freshly built reference engine. Wrapping at the Protocols keeps the
mutants independent of the reference's internals; the few that cannot (a scheduler's queue
order, the sampler's filter) say so.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.backend import ReferenceBackend
from pagedkv.interfaces import KVManager, KVManagerConfig, PagedStore, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.generation_config import GenerationDefaults
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
    page_sizes: Container[int] | None = None
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
        """The reference runner, over this backend's own (possibly broken) store."""
        if self.store is None or num_pages is None:
            return ReferenceBackend().create_model_runner(
                model_dir, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
            )
        from pagedkv.engine.runner import ModelRunner
        from pagedkv.model.loader import load_model

        model = load_model(model_dir, dtype=dtype, device=device)
        cfg = model.config
        store = self.create_paged_store(
            StoreConfig(
                num_layers=cfg.num_hidden_layers,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                page_size=page_size,
                num_pages=num_pages,
                dtype=dtype,
                device=device,
            )
        )
        return ModelRunner.paged(model, store)

    def create_engine(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
        generation_defaults: GenerationDefaults | None = None,
    ) -> Engine:
        from pagedkv.engine.engine import LLMEngine

        if self.runner is not None:
            runner = self.runner(runner)
        kv = None
        if config.mode == "v1":
            kv = self.create_kv_manager(
                KVManagerConfig(config.num_pages, config.page_size, config.enable_prefix_caching)
            )
        engine = LLMEngine(
            runner,
            config,
            kv_manager=kv,
            tokenizer=tokenizer,
            eos_ids=eos_ids,
            generation_defaults=generation_defaults,
        )
        if self.adjust is not None:
            self.adjust(engine)
        return self.engine(engine) if self.engine is not None else engine
