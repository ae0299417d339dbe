"""The model runner: owns the model and its cache mode, and runs one step plan.

Per step it prepares the step's attention from the plan once (every check and all host work:
the layout of the ragged batch, the store's metadata) and hands that immutable object to every
layer. Its cache mode is chosen once, at construction: :meth:`ModelRunner.paged` (v1, over a
PagedStore) or :meth:`ModelRunner.recompute` (v0, no cache).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pagedkv.accel.cpu.builder import build_cpu_model, weight_nbytes
from pagedkv.accel.cpu.host_memory import retain_freed_memory
from pagedkv.accel.cpu.primitive_cache import cap_primitive_caches
from pagedkv.accel.cuda.attention_choice import attention_store, static_decode_for
from pagedkv.accel.cuda.fused_choice import fused_ops_model
from pagedkv.accel.static_decode import StaticDecodePath, resolve_cuda_graphs, static_store
from pagedkv.device import DEFAULT_DEVICE
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore, StoreConfig
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention, RecomputeStepAttention, StepAttention
from pagedkv.plan import StepPlan
from pagedkv.store.paged_store import TorchPagedStore

#: Turns a step plan into the step's attention (validating the plan against the cache mode).
PrepareAttention = Callable[[StepPlan], StepAttention]

#: The fixed-shape decode path of the model a runner runs (given that model).
StaticDecodeOf = Callable[[Qwen3ForCausalLM], StaticDecodePath]


class ModelRunner:
    """Runs plans on a model; the only place the engine's work meets tensors of the model.

    Build it with :meth:`paged`, :meth:`recompute` or :meth:`from_model_dir`. The runner
    runs its own copy of the model it is given, built by the CPU backend with the modules its
    options choose (:func:`~pagedkv.accel.cpu.builder.build_cpu_model`); the model given is
    never changed, so several runners may be given one. Compiled or captured decode steps
    belong to this runner.

    Attributes:
        model: the Qwen3 model it runs.
        options: how it runs.
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        prepare: PrepareAttention,
        store: PagedStore | None = None,
        options: RunnerOptions | None = None,
        static_decode: StaticDecodeOf | None = None,
    ) -> None:
        self.options = resolve_cuda_graphs(options or RunnerOptions(), model, store)
        # The Triton norms, rotations and activations the options choose (ENG-220), in a copy.
        fused = fused_ops_model(model, self.options)
        if next(model.parameters()).device.type == "cpu":
            # Before the first oneDNN product (packing the weights is one), which reads them
            # (ENG-197).
            cap_primitive_caches()
        static = static_store(model, store, self.options)
        if static_decode is None and static is not None:
            static_decode = partial(static_decode_for, store=static, options=self.options)
        self.model = build_cpu_model(fused, store, self.options, static_decode is not None)
        self._prepare = prepare
        self._store = store
        self._static = None if static_decode is None else static_decode(self.model)
        self._retain_freed_memory(next(model.parameters()).device)

    def _retain_freed_memory(self, device: torch.device) -> None:
        """Apply ``options.retain_freed_memory`` (ENG-114).

        Raises:
            InvalidRequest: ``True`` where the C library cannot keep freed memory.
        """
        wanted = self.options.retain_freed_memory
        if wanted is False or (wanted is None and device.type != "cpu"):
            return
        if not retain_freed_memory() and wanted:
            raise InvalidRequest(
                "retain_freed_memory needs glibc's mallopt; this process's C library has none"
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights, packed ones counted as their plain size."""
        return weight_nbytes(self.model)

    @classmethod
    def paged(
        cls, model: Qwen3ForCausalLM, store: PagedStore, options: RunnerOptions | None = None
    ) -> ModelRunner:
        """A runner for v1 plans, writing and reading K/V in ``store``.

        Raises:
            InvalidRequest: the store is not shaped for the model (layers, KV heads, head dim),
                or ``options.attention`` cannot run over it.
        """
        shape, config = store.config, model.config
        kv_heads = model.layout.num_kv_heads  # a tensor-parallel rank's own (TP-002)
        if (shape.num_layers, shape.num_kv_heads, shape.head_dim) != (
            config.num_hidden_layers,
            kv_heads,
            config.head_dim,
        ):
            raise InvalidRequest(
                f"store holds {shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
                f"{shape.head_dim} channels; the model needs {config.num_hidden_layers} x "
                f"{kv_heads} x {config.head_dim}"
            )
        # The attention kernels the options choose, in the store's place (ENG-199).
        store = attention_store(store, options or RunnerOptions())
        return cls(model, partial(PagedStepAttention.prepare, store), store, options)

    @classmethod
    def recompute(
        cls, model: Qwen3ForCausalLM, options: RunnerOptions | None = None
    ) -> ModelRunner:
        """A runner for cache-less (v0) plans; it keeps no K/V.

        Raises:
            InvalidRequest: options that need a K/V pool (``cuda_graphs``, ``compile``, an
                ``attention`` other than the reference).
        """
        if options is not None and (options.cuda_graphs or options.compile):
            raise InvalidRequest("cuda_graphs and compile run decode steps of a v1 (paged) runner")
        if options is not None and options.attention != "reference":
            raise InvalidRequest(
                f"attention={options.attention!r} reads paged K/V: a v1 (paged) runner only"
            )
        return cls(model, RecomputeStepAttention.prepare, None, options)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = DEFAULT_DEVICE,
        options: RunnerOptions | None = None,
    ) -> ModelRunner:
        """Load a checkpoint; with ``num_pages`` set, preallocate its K/V pool once and run v1
        plans, else run v0 plans."""
        model = load_model(model_dir, dtype=dtype, device=device)
        return cls.for_model(model, num_pages=num_pages, page_size=page_size, options=options)

    @classmethod
    def for_model(
        cls,
        model: Qwen3ForCausalLM,
        *,
        num_pages: int | None,
        page_size: int,
        options: RunnerOptions | None = None,
    ) -> ModelRunner:
        """With ``num_pages`` set, a v1 runner over a fresh K/V pool shaped for ``model`` (for
        a tensor-parallel shard: its own K/V heads) in its dtype and on its device; else a v0
        runner."""
        if num_pages is None:
            return cls.recompute(model, options)
        cfg = model.config
        weight = next(model.parameters())
        store = TorchPagedStore(
            StoreConfig(
                num_layers=cfg.num_hidden_layers,
                num_kv_heads=model.layout.num_kv_heads,
                head_dim=cfg.head_dim,
                page_size=page_size,
                num_pages=num_pages,
                dtype=str(weight.dtype).removeprefix("torch."),
                device=str(weight.device),
            )
        )
        return cls.paged(model, store, options)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_positions(self) -> int:
        return self.model.config.max_positions

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32, on the runner's :attr:`device`: the engine samples
        them there, ENG-216) at each sequence's last scheduled row. A static decode step's
        are its output buffer, which its next replay overwrites: read them before the next
        call, as the engine does.

        Raises:
            InvalidRequest: a plan of the other cache mode, or one the store refuses.
        """
        with torch.inference_mode():
            attention = self._prepare(plan)
            copies = plan.page_copies_on_host  # checked on the host: nothing read back
            if copies is not None:
                if self._store is None:
                    raise InvalidRequest("a cache-less runner has no pages to copy")
                self._store.copy_pages(copies[0], copies[1])
            if (
                self._static is not None
                and isinstance(attention, PagedStepAttention)
                and self._static.fits(plan, attention.metadata)
            ):
                logits = self._static.run(plan, attention.metadata)
            else:
                logits = self.model(plan, attention)
        return logits.float()
