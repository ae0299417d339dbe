"""Every decoder layer of a decode step in one C call (``native/decode_layers.c``, built on first
use by :mod:`pagedkv.native.build`), ENG-160.

Why: with its products, norms, activation and attention each a C kernel already, a Qwen3 layer
of a decode step is still about ten calls from Python (the fused norms, four packed products,
the activation, two K/V copies and the attention), each behind its module, its checks and a
``ctypes`` call: a tenth of a batch-1 decode step of the 0.6B shape. The C program makes the
same calls in the same order, through each kernel's own entry point, on buffers of the same
shapes, so its output is the modules' to the bit; a step pays one call for all its layers
(``bench/kernels.md`` has the figures).

The program writes each layer's K/V into the reference store's pools itself, at the plan's
slots, where the store's ``write`` would (as the compiled and captured decode steps of
:mod:`pagedkv.accel.static_decode` read them), so it is built over a
:class:`~pagedkv.store.paged_store.TorchPagedStore` only.

It runs a step whose every sequence decodes one row, on a model whose every layer the kernels
take whole: dense, one rank, no attention bias, its norms and activation fused
(:mod:`pagedkv.accel.cpu.fused_norms`, :mod:`pagedkv.accel.cpu.fused_swiglu`), every product of
its layers read from its packed weight (:mod:`pagedkv.accel.cpu.packed_gemv`) for that many
rows, and K/V pools of the model's dtype attended by the C decode kernel
(:mod:`pagedkv.store.native_decode`). It takes the place of the model's decoder stack
(:class:`ProgramDecoderLayers`), which runs the modules for any other step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.accel.cpu.fused_norms import MAX_CHANNELS, MAX_HEAD_DIM, FusedRMSNorm
from pagedkv.accel.cpu.fused_swiglu import FusedSwiGLUMLP
from pagedkv.accel.cpu.packed_layout import PackedWeight
from pagedkv.accel.cpu.packed_linear import PackedProduct
from pagedkv.accel.substitution import as_subclass
from pagedkv.model.qwen3 import DecoderLayers, Qwen3DecoderLayer, Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention, StepAttention
from pagedkv.native.build import BuildFailure, load_library
from pagedkv.store.paged_store import PagedAttentionMetadata

#: The program's C source, shipped with the package.
SOURCE = Path(__file__).with_name("native") / "decode_layers.c"

_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64

#: A layer's products, as :class:`_Layer`'s fields name them (its weights, then their entry
#: points ``<name>_product``).
_PRODUCTS = ("qkv", "o", "gate_up", "down")


class _Model(ctypes.Structure):
    """``struct model`` of the C source."""

    _fields_ = [
        *((name, _POINTER) for name in ("add_rms_norm", "rms_norm_rope", "swiglu", "decode")),
        *((name, _SIZE) for name in ("bf16", "hidden", "heads", "kv_heads", "dim", "inter")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


class _Layer(ctypes.Structure):
    """``struct layer`` of the C source: norms' weights, packed weights, their products'
    entry points, the K/V pools."""

    _fields_ = [
        (name, _POINTER)
        for name in (
            "input_norm",
            "post_norm",
            "q_norm",
            "k_norm",
            *_PRODUCTS,
            *(f"{p}_product" for p in _PRODUCTS),
            "keys",
            "values",
        )
    ]


#: The buffers of ``struct step`` after ``hidden``, in its order (each a part of one
#: allocation).
_BUFFERS = ("residual", "spare", "normed", "qkv", "q", "k", "attended", "o", "gate_up", "act")

#: Elements each buffer's start is a multiple of: 64 bytes or more in either dtype.
ALIGN = 32


class _Step(ctypes.Structure):
    """``struct step`` of the C source."""

    _fields_ = [
        ("rows", _SIZE),
        ("width", _SIZE),
        *((name, _POINTER) for name in ("slots", "kv_index", "lengths", "cos", "sin")),
        *((name, _POINTER) for name in ("hidden", *_BUFFERS)),
    ]


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """What a decode step's layers read besides the model, prepared by the store once.

    Attributes:
        slots: ``[rows]`` int64 slot each row's K/V are written to.
        kv_index: ``[rows, width]`` int64 slot of each position each row attends to (only its
            first ``lengths[row]`` are read).
        lengths: ``[rows]`` int64 positions each row attends to, its own included.
    """

    slots: torch.Tensor
    kv_index: torch.Tensor
    lengths: torch.Tensor


@dataclass(frozen=True, slots=True)
class _LayerModules:
    """One dense layer's modules the program reads."""

    norms: tuple[FusedRMSNorm, ...]
    products: tuple[PackedProduct, ...]
    mlp: FusedSwiGLUMLP


