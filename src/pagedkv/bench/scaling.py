"""Scaling: output tokens/s against concurrency, and the engine's share of a decode step.

For each concurrency ``c``, ``c`` requests of identical lengths are submitted at once to each
system (the static ``generate`` batch is all ``c`` of them: no padding, its best case). Then
32 concurrent requests run on pagedkv v1 with the runner timed (:mod:`pagedkv.bench.overhead`):
the engine's share is the time of its decode steps not spent in the runner's ``execute``.
"""

from __future__ import annotations

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
from pagedkv.bench.overhead import decode_step_breakdown
from pagedkv.bench.pagedkv_system import (
    MAX_NUM_BATCHED_TOKENS,
    PAGE_SIZE,
    PagedkvSystem,
    greedy_params,
    load_runner,
    make_engine,
    warm_up,
)
from pagedkv.bench.requests import uniform_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import rounded
from pagedkv.bench.system import SystemUnderTest
from pagedkv.engine.runner import ModelRunner

QUICK_LEVELS = (1, 4, 16)
FULL_LEVELS = (1, 4, 16, 64)
PROMPT_LEN = 64
QUICK_OUTPUT_LEN = 16
FULL_OUTPUT_LEN = 32
#: Concurrent requests of the overhead measurement, and their lengths.
OVERHEAD_BATCH = 32
OVERHEAD_PROMPT_LEN = 32
QUICK_OVERHEAD_OUTPUT_LEN = 32
FULL_OVERHEAD_OUTPUT_LEN = 128


def run(ctx: BenchContext, checkpoint: Checkpoint, vocab: int) -> WorkloadResult:
    """Throughput per system and concurrency level, then the engine overhead at 32."""
    result = WorkloadResult("scaling")
    levels = QUICK_LEVELS if ctx.quick else FULL_LEVELS
    output_len = QUICK_OUTPUT_LEN if ctx.quick else FULL_OUTPUT_LEN
    per_seq_pages = -(-(PROMPT_LEN + max(output_len, FULL_OVERHEAD_OUTPUT_LEN)) // PAGE_SIZE)
    num_pages = max(max(levels), OVERHEAD_BATCH) * per_seq_pages + 16
    runner = load_runner(checkpoint, num_pages)
    recompute = ModelRunner.recompute(runner.model)  # the same model, no K/V pool
    warm_up(make_engine(runner, "v1", num_pages), vocab)
    hf_model = load_hf_model(checkpoint)
    systems: dict[str, SystemUnderTest] = {
        "pagedkv-v1": PagedkvSystem("v1", lambda: make_engine(runner, "v1", num_pages)),
        "pagedkv-v0": PagedkvSystem("v0", lambda: make_engine(recompute, "v0", num_pages)),
        HF_GENERATE: HfGenerate(hf_model),
    }
    if not ctx.quick and has_generate_batch(hf_model):
        systems[HF_GENERATE_BATCH] = HfGenerateBatch(
            hf_model,
            page_size=PAGE_SIZE,
            num_blocks=num_pages,
            max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
            max_requests_per_batch=max(levels),
        )
    throughput: dict[str, dict[str, float | None]] = {name: {} for name in systems}
    for level in levels:
        requests = uniform_requests(level, PROMPT_LEN, output_len, vocab, ctx.seed + level)
        for name, system in systems.items():
            ctx.log(f"scaling: {name} at concurrency {level}")
            try:
                if level == levels[0]:
                    system.run(requests[:1])  # warm-up
                tokens_per_s = system.run(requests).tokens_per_s
            except Exception as exc:  # a baseline failing on CPU is recorded, not fatal
                result.errors[f"{name}@{level}"] = f"{type(exc).__name__}: {exc}"
                tokens_per_s = float("nan")
            throughput[name][str(level)] = rounded(tokens_per_s, 2)
    result.figures["throughput_tokens_per_s"] = throughput
    result.figures["spec"] = {
        "levels": list(levels),
        "prompt_len": PROMPT_LEN,
        "output_len": output_len,
    }
    top = str(levels[-1])
    v1_top, hf_top = throughput["pagedkv-v1"].get(top), throughput[HF_GENERATE].get(top)
    v1_one = throughput["pagedkv-v1"].get(str(levels[0]))
    result.add_ratio(
        "v1_speedup_top_over_one",
        (v1_top / v1_one) if v1_top and v1_one else float("nan"),
        f"pagedkv v1 output tokens/s at concurrency {top} over concurrency {levels[0]}",
    )
    result.add_ratio(
        "pagedkv_vs_hf_generate_top",
        (v1_top / hf_top) if v1_top and hf_top else float("nan"),
        f"output tokens/s of pagedkv v1 over generate at concurrency {top} (equal lengths: "
        "generate's best case)",
    )
    _overhead(ctx, result, runner, num_pages, vocab)
    return result


def _overhead(
    ctx: BenchContext,
    result: WorkloadResult,
    runner: ModelRunner,
    num_pages: int,
    vocab: int,
) -> None:
    output_len = QUICK_OVERHEAD_OUTPUT_LEN if ctx.quick else FULL_OVERHEAD_OUTPUT_LEN
    ctx.log(f"scaling: engine overhead at {OVERHEAD_BATCH} concurrent requests")
    engine = make_engine(runner, "v1", num_pages)
    requests = uniform_requests(OVERHEAD_BATCH, OVERHEAD_PROMPT_LEN, output_len, vocab, ctx.seed)
    for request in requests:
        engine.add_request(request.prompt, greedy_params(request.max_tokens))
    breakdown = decode_step_breakdown(engine, OVERHEAD_BATCH)
    result.figures["engine_overhead"] = {
        "concurrent_requests": OVERHEAD_BATCH,
        "decode_steps_measured": breakdown.steps,
        "per_step_us": breakdown.per_step_us(),
        "engine_share": rounded(breakdown.engine_share),
    }
    result.add_ratio(
        "engine_overhead_share",
        breakdown.engine_share,
        f"(step - runner execute) / step over decode steps of {OVERHEAD_BATCH} concurrent "
        "requests: scheduler, KVManager, plan building and postprocessing",
    )
    result.add_target(
        "engine_overhead_share",
        "<=",
        0.10,
        f"engine overhead < 10% of a decode step at {OVERHEAD_BATCH} concurrent requests",
    )
