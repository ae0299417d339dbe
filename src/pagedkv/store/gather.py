"""Row gathers of K/V tensors at the speed of their bytes.

On the CPU, ``index_select`` of a 16-bit float tensor (bfloat16, float16) takes a slow path,
an order of magnitude slower than the same bytes viewed as int16 (``bench/kernels.md``). A
gather moves bytes and computes nothing, so it is done on an integer view of the same width:
the result is bit for bit the same.
"""

from __future__ import annotations

import torch

#: Integer dtype of the same width as each float dtype whose gather is slow.
_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor.index_select(0, index)``, bit for bit, through an integer view where faster.

    Preconditions: ``index`` is a 1-D integer tensor on ``tensor``'s device, every entry in
    ``[0, tensor.shape[0])`` (checked by ``index_select`` itself).
    """
    same_width = _SAME_WIDTH_INT.get(tensor.dtype)
    if same_width is None or tensor.device.type != "cpu":
        return tensor.index_select(0, index)
    return tensor.view(same_width).index_select(0, index).view(tensor.dtype)