class DecodeLayers:
    """The program for one model and its K/V pools. Build it with :meth:`build`; call it on a
    step :meth:`takes`."""

    def __init__(
        self,
        library: ctypes.CDLL,
        model: Qwen3ForCausalLM,
        layers: Sequence[_LayerModules],
        pools: Sequence[tuple[torch.Tensor, torch.Tensor]],
        decode: int,
    ) -> None:
        self._entry = library.decode_layers
        self._entry.argtypes = [_POINTER, _POINTER, _SIZE, _POINTER, ctypes.c_int]
        self._entry.restype = ctypes.c_int
        config = model.config
        first = layers[0]
        gemv = first.products[0].gemv
        fused, swiglu = first.norms[0].kernel, first.mlp.kernel
        if gemv is None:
            raise ValueError("build checks the kernels first")
        self._gemv = gemv
        norm, rope = fused.addresses
        self.dtype = fused.dtype
        self._model = _Model(
            norm,
            rope,
            swiglu.address,
            decode,
            int(self.dtype == torch.bfloat16),
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
            first.norms[0].eps,
            config.head_dim**-0.5,
        )
        self._layers = layers
        self._pools = pools
        #: For each row count seen: the layers' structs with their product entry points for
        #: it, each buffer's offset in the step's allocation, and that allocation's elements.
        self._programs: dict[int, tuple[ctypes.Array[_Layer], tuple[int, ...], int]] = {}
        hidden, q_width = config.hidden_size, config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        #: Elements per row of each buffer of :data:`_BUFFERS`.
        self._row_widths = (
            *(hidden, hidden, hidden, q_width + 2 * kv_width),
            *(q_width, kv_width, q_width, hidden, 2 * inter, inter),
        )
        self.max_rows = min(
            gemv.max_rows(_weight(p).layout) for layer in layers for p in layer.products
        )

    @classmethod
    def build(
        cls,
        model: Qwen3ForCausalLM,
        pools: Sequence[tuple[torch.Tensor, torch.Tensor]],
        decode: int,
        folder: Path | None = None,
    ) -> DecodeLayers | BuildFailure:
        """The program for ``model`` with each layer's ``(keys, values)`` pool
        ``[slots, kv_heads, head_dim]`` and the C decode kernel's entry point ``decode``
        (:attr:`~pagedkv.store.native_decode.NativeDecode.address`), built if needed; the
        reason it cannot run them."""
        layers = _layer_modules(model)
        if isinstance(layers, BuildFailure):
            return layers
        config = model.config
        dtype = next(model.parameters()).dtype
        shape = (config.num_key_value_heads, config.head_dim)
        if len(pools) != len(layers) or any(
            pool.dtype != dtype or pool.dim() != 3 or tuple(pool.shape[1:]) != shape
            for pair in pools
            for pool in pair
        ):
            return BuildFailure(f"every layer's K/V pools must be {dtype}, [slots, *{shape}]")
        if not all(pool.is_contiguous() for pair in pools for pool in pair):
            return BuildFailure("the K/V pools must be contiguous")
        library = load_library(SOURCE, folder)
        if isinstance(library, BuildFailure):
            return library
        return cls(library, model, layers, pools, decode)

    def takes(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` sequences runs here (every product has a kernel
        for that many rows), outside ``torch.compile``."""
        return 1 <= rows <= self.max_rows and not torch.compiler.is_compiling()

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: DecodeStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on ``hidden`` ``[rows, hidden_size]`` (the embeddings, overwritten),
        rotated by ``cos`` and ``sin`` ``[rows, head_dim]``: the last layer's output and its
        residual stream, as the modules return them.

        Raises:
            ValueError: a kernel failed (a scratch buffer could not be allocated).
        """
        rows = hidden.shape[0]
        hidden = hidden.contiguous()
        cos, sin = cos.to(self.dtype).contiguous(), sin.to(self.dtype).contiguous()
        slots = step.slots.to(torch.int64).contiguous()
        kv_index = step.kv_index.to(torch.int64).contiguous()
        lengths = step.lengths.to(torch.int64).contiguous()
        program, offsets, total = self._program(rows)
        scratch = torch.empty(total, dtype=self.dtype)
        base, itemsize = scratch.data_ptr(), scratch.element_size()
        struct = _Step(
            rows,
            kv_index.shape[1],
            slots.data_ptr(),
            kv_index.data_ptr(),
            lengths.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            hidden.data_ptr(),
            *(base + offset * itemsize for offset in offsets),
        )
        failed = self._entry(
            ctypes.byref(self._model),
            program,
            len(program),
            ctypes.byref(struct),
            torch.get_num_threads(),
        )
        if failed:
            raise ValueError(f"layer {failed - 1} of the decode step failed in a kernel")
        return hidden, scratch[: hidden.numel()].view(hidden.shape)

    def _program(self, rows: int) -> tuple[ctypes.Array[_Layer], tuple[int, ...], int]:
        """For ``rows`` rows: the layers' structs with their product entry points, each
        buffer's offset in the step's one allocation (:data:`ALIGN`-aligned), and its size."""
        program = self._programs.get(rows)
        if program is None:
            offsets, total = [], 0
            for width in self._row_widths:
                offsets.append(total)
                total += -(-rows * width // ALIGN) * ALIGN
            structs = []
            for layer, (keys, values) in zip(self._layers, self._pools, strict=True):
                weights = [_weight(p) for p in layer.products]
                entries = [self._gemv.entry_address(w.layout, rows) for w in weights]
                structs.append(
                    _Layer(
                        *(norm.weight.data_ptr() for norm in layer.norms),
                        *(w.address for w in weights),
                        *entries,
                        keys.data_ptr(),
                        values.data_ptr(),
                    )
                )
            program = ((_Layer * len(structs))(*structs), tuple(offsets), total)
            self._programs[rows] = program
        return program


def _weight(product: PackedProduct) -> PackedWeight:
    weight = product.packed_weight
    if weight is None:
        raise ValueError("build checks every product's packed weight first")
    return weight


def _layer_modules(model: Qwen3ForCausalLM) -> list[_LayerModules] | BuildFailure:
    """Each layer's modules, or the reason the program cannot run the model."""
    config = model.config
    if model.layout.size != 1:
        return BuildFailure("the decode layers program runs a model of one rank")
    if config.hidden_size > MAX_CHANNELS or config.head_dim > MAX_HEAD_DIM:
        return BuildFailure("the fused norms do not take rows this wide")
    layers = []
    for layer in model.model.layers:
        if not isinstance(layer, Qwen3DecoderLayer):
            return BuildFailure(f"the decode layers program runs Qwen3 layers, not {layer}")
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, FusedSwiGLUMLP):
            return BuildFailure(
                "the decode layers program runs dense MLPs with fused norms and SwiGLU"
            )
        norms = (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            attention.q_norm,
            attention.k_norm,
        )
        products = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(p.bias is not None for p in products):
            return BuildFailure("the decode layers program runs bias-free projections")
        fused_norms = tuple(n for n in norms if isinstance(n, FusedRMSNorm))
        if len(fused_norms) != len(norms):
            return BuildFailure("the decode layers program needs fused norms and SwiGLU")
        packed = tuple(
            p
            for p in products
            if isinstance(p, PackedProduct) and p.gemv is not None and p.packed_weight is not None
        )
        if len(packed) != len(products):
            return BuildFailure("the decode layers program needs every product packed_gemv's")
        layers.append(_LayerModules(fused_norms, packed, mlp))
    if not layers:
        return BuildFailure("the model has no layers")
    return layers


class ProgramDecoderLayers(DecoderLayers):
    """The decoder stack that runs a decode step it takes through :attr:`program`, and any
    other step through its layers. Build it with :meth:`substitute`."""

    program: DecodeLayers

    @classmethod
    def substitute(cls, layers: DecoderLayers, program: DecodeLayers) -> ProgramDecoderLayers:
        """``layers``' substitute (the same layer modules, which ``program`` reads)."""
        return as_subclass(layers, cls, program=program)

    def stack(self) -> DecoderLayers:
        """The reference stack of the same layers, without the program (which is bound to one
        store's pools)."""
        return DecoderLayers(list(self))

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: StepAttention
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer on the embeddings ``hidden`` ``[T, hidden_size]``: the last layer's
        ``(output, residual)``."""
        step = self.decode_step(attention, hidden.shape[0])
        if step is None:
            return super().forward(hidden, cos, sin, attention)
        return self.program(hidden, cos, sin, step)

    def decode_step(self, attention: StepAttention, rows: int) -> DecodeStep | None:
        """What the program reads of a step of ``rows`` rows, where it takes the step: every
        sequence decodes one row, all of them in the one group the C decode kernel attends,
        no more rows than its products take (ENG-160); else ``None``, the modules."""
        if not isinstance(attention, PagedStepAttention):
            return None
        metadata = attention.metadata
        if not isinstance(metadata, PagedAttentionMetadata) or len(metadata.layout.groups) != 1:
            return None
        # The groups cover every row once, so a lone decode group (the only kind with context
        # lengths) holds every row of the step, a sequence each, in order.
        (group,) = metadata.layout.groups
        if group.context_lens is None or not self.program.takes(rows):
            return None
        return DecodeStep(attention.slot_mapping, group.kv_index, group.context_lens)


def decode_program(model: Qwen3ForCausalLM) -> DecodeLayers | None:
    """The decode layers program ``model``'s decoder stack runs, or ``None``: the modules."""
    layers = model.model.layers
    return layers.program if isinstance(layers, ProgramDecoderLayers) else None
