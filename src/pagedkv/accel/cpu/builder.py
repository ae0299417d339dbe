"""The CPU backend: builds the model a runner runs on the CPU out of the reference model, its
modules replaced by the C and oneDNN ones where the runner's options and the machine allow.

Each option of :class:`~pagedkv.engine.runner_options.RunnerOptions` is resolved here, once:
``pack_weights`` (oneDNN's packed weights, :mod:`pagedkv.accel.cpu.packed_linear`),
``fused_norms`` (ENG-116), ``fused_swiglu`` (ENG-159), ``packed_gemv`` (ENG-117) and
``decode_layers`` (ENG-160); with ``fused_ops="triton"`` (ENG-220) the norms and MLPs are
the CUDA room's substitutes, built before (:mod:`pagedkv.accel.cuda.fused_choice`), and the C
kernels of the same modules stay off. An option left ``None`` is on where it can run;
``True`` where it cannot is refused with the reason. The model given is never changed: the
result is a copy of its module tree sharing its tensors (:mod:`pagedkv.accel.substitution`).
A model that is itself the result of a build keeps the substitutes it has, each copied for the
new runner; an option that would remove one (``fused_norms=False`` on fused norms) is
refused, since the reference modules' plain weights are gone from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from pagedkv.accel.cpu.decode_layers import DecodeLayers, ProgramDecoderLayers
from pagedkv.accel.cpu.fused_norms import FusedNorms, FusedRMSNorm, has_fused_norms
from pagedkv.accel.cpu.fused_swiglu import FusedSwiGLU, FusedSwiGLUMLP, has_fused_swiglu
from pagedkv.accel.cpu.onednn import packing_supported
from pagedkv.accel.cpu.packed_gemv import PackedGemv
from pagedkv.accel.cpu.packed_layout import LAYOUTS
from pagedkv.accel.cpu.packed_linear import PackedProduct, has_packed_gemv, is_packed, packed
from pagedkv.accel.substitution import as_subclass, substituted_copy
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore
from pagedkv.model.layers import Linear, RMSNorm, SwiGLUMLP
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.native.build import BuildFailure
from pagedkv.store.native_decode import NativeDecode
from pagedkv.store.paged_store import TorchPagedStore

#: A kernel of the layers (:class:`FusedNorms`, :class:`FusedSwiGLU`).
Kernel = TypeVar("Kernel")


def build_cpu_model(
    model: Qwen3ForCausalLM,
    store: PagedStore | None,
    options: RunnerOptions,
    static: bool,
) -> Qwen3ForCausalLM:
    """The model a runner with ``options`` runs: ``model``'s substitute, over ``store``'s K/V
    pools (``None``: a cache-less runner), its decode steps compiled or captured where
    ``static``.

    Raises:
        InvalidRequest: an option set to ``True`` where it cannot run, or one that would take
            a substitute out of a built model, or ``compile`` with packed weights.
    """
    if options.compile and (options.packs or is_packed(model)):
        raise InvalidRequest(
            "compile needs plain weights: inductor cannot lower oneDNN's packed ones "
            "(pack_weights=True, or a model packed by another runner)"
        )
    weight = model.model.norm.weight
    # fused_ops="triton" (ENG-220): the CUDA room's substitutes hold the norms and MLPs, which
    # the C kernels leave alone (a conflicting setting was refused there).
    triton_ops = options.fused_ops == "triton"
    norms = (
        None
        if triton_ops
        else _kernel(
            "fused_norms",
            "norms",
            options.fused_norms,
            has_fused_norms(model),
            weight,
            FusedNorms.build,
        )
    )
    swiglu = (
        None
        if triton_ops
        else _kernel(
            "fused_swiglu",
            "MLPs",
            options.fused_swiglu,
            has_fused_swiglu(model),
            weight,
            FusedSwiGLU.build,
        )
    )
    gemv = _gemv(options.packed_gemv, model)

    def substitute(module: nn.Module) -> nn.Module | None:
        if isinstance(module, Linear):
            return _product(module, options.packs, gemv)
        if isinstance(module, RMSNorm) and norms is not None:
            return FusedRMSNorm.substitute(module, norms)
        if isinstance(module, SwiGLUMLP) and swiglu is not None:
            return FusedSwiGLUMLP.substitute(module, swiglu)
        if isinstance(module, ProgramDecoderLayers):
            return module.stack()
        return None

    built = substituted_copy(model, substitute)
    if options.packs and model.lm_head is None:
        built.lm_head = _tied_head(built, gemv)
    if gemv is not None and options.packed_gemv and not has_packed_gemv(built):
        raise InvalidRequest(
            "packed_gemv: no linear layer holds a weight packed in a layout the kernel "
            "reads (pack_weights off, compile on, or a dtype or device oneDNN does not "
            f"pack, or a layout other than {', '.join(layout.name for layout in LAYOUTS)})"
        )
    program = _decode_program(built, store, static, options.decode_layers)
    if program is not None:
        built.model.layers = ProgramDecoderLayers.substitute(built.model.layers, program)
    return built


def weight_nbytes(model: Qwen3ForCausalLM) -> int:
    """Bytes of ``model``'s weights, a packed weight counted as its plain size and a tied LM
    head's packed copy of the embedding table not counted again."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied_copy = model.lm_head if model.config.tie_word_embeddings else None
    for module in model.modules():
        if isinstance(module, PackedProduct) and module is not tied_copy:
            total += module.plain_nbytes
    return total


