"""Repacking linear weights for oneDNN's CPU kernels, where that is faster.

torch's plain ``F.linear`` on a bfloat16 CPU weight runs a matrix-vector product that converts
and multiplies slower than memory delivers the weight: batch-1 decode is then bound by the
kernel, not the bandwidth. oneDNN reads a weight repacked once into its blocked layout with
AVX-512 bfloat16 dot products or AMX tiles, about 1.5x faster per decode step and no slower on
prefill (measured on the benchmark machine; see ``bench/README.md``). float32 weights gain
nothing from it (MKL's GEMV already streams at the read bandwidth) and would round differently
from transformers, so they are left alone.

Packing is decided once, after loading, for the whole model (:func:`pack_linear_weights`). A
tied LM head is the embedding table, which the embedding lookup still reads plainly: it gets a
packed copy of its own, ``vocab x hidden`` elements more memory for a quarter of the Qwen3-0.6B
decode step's bytes read at the faster rate.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.layers import Linear
from pagedkv.model.qwen3 import Qwen3ForCausalLM


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN runs ``dtype`` linear layers on ``device``: bfloat16 on a CPU where
    oneDNN has bfloat16 kernels (AVX-512 BF16 or AMX)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    supported: bool = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return supported


def pack_linear_weights(model: Qwen3ForCausalLM) -> int:
    """Repack every :class:`~pagedkv.model.layers.Linear` of ``model`` whose weight oneDNN runs
    faster (see :func:`packing_supported`), and a tied LM head; returns how many were packed.
    The plain weights are released, so the model holds one copy of each (two of a tied
    embedding table)."""
    table = model.model.embed_tokens.weight
    tied = model.lm_head is None and model.packed_head is None
    if tied and packing_supported(table.dtype, table.device):
        head = Linear(table.shape[1], table.shape[0], bias=False, device="meta")
        head.weight = table
        head.pack()
        model.packed_head = head
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None:
            weight = module.weight
            if packing_supported(weight.dtype, weight.device):
                module.pack()
                packed += 1
    return packed


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights, a packed weight counted as its plain size."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    copy = getattr(model, "packed_head", None)  # a copy of the embedding table, counted there
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None and module is not copy:
            total += module.in_features * module.out_features * module.packed_itemsize
    return total
