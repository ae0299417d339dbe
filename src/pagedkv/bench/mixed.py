"""Mixed workload: requests of varied prompt and output lengths, all submitted at once.

Systems, all on the small checkpoint in float32, greedy, each request generating exactly its
``max_tokens``:

* ``pagedkv-v1``: the engine with its paged KV cache;
* ``pagedkv-v0``: the same engine recomputing every sequence at every step (no cache);
* ``hf-generate``: transformers ``generate`` on static, left-padded batches (best batch size of
  those tried);
* ``hf-generate-batch``: transformers' continuous batching (full mode only).

Repetitions are interleaved (v1, v0, hf, v1, v0, hf, ...) so slow drifts in the machine's load
hit every system alike; each system's figure is its median repetition, and each ratio the
median of the ratios within a repetition. In full mode v0 (minutes per run) runs in the first
repetition only; transformers' continuous batching (seconds) runs in every repetition, after a
warm-up, so that its ratio is paired like the others (measured once after the repetitions, its
one run against the median of pagedkv's swung between full runs: bench/README.md).
"""

from __future__ import annotations

import time

from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.hf_systems import (
    HF_GENERATE,
    HF_GENERATE_BATCH,
    HfGenerate,
    HfGenerateBatch,
    has_generate_batch,
    load_hf_model,
)
from pagedkv.bench.pagedkv_system import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PAGE_SIZE,
    PagedkvSystem,
    load_runner,
    make_engine,
    warm_up,
)
from pagedkv.bench.requests import BenchRequest, LengthDistribution, MixedSpec, mixed_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.run import RunResult
from pagedkv.bench.stats import median, ratio
from pagedkv.bench.system import SystemUnderTest
from pagedkv.engine.runner import ModelRunner

QUICK = MixedSpec(
    num_requests=12,
    prompt=LengthDistribution(median=48, sigma=0.6, low=16, high=128),
    output=LengthDistribution(median=16, sigma=0.6, low=4, high=48),
)
FULL = MixedSpec(
    num_requests=64,
    prompt=LengthDistribution(median=128, sigma=0.8, low=16, high=512),
    output=LengthDistribution(median=48, sigma=0.8, low=8, high=256),
)
#: Static batch sizes tried for ``generate``; the fastest is the baseline.
QUICK_HF_BATCH_SIZES = (12,)
FULL_HF_BATCH_SIZES = (8, 16, 64)


def spec_for(quick: bool) -> MixedSpec:
    """The mixed workload of the mode."""
    return QUICK if quick else FULL


