"""What rank 0 tells its workers: frozen messages, pickled over the control group.

A worker does what each message says, in order: load its shard (and reply through the store),
run a step plan, drop its shard, or leave. It never decides anything itself: which pages a
step writes and reads comes in the plan, from rank 0's scheduler and KVManager.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.plan import StepPlan


@dataclass(frozen=True, slots=True)
class LoadShard:
    """Load this rank's shard of a checkpoint and, with ``num_pages``, a PagedStore of its
    K/V heads; then put a :class:`LoadReply` under ``reply_key`` in the store.

    Attributes:
        model_dir: the checkpoint directory, as every rank sees it.
        dtype: parameter and K/V dtype name.
        num_pages: pages of the store (``None``: a v0 runner without one).
        page_size: positions per page.
        options: how the rank's runner runs its model.
        reply_key: the store key of the reply, ``{reply_key}/{rank}``.
    """

    model_dir: str
    dtype: str
    num_pages: int | None
    page_size: int
    options: RunnerOptions
    reply_key: str


@dataclass(frozen=True, slots=True)
class LoadReply:
    """A worker's answer to :class:`LoadShard`.

    Attributes:
        rank: the worker.
        error_type: the class name of the error that failed the load, ``None`` on success.
        message: the error's message (empty on success).
    """

    rank: int
    error_type: str | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class RunStep:
    """Run one step plan (its tensors on the CPU; each rank moves them to its device)."""

    plan: StepPlan


@dataclass(frozen=True, slots=True)
class Unload:
    """Drop the loaded shard and its store (the group stays, for the next load)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the worker loop: the group is closing."""


Message = LoadShard | RunStep | Unload | Shutdown


def plan_to(plan: StepPlan, device: torch.device) -> StepPlan:
    """``plan`` with every tensor on ``device`` (itself when they already are)."""
    if plan.input_ids.device == device:
        return plan
    batch = plan.attention
    attention = dataclasses.replace(
        batch,
        query_start=batch.query_start.to(device),
        context_lens=batch.context_lens.to(device),
        page_tables=None if batch.page_tables is None else batch.page_tables.to(device),
        slot_mapping=None if batch.slot_mapping is None else batch.slot_mapping.to(device),
    )
    return dataclasses.replace(
        plan,
        input_ids=plan.input_ids.to(device),
        positions=plan.positions.to(device),
        attention=attention,
        logits_indices=plan.logits_indices.to(device),
        page_copies=None if plan.page_copies is None else plan.page_copies.to(device),
    )
