"""Rank 0's handle on its tensor-parallel group: the workers, the channel to them, their
liveness, and the group's end.

A group is started in one of two ways (TP-020, TP-021):

* :meth:`WorkerGroup.spawn`: this process is rank 0 and starts ``size - 1`` worker processes
  on this machine (``spawn`` start method), which meet it on a TCP store on a free loopback
  port; it watches their processes;
* :meth:`WorkerGroup.from_environment`: under ``torchrun`` every rank was started by the
  launcher and meets by ``env://``; rank 0 gets the group, the others serve
  (:func:`pagedkv.parallel.worker.serve_rank`).

Once a collective or a message fails, the group is broken for good: it records the
:class:`~pagedkv.errors.WorkerFailed` error, ends the workers it started, and raises that error
on every later use (TP-022). :meth:`close` ends the workers and joins them (TP-023).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import weakref
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as torch_mp
from torch._C._distributed_c10d import Store

from pagedkv.device import DEFAULT_DEVICE
from pagedkv.errors import InvalidRequest, WorkerFailed
from pagedkv.parallel.collectives import GroupCollectives, MessageChannel
from pagedkv.parallel.messages import LoadReply, Message, Shutdown
from pagedkv.parallel.process_group import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    RankGroups,
    build_groups,
    environment_store,
    host_store,
)
from pagedkv.parallel.worker import SpawnedWorker, rank_device, spawned_worker_main

logger = logging.getLogger("pagedkv.parallel")

#: Seconds to wait for spawned workers to reach the store before giving up on one.
START_TIMEOUT_S = 300.0
#: Seconds a load may take on a worker.
LOAD_TIMEOUT_S = 1800.0
#: Seconds :meth:`WorkerGroup.close` waits for a worker to leave before ending it.
JOIN_TIMEOUT_S = 10.0
#: Seconds a failure waits for the process that caused it to show as exited.
EXIT_GRACE_S = 2.0
#: Seconds between liveness checks while waiting on the store.
POLL_S = 0.02


class WorkerGroup:
    """Rank 0 of a tensor-parallel group. Build it with :meth:`spawn` or
    :meth:`from_environment`.

    Attributes:
        groups: rank 0's process groups.
        collectives: rank 0's collectives (timed: :attr:`GroupCollectives.seconds`).
        processes: the workers this process started, rank ``i + 1`` at ``i``; empty under
            torchrun.
    """

    def __init__(self, groups: RankGroups, processes: list[BaseProcess]) -> None:
        self.groups = groups
        self.collectives = GroupCollectives(groups)
        self.processes = processes
        self._channel = MessageChannel(groups)
        self._failure: WorkerFailed | None = None
        self._closed = False
        self._loads = 0
        #: Whether a runner holds the group's workers now (one at a time).
        self.in_use = False
        # A group dropped without close() still ends the processes it started.
        self._finalizer = weakref.finalize(self, _end, list(processes))

    @property
    def size(self) -> int:
        return self.groups.size

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @property
    def failure(self) -> WorkerFailed | None:
        """The error that broke the group, if any."""
        return self._failure

    @classmethod
    def spawn(
        cls,
        size: int,
        device_type: str = DEFAULT_DEVICE,
        *,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        threads: int | None = None,
    ) -> WorkerGroup:
        """Start ``size - 1`` workers on this machine; this process is rank 0.

        Args:
            size: ranks in the group, >= 1.
            device_type: ``cpu`` (gloo) or ``cuda`` (NCCL; rank ``r`` on ``cuda:r``).
            collective_timeout_s: bound of one collective, > 0.
            threads: intra-op threads of each worker (default: this process's count).

        Raises:
            InvalidRequest: a bad size, device type or timeout, or fewer CUDA devices than
                ranks.
            WorkerFailed: a worker died before it joined.
        """
        _check_group(size, device_type, collective_timeout_s)
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise InvalidRequest(
                f"tensor_parallel_size={size} needs {size} CUDA devices, this machine has "
                f"{torch.cuda.device_count()}"
            )
        store = host_store(size)
        context = torch_mp.get_context("spawn")
        threads = torch.get_num_threads() if threads is None else threads
        processes: list[BaseProcess] = []
        for rank in range(1, size):
            worker = SpawnedWorker(
                rank, size, store.port, device_type, collective_timeout_s, threads
            )
            process: BaseProcess = context.Process(
                target=spawned_worker_main,
                args=(worker,),
                name=f"pagedkv-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            processes.append(process)
            logger.info("tensor-parallel worker rank %d started (pid %s)", rank, process.pid)
        try:
            for rank, process in enumerate(processes, start=1):
                _wait_key(store, f"ready/{rank}", [process], START_TIMEOUT_S, "to start")
            groups = build_groups(store, 0, size, rank_device(device_type, 0), collective_timeout_s)
        except BaseException:
            _end(processes)
            raise
        return cls(groups, processes)

    @classmethod
    def from_environment(
        cls,
        size: int,
        device_type: str = DEFAULT_DEVICE,
        *,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ) -> tuple[WorkerGroup | None, RankGroups]:
        """Join the group of a ``torchrun`` launch (TP-021).

        Returns:
            ``(group, groups)``: on rank 0 its group; on the others ``None`` and the rank's
            groups, to serve (:func:`pagedkv.parallel.worker.serve_rank`).

        Raises:
            InvalidRequest: ``size`` is not the launch's ``WORLD_SIZE``, or a bad device type
                or timeout.
        """
        _check_group(size, device_type, collective_timeout_s)
        store, rank, world = environment_store()
        if world != size:
            raise InvalidRequest(
                f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} ranks"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        device = rank_device(device_type, local_rank)
        groups = build_groups(store, rank, size, device, collective_timeout_s)
        if rank != 0:
            return None, groups
        return cls(groups, []), groups

    # -- use --------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the group's failure, if any, after a liveness check of the workers this
        process started (cheap: no message is sent).

        Raises:
            WorkerFailed: a worker died, now or before.
            InvalidRequest: the group was closed.
        """
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise InvalidRequest("the tensor-parallel group is closed")
        if any(not process.is_alive() for process in self.processes):
            raise self.fail(None)

    def send(self, message: Message) -> None:
        """Broadcast ``message`` to every worker.

        Raises:
            WorkerFailed: a worker is gone.
        """
        self.check()
        try:
            self._channel.send(message)
        except RuntimeError as exc:
            raise self.fail(exc) from exc

    def next_reply_key(self) -> str:
        """A fresh store key for the replies to one load."""
        self._loads += 1
        return f"load/{self._loads}"

    def replies(self, key: str) -> list[LoadReply]:
        """Every worker's reply under ``key``, in rank order; waits while they load, checking
        that they live.

        Raises:
            WorkerFailed: a worker died or did not answer within :data:`LOAD_TIMEOUT_S`.
        """
        out = []
        for rank in range(1, self.size):
            try:
                _wait_key(
                    self.groups.store, f"{key}/{rank}", self.processes, LOAD_TIMEOUT_S, "to load"
                )
            except WorkerFailed as exc:
                raise self.fail(exc) from exc
            reply = pickle.loads(bytes.fromhex(self.groups.store.get(f"{key}/{rank}").decode()))
            if not isinstance(reply, LoadReply):
                raise self.fail(RuntimeError(f"rank {rank} replied {reply!r}"))
            out.append(reply)
        return out

    def fail(self, cause: BaseException | None) -> WorkerFailed:
        """Mark the group broken by ``cause`` (a failed collective or message, or a worker
        found dead) and end the workers this process started. Returns the error to raise:
        it names the rank that died and its exit code when that can be told."""
        if self._failure is not None:
            return self._failure
        dead = _first_dead(self.processes, EXIT_GRACE_S if cause is not None else 0.0)
        detail = f": {cause}" if cause is not None else ""
        if dead is not None:
            rank, process = dead
            error = WorkerFailed(
                f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
                f"{process.exitcode}{detail}",
                rank=rank,
                exitcode=process.exitcode,
            )
        else:
            error = WorkerFailed(f"a tensor-parallel collective failed{detail}")
        logger.error("%s", error)
        self._failure = error
        _end(self.processes, kill=True)  # the survivors cannot go on: the protocol broke
        return error

    def close(self) -> None:
        """Tell the workers to leave, join them (ending any that do not leave within
        :data:`JOIN_TIMEOUT_S`). Idempotent; a broken group only ends its processes."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            try:
                self._channel.send(Shutdown())
            except RuntimeError as exc:  # a worker was already gone: end the others
                logger.warning("closing the tensor-parallel group: %s", exc)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()


def _check_group(size: int, device_type: str, collective_timeout_s: float) -> None:
    if size < 1:
        raise InvalidRequest(f"tensor_parallel_size must be >= 1, got {size}")
    if device_type not in ("cpu", "cuda"):
        raise InvalidRequest(f"tensor parallelism runs on cpu or cuda, not {device_type!r}")
    if not collective_timeout_s > 0:
        raise InvalidRequest(f"collective_timeout_s must be > 0, got {collective_timeout_s}")


def _wait_key(
    store: Store, key: str, processes: list[BaseProcess], timeout_s: float, what: str
) -> None:
    """Wait for ``key`` in ``store``, polling the liveness of ``processes``.

    Raises:
        WorkerFailed: a process died, or the key did not come within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([key]):
            return
        dead = _first_dead(processes, 0.0)
        if dead is not None:
            rank, process = dead
            raise WorkerFailed(
                f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
                f"{process.exitcode} before it was ready {what}",
                rank=rank,
                exitcode=process.exitcode,
            )
        if time.monotonic() > deadline:
            raise WorkerFailed(
                f"a tensor-parallel worker did not answer within {timeout_s:g} s {what}"
            )
        time.sleep(POLL_S)


def _first_dead(processes: list[BaseProcess], grace_s: float) -> tuple[int, BaseProcess] | None:
    """The first worker (rank, process) that has exited, waiting up to ``grace_s`` for one."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, process in enumerate(processes, start=1):
            if not process.is_alive():
                return rank, process
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _end(processes: list[BaseProcess], *, kill: bool = False) -> None:
    """Terminate (or with ``kill`` kill at once, which also ends a stopped process), then
    kill, every process still running, and reap them all."""
    for process in processes:
        if process.is_alive():
            if kill:
                process.kill()
            else:
                process.terminate()
    for process in processes:
        process.join(JOIN_TIMEOUT_S / 2)
        if process.is_alive():
            process.kill()
            process.join(JOIN_TIMEOUT_S / 2)
