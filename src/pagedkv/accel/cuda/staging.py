"""Persistent staging of a step's small integer tensors: filled on the host, moved in one copy.

A step's plan is a handful of small int64 tensors (token ids, positions, offsets, context
lengths, page tables, slots, logits rows). Moved one by one from pageable host memory, each is
a synchronous copy of its own. :class:`PlanStaging` instead keeps two buffers for the life of
a scheduler: one on the host, page-locked (pinned) when the device is CUDA, and
one on the device. Each step writes its tensors into the host buffer back to back and moves
them with ONE copy, non-blocking from pinned memory, into the device buffer; the step's
tensors are views of the two buffers (ENG-224). :func:`~pagedkv.store.one_copy.move_once` is
the same single copy into a buffer of its own, for tensors that outlive the step (the Triton
store's metadata, PST-052; the reference store's layouts, PST-054).

The buffers grow geometrically (to at least twice their size) when a step needs more, and are
never shrunk, so a steady load allocates nothing per step. On the CPU (and on any device that
is not CUDA, such as ``meta`` in the tests) nothing is pinned and the copy is an ordinary
``copy_`` between two plain buffers: the same code runs everywhere.

Lifetime: the views :meth:`PlanStaging.stage` returns are valid until its next call, which
overwrites the buffers; a plan is built, run and dropped before the next one is built. Before
the host buffer is refilled, the previous copy out of it is waited for (a CUDA event: the host
waits for a copy it issued, and reads nothing back from the device). The device buffer is
overwritten by a copy queued on the current stream, after the work of the step that read it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.errors import InvalidRequest
from pagedkv.plan_builders import Staged
from pagedkv.store.one_copy import split_views

#: Elements a new staging holds before it first grows.
INITIAL_CAPACITY = 1024


class PlanStaging:
    """A host buffer and a device buffer of one integer dtype, reused step after step: the
    :class:`~pagedkv.plan_builders.Staging` the schedulers build their plans through.

    Args:
        device: where the staged tensors are wanted.
        dtype: their integer dtype (``torch.int64`` for a plan).
        capacity: elements held before the first growth, >= 1.

    Raises:
        InvalidRequest: a capacity below 1 or a dtype that is not an integer one.
    """

    def __init__(
        self,
        device: torch.device | str,
        dtype: torch.dtype = torch.int64,
        capacity: int = INITIAL_CAPACITY,
    ) -> None:
        if capacity < 1:
            raise InvalidRequest(f"a staging buffer holds at least 1 element, not {capacity}")
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise InvalidRequest(f"a staging buffer holds integers, not {dtype}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.pinned = self.device.type == "cuda"
        self._host = self._host_buffer(capacity)
        self._device = torch.empty(capacity, dtype=dtype, device=self.device)
        self._copied: torch.cuda.Event | None = None
        self.growths = 0

    @property
    def capacity(self) -> int:
        """Elements the buffers hold now."""
        return int(self._host.shape[0])

    @property
    def host_buffer(self) -> torch.Tensor:
        """The whole host buffer (pinned on CUDA); every staged host view is a view of it."""
        return self._host

    @property
    def device_buffer(self) -> torch.Tensor:
        """The whole device buffer; every staged device view is a view of it."""
        return self._device

    def stage(self, parts: Sequence[torch.Tensor]) -> Staged:
        """``parts`` (1-D host tensors of integers) written back to back into the host
        buffer, then moved to the device in one copy.

        Nothing is read from the device. The views returned stay valid until the next call.

        Raises:
            InvalidRequest: a part that is not a 1-D tensor on the CPU.
        """
        lengths = []
        for part in parts:
            if part.dim() != 1 or part.device.type != "cpu":
                raise InvalidRequest(
                    f"a staged part is a 1-D host tensor, got {list(part.shape)} on {part.device}"
                )
            lengths.append(int(part.shape[0]))
        total = sum(lengths)
        self._reserve(total)
        if self._copied is not None:
            # The previous step's copy may still be reading the host buffer: wait for it (a
            # copy this process queued; no value comes back from the device).
            self._copied.synchronize()
        host, device = self._host[:total], self._device[:total]
        offset = 0
        for part, length in zip(parts, lengths, strict=True):
            host[offset : offset + length].copy_(part)
            offset += length
        device.copy_(host, non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self._copied = event
        return Staged(split_views(host, lengths), split_views(device, lengths))

    def _reserve(self, total: int) -> None:
        """Grow both buffers to at least ``total`` elements, at least doubling; never shrink."""
        if total <= self.capacity:
            return
        capacity = max(total, 2 * self.capacity)
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._host = self._host_buffer(capacity)
        self._device = torch.empty(capacity, dtype=self.dtype, device=self.device)
        self.growths += 1

    def _host_buffer(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity, dtype=self.dtype, pin_memory=self.pinned)
