"""oneDNN's packed linear weights: the CPU product used for most rows.

torch's plain ``F.linear`` on a CPU weight calls MKL (float32) or a generic matrix-vector
product (bfloat16); oneDNN reads a weight repacked once into its blocked layout with AVX-512 or
AMX kernels, faster for batch-1 decode, batched decode and prefill alike in both dtypes
(``bench/kernels.md`` has the figures). oneDNN rounds float32 differently from MKL (another
order of the same float32 sums), well inside GLD's float32 tolerance.
"""

from __future__ import annotations

import torch

#: The batch size oneDNN chooses a packed weight's blocked layout for. Packed for 32 rows,
#: products of 1 to 128 rows were as fast or faster than packed for 1 row on the 0.6B shape
#: (``bench/kernels.md``); vLLM's CPU backend packs for 32 rows too.
PACKED_FOR_ROWS = 32


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


def onednn_pack(weight: torch.Tensor, rows: int = PACKED_FOR_ROWS) -> torch.Tensor:
    """``weight`` ``[out, in]`` repacked into oneDNN's blocked layout for products of about
    ``rows`` rows (an opaque oneDNN tensor, read only by :func:`onednn_linear`)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    return packed


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN, ``packed`` from :func:`onednn_pack`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x, packed, None if bias is None else bias.detach(), "none", [], ""
    )
    return out
