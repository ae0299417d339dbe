"""The model's collectives over a process group, timed, and rank 0's messages to the workers.

:class:`GroupCollectives` implements :class:`~pagedkv.model.tensor_parallel.Collectives` on the
data group: a sum all-reduce (in place) and a gather of the logits' columns on rank 0. It adds
up the seconds spent waiting in them, which is how a step's communication share is measured
(on CUDA only when ``synchronize`` is on, since NCCL returns before the transfer ends).

:class:`MessageChannel` broadcasts pickled messages from rank 0 on the control group: one
broadcast of a fixed :data:`INLINE_BYTES` buffer (length, then the start of the message), and a
second one only for a message that does not fit (a long prefill's plan).
"""

from __future__ import annotations

import pickle
import time

import torch

from pagedkv.parallel.process_group import RankGroups

#: Bytes of the first broadcast of a message: a decode step's plan fits in it.
INLINE_BYTES = 8192
#: Bytes of the length prefix.
_LENGTH_BYTES = 8


class GroupCollectives:
    """The collectives of one rank's model shard, on its data group.

    Attributes:
        seconds: time spent in collectives since creation (or the last :meth:`reset`).
        calls: collectives run since then.
        synchronize: synchronise the device around each collective, so that ``seconds`` is
            the transfer's time on CUDA too (slower; for measurements).
    """

    def __init__(self, groups: RankGroups, *, synchronize: bool = False) -> None:
        self._groups = groups
        self.seconds = 0.0
        self.calls = 0
        self.synchronize = synchronize and groups.device.type == "cuda"

    def reset(self) -> None:
        """Start counting again."""
        self.seconds = 0.0
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        start = self._start()
        tensor = tensor.contiguous()
        self._groups.data.allreduce([tensor]).wait()
        self._stop(start)
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        start = self._start()
        tensor = tensor.contiguous()
        first = self._groups.rank == 0
        outputs = [torch.empty_like(tensor) for _ in range(self._groups.size)] if first else []
        self._groups.data.gather(outputs, tensor, 0).wait()
        self._stop(start)
        return torch.cat(outputs, dim=1) if first else None

    def _start(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self._groups.device)
        return time.perf_counter()

    def _stop(self, start: float) -> None:
        if self.synchronize:
            torch.cuda.synchronize(self._groups.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1


class MessageChannel:
    """Rank 0's pickled messages to every other rank, on the control group.

    Every rank calls :meth:`send` (rank 0) or :meth:`receive` (the others) in the same
    order. Messages are pickled: rank 0 and the workers run the same pagedkv.
    """

    def __init__(self, groups: RankGroups) -> None:
        self._groups = groups

    def send(self, message: object) -> None:
        """Broadcast ``message`` from rank 0, within the collective timeout.

        Raises:
            RuntimeError: a worker is gone or did not take the message in time.
        """
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
        head[:_LENGTH_BYTES] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        inline = payload[: INLINE_BYTES - _LENGTH_BYTES]
        head[_LENGTH_BYTES : _LENGTH_BYTES + len(inline)] = torch.frombuffer(
            bytearray(inline), dtype=torch.uint8
        )
        timeout = self._groups.timeout  # bounded on the sending side only
        self._groups.control.broadcast(head, 0, timeout).wait()
        rest = payload[len(inline) :]
        if rest:
            tail = torch.frombuffer(bytearray(rest), dtype=torch.uint8)
            self._groups.control.broadcast(tail, 0, timeout).wait()

    def receive(self) -> object:
        """The next message from rank 0 (blocks until it comes or rank 0 is gone)."""
        head = torch.empty(INLINE_BYTES, dtype=torch.uint8)
        self._groups.control.broadcast(head, 0).wait()
        length = int(head[:_LENGTH_BYTES].view(torch.int64).item())
        inline = min(length, INLINE_BYTES - _LENGTH_BYTES)
        payload = head[_LENGTH_BYTES : _LENGTH_BYTES + inline].numpy().tobytes()
        if length > inline:
            tail = torch.empty(length - inline, dtype=torch.uint8)
            self._groups.control.broadcast(tail, 0).wait()
            payload += tail.numpy().tobytes()
        return pickle.loads(payload)
