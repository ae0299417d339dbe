"""Running the selected workloads of a table and writing a run's results (the heavy half of
the command line)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.bench import plots
from pagedkv.bench.checkpoints import QWEN3_0_6B, Checkpoint, small_checkpoint
from pagedkv.bench.context import BenchContext, default_cache_dir
from pagedkv.bench.in_process import quiet_transformers, run_workload, vocab_of
from pagedkv.bench.isolated import run_isolated
from pagedkv.bench.machine import load_average, machine_info, physical_cores
from pagedkv.bench.pagedkv_system import PAGE_SIZE
from pagedkv.bench.report import results_markdown
from pagedkv.bench.results import WorkloadResult, build_document, write_json
from pagedkv.bench.workloads import WorkloadTable


@dataclass(frozen=True, slots=True)
class SuiteRun:
    """What a run produced.

    Attributes:
        document: the results.json document, as written to ``--out``.
        failed: a workload raised (its error is in the document).
    """

    document: dict[str, Any]
    failed: bool


def run_suite(args: argparse.Namespace, table: WorkloadTable) -> SuiteRun:
    """Run the workloads of ``table`` that ``args`` select (see
    :func:`pagedkv.bench.cli.add_arguments`) and write the results to ``args.out``."""
    ctx = BenchContext(
        quick=args.quick,
        threads=args.threads if args.threads is not None else physical_cores(),
        device=args.device,
        cache_dir=args.cache_dir or default_cache_dir(),
        seed=args.seed,
        verbose=not args.quiet,
    )
    if args.budget_s is not None:
        ctx.deadline = ctx.started + args.budget_s
    quiet_transformers()
    torch.set_num_threads(ctx.threads)
    selected = args.only or default_selection(table, ctx)
    if ctx.device != "cpu":
        selected = [w for w in selected if w in table.cuda_names]
    machine = machine_info(ctx.threads)
    checkpoint = small_checkpoint(ctx.cache_dir)
    vocab = vocab_of(checkpoint)
    ctx.log(f"small checkpoint: {checkpoint.name} ({checkpoint.description})")
    # A full run's workloads each in a fresh process (SRV-049); the quick gate's in this one.
    results = [
        _run_one(table, name, ctx, checkpoint, vocab) for name in table.names if name in selected
    ]
    machine["load_average_end"] = load_average()
    document = build_document(
        mode="quick" if ctx.quick else "full",
        machine=machine,
        settings=_settings(ctx, checkpoint, [n for n in table.names if n in selected]),
        workloads=results,
        runtime_s=time.perf_counter() - ctx.started,
    )
    _write(ctx, document, args.out, plots_wanted=not (ctx.quick or args.no_plots))
    return SuiteRun(document, failed=any("workload" in r.errors for r in results))


def default_selection(table: WorkloadTable, ctx: BenchContext) -> tuple[str, ...]:
    """The workloads a run without ``--only`` measures: ``--quick``'s, else on the CPU every
    workload but those sized for a GPU (ENG-231), else every workload (which the caller
    narrows to those of ``--device cuda``)."""
    if ctx.quick:
        return table.quick_names
    return table.cpu_names if ctx.device == "cpu" else table.names


def _run_one(
    table: WorkloadTable, name: str, ctx: BenchContext, checkpoint: Checkpoint, vocab: int
) -> WorkloadResult:
    if ctx.deadline is not None and time.perf_counter() >= ctx.deadline:
        note = f"cut: {name} not started: the run's time budget was spent"
        ctx.log(note)
        return WorkloadResult(name, notes=[note])
    if ctx.quick:
        return run_workload(table, name, ctx, checkpoint, vocab)
    return run_isolated(name, ctx, table.child_module)


def _settings(ctx: BenchContext, checkpoint: Checkpoint, selected: Sequence[str]) -> dict[str, Any]:
    return {
        "workloads": list(selected),
        "seed": ctx.seed,
        "torch_threads": ctx.threads,
        "device": ctx.device,
        "dtype": "float32",
        "page_size": PAGE_SIZE,
        "small_checkpoint": f"{checkpoint.name} ({checkpoint.description})",
        "large_checkpoint": (
            f"qwen3-0.6b-shape: hidden {QWEN3_0_6B.hidden}, {QWEN3_0_6B.layers} layers, "
            f"{QWEN3_0_6B.heads} heads, {QWEN3_0_6B.kv_heads} KV heads, head_dim "
            f"{QWEN3_0_6B.head_dim}, vocab {QWEN3_0_6B.vocab}, random weights"
        ),
    }


def _write(ctx: BenchContext, document: dict[str, Any], out: Path, plots_wanted: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(document, out / "results.json")
    (out / "results.md").write_text(results_markdown(document), encoding="utf-8")
    ctx.log(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    if plots_wanted and plots.available():
        for path in plots.write_plots(document, out):
            ctx.log(f"wrote {path}")
    elif plots_wanted:
        ctx.log("matplotlib is not installed: no plots (pip install 'pagedkv[bench]')")
