"""Where one batch-1 decode step of pagedkv goes, on the 0.6B shape:
``python -m pagedkv_bench.decode_profile [--dtype D] [--threads T] [--steps N]``.

One request (a 128-token prompt, as the peers' decode row) is prefilled, then its decode steps
are measured two ways at once:

* the engine's own step report (:mod:`pagedkv.bench.overhead`): schedule, plan, execute (the
  runner) and postprocess (sampling, the scheduler's update, the outputs);
* a profile of the Python calls inside them (``cProfile``: a decode step makes a few hundred,
  so it costs little), from which the kernels' calls are read by name: every decoder layer
  in one C call (ENG-160), the LM head's packed product, the rotary tables, and the one pass
  over the 151,936 logits that greedy sampling reads (the logit summary, ENG-158). What is
  left of the step is the engine's Python between them.

The bench's checkpoint has no tokenizer, so nothing is detokenized (as llama.cpp's benchmark
detokenizes nothing); ``pagedkv bench``'s ``detokenize`` workload times that cost on its own.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedkv.bench.checkpoints import QWEN3_0_6B, qwen3_shaped_checkpoint
from pagedkv.bench.context import default_cache_dir
from pagedkv.bench.overhead import StepBreakdown
from pagedkv.bench.pagedkv_system import PAGE_SIZE, greedy_params, load_runner, make_engine
from pagedkv.bench.requests import uniform_requests
from pagedkv.engine.outputs import StepReport

#: The calls read from the profile: (file name ending, function name) -> what they are.
KERNELS = {
    ("accel/cpu/decode_layers.py", "__call__"): "decoder layers (one C call, every layer)",
    ("accel/cpu/packed_gemv.py", "product"): "LM head (packed product)",
    ("engine/logit_summary.py", "__call__"): "logit summary (greedy's pass over the logits)",
    ("model/rope.py", "forward"): "rotary tables (cos, sin)",
}


def profile(dtype: str, threads: int, steps: int, cache_dir: Path) -> str:
    """The breakdown of ``steps`` decode steps, as a Markdown table."""
    torch.set_num_threads(threads)
    checkpoint = qwen3_shaped_checkpoint(cache_dir)
    num_pages = -(-(128 + steps + 1) // PAGE_SIZE) + 4
    runner = load_runner(checkpoint, num_pages, dtype=dtype)
    (request,) = uniform_requests(1, 128, steps + 1, QWEN3_0_6B.vocab, 0)
    for _ in range(2):  # the first run builds the kernels and warms the caches
        engine = make_engine(runner, "v1", num_pages)
        engine.add_request(request.prompt, greedy_params(steps + 1))
        engine.step()  # the prefill
        breakdown = StepBreakdown()

        def observe(report: StepReport, into: StepBreakdown = breakdown) -> None:
            if report.num_tokens == 1:
                into.add(report)

        engine.add_step_observer(observe)
        profiler = cProfile.Profile()
        profiler.enable()
        while engine.has_unfinished_requests():
            engine.step()
        profiler.disable()
    stats = pstats.Stats(profiler)
    found = {what: 0.0 for what in KERNELS.values()}
    for (path, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
        for (suffix, function), what in KERNELS.items():
            if path.endswith(suffix) and name == function:
                found[what] += row[3]  # cumulative seconds
    n = breakdown.steps
    step_ms = breakdown.total_s / n * 1e3
    lines = [
        f"{dtype}, {threads} threads, {n} decode steps after a 128-token prompt: "
        f"{step_ms:.2f} ms per step ({n / breakdown.total_s:.2f} tokens/s)",
        "",
        "| part of a step | ms per step | share |",
        "|---|---|---|",
    ]
    parts = {
        "schedule": breakdown.schedule_s,
        "plan": breakdown.plan_s,
        "execute (the runner)": breakdown.execute_s,
        "postprocess (sampling, update, outputs)": breakdown.postprocess_s,
    }
    kernels = sum(found.values())
    parts.update({f"- of which {what}": seconds for what, seconds in found.items()})
    parts["- the rest: Python and torch calls between them"] = breakdown.total_s - sum(
        (breakdown.schedule_s, breakdown.plan_s, kernels)
    )
    for what, seconds in parts.items():
        lines.append(f"| {what} | {seconds / n * 1e3:.2f} | {seconds / breakdown.total_s:.1%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=63)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args(argv)
    for dtype in args.dtype or ["float32", "bfloat16"]:
        print(profile(dtype, args.threads, args.steps, args.cache_dir), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
