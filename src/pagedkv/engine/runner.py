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
from typing import TypeVar

import torch

from pagedkv.engine.host_memory import retain_freed_memory
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.engine.static_decode import StaticDecode
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore, StoreConfig
from pagedkv.model.decode_layers import DecodeLayers, DecodeStep
from pagedkv.model.fused_norms import FusedNorms, has_fused_norms, use_fused_norms
from pagedkv.model.fused_swiglu import FusedSwiGLU, has_fused_swiglu, use_fused_swiglu
from pagedkv.model.loader import load_model
from pagedkv.model.packed_gemv import PackedGemv, has_packed_gemv, use_packed_gemv
from pagedkv.model.packed_layout import LAYOUTS
from pagedkv.model.packing import is_packed, pack_linear_weights, weight_nbytes
from pagedkv.model.qwen3 import Layers, Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention, RecomputeStepAttention, StepAttention
from pagedkv.native.build import BuildFailure
from pagedkv.plan import StepPlan
from pagedkv.store.native_decode import NativeDecode
from pagedkv.store.paged_store import PagedAttentionMetadata, TorchPagedStore

#: Turns a step plan into the step's attention (validating the plan against the cache mode).
PrepareAttention = Callable[[StepPlan], StepAttention]

#: A fused kernel of the model's layers (:class:`FusedNorms`, :class:`FusedSwiGLU`).
Kernel = TypeVar("Kernel")


def _fuse(
    option: str,
    fused: str,
    wanted: bool | None,
    already: bool,
    weight: torch.Tensor,
    build: Callable[[torch.dtype], Kernel | BuildFailure],
    use: Callable[[Kernel], object],
) -> None:
    """Apply the fusion option named ``option`` (``wanted``) to the model whose ``fused``
    layers ``already`` run a kernel, ``weight`` one of its weights: ``build`` the kernel for
    its dtype on the CPU and ``use`` it, unless ``wanted`` is ``False``.

    Raises:
        InvalidRequest: ``True`` where the kernel cannot run, ``False`` when ``already``.
    """
    if wanted is False:
        if already:
            raise InvalidRequest(f"{option}=False on a model whose {fused} another runner fused")
        return
    kernel = (
        build(weight.dtype)
        if weight.device.type == "cpu"
        else BuildFailure(f"the kernel runs on the CPU, the model is on {weight.device}")
    )
    if isinstance(kernel, BuildFailure):
        if wanted:
            raise InvalidRequest(f"{option}: {kernel.reason}")
        return
    use(kernel)


