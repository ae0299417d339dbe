"""The reference backend: what ``make conformance`` tests when no ``BACKEND`` is given.

A backend is any object satisfying :class:`pagedkv.interfaces.Backend`, returned by a
zero-argument factory named ``module:factory`` (``--backend`` / ``PAGEDKV_BACKEND``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pagedkv.device import DEFAULT_DEVICE
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Closable, KVManager, KVManagerConfig, PagedStore, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.kv.radix_index import RadixPrefixIndex
from pagedkv.model_source import resolve_dtype, resolve_model

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.generation_config import GenerationDefaults
    from pagedkv.engine.tokenizer import Tokenizer
    from pagedkv.interfaces import Engine, StepRunner


@dataclass(frozen=True)
class ReferenceBackend:
    """pagedkv's own implementations.

    Attributes:
        prefix_index: ``hash`` (chained hash, verified against token ids) or ``radix`` (a tree
            of pages keyed by token ids); the KVManager and engines built here use it.
        runner_options: how the model runners built here run their models (ENG-110); a v0
            runner (no K/V pool) takes them without ``compile`` and ``cuda_graphs``, which
            run v1 decode steps.
        tensor_parallel_size: ranks each model runner built here splits its model over
            (specs/tensor-parallel.md): above 1, the runner starts its workers (or joins a
            ``torchrun`` launch) and ends them when closed.
    """

    name: str = "pagedkv reference"
    prefix_index: Literal["hash", "radix"] = "hash"
    runner_options: RunnerOptions = dataclasses.field(default_factory=RunnerOptions)
    tensor_parallel_size: int = 1
    capabilities: frozenset[str] = frozenset(
        {
            "prefix_caching",
            "eviction",
            "reset",
            "fork",
            "paged_store",
            "model",
            "engine",
            "cuda",
            "supplied_kv_manager",
        }
    )

    @property
    def variants(self) -> dict[str, str]:
        """Choices where backends may differ (``pagedkv_conformance.variants``), read by the
        conformance suite: an entry orphaned by its parent's eviction blocks its key in the
        chained-hash index and is detached in the radix tree (KVM-050). Every other variant
        takes its default, which is the reference's choice."""
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
        generation_defaults: GenerationDefaults | None = None,
        kv_manager: KVManager | None = None,
    ) -> LLMEngine:
        """pagedkv's engine over ``runner``; in v1 over ``kv_manager`` when given (one this
        backend's ``create_kv_manager`` made for the config's pool, ENG-175), else over a fresh
        KVManager of this backend (the only place an engine's page pool is created)."""
        from pagedkv.engine.engine import LLMEngine

        kv = kv_manager
        if kv is None and config.mode == "v1":
            kv = self.create_kv_manager(
                KVManagerConfig(config.num_pages, config.page_size, config.enable_prefix_caching)
            )
        return LLMEngine(
            runner,
            config,
            kv_manager=kv,
            tokenizer=tokenizer,
            eos_ids=eos_ids,
            generation_defaults=generation_defaults,
        )

    def load_engine(
        self,
        model_dir: str | Path | None,
        config: EngineConfig | None = None,
        *,
        dtype: str = "float32",
        device: str = DEFAULT_DEVICE,
        generation_config: str = "auto",
    ) -> LLMEngine:
        """An engine for a Hugging Face format Qwen3 checkpoint: its model (with a K/V pool in
        v1), its tokenizer if it has one, its EOS tokens and its sampling defaults.

        Args:
            model_dir: a directory, a hub id already in the local Hugging Face cache
                (ENG-082), or ``None`` for the embedded model.
            dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto`` for the checkpoint's
                own (ENG-081).
            generation_config: ``auto`` (the checkpoint's ``generation_config.json``),
                ``vllm`` (no model defaults) or a directory holding one (ENG-080).

        Raises:
            CheckpointError: a missing or malformed file, or an id not in the cache.
            InvalidRequest: a bad dtype or device.
        """
        from pagedkv.engine.config import EngineConfig
        from pagedkv.engine.generation_config import GenerationDefaults
        from pagedkv.engine.tokenizer import Tokenizer, eos_token_ids

        config = config or EngineConfig()
        path = resolve_model(model_dir)
        defaults = GenerationDefaults.load(generation_config, path)
        tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
        eos_ids = eos_token_ids(path)
        runner = self.for_batch(config.max_num_seqs).create_model_runner(
            str(path),
            num_pages=config.num_pages if config.mode == "v1" else None,
            page_size=config.page_size,
            dtype=resolve_dtype(dtype, path),
            device=device,
        )
        try:
            return self.create_engine(
                runner, config, tokenizer=tokenizer, eos_ids=eos_ids, generation_defaults=defaults
            )
        except BaseException:
            if isinstance(runner, Closable):  # a tensor-parallel runner's workers
                runner.close()
            raise

    def for_batch(self, max_num_seqs: int) -> ReferenceBackend:
        """This backend, its runners' fixed-shape decode batches going up to ``max_num_seqs``
        (ENG-226) unless ``runner_options.max_decode_batch`` says otherwise."""
        if self.runner_options.max_decode_batch is not None:
            return self
        options = dataclasses.replace(self.runner_options, max_decode_batch=max_num_seqs)
        return dataclasses.replace(self, runner_options=options)

    def create_paged_store(self, config: StoreConfig) -> PagedStore:
        """The reference store, or the store of the attention kernels ``runner_options``
        choose over its pools (ENG-199).

        Raises:
            InvalidRequest: a configuration the store refuses, or an ``attention`` that
                cannot run on its device.
        """
        from pagedkv.accel.cuda.attention_choice import attention_store
        from pagedkv.store.paged_store import TorchPagedStore

        eager = dataclasses.replace(self.runner_options, compile=False, cuda_graphs=False)
        return attention_store(TorchPagedStore(config), eager)

    def create_model_runner(
        self,
        model_dir: str,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = DEFAULT_DEVICE,
    ) -> StepRunner:
        """A runner for the checkpoint (see :class:`~pagedkv.interfaces.ModelBackend`); split
        over ``tensor_parallel_size`` ranks when that is above 1.

        Raises:
            InvalidRequest: ``tensor_parallel_size`` < 1, or an option the runner cannot
                honour.
        """
        from pagedkv.engine.runner import ModelRunner

        options = self.runner_options if num_pages is not None else self._v0_options()
        if self.tensor_parallel_size != 1:
            if self.tensor_parallel_size < 1:
                raise InvalidRequest(
                    f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
                )
            from pagedkv.parallel.launch import tensor_parallel_runner

            return tensor_parallel_runner(
                model_dir,
                self.tensor_parallel_size,
                num_pages=num_pages,
                page_size=page_size,
                dtype=dtype,
                device=device,
                options=options,
            )
        return ModelRunner.from_model_dir(
            model_dir,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            device=device,
            options=options,
        )

    def _v0_options(self) -> RunnerOptions:
        """The options of a v0 runner: what reads or captures paged K/V does not apply."""
        return dataclasses.replace(
            self.runner_options, compile=False, cuda_graphs=False, attention="reference"
        )


