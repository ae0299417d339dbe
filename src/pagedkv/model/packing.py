"""Repacking linear weights for oneDNN's CPU kernels, where that is faster.

torch's plain ``F.linear`` on a CPU weight calls MKL (float32) or a generic matrix-vector
product (bfloat16); oneDNN reads a weight repacked once into its blocked layout with AVX-512 or
AMX kernels. Measured on the benchmark machine (2 cores, AVX-512, torch 2.13, both threads;
``bench/README.md``), the linear layers of the Qwen3-0.6B shape, every weight read from memory
(packed for one row; packed for :data:`~pagedkv.model.layers.PACKED_FOR_ROWS`, as they are,
faster again):

| dtype    | rows | ``F.linear`` | oneDNN, packed |
|----------|------|--------------|----------------|
| float32  | 1    | 93 ms        | 75 ms          |
| float32  | 8    | 360 ms       | 145 ms         |
| float32  | 64   | 1017 ms      | 406 ms         |
| bfloat16 | 1    | 62 ms        | 34 ms          |

and a float32 product of 1024 rows reaches 383 GFLOP/s packed against 168 through MKL. So
batch-1 decode, batched decode and prefill are all faster packed, in both dtypes. oneDNN
rounds float32 differently from MKL (another order of the same float32 sums: about 4.5e-6
against 1.9e-6 of a float64 product on one 1024-wide row), well inside GLD's float32 tolerance.

Packing is decided once, after loading, for the whole model (:func:`pack_linear_weights`). A
tied LM head is the embedding table, which the embedding lookup still reads plainly: it gets a
packed copy of its own, ``vocab x hidden`` elements more memory, for the largest single read of
a decode step at the faster rate (the Qwen3-0.6B float32 head: 31 ms plain, 17 ms packed).

Products of one to four rows with a packed weight may skip oneDNN's kernel for one that
reads the packed layout itself, faster for those few rows (:mod:`pagedkv.model.packed_gemv`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.layers import Linear
from pagedkv.model.qwen3 import Qwen3ForCausalLM


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN runs ``dtype`` linear layers on ``device``: on a CPU with oneDNN,
    float32, and bfloat16 where oneDNN has bfloat16 kernels (AVX-512 BF16 or AMX). float16 is
    left to ``F.linear``."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.float32:
        return True
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


def is_packed(model: nn.Module) -> bool:
    """Whether any :class:`~pagedkv.model.layers.Linear` of ``model`` holds a packed weight."""
    return any(isinstance(m, Linear) and m.packed is not None for m in model.modules())


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights, a packed weight counted as its plain size."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    copy = getattr(model, "packed_head", None)  # a copy of the embedding table, counted there
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None and module is not copy:
            total += module.in_features * module.out_features * module.packed_itemsize
    return total
