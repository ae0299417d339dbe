"""The cost of structured outputs: decode step time at 32 requests with half of them
constrained by a JSON schema against none (goal: at most 10% slower).

Each run adds 32 seeded requests of the same prompt length to a fresh engine of the small
checkpoint (its tokenizer is what the grammar engine reads) and steps them to the end; only
decode steps of all 32 sequences are timed (:func:`~pagedkv.bench.overhead.decode_step_breakdown`).
The constrained half follows a schema that cannot complete within the output (an array of at
least 64 objects of a string and an integer), so every timed step masks 16 rows: keys,
strings, numbers and separators, the grammar's mix. Runs alternate unconstrained and
constrained, the figures are medians over repetitions, and the ratio is the median of each
repetition's ratio, so both sides of one ratio share the machine's load of the moment.
"""

from __future__ import annotations

from pagedkv.backend import load_engine
from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.overhead import StepBreakdown, decode_step_breakdown
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import median, ratio, rounded
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.structured import StructuredOutputsParams

BATCH = 32
CONSTRAINED = 16
PROMPT_LEN = 32
NEW_TOKENS = 48
#: The goal: steps with half the batch constrained at most this much slower than with none.
SLOWDOWN_TARGET = 1.10
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
        }
    },
    "required": ["people"],
}


def _run(ctx: BenchContext, checkpoint: Checkpoint, constrained: int, vocab: int) -> StepBreakdown:
    """One batch of :data:`BATCH` requests, ``constrained`` of them under :data:`SCHEMA`, on a
    fresh engine; the breakdown of its full-batch decode steps."""
    config = EngineConfig(
        page_size=16,
        num_pages=BATCH * 8,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * PROMPT_LEN,
        max_model_len=256,
    )
    engine = load_engine(checkpoint.path, config, device=ctx.device)
    schema = StructuredOutputsParams(json=SCHEMA)
    for i in range(BATCH):
        prompt = [(ctx.seed + 7 * i + j) % vocab for j in range(PROMPT_LEN)]
        params = SamplingParams(
            max_tokens=NEW_TOKENS,
            temperature=1.0,
            seed=ctx.seed + i,
            ignore_eos=True,
            structured_outputs=schema if i < constrained else None,
        )
        engine.add_request(prompt, params)
    return decode_step_breakdown(engine, BATCH)


def run(ctx: BenchContext, checkpoint: Checkpoint, vocab: int) -> WorkloadResult:
    """Decode step time with half the batch constrained against none."""
    result = WorkloadResult("structured")
    repetitions = 3 if ctx.quick else 5
    ctx.log("structured: warming up")
    _run(ctx, checkpoint, CONSTRAINED, vocab)
    plain: list[float] = []
    masked: list[float] = []
    post_plain: list[float] = []
    post_masked: list[float] = []
    for repetition in range(repetitions):
        ctx.log(f"structured: repetition {repetition + 1}/{repetitions}")
        order = (0, CONSTRAINED) if repetition % 2 == 0 else (CONSTRAINED, 0)
        for constrained in order:
            breakdown = _run(ctx, checkpoint, constrained, vocab)
            us = breakdown.per_step_us()
            (masked if constrained else plain).append(us["step"])
            (post_masked if constrained else post_plain).append(us["postprocess"])
    result.figures.update(
        {
            "checkpoint": checkpoint.name,
            "vocab": vocab,
            "batch": BATCH,
            "constrained": CONSTRAINED,
            "new_tokens": NEW_TOKENS,
            "repetitions": repetitions,
            "step_us_none": plain,
            "step_us_half": masked,
            "postprocess_us_none": post_plain,
            "postprocess_us_half": post_masked,
            "median_step_us_none": rounded(median(plain), 1),
            "median_step_us_half": rounded(median(masked), 1),
        }
    )
    slowdown = median([ratio(m, p) for m, p in zip(masked, plain, strict=True)])
    result.add_ratio(
        "half_constrained_vs_none",
        slowdown,
        f"decode step time at {BATCH} requests, {CONSTRAINED} of them under a JSON schema "
        "(llguidance masks), over none; median of interleaved repetitions",
    )
    result.add_target(
        "half_constrained_vs_none",
        "<=",
        SLOWDOWN_TARGET,
        f"structured outputs: half the batch constrained at most {SLOWDOWN_TARGET - 1:.0%} "
        "slower a decode step",
    )
    return result
