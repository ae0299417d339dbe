"""Command line of the project's benchmarks: ``python -m pagedkv_bench [--quick] [--gate
FLOORS] ...``, what ``make bench`` and ``make bench-gate`` run.

The options of ``pagedkv bench`` (:func:`pagedkv.bench.cli.add_arguments`) over the project's
table (:data:`~pagedkv_bench.workloads.PROJECT_WORKLOADS`: the peers workload too), and
``--gate FLOORS``, which then fails the run (exit status 1) if a gated ratio is below its floor
(:mod:`pagedkv_bench.gate`).

Exit status: 0 success, 1 a floor not met or a workload failed, 2 a malformed command line.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from pagedkv.bench import cli
from pagedkv.bench.results import read_json
from pagedkv_bench import gate
from pagedkv_bench.workloads import PROJECT_WORKLOADS


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m pagedkv_bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv_bench",
        description="The project's benchmarks: pagedkv beside transformers and vLLM's CPU "
        "backend; every figure is a ratio measured in the same run.",
    )
    cli.add_arguments(parser, PROJECT_WORKLOADS)
    parser.add_argument(
        "--gate",
        type=Path,
        default=None,
        metavar="FLOORS",
        help="after the run, exit 1 if a ratio is below its floor in FLOORS",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the workloads parsed ``args`` select, then the gate if asked; the exit status."""
    floors = args.gate
    if floors is None:
        return cli.run(args, PROJECT_WORKLOADS)
    return cli.run(
        args, PROJECT_WORKLOADS, lambda document: gate.report(document, read_json(floors))
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagedkv_bench``; returns the exit status."""
    return run(build_parser().parse_args(list(argv) if argv is not None else None))
