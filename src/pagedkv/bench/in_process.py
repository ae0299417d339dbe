"""Running one workload in this process: its result, with the error it raised recorded."""

from __future__ import annotations

import logging
import time
from typing import Any

from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.workloads import WorkloadTable


def run_workload(
    table: WorkloadTable, name: str, ctx: BenchContext, checkpoint: Checkpoint, vocab: int
) -> WorkloadResult:
    """Run ``table``'s workload ``name`` in this process; its result, with the error it raised
    (if any) under ``errors["workload"]`` and its wall time, seconds."""
    started = time.perf_counter()
    try:
        result = table.runner(name)(ctx, checkpoint, vocab)
    except Exception as exc:  # one workload failing must not lose the others' results
        result = WorkloadResult(name, errors={"workload": f"{type(exc).__name__}: {exc}"})
        ctx.log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - started
    ctx.log(f"{name}: done in {result.seconds:.1f} s")
    return result


def vocab_of(checkpoint: Checkpoint) -> int:
    """The vocabulary size of ``checkpoint``."""
    from pagedkv.model.config import ModelConfig

    return ModelConfig.from_dir(checkpoint.path).vocab_size


def quiet_transformers() -> None:
    """Silence transformers' progress bars and warnings; failures still raise and are recorded.

    Its continuous batching logs an error per manager on a CPU without ``psutil`` (it cannot
    size the cache from free memory; the benchmarks size it themselves), so that logger is
    silenced too.
    """
    from transformers.utils import logging as hf_logging_module

    hf_logging: Any = hf_logging_module
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