def pages_needed(requests: list[BenchRequest], page_size: int = PAGE_SIZE) -> int:
    """Pages that hold every request at its full length at once, plus a little slack."""
    return sum(-(-r.total_len // page_size) for r in requests) + 16


def run(ctx: BenchContext, checkpoint: Checkpoint, vocab: int) -> WorkloadResult:
    """Measure the mixed workload on every system."""
    result = WorkloadResult("mixed")
    spec = spec_for(ctx.quick)
    requests = mixed_requests(spec, vocab, ctx.seed)
    num_pages = pages_needed(requests)
    repetitions = 5 if ctx.quick else 3
    batch_sizes = QUICK_HF_BATCH_SIZES if ctx.quick else FULL_HF_BATCH_SIZES

    runner = load_runner(checkpoint, num_pages)
    warm_up(make_engine(runner, "v1", num_pages), vocab)
    hf_model = load_hf_model(checkpoint)
    HfGenerate(hf_model, batch_size=2).run(requests[:2])  # warm-up

    systems: dict[str, SystemUnderTest] = {
        "pagedkv-v1": PagedkvSystem("pagedkv-v1", lambda: make_engine(runner, "v1", num_pages)),
        "pagedkv-v0": PagedkvSystem(
            "pagedkv-v0",
            lambda: make_engine(ModelRunner.recompute(runner.model), "v0", num_pages),
        ),
    }
    for size in batch_sizes:
        systems[f"{HF_GENERATE}-bs{size}"] = HfGenerate(hf_model, batch_size=size)
    if not ctx.quick:
        batch = _generate_batch(result, hf_model, requests, num_pages)
        if batch is not None:
            systems[HF_GENERATE_BATCH] = batch
    runs: dict[str, list[RunResult]] = {name: [] for name in systems}
    for repetition in range(repetitions):
        for name, system in list(systems.items()):
            if name == "pagedkv-v0" and repetition > 0 and not ctx.quick:
                continue
            ctx.log(f"mixed: {name} (repetition {repetition + 1}/{repetitions})")
            try:
                runs[name].append(system.run(requests))
            except Exception as exc:  # recorded: the baseline may not run on every CPU
                if name != HF_GENERATE_BATCH:
                    raise
                result.errors[name] = f"{type(exc).__name__}: {exc}"
                result.notes.append("transformers continuous batching failed; see errors")
                del systems[name]

    medians = {name: _median_run(rs) for name, rs in runs.items() if rs}
    static = [medians[f"{HF_GENERATE}-bs{size}"] for size in batch_sizes]
    best_static = max(static, key=lambda r: r.tokens_per_s)
    best_name = f"{HF_GENERATE}-bs{batch_sizes[static.index(best_static)]}"
    v1 = medians["pagedkv-v1"]
    result.figures = {
        "num_requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "prompt_len": _describe(spec.prompt),
        "output_len": _describe(spec.output),
        "repetitions": repetitions,
        "engine": {
            "page_size": PAGE_SIZE,
            "num_pages": num_pages,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
        },
        "hf_generate_best_batch_size": batch_sizes[static.index(best_static)],
        "systems": {name: r.summary() for name, r in medians.items()},
        "repetition_tokens_per_s": {
            name: [round(r.tokens_per_s, 2) for r in rs] for name, rs in runs.items()
        },
    }
    result.add_ratio(
        "v1_vs_v0_speedup",
        _paired(runs["pagedkv-v1"], runs["pagedkv-v0"]),
        "output tokens/s of pagedkv v1 (paged KV cache) over v0 (recompute), same engine; "
        "median over repetitions of each repetition's ratio",
    )
    result.add_ratio(
        "pagedkv_vs_hf_generate",
        _paired(runs["pagedkv-v1"], runs[best_name]),
        "output tokens/s of pagedkv v1 over transformers generate (static padded batches, "
        "best batch size tried); median over repetitions of each repetition's ratio",
    )
    result.add_ratio(
        "ttft_p50_hf_generate_over_pagedkv",
        ratio(_p50(best_static), _p50(v1)),
        "TTFT p50 of transformers generate over pagedkv v1 (higher: pagedkv answers sooner)",
    )
    result.add_target(
        "pagedkv_vs_hf_generate", ">=", 2.0, "mixed: pagedkv >= 2x transformers generate"
    )
    result.add_ratio(
        "pagedkv_vs_hf_generate_batch",
        _paired(runs["pagedkv-v1"], runs.get(HF_GENERATE_BATCH, [])),
        "output tokens/s of pagedkv v1 over transformers continuous batching (generate_batch); "
        "median over repetitions of each repetition's ratio",
    )
    result.add_target(
        "pagedkv_vs_hf_generate_batch",
        ">=",
        5.0,
        "mixed: pagedkv >= 5x transformers continuous batching (generate_batch)",
    )
    return result


def _generate_batch(
    result: WorkloadResult, model: object, requests: list[BenchRequest], num_pages: int
) -> HfGenerateBatch | None:
    """Transformers' continuous batching, its cache shaped like pagedkv's, warmed up on two of
    ``requests``; ``None`` (and a note of why) where the installed transformers has none or
    its warm-up fails."""
    if not has_generate_batch(model):
        result.notes.append("the installed transformers has no generate_batch: not measured")
        return None
    system = HfGenerateBatch(
        model,
        page_size=PAGE_SIZE,
        num_blocks=num_pages,
        max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        max_requests_per_batch=MAX_NUM_SEQS,
    )
    started = time.perf_counter()
    try:
        system.run(requests[:2])  # warm-up
    except Exception as exc:  # recorded in the results: the baseline may not run on CPU
        result.errors[HF_GENERATE_BATCH] = f"{type(exc).__name__}: {exc}"
        result.notes.append(
            f"transformers continuous batching failed after {time.perf_counter() - started:.1f}"
            " s; see errors"
        )
        return None
    return system


def _paired(numerators: list[RunResult], denominators: list[RunResult]) -> float:
    """Median over repetitions of the throughput ratio of runs made back to back (the shorter
    list's repetitions only)."""
    pairs = zip(numerators, denominators, strict=False)
    return median([ratio(a.tokens_per_s, b.tokens_per_s) for a, b in pairs])


def _median_run(runs: list[RunResult]) -> RunResult:
    ordered = sorted(runs, key=lambda r: r.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def _p50(run: RunResult) -> float:
    return median(run.ttft_s)


def _describe(dist: LengthDistribution) -> dict[str, float]:
    return {"median": dist.median, "sigma": dist.sigma, "low": dist.low, "high": dist.high}
