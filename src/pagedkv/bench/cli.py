"""Command line of the benchmarks: ``python -m pagedkv.bench [--quick] [--out DIR] ...``.

A run measures each workload in turn, then writes ``results.json`` (layout in
``bench/README.md``), ``results.md`` and, in full mode with matplotlib installed, PNG plots to
``--out``. ``--gate FLOORS`` then fails the run (exit status 1) if a gated ratio is below its
floor. ``--table RESULTS`` only prints the Markdown results table of an earlier run.

Exit status: 0 success, 1 a floor not met or a workload failed, 2 a malformed command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedkv.bench.workloads import PAGEDKV_WORKLOADS, WorkloadTable


def add_arguments(
    parser: argparse.ArgumentParser, table: WorkloadTable = PAGEDKV_WORKLOADS
) -> None:
    """Add the benchmark's options to ``parser``, its workloads ``table``'s (also used by
    ``pagedkv bench``)."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short CI mode: small workloads, no 0.6B-shaped checkpoint, no plots",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench"),
        metavar="DIR",
        help="folder for results.json, results.md and plots (default: bench/)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=table.names,
        metavar="WORKLOAD",
        help=f"run only this workload (repeatable): {', '.join(table.names)}",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of every system (default: the physical cores usable)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where pagedkv and transformers run; cuda runs the 0.6B-shape workloads "
        f"({', '.join(table.cuda_names)}) and is skipped with a reason without a GPU",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where generated checkpoints are kept (default: $PAGEDKV_BENCH_CACHE or "
        "~/.cache/pagedkv/bench)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every workload")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time budget of the run: a workload that would start after it is skipped, and "
        "the device workload's parts each stop at their share, each saying so in the results",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--table",
        type=Path,
        default=None,
        metavar="RESULTS",
        help="print the Markdown results table of RESULTS (a results.json) and exit",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m pagedkv.bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.bench",
        description="Benchmark pagedkv against its alternatives; every figure is a ratio "
        "measured in the same run.",
    )
    add_arguments(parser)
    return parser


def run(
    args: argparse.Namespace,
    table: WorkloadTable = PAGEDKV_WORKLOADS,
    check: Callable[[dict[str, Any]], int] | None = None,
) -> int:
    """Run the workloads of ``table`` that parsed ``args`` describe, then ``check`` (if given)
    on the run's results document; the exit status, the worse of the run's and the check's.

    Torch, transformers and the workloads are imported only here, so building the parser is
    cheap.
    """
    if args.table is not None:
        from pagedkv.bench.report import results_table
        from pagedkv.bench.results import read_json

        print(results_table(read_json(args.table)))
        return 0
    if args.threads is not None and args.threads < 1:
        print("bench: error: --threads must be >= 1", file=sys.stderr)
        return 2
    if args.budget_s is not None and not args.budget_s > 0:
        print("bench: error: --budget-s must be > 0", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench: skipped: --device cuda, but CUDA is not available here", file=sys.stderr)
            return 0
    from pagedkv.bench.suite import run_suite

    done = run_suite(args, table)
    status = 1 if done.failed else 0
    return status if check is None else max(status, check(done.document))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagedkv.bench``; returns the exit status."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    return run(args)
