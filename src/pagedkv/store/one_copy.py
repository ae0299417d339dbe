"""Small host tensors moved to a device in one copy, each a view of a buffer of their own.

Why here: both the reference store (:mod:`pagedkv.store.ragged_attention`'s layouts) and the
CUDA room (:mod:`pagedkv.accel.cuda.staging`, the Triton store's metadata) move a step's small
integer tensors this way, and the store may not import the CUDA room; this module imports
torch and nothing of pagedkv but its errors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.errors import InvalidRequest


def move_once(parts: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``parts`` (1-D host tensors of one integer dtype, at least one) on ``device`` in one
    copy, each a view of a buffer of their own (PST-052, PST-054): for tensors that must
    outlive the step that made them, which a staging's reused buffers do not. On CUDA the host
    buffer is pinned and the copy non-blocking (the caching host allocator keeps the buffer
    until the copy is done); on the CPU the parts are concatenated and nothing moves.

    Raises:
        InvalidRequest: no parts, or a part that is not a 1-D host tensor.
    """
    if not parts:
        raise InvalidRequest("move_once moves at least one tensor")
    for part in parts:
        if part.dim() != 1 or part.device.type != "cpu":
            raise InvalidRequest(
                f"a staged part is a 1-D host tensor, got {list(part.shape)} on {part.device}"
            )
    lengths = [int(p.shape[0]) for p in parts]
    pinned = device.type == "cuda"
    host = torch.empty(sum(lengths), dtype=parts[0].dtype, pin_memory=pinned)
    torch.cat(list(parts), out=host)
    moved = host.to(device, non_blocking=pinned)
    return split_views(moved, lengths)


def split_views(buffer: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """``buffer`` cut into consecutive views of ``lengths`` (which sum to its length)."""
    return tuple(torch.split(buffer, lengths)) if lengths else ()
