"""Tensor parallelism: two ranks against one on the Qwen3-0.6B shape (full mode, CPU, gloo).

Both systems get the same cores: one rank with every thread, or two ranks with half each (rank
0 is this process, rank 1 a spawned worker). Two workloads, greedy, float32:

* batch-1 decode: one request of :data:`PROMPT_LEN` tokens generating :data:`NEW_TOKENS`;
  decode tokens/s counts the tokens after the first over the time from the first to the last;
* mixed: the mixed workload's requests (:data:`MIXED`), all submitted at once; output
  tokens/s over the run's wall time.

Repetitions alternate which system goes first; a ratio is the median of the per-repetition
ratios (TP=2 over TP=1). The communication share of a step is rank 0's time inside collectives
(the all-reduces, the logits' gather; waiting for the other rank included) over the runner's
time for the step, summed over the run. Bytes moved per step are counted from the shapes:
``(2 * layers + 1)`` all-reduces of ``[T, hidden]`` activations and one gather of the
logits' ``[B, vocab / 2]`` float32 columns from rank 1 (see ``bench/README.md`` for the
projection to a multi-GPU node).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pagedkv.bench.checkpoints import qwen3_shaped_checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.pagedkv_system import PAGE_SIZE, load_runner, make_engine, run_engine
from pagedkv.bench.requests import (
    BenchRequest,
    LengthDistribution,
    MixedSpec,
    mixed_requests,
    uniform_requests,
)
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.run import RunResult
from pagedkv.bench.stats import median, ratio
from pagedkv.engine.outputs import StepReport
from pagedkv.interfaces import StepRunner
from pagedkv.model.config import ModelConfig
from pagedkv.parallel.group import WorkerGroup
from pagedkv.parallel.runner import TensorParallelRunner

DTYPE = "float32"
PROMPT_LEN = 16
NEW_TOKENS = 33
REPETITIONS = 3
#: The mixed workload of this benchmark: smaller than ``mixed``'s full one, as every request
#: runs on the 0.6B shape here.
MIXED = MixedSpec(
    num_requests=16,
    prompt=LengthDistribution(median=64, sigma=0.6, low=16, high=192),
    output=LengthDistribution(median=24, sigma=0.6, low=8, high=64),
)
RANKS = 2


def run(ctx: BenchContext) -> WorkloadResult:
    """TP=2 against TP=1: batch-1 decode and mixed throughput, and the communication share."""
    result = WorkloadResult("tp")
    if ctx.device != "cpu":
        result.notes.append("tp runs on the CPU (gloo) only; a CUDA run needs two GPUs")
        return result
    ctx.log("tp: preparing the Qwen3-0.6B-shaped checkpoint (generated once)")
    checkpoint = qwen3_shaped_checkpoint(ctx.cache_dir)
    config = ModelConfig.from_dir(checkpoint.path)
    threads = max(1, ctx.threads // RANKS)
    decode = uniform_requests(1, PROMPT_LEN, NEW_TOKENS, config.vocab_size, ctx.seed)
    mixed = mixed_requests(MIXED, config.vocab_size, ctx.seed)
    num_pages = sum(-(-r.total_len // PAGE_SIZE) for r in mixed) + 16
    result.figures.update(
        checkpoint=checkpoint.name,
        dtype=DTYPE,
        threads_tp1=ctx.threads,
        threads_per_rank_tp2=threads,
        repetitions=REPETITIONS,
        decode={"prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS},
        mixed={"requests": len(mixed), "prompt_tokens": sum(len(r.prompt) for r in mixed)},
        bytes_per_step=_bytes_per_step(config),
    )
    ctx.log(f"tp: loading TP=1 and TP=2 ({threads} thread(s) per rank)")
    single = load_runner(checkpoint, num_pages, dtype=DTYPE)
    group = WorkerGroup.spawn(RANKS, threads=threads)
    try:
        with _threads(threads):
            split = TensorParallelRunner.load(
                group, checkpoint.path, num_pages=num_pages, page_size=PAGE_SIZE, dtype=DTYPE
            )
        systems: dict[str, tuple[StepRunner, int]] = {
            "tp1": (single, ctx.threads),
            "tp2": (split, threads),
        }
        for runner, count in systems.values():  # warm-up: one short request each
            with _threads(count):
                _measure(runner, num_pages, [BenchRequest(decode[0].prompt, 3)])
        _compare(ctx, result, systems, "decode", decode, num_pages)
        _compare(ctx, result, systems, "mixed", mixed, num_pages)
        split.close()
    finally:
        group.close()
        del single
        gc.collect()
    return result


def _compare(
    ctx: BenchContext,
    result: WorkloadResult,
    systems: dict[str, tuple[StepRunner, int]],
    workload: str,
    requests: list[BenchRequest],
    num_pages: int,
) -> None:
    rates: dict[str, list[float]] = {name: [] for name in systems}
    shares: list[float] = []
    steps: list[dict[str, float]] = []
    order = list(systems)
    for repetition in range(REPETITIONS):
        ctx.log(f"tp: {workload}: repetition {repetition + 1}/{REPETITIONS}")
        for name in order if repetition % 2 == 0 else order[::-1]:
            runner, count = systems[name]
            with _threads(count):
                run_result, execute_s, comm_s, num_steps = _measure(runner, num_pages, requests)
            rate = (
                run_result.decode_tokens_per_s if workload == "decode" else run_result.tokens_per_s
            )
            rates[name].append(rate)
            if name == "tp2":
                shares.append(ratio(comm_s, execute_s))
                steps.append(
                    {
                        "steps": num_steps,
                        "ms_per_step": round(execute_s / num_steps * 1e3, 2),
                        "collective_ms_per_step": round(comm_s / num_steps * 1e3, 2),
                    }
                )
    paired = [ratio(b, a) for a, b in zip(rates["tp1"], rates["tp2"], strict=True)]
    unit = "decode_tokens_per_s" if workload == "decode" else "output_tokens_per_s"
    result.figures[workload] = {
        **result.figures.get(workload, {}),
        f"tp1_{unit}": [round(r, 3) for r in rates["tp1"]],
        f"tp2_{unit}": [round(r, 3) for r in rates["tp2"]],
        "tp2_steps": steps,
        "tp2_collective_share": [round(s, 3) for s in shares],
    }
    what = "batch-1 decode tokens/s" if workload == "decode" else "mixed output tokens/s"
    result.add_ratio(
        f"{workload}_tp2_vs_tp1",
        median(paired),
        f"{what} of the 0.6B shape, two ranks (gloo, half the threads each) over one rank "
        "(every thread), median over alternating repetitions",
    )
    result.add_ratio(
        f"{workload}_collective_share",
        median(shares),
        f"{what.split(' tokens')[0]} at two ranks: rank 0's seconds in collectives over its "
        "runner's seconds (median repetition)",
    )


def _measure(
    runner: StepRunner, num_pages: int, requests: list[BenchRequest]
) -> tuple[RunResult, float, float, int]:
    """One run on a fresh engine: its result, the runner's seconds, the seconds in
    collectives (0 for one rank) and the steps."""
    execute: list[float] = []

    def observer(report: StepReport) -> None:
        execute.append(report.execute_s)

    before = runner.collective_seconds if isinstance(runner, TensorParallelRunner) else 0.0
    engine = make_engine(runner, "v1", num_pages)
    run_result = run_engine(engine, requests, "pagedkv", observer)
    after = runner.collective_seconds if isinstance(runner, TensorParallelRunner) else 0.0
    return run_result, sum(execute), after - before, len(execute)


@contextmanager
def _threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads in this process (rank 0 of two gets half
    of them), restoring the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _bytes_per_step(config: ModelConfig) -> dict[str, int]:
    """Bytes each rank sends into the all-reduces, and rank 1's logits gathered, per token of
    a step at two ranks in float32 (the activations' dtype)."""
    activations = config.hidden_size * 4
    return {
        "all_reduces_per_step": 2 * config.num_hidden_layers + 1,
        "all_reduce_bytes_per_token": (2 * config.num_hidden_layers + 1) * activations,
        "gather_bytes_per_logits_row": -(-config.vocab_size // RANKS) * 4,
    }
