"""The worker loop of a rank other than 0, and the entry point of a worker process this
machine spawns.

A worker holds its shard of the model and a PagedStore of its K/V heads, and runs every step
plan rank 0 broadcasts: the same plan, the same page ids and slots, its own heads. It keeps no
scheduler and no KVManager (TP-010). A plan every rank refuses alike (``InvalidRequest``,
raised before any collective) leaves it waiting for the next message, as rank 0 goes on; any
other error ends the process, which closes its connections, so rank 0's collectives fail at
once instead of waiting for their timeout (TP-022).
"""

from __future__ import annotations

import logging
import pickle
import sys
from dataclasses import dataclass

import torch

from pagedkv.engine.runner import ModelRunner
from pagedkv.errors import InvalidRequest
from pagedkv.model.loader import load_model
from pagedkv.parallel.collectives import GroupCollectives, MessageChannel
from pagedkv.parallel.messages import LoadReply, LoadShard, RunStep, Shutdown, Unload, plan_to
from pagedkv.parallel.process_group import RankGroups, build_groups, join_store

logger = logging.getLogger("pagedkv.parallel")


def load_shard(
    groups: RankGroups, collectives: GroupCollectives, message: LoadShard
) -> ModelRunner:
    """This rank's runner: its shard of the checkpoint, and its store (TP-001, TP-002)."""
    model = load_model(
        message.model_dir,
        dtype=message.dtype,
        device=groups.device,
        tp_rank=groups.rank,
        tp_size=groups.size,
        collectives=collectives,
    )
    return ModelRunner.for_model(
        model, num_pages=message.num_pages, page_size=message.page_size, options=message.options
    )


def serve_rank(groups: RankGroups) -> None:
    """Run rank 0's messages until it says :class:`Shutdown`.

    Raises:
        RuntimeError: rank 0 or another worker is gone (a collective or the control channel
            failed), or a step failed on this rank alone.
    """
    channel = MessageChannel(groups)
    collectives = GroupCollectives(groups)
    runner: ModelRunner | None = None
    while True:
        message = channel.receive()
        if isinstance(message, LoadShard):
            runner = None
            reply = LoadReply(groups.rank)
            try:
                runner = load_shard(groups, collectives, message)
            except Exception as exc:  # reported to rank 0, which raises it
                reply = LoadReply(groups.rank, type(exc).__name__, str(exc))
            key = f"{message.reply_key}/{groups.rank}"
            groups.store.set(key, pickle.dumps(reply).hex())
        elif isinstance(message, RunStep):
            if runner is None:
                raise RuntimeError("rank 0 sent a step before any shard was loaded")
            try:
                runner.execute(plan_to(message.plan, groups.device))
            except InvalidRequest:  # rank 0 refused the same plan before any collective
                continue
        elif isinstance(message, Unload):
            runner = None
        elif isinstance(message, Shutdown):
            return
        else:
            raise RuntimeError(f"unknown message from rank 0: {message!r}")


@dataclass(frozen=True, slots=True)
class SpawnedWorker:
    """What a spawned worker process needs to join its group.

    Attributes:
        rank: its rank, ``1 <= rank < size``.
        size: ranks in the group.
        port: the port of rank 0's store on the loopback address.
        device_type: ``cpu`` or ``cuda`` (rank ``r`` then takes ``cuda:r``).
        collective_timeout_s: bound of one collective.
        threads: intra-op torch threads of the worker, ``None`` for torch's default.
    """

    rank: int
    size: int
    port: int
    device_type: str
    collective_timeout_s: float
    threads: int | None


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """The device of a rank: the CPU, or CUDA device ``local_rank`` (made current)."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def spawned_worker_main(worker: SpawnedWorker) -> None:
    """Entry point of a worker process started by rank 0 (``spawn``): join the store, say
    ready, build the groups, serve until rank 0 says to leave."""
    if worker.threads is not None:
        torch.set_num_threads(worker.threads)
    store = join_store("127.0.0.1", worker.port, worker.size)
    store.set(f"ready/{worker.rank}", "1")
    device = rank_device(worker.device_type, worker.rank)
    groups = build_groups(store, worker.rank, worker.size, device, worker.collective_timeout_s)
    try:
        with torch.inference_mode():
            serve_rank(groups)
    except RuntimeError as exc:  # rank 0 (or a peer) is gone: leave, saying why in one line
        message = " ".join(str(exc).split())
        print(f"pagedkv tensor-parallel rank {worker.rank}: leaving: {message}", file=sys.stderr)
        raise SystemExit(1) from None
