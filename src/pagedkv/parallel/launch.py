"""Starting a tensor-parallel runner from an entry point (``LLM``, ``pagedkv serve``), on one
machine or under ``torchrun`` (TP-020, TP-021).

Without ``torchrun``'s variables this process becomes rank 0 and spawns the workers itself.
Under ``torchrun`` every rank runs the same entry point: rank 0 gets the runner and goes on to
run the engine or the server; every other rank serves rank 0's messages here and, when rank 0
closes, leaves with ``SystemExit(0)``, so the entry point ends there.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pagedkv.device import DEFAULT_DEVICE
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.parallel.group import WorkerGroup
from pagedkv.parallel.process_group import DEFAULT_COLLECTIVE_TIMEOUT_S
from pagedkv.parallel.runner import TensorParallelRunner, check_options
from pagedkv.parallel.worker import serve_rank

#: The variables ``torchrun`` sets for every rank; all present means an ``env://`` launch.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """Whether this process is a rank of a ``torchrun`` (``env://``) launch."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def device_type(device: str, size: int) -> str:
    """``cpu`` or ``cuda``: each rank picks its own CUDA device (TP-024).

    Raises:
        InvalidRequest: a device with an explicit index, or another device type.
    """
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise InvalidRequest(f"invalid device {device!r}: {exc}") from exc
    if parsed.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"tensor parallelism runs on cpu or cuda, not device {device!r}")
    if parsed.index is not None:
        raise InvalidRequest(
            f"device {device!r} names one device, but with tensor_parallel_size={size} rank r "
            "runs on cuda:LOCAL_RANK: give device 'cuda'"
        )
    return parsed.type


def tensor_parallel_runner(
    model_dir: str | Path,
    size: int,
    *,
    num_pages: int | None,
    page_size: int,
    dtype: str = "float32",
    device: str = DEFAULT_DEVICE,
    options: RunnerOptions | None = None,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> TensorParallelRunner:
    """Rank 0's runner of ``model_dir`` split over ``size`` ranks; the group ends when the
    runner closes.

    Raises:
        InvalidRequest: a bad size, device or option, or a ``torchrun`` world of another size.
        CheckpointError: a bad checkpoint, or a model ``size`` ranks cannot split.
        WorkerFailed: a worker died while starting or loading.
        SystemExit: on a rank other than 0 of a ``torchrun`` launch, once rank 0 has closed.
    """
    kind = device_type(device, size)
    check_options(options or RunnerOptions(), size)
    if launched_by_torchrun():
        group, groups = WorkerGroup.from_environment(
            size, kind, collective_timeout_s=collective_timeout_s
        )
        if group is None:
            with torch.inference_mode():
                serve_rank(groups)
            raise SystemExit(0)
    else:
        group = WorkerGroup.spawn(size, kind, collective_timeout_s=collective_timeout_s)
    try:
        return TensorParallelRunner.load(
            group,
            model_dir,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            options=options,
            owns_group=True,
        )
    except BaseException:
        group.close()
        raise