def _kernel(
    option: str,
    layers: str,
    wanted: bool | None,
    already: bool,
    weight: torch.Tensor,
    build: Callable[[torch.dtype], Kernel | BuildFailure],
) -> Kernel | None:
    """The kernel of the option named ``option`` (``wanted``) for the model whose ``layers``
    ``already`` run one, ``weight`` one of its weights: built for its dtype on the CPU, unless
    ``wanted`` is ``False``; ``None`` where it is off or cannot run.

    Raises:
        InvalidRequest: ``True`` where the kernel cannot run, ``False`` when ``already``.
    """
    if wanted is False:
        if already:
            raise InvalidRequest(f"{option}=False on a model whose {layers} another runner fused")
        return None
    kernel = (
        build(weight.dtype)
        if weight.device.type == "cpu"
        else BuildFailure(f"the kernel runs on the CPU, the model is on {weight.device}")
    )
    if isinstance(kernel, BuildFailure):
        if wanted:
            raise InvalidRequest(f"{option}: {kernel.reason}")
        return None
    return kernel


def _gemv(wanted: bool | None, model: Qwen3ForCausalLM) -> PackedGemv | None:
    """The kernel of products of few rows (ENG-117), unless ``wanted`` is ``False``.

    Raises:
        InvalidRequest: ``True`` where it cannot be built, ``False`` on a model whose layers
            another runner gave it.
    """
    if wanted is False:
        if has_packed_gemv(model):
            raise InvalidRequest(
                "packed_gemv=False on a model whose layers another runner gave the kernel"
            )
        return None
    kernel = PackedGemv.build()
    if isinstance(kernel, BuildFailure):
        if wanted:
            raise InvalidRequest(f"packed_gemv: {kernel.reason}")
        return None
    return kernel


def _product(layer: Linear, packs: bool, gemv: PackedGemv | None) -> Linear | None:
    """``layer``'s substitute: packed where ``packs`` and oneDNN runs its dtype (a layer
    packed already stays so), given ``gemv`` where the kernel reads its layout; ``None``:
    ``layer`` as it is."""
    if isinstance(layer, PackedProduct):
        product: PackedProduct = as_subclass(layer, type(layer))
    elif packs and packing_supported(layer.weight.dtype, layer.weight.device):
        product = packed(layer)
    else:
        return None
    reads = gemv is not None and gemv.reads(product.packed_weight)
    product.gemv = gemv if reads else None
    return product


def _tied_head(model: Qwen3ForCausalLM, gemv: PackedGemv | None) -> Linear | None:
    """A packed copy of the tied embedding table as the LM head, where oneDNN runs its dtype:
    the largest single read of a decode step at the packed rate, for ``vocab x hidden``
    elements more memory (the embedding lookup still reads the table plainly)."""
    table = model.model.embed_tokens.weight
    if not packing_supported(table.dtype, table.device):
        return None
    head = Linear(table.shape[1], table.shape[0], bias=False, device="meta")
    return _product(packed(head, table), True, gemv)


def _decode_program(
    model: Qwen3ForCausalLM, store: PagedStore | None, static: bool, wanted: bool | None
) -> DecodeLayers | None:
    """The decode layers program (ENG-160) of ``model`` over ``store``'s pools, unless
    ``wanted`` is ``False``; ``None`` where it is off or cannot run.

    Raises:
        InvalidRequest: ``True`` where the program cannot run the model and store.
    """
    if wanted is False:
        return None
    program = _program(model, store, static)
    if isinstance(program, BuildFailure):
        if wanted:
            raise InvalidRequest(f"decode_layers: {program.reason}")
        return None
    return program


def _program(
    model: Qwen3ForCausalLM, store: PagedStore | None, static: bool
) -> DecodeLayers | BuildFailure:
    """The program, or why it cannot be: it runs v1 steps over the reference store whose
    decode attention is the C kernel, not steps compiled or captured (``static``)."""
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
