"""One workload of a full run in a fresh interpreter (SRV-049).

A full run holds several 0.6B-shaped models one after another (eager and compiled, pagedkv's
and transformers'), and what one workload leaves in the process (allocator state, compiled
kernels' threads, cached weights) slows the next one's in-process systems (bench/README.md
says by how much). So each workload of a full run runs here, in a new process, as a user's
single engine would; ``python -m pagedkv.bench.isolated NAME RESULT [options]`` runs workload
NAME of :data:`~pagedkv.bench.workloads.PAGEDKV_WORKLOADS` with the run's options and writes
its :class:`~pagedkv.bench.results.WorkloadResult` to the JSON file RESULT. A table that adds
workloads names its own child module, which calls :func:`main` with that table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pagedkv.bench.checkpoints import small_checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.in_process import quiet_transformers, run_workload, vocab_of
from pagedkv.bench.results import Target, WorkloadResult
from pagedkv.bench.workloads import PAGEDKV_WORKLOADS, WorkloadTable


def run_isolated(
    name: str, ctx: BenchContext, child_module: str = PAGEDKV_WORKLOADS.child_module
) -> WorkloadResult:
    """Run workload ``name`` in a new interpreter (``python -m child_module``) with ``ctx``'s
    settings; its result, or a result whose ``errors`` say why the process gave none."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "result.json"
        command = [
            sys.executable,
            "-m",
            child_module,
            name,
            str(path),
            "--threads",
            str(ctx.threads),
            "--device",
            ctx.device,
            "--cache-dir",
            str(ctx.cache_dir),
            "--seed",
            str(ctx.seed),
            "--elapsed",
            str(time.perf_counter() - ctx.started),
            *(
                []
                if ctx.deadline is None
                else ["--seconds-left", str(ctx.deadline - time.perf_counter())]
            ),
            *([] if ctx.verbose else ["--quiet"]),
        ]
        done = subprocess.run(command, check=False)
        if done.returncode != 0 or not path.is_file():
            error = f"its process exited with status {done.returncode} and no result"
            return WorkloadResult(name, errors={"workload": error})
        return result_from_json(json.loads(path.read_text(encoding="utf-8")))


def result_from_json(data: dict[str, Any]) -> WorkloadResult:
    """The :class:`WorkloadResult` that :func:`dataclasses.asdict` wrote as ``data``."""
    targets = [Target(**t) for t in data.pop("targets")]
    return WorkloadResult(**data, targets=targets)


def main(argv: list[str] | None = None, table: WorkloadTable = PAGEDKV_WORKLOADS) -> int:
    """Run one workload of ``table`` (see the module docstring); the exit status."""
    parser = argparse.ArgumentParser(prog=f"python -m {table.child_module}")
    parser.add_argument("name")
    parser.add_argument("result", type=Path)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--elapsed", type=float, default=0.0)
    parser.add_argument("--seconds-left", type=float, default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    now = time.perf_counter()
    ctx = BenchContext(
        quick=False,
        threads=args.threads,
        device=args.device,
        cache_dir=args.cache_dir,
        seed=args.seed,
        verbose=not args.quiet,
        started=now - args.elapsed,
        deadline=None if args.seconds_left is None else now + args.seconds_left,
    )
    quiet_transformers()
    torch.set_num_threads(ctx.threads)
    checkpoint = small_checkpoint(ctx.cache_dir)
    result = run_workload(table, args.name, ctx, checkpoint, vocab_of(checkpoint))
    args.result.write_text(json.dumps(asdict(result)), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
