"""Prefill attention: equal-shape chunks grouped into shared calls, against a call per chunk.

The same ragged layout (:mod:`pagedkv.store.ragged_attention`) is planned twice for each batch of
prefill chunks: grouped as the PagedStore does it (equal query and context lengths share a
call, up to ``GROUP_ROWS`` rows) and with one attention call per chunk (how prefill chunks ran
before). Each is run for one layer over K/V gathered from a flat pool, on the embedded model's
head shape and on Qwen3-0.6B's, timed in CPU time (a shared machine preempts milliseconds-long
runs); the ratio is the time of a call per chunk over the grouped time (above 1.0: grouping is
faster).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial

import torch

from pagedkv.bench.context import BenchContext
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import rounded
from pagedkv.store.ragged_attention import (
    GROUP_ROWS,
    AttentionLayout,
    plan_attention,
    ragged_attention,
)

#: (query heads, KV heads, head dim): the embedded model's and Qwen3-0.6B's.
HEAD_SHAPES = {"embedded": (4, 2, 64), "qwen3-0.6b": (16, 8, 128)}
#: Batches of prefill chunks (each a whole fresh prompt), by name: chunk lengths.
BATCHES = {
    "16x16": [16] * 16,
    "32x32": [32] * 32,
    "8x64": [64] * 8,
    "4x128": [128] * 4,
    "mixed8": [16, 40, 77, 128, 99, 23, 64, 50],
}


def layout(lengths: list[int], group_rows: int) -> AttentionLayout:
    """Chunks laid out one after the other, in the pool as in the step."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    offsets = torch.tensor(starts[:-1], dtype=torch.int64)

    def index(seqs: list[int], width: int) -> torch.Tensor:
        return offsets[seqs][:, None] + torch.arange(width)[None, :]

    return plan_attention(starts, lengths, index, torch.device("cpu"), group_rows)


def best_seconds(runs: dict[str, Callable[[], object]], repetitions: int) -> dict[str, float]:
    """Least CPU time (of this process: other work on the machine does not count) of
    ``repetitions`` runs of each, after one warm-up; the runs alternate, so a slow moment of
    the machine hits them alike."""
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()
    for _ in range(repetitions):
        for name, run in runs.items():
            start = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - start)
    return best


def run(ctx: BenchContext) -> WorkloadResult:
    """Time grouped and per-chunk prefill attention on every batch and head shape."""
    result = WorkloadResult("attention")
    repetitions = 15 if ctx.quick else 40
    gen = torch.Generator().manual_seed(ctx.seed)
    figures: dict[str, dict[str, dict[str, float | None]]] = {}
    speedups: list[float] = []
    for shape_name, (heads, kv_heads, dim) in HEAD_SHAPES.items():
        ctx.log(f"attention: prefill chunks on the {shape_name} head shape")
        figures[shape_name] = {}
        for batch_name, lengths in BATCHES.items():
            rows = sum(lengths)
            query = torch.randn(rows, heads, dim, generator=gen)
            keys = torch.randn(rows, kv_heads, dim, generator=gen)
            values = torch.randn(rows, kv_heads, dim, generator=gen)
            layouts = {"grouped": layout(lengths, GROUP_ROWS), "per_chunk": layout(lengths, 1)}
            times = best_seconds(
                {
                    name: partial(ragged_attention, query, keys, values, plan, dim**-0.5)
                    for name, plan in layouts.items()
                },
                repetitions,
            )
            speedup = times["per_chunk"] / times["grouped"]
            speedups.append(speedup)
            figures[shape_name][batch_name] = {
                "grouped_ms": rounded(times["grouped"] * 1e3, 3),
                "per_chunk_ms": rounded(times["per_chunk"] * 1e3, 3),
                "speedup": rounded(speedup, 3),
            }
    result.figures["prefill_attention"] = figures
    result.add_ratio(
        "prefill_grouped_speedup",
        math.exp(sum(math.log(x) for x in speedups) / len(speedups)),
        "geometric mean, over batches and head shapes, of one layer's prefill attention time "
        "with a call per chunk over the time with equal-shape chunks grouped (1.0 = no faster)",
    )
    result.add_target(
        "prefill_grouped_speedup",
        ">=",
        1.0,
        "grouping equal-shape prefill chunks is not slower than a call per chunk",
    )
    result.add_ratio(
        "prefill_grouped_speedup_worst",
        min(speedups),
        "worst, over the same batches, of the per-chunk time over the grouped time (batches "
        "with no equal shapes run the same calls both ways: their ratio is the noise)",
    )
    return result
