"""Parallel sampling on shared pages: one request with ``n=4`` against four independent
requests of the same prompt (specs/engine.md ENG-047).

The prompt is 409 tokens, not a multiple of the page size, so each sample needs its own copy
of the partial last page. Both run greedily to the same lengths, prefix caching on and off;
the figures are the KV pages at the peak (end of a step) and the prompt positions the model
computed. With caching off, four independent requests hold and compute the prompt four
times; with it they wait for the first one's pages and hit them, but still compute their
partial pages.
"""

from __future__ import annotations

import dataclasses

from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.pagedkv_system import PAGE_SIZE, load_runner, make_engine
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import ratio
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner

SAMPLES = 4
PROMPT_TOKENS = 409  # 25 full pages of 16 and 9 tokens more
FULL_NEW_TOKENS = 32
QUICK_NEW_TOKENS = 8


def _run(
    runner: ModelRunner, num_pages: int, caching: bool, parallel: bool, new_tokens: int
) -> dict[str, int]:
    engine = make_engine(runner, "v1", num_pages, enable_prefix_caching=caching)
    prompt = [(7 * i + 3) % runner.vocab_size for i in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    if parallel:
        run_to_completion(engine, [prompt], dataclasses.replace(params, n=SAMPLES))
    else:
        run_to_completion(engine, [prompt] * SAMPLES, params)
    stats = engine.stats()
    return {
        "peak_pages": stats.peak_pages_in_use,
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "steps": stats.steps,
    }


def run(ctx: BenchContext, checkpoint: Checkpoint) -> WorkloadResult:
    result = WorkloadResult("parallel")
    new_tokens = QUICK_NEW_TOKENS if ctx.quick else FULL_NEW_TOKENS
    num_pages = SAMPLES * (-(-(PROMPT_TOKENS + new_tokens) // PAGE_SIZE)) + 8
    runner = load_runner(checkpoint, num_pages)
    for caching in (False, True):
        key = f"cache_{'on' if caching else 'off'}"
        forked = _run(runner, num_pages, caching, True, new_tokens)
        apart = _run(runner, num_pages, caching, False, new_tokens)
        ctx.log(f"parallel: {key}: n=4 {forked}, 4 requests {apart}")
        result.figures[key] = {"n_4": forked, "four_requests": apart}
        result.add_ratio(
            f"pages_{key}",
            ratio(apart["peak_pages"], forked["peak_pages"]),
            f"peak KV pages of 4 independent requests over one request with n=4 "
            f"(prefix caching {'on' if caching else 'off'}; {PROMPT_TOKENS}-token prompt, "
            f"{new_tokens} tokens each)",
        )
        result.add_ratio(
            f"prefill_{key}",
            ratio(apart["prefill_tokens_computed"], forked["prefill_tokens_computed"]),
            f"prompt positions computed by 4 independent requests over n=4 (prefix caching "
            f"{'on' if caching else 'off'})",
        )
    result.figures["spec"] = {
        "samples": SAMPLES,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "page_size": PAGE_SIZE,
    }
    return result