def reference_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:reference_backend``."""
    return ReferenceBackend()


def load_engine(
    model_dir: str | Path | None,
    config: EngineConfig | None = None,
    *,
    dtype: str = "float32",
    device: str = DEFAULT_DEVICE,
    generation_config: str = "auto",
    tensor_parallel_size: int = 1,
    runner_options: RunnerOptions | None = None,
) -> Engine:
    """The reference backend's engine for a model directory (see
    :meth:`ReferenceBackend.load_engine`), typed as the :class:`~pagedkv.interfaces.Engine`
    Protocol its users live on; its model split over ``tensor_parallel_size`` ranks and run
    with ``runner_options`` (unset: the defaults)."""
    return ReferenceBackend(
        tensor_parallel_size=tensor_parallel_size,
        runner_options=runner_options or RunnerOptions(),
    ).load_engine(
        model_dir, config, dtype=dtype, device=device, generation_config=generation_config
    )


def radix_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:radix_backend``: the reference with its prefix
    index swapped for the radix tree, held to the same suite."""
    return ReferenceBackend(name="pagedkv reference, radix prefix index", prefix_index="radix")


def compiled_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:compiled_backend``: the reference with its decode
    steps compiled by ``torch.compile`` (ENG-110), held to the same suites
    (``make conformance-compiled`` runs the golden ones)."""
    return ReferenceBackend(
        name="pagedkv reference, compiled decode", runner_options=RunnerOptions(compile=True)
    )


def triton_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:triton_backend``: the reference with its paged
    K/V written and attended by the Triton kernels (``attention="triton"``, ENG-199) and its
    norms, rotations and SwiGLU activations launched as Triton kernels too
    (``fused_ops="triton"``, ENG-220), its stores and runners held to the same suites; v0
    runners keep no pages and attend as the reference does, with the fused ops. Runs on a
    CUDA device, or on the CPU under ``TRITON_INTERPRET=1``."""
    return ReferenceBackend(
        name="pagedkv reference, Triton attention and fused ops",
        runner_options=RunnerOptions(attention="triton", fused_ops="triton"),
    )


def tensor_parallel_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:tensor_parallel_backend``: the reference with
    every model split over two ranks (each runner spawns its worker), held to the golden
    suites (``make conformance-tp``; minutes, not in ``make test``, which runs its own TP
    checks on shared workers)."""
    return ReferenceBackend(name="pagedkv reference, tensor-parallel x2", tensor_parallel_size=2)
