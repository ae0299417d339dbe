"""Running the selected workloads and writing a run's results (the heavy half of the CLI)."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pagedkv.bench import (
    attention,
    decode,
    detokenize,
    gate,
    memory,
    micro,
    mixed,
    parallel,
    peers,
    plots,
    scaling,
    scheduling,
    shared_prefix,
    tensor_parallel,
)
from pagedkv.bench.checkpoints import QWEN3_0_6B, Checkpoint, small_checkpoint
from pagedkv.bench.cli import CUDA_WORKLOADS, WORKLOADS
from pagedkv.bench.context import BenchContext, default_cache_dir
from pagedkv.bench.isolated import run_isolated
from pagedkv.bench.machine import load_average, machine_info, physical_cores
from pagedkv.bench.pagedkv_system import PAGE_SIZE
from pagedkv.bench.report import results_markdown
from pagedkv.bench.results import WorkloadResult, build_document, read_json, write_json

#: The workloads of ``--quick`` (the CI gate): no 0.6B-shaped checkpoint.
QUICK_WORKLOADS = ("micro", "scheduling", "attention", "memory", "shared_prefix", "mixed")

Runner = Callable[[BenchContext, Checkpoint, int], WorkloadResult]


def _runners() -> dict[str, Runner]:
    return {
        "micro": lambda ctx, ck, vocab: micro.run(ctx),
        "scheduling": lambda ctx, ck, vocab: scheduling.run(ctx),
        "attention": lambda ctx, ck, vocab: attention.run(ctx),
        "memory": memory.run,
        "shared_prefix": shared_prefix.run,
        "mixed": mixed.run,
        "scaling": scaling.run,
        "decode": lambda ctx, ck, vocab: decode.run(ctx),
        "detokenize": lambda ctx, ck, vocab: detokenize.run(ctx, ck),
        "parallel": lambda ctx, ck, vocab: parallel.run(ctx, ck),
        "peers": lambda ctx, ck, vocab: peers.run(ctx),
        "tp": lambda ctx, ck, vocab: tensor_parallel.run(ctx),
    }


def run_suite(args: argparse.Namespace) -> int:
    """Run the workloads ``args`` select (see :func:`pagedkv.bench.cli.add_arguments`), write
    the results, check the floors if asked; the exit status."""
    ctx = BenchContext(
        quick=args.quick,
        threads=args.threads if args.threads is not None else physical_cores(),
        device=args.device,
        cache_dir=args.cache_dir or default_cache_dir(),
        seed=args.seed,
        verbose=not args.quiet,
    )
    quiet_transformers()
    torch.set_num_threads(ctx.threads)
    selected = args.only or (QUICK_WORKLOADS if ctx.quick else WORKLOADS)
    if ctx.device != "cpu":
        selected = [w for w in selected if w in CUDA_WORKLOADS]
    machine = machine_info(ctx.threads)
    checkpoint = small_checkpoint(ctx.cache_dir)
    vocab = vocab_of(checkpoint)
    ctx.log(f"small checkpoint: {checkpoint.name} ({checkpoint.description})")
    # A full run's workloads each in a fresh process (SRV-049); the quick gate's in this one.
    results = [
        run_workload(name, ctx, checkpoint, vocab) if ctx.quick else run_isolated(name, ctx)
        for name in WORKLOADS
        if name in selected
    ]
    failed = any("workload" in r.errors for r in results)
    machine["load_average_end"] = load_average()
    document = build_document(
        mode="quick" if ctx.quick else "full",
        machine=machine,
        settings=_settings(ctx, checkpoint, selected),
        workloads=results,
        runtime_s=time.perf_counter() - ctx.started,
    )
    _write(ctx, document, args.out, plots_wanted=not (ctx.quick or args.no_plots))
    status = 1 if failed else 0
    if args.gate is not None:
        status = max(status, gate.report(document, read_json(args.gate)))
    return status


def run_workload(
    name: str, ctx: BenchContext, checkpoint: Checkpoint, vocab: int
) -> WorkloadResult:
    """Run workload ``name`` in this process; its result, with the error it raised (if any)
    under ``errors["workload"]`` and its wall time."""
    started = time.perf_counter()
    try:
        result = _runners()[name](ctx, checkpoint, vocab)
    except Exception as exc:  # one workload failing must not lose the others' results
        result = WorkloadResult(name, errors={"workload": f"{type(exc).__name__}: {exc}"})
        ctx.log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - started
    ctx.log(f"{name}: done in {result.seconds:.1f} s")
    return result


def _settings(ctx: BenchContext, checkpoint: Checkpoint, selected: Sequence[str]) -> dict[str, Any]:
    return {
        "workloads": [w for w in WORKLOADS if w in selected],
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
