"""The rank-0 step runner of a tensor-parallel group: the engine's only view of the split.

:class:`TensorParallelRunner` is a :class:`~pagedkv.interfaces.StepRunner`: the engine (with
its scheduler and KVManager, on rank 0 only) hands it each step plan exactly as it would a
single-rank runner. It broadcasts the plan to the workers, runs rank 0's own shard on it (the
collectives inside meet the workers'), and returns the logits, which were gathered on rank 0
(TP-010). The KVManager never learns how many ranks there are; each rank's PagedStore only
follows the plan's slots and page tables.

A worker's death breaks the runner for good: the step raises
:class:`~pagedkv.errors.WorkerFailed` (a :class:`~pagedkv.errors.RunnerFailed`, which ends the
engine) and so does every later one (TP-022).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import CheckpointError, InvalidRequest, RunnerFailed, UnsupportedModel
from pagedkv.model.config import ModelConfig
from pagedkv.model.tensor_parallel import ShardLayout
from pagedkv.parallel.group import WorkerGroup
from pagedkv.parallel.messages import LoadReply, LoadShard, RunStep, Unload, plan_to
from pagedkv.parallel.worker import load_shard
from pagedkv.plan import StepPlan

logger = logging.getLogger("pagedkv.parallel")

#: Errors a worker's failed load is raised as on rank 0, by class name.
_LOAD_ERRORS: dict[str, type[Exception]] = {
    "CheckpointError": CheckpointError,
    "UnsupportedModel": UnsupportedModel,
    "InvalidRequest": InvalidRequest,
}


class TensorParallelRunner:
    """Rank 0's runner of a tensor-parallel group; build it with :meth:`load`.

    Attributes:
        group: the group (its workers and process groups).
        local: rank 0's own runner, over its shard and its store.
    """

    def __init__(self, group: WorkerGroup, local: ModelRunner, *, owns_group: bool) -> None:
        self.group = group
        self.local = local
        self._owns_group = owns_group
        self._closed = False

    @classmethod
    def load(
        cls,
        group: WorkerGroup,
        model_dir: str | Path,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        options: RunnerOptions | None = None,
        owns_group: bool = False,
    ) -> TensorParallelRunner:
        """Load ``model_dir`` over ``group``: every rank reads its own shard (TP-004) and, with
        ``num_pages``, builds a PagedStore of its K/V heads with that many pages (TP-010).

        Args:
            group: a group no other runner holds.
            owns_group: close the group when this runner closes.

        Raises:
            CheckpointError: a bad checkpoint (``UnsupportedModel``: a model the group's size
                cannot split, TP-003), on any rank.
            InvalidRequest: options the group cannot honour (TP-024), or a group already in
                use.
            WorkerFailed: a worker died.
        """
        options = options or RunnerOptions()
        check_options(options, group.size)
        if group.in_use:
            raise InvalidRequest("the tensor-parallel group already runs a model")
        group.check()
        config = ModelConfig.from_dir(Path(model_dir))
        ShardLayout.of(config, 0, group.size)  # a model the group cannot split fails here
        message = LoadShard(
            str(Path(model_dir).resolve()),
            dtype,
            num_pages,
            page_size,
            options,
            group.next_reply_key(),
        )
        group.send(message)
        local: ModelRunner | None = None
        error: Exception | None = None
        try:
            local = load_shard(group.groups, group.collectives, message)
        except Exception as exc:  # the workers' replies are still collected
            error = exc
        replies = group.replies(message.reply_key)
        if error is None:
            error = _reply_error(replies)
        if error is not None or local is None:
            group.send(Unload())
            raise error or RunnerFailed("rank 0's shard did not load")
        group.in_use = True
        return cls(group, local, owns_group=owns_group)

    # -- StepRunner ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def max_positions(self) -> int:
        return self.local.max_positions

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return self.group.size

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (float32, on :attr:`device`), gathered from every rank's
        shard.

        Raises:
            InvalidRequest: a plan the stores refuse (every rank refused it alike, before any
                collective; the group goes on).
            WorkerFailed: a worker died or a collective failed or timed out; the runner is
                broken for good.
        """
        if self._closed:
            raise InvalidRequest("the tensor-parallel runner is closed")
        self.group.send(RunStep(plan_to(plan, torch.device("cpu"))))
        try:
            return self.local.execute(plan)
        except InvalidRequest:
            raise
        except Exception as exc:  # a collective failed (or rank 0's own shard did)
            raise self.group.fail(exc) from exc

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def collective_seconds(self) -> float:
        """Seconds rank 0 has spent in collectives (see :class:`GroupCollectives`)."""
        return self.group.collectives.seconds

    def close(self) -> None:
        """Release the workers' shards, and end the group if this runner owns it (TP-023).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.group.in_use = False
        if self.group.failure is None and not self._owns_group:
            try:
                self.group.send(Unload())
            except RunnerFailed as exc:
                logger.warning("unloading the tensor-parallel shards: %s", exc)
        if self._owns_group:
            self.group.close()


def check_options(options: RunnerOptions, size: int) -> None:
    """Refuse the runner options a group of ``size`` ranks cannot honour (TP-024).

    Raises:
        InvalidRequest: ``compile`` or ``cuda_graphs`` with more than one rank (their fixed
            decode steps would have to capture the collectives).
    """
    if size > 1:
        for name in ("compile", "cuda_graphs"):
            if getattr(options, name):
                raise InvalidRequest(f"{name} is not supported with tensor_parallel_size > 1")


def _reply_error(replies: list[LoadReply]) -> Exception | None:
    """The first worker's load error, as the error class it was raised as where pagedkv
    knows it."""
    for reply in replies:
        if reply.error_type is not None:
            kind = _LOAD_ERRORS.get(reply.error_type, RunnerFailed)
            return kind(f"rank {reply.rank}: {reply.message}")
    return None