class ModelRunner:
    """Runs plans on a model; the only place the engine's work meets tensors of the model.

    Build it with :meth:`paged`, :meth:`recompute` or :meth:`from_model_dir`. Packing the
    weights (``options.packs``) changes the model itself, once: a model given to several
    runners stays packed, and a compiling runner refuses it. Compiled or captured decode steps
    belong to this runner.

    Attributes:
        model: the Qwen3 model.
        options: how it runs.
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        prepare: PrepareAttention,
        store: PagedStore | None = None,
        options: RunnerOptions | None = None,
        static_decode: StaticDecode | None = None,
    ) -> None:
        self.model = model
        self.options = options or RunnerOptions()
        self._prepare = prepare
        self._store = store
        self._static = static_decode
        if self.options.compile and (self.options.packs or is_packed(model)):
            raise InvalidRequest(
                "compile needs plain weights: inductor cannot lower oneDNN's packed ones "
                "(pack_weights=True, or a model packed by another runner)"
            )
        if self.options.packs:
            pack_linear_weights(model)
        self._fuse_kernels(model)
        self._use_packed_gemv(model)
        self._layers = self._decode_layers(model, store)
        self._retain_freed_memory(next(model.parameters()).device)

    def _fuse_kernels(self, model: Qwen3ForCausalLM) -> None:
        """Apply ``options.fused_norms`` (ENG-116) and ``options.fused_swiglu`` (ENG-159).

        Raises:
            InvalidRequest: ``True`` where a kernel cannot run, ``False`` on a model that
                another runner fused.
        """
        weight = model.model.norm.weight
        _fuse(
            "fused_norms",
            "norms",
            self.options.fused_norms,
            has_fused_norms(model),
            weight,
            FusedNorms.build,
            partial(use_fused_norms, model),
        )
        _fuse(
            "fused_swiglu",
            "MLPs",
            self.options.fused_swiglu,
            has_fused_swiglu(model),
            weight,
            FusedSwiGLU.build,
            partial(use_fused_swiglu, model),
        )

    def _use_packed_gemv(self, model: Qwen3ForCausalLM) -> None:
        """Apply ``options.packed_gemv`` (ENG-117).

        Raises:
            InvalidRequest: ``True`` where the kernel cannot be built or reads no layer's
                weight, ``False`` on a model whose layers another runner gave the kernel.
        """
        wanted = self.options.packed_gemv
        if wanted is False:
            if has_packed_gemv(model):
                raise InvalidRequest(
                    "packed_gemv=False on a model whose layers another runner gave the kernel"
                )
            return
        kernel = PackedGemv.build()
        if isinstance(kernel, BuildFailure):
            if wanted:
                raise InvalidRequest(f"packed_gemv: {kernel.reason}")
            return
        if use_packed_gemv(model, kernel) == 0 and wanted:
            raise InvalidRequest(
                "packed_gemv: no linear layer holds a weight packed in a layout the kernel "
                "reads (pack_weights off, compile on, or a dtype or device oneDNN does not "
                f"pack, or a layout other than {', '.join(layout.name for layout in LAYOUTS)})"
            )

    def _decode_layers(
        self, model: Qwen3ForCausalLM, store: PagedStore | None
    ) -> DecodeLayers | None:
        """Apply ``options.decode_layers`` (ENG-160): the program over ``store``'s pools.

        Raises:
            InvalidRequest: ``True`` where the program cannot run the model and store.
        """
        wanted = self.options.decode_layers
        if wanted is False:
            return None
        program = _decode_program(model, store, self._static is not None)
        if isinstance(program, BuildFailure):
            if wanted:
                raise InvalidRequest(f"decode_layers: {program.reason}")
            return None
        return program

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
            InvalidRequest: the store is not shaped for the model (layers, KV heads, head dim).
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
        options = options or RunnerOptions()
        static = None
        if options.cuda_graphs or options.compile:
            static = _static_decode(model, store, options)
        return cls(model, partial(PagedStepAttention.prepare, store), store, options, static)

    @classmethod
    def recompute(
        cls, model: Qwen3ForCausalLM, options: RunnerOptions | None = None
    ) -> ModelRunner:
        """A runner for cache-less (v0) plans; it keeps no K/V.

        Raises:
            InvalidRequest: options that need a K/V pool (``cuda_graphs``, ``compile``).
        """
        if options is not None and (options.cuda_graphs or options.compile):
            raise InvalidRequest("cuda_graphs and compile run decode steps of a v1 (paged) runner")
        return cls(model, RecomputeStepAttention.prepare, None, options)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = "cpu",
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
        """Logits ``[B, vocab]`` (float32, on the CPU) at each sequence's last scheduled row.

        Raises:
            InvalidRequest: a plan of the other cache mode, or one the store refuses.
        """
        with torch.inference_mode():
            attention = self._prepare(plan)
            if plan.page_copies is not None:
                if self._store is None:
                    raise InvalidRequest("a cache-less runner has no pages to copy")
                self._store.copy_pages(plan.page_copies[0], plan.page_copies[1])
            if (
                self._static is not None
                and isinstance(attention, PagedStepAttention)
                and isinstance(attention.metadata, PagedAttentionMetadata)
                and self._static.fits(plan, attention.metadata)
            ):
                logits = self._static.run(plan, attention.metadata)
            else:
                logits = self.model(plan, attention, self._layers_for(plan, attention))
        return logits.float().cpu()

    def _layers_for(self, plan: StepPlan, attention: StepAttention) -> Layers | None:
        """The decode layers program bound to this step, where it takes the step: every
        sequence decodes one row, all of them in the one group the C decode kernel attends,
        no more rows than its products take (ENG-160); else ``None``, the modules."""
        program = self._layers
        if program is None or not isinstance(attention, PagedStepAttention):
            return None
        metadata = attention.metadata
        if not isinstance(metadata, PagedAttentionMetadata) or len(metadata.layout.groups) != 1:
            return None
        # The groups cover every row once, so a lone decode group (the only kind with context
        # lengths) holds every row of the step, a sequence each, in order.
        (group,) = metadata.layout.groups
        if group.context_lens is None or not program.takes(plan.num_tokens):
            return None
        step = DecodeStep(attention.slot_mapping, group.kv_index, group.context_lens)
        return partial(program, step=step)


def _decode_program(
    model: Qwen3ForCausalLM, store: PagedStore | None, static: bool
) -> DecodeLayers | BuildFailure:
    """The decode layers program (ENG-160) of ``model`` over ``store``, or why it cannot be:
    it runs v1 steps over the reference store whose decode attention is the C kernel, not
    steps compiled or captured (``static``)."""
    if static:
        return BuildFailure("decode steps are compiled or captured (compile, cuda_graphs)")
    if not isinstance(store, TorchPagedStore):
        return BuildFailure("it runs v1 steps over pagedkv's TorchPagedStore")
    kernel = store.decode_kernel
    if not isinstance(kernel, NativeDecode):
        return BuildFailure("the store's decode attention is not its C kernel (PST-009)")
    pools = [(store.key_pool(i), store.value_pool(i)) for i in range(store.config.num_layers)]
    flat = [(keys.flatten(0, 1), values.flatten(0, 1)) for keys, values in pools]
    return DecodeLayers.build(model, flat, kernel.address)


#: Largest decode batch run by :class:`StaticDecode` (larger ones take the ordinary path).
STATIC_MAX_BATCH = 256


def _static_decode(
    model: Qwen3ForCausalLM, store: PagedStore, options: RunnerOptions
) -> StaticDecode:
    """The fixed-shape decode path of ``options`` over the reference store.

    Raises:
        InvalidRequest: ``compile`` with ``cuda_graphs`` (a step is captured or compiled,
            not both), CUDA graphs on a model not on a CUDA device, or a store other than
            the reference one (whose pools the captured step reads).
    """
    if options.compile and options.cuda_graphs:
        raise InvalidRequest("compile and cuda_graphs exclude each other: choose one")
    device = next(model.parameters()).device
    if options.cuda_graphs and device.type != "cuda":
        raise InvalidRequest(f"cuda_graphs needs a model on a CUDA device, not {device}")
    if not isinstance(store, TorchPagedStore):
        raise InvalidRequest("cuda_graphs and compile need pagedkv's TorchPagedStore")
    config = store.config
    return StaticDecode(
        model,
        store,
        max_batch=STATIC_MAX_BATCH,
        max_width=min(model.config.max_positions, config.num_pages * config.page_size),
        cuda_graphs=options.cuda_graphs,
        compile=options.compile,
    )
