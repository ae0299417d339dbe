"""How the ranks of a tensor-parallel group meet and talk: a TCP store, and two process groups.

* the **control** group (always gloo) carries rank 0's pickled messages to the workers
  (:mod:`pagedkv.parallel.messages`). A worker waits on it for as long as the engine is idle,
  so its timeout is effectively unbounded; a dead rank 0 closes the connection and ends the
  wait at once;
* the **data** group carries the model's all-reduces and the logits' gather: gloo for a CPU
  model, NCCL for CUDA. Its timeout bounds every collective (TP-022).

No process-wide state is touched: the groups are built directly on the store
(``ProcessGroupGloo(store, rank, size, timeout)``), never through
``torch.distributed.init_process_group``, so several groups (one per engine) may live in one
process, as they do in the tests.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

# The typed names of torch.distributed's store and group classes (the public module re-exports
# them untyped).
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore
from torch.distributed.rendezvous import rendezvous

from pagedkv.errors import InvalidRequest

#: Timeout of the control group: a worker waits this long for the next message.
CONTROL_TIMEOUT = datetime.timedelta(days=365 * 50)
#: Default bound of one collective of a step, seconds (TP-022).
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
#: Seconds a rank waits for the others to reach the store.
STORE_TIMEOUT_S = 300.0


class Work(Protocol):
    """A collective in flight."""

    def wait(self) -> bool:
        """Block until it is done; raises if it failed or timed out."""
        ...


class CollectiveGroup(Protocol):
    """The methods of a torch.distributed process group (``ProcessGroupGloo``,
    ``ProcessGroupNCCL``) that pagedkv calls; their stubs leave them out."""

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> Work:
        """Sum ``tensors[0]`` over the ranks, in place."""
        ...

    def broadcast(
        self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta | None = None
    ) -> Work:
        """Copy rank ``root``'s ``tensor`` into every rank's, within ``timeout`` (default:
        the group's)."""
        ...

    def gather(
        self, output_tensors: Sequence[torch.Tensor], input_tensor: torch.Tensor, root: int
    ) -> Work:
        """Each rank's ``input_tensor`` into rank ``root``'s ``output_tensors``."""
        ...


@dataclass(frozen=True)
class RankGroups:
    """One rank's view of its group.

    Attributes:
        rank: this rank.
        size: ranks in the group.
        store: the key-value store the group met on (replies and readiness go through it).
        control: gloo group of rank 0's messages.
        data: the group of the model's collectives (gloo or NCCL).
        device: the device this rank's model lives on.
        timeout: the bound of one collective, and of rank 0's sending of one message (a
            gloo send waits for the receiver: a worker that stopped answering must not hold
            rank 0 for the control group's unbounded timeout).
    """

    rank: int
    size: int
    store: Store
    control: CollectiveGroup
    data: CollectiveGroup
    device: torch.device
    timeout: datetime.timedelta


def host_store(size: int) -> TCPStore:
    """A TCP store on a free loopback port (``store.port``), hosted by this process (rank 0
    of a group it spawns)."""
    return TCPStore(
        "127.0.0.1",
        0,
        size,
        True,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )


def join_store(host: str, port: int, size: int) -> TCPStore:
    """The store of a group, hosted elsewhere."""
    return TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def environment_store() -> tuple[Store, int, int]:
    """``(store, rank, world size)`` of a ``torchrun`` launch (``env://``: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; torchrun's own store when its agent
    hosts one)."""
    store, rank, size = next(
        rendezvous("env://", timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    )
    return store, rank, size


def build_groups(
    store: Store, rank: int, size: int, device: torch.device, collective_timeout_s: float
) -> RankGroups:
    """The control and data groups of rank ``rank``; every rank calls it, in any order.

    Raises:
        InvalidRequest: a CUDA device on a torch without NCCL.
    """
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    control = _gloo(PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
    data_store = PrefixStore("data", store)
    if device.type == "cuda":
        data = _nccl_group(data_store, rank, size, timeout)
    else:
        data = _gloo(data_store, rank, size, timeout)
    return RankGroups(rank, size, store, control, data, device, timeout)


def _gloo(store: Store, rank: int, size: int, timeout: datetime.timedelta) -> CollectiveGroup:
    return cast("CollectiveGroup", ProcessGroupGloo(store, rank, size, timeout))


def _nccl_group(store: Store, rank: int, size: int, timeout: datetime.timedelta) -> CollectiveGroup:
    nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not dist.is_nccl_available():
        raise InvalidRequest("device cuda with tensor_parallel_size > 1 needs torch with NCCL")
    options = nccl.Options()
    options._timeout = timeout
    group: CollectiveGroup = nccl(store, rank, size, options)
    return group
