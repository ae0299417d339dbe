"""The device workload of ``pagedkv bench --device cuda`` (ENG-208): the rows a GPU is judged
by, each with its fraction of the memory bound, its parts sharing the run's time budget
(ENG-209).

Parts, in run order, with their weights in the budget: ``decode`` (batch-1 decode of 256
tokens), ``requests`` (8 and 32 requests against transformers' static batching), ``mixed``
(the mixed workload against transformers' continuous batching) and ``nanovllm`` (nano-vllm's
workload: 256 sequences, prompts and outputs of 100 to 1,024 tokens, seed 0); rows in
:mod:`pagedkv.bench.device_rows`. On the 0.6B-shaped checkpoint; with ``--quick``, on a tiny
checkpoint with tiny sizes (:data:`~pagedkv.bench.device_sizes.TINY_SIZES`), so the same code
runs on the CPU in seconds. A part that raises is recorded and the next one runs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from pagedkv.bench.budget import split
from pagedkv.bench.checkpoints import Checkpoint, qwen3_shaped_checkpoint, tiny_checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.device_rows import (
    Part,
    decode_part,
    mixed_part,
    nanovllm_part,
    requests_part,
    runner_variants,
)
from pagedkv.bench.device_sizes import GPU_SIZES, TINY_SIZES
from pagedkv.bench.results import WorkloadResult

#: The parts, in run order: name, weight in the time budget, body.
PARTS: tuple[tuple[str, float, Callable[[Part], None]], ...] = (
    ("decode", 0.15, decode_part),
    ("requests", 0.30, requests_part),
    ("mixed", 0.20, mixed_part),
    ("nanovllm", 0.35, nanovllm_part),
)

#: The goals of the GPU run (issue targets): ratio name, threshold, description.
TARGETS = (
    (
        "decode_bf16_pagedkv_fraction_of_bound",
        0.35,
        "bf16 batch-1 decode: pagedkv >= 0.35 of the memory bound",
    ),
    (
        "bf16_bs32_pagedkv_vs_hf-generate",
        3.0,
        "bf16, 32 requests: pagedkv >= 3x transformers static batching",
    ),
    (
        "mixed_bf16_pagedkv_vs_hf-generate-batch",
        2.0,
        "mixed workload: pagedkv >= 2x transformers continuous batching (generate_batch)",
    ),
    (
        "nanovllm_bf16_pagedkv_fraction_of_bound",
        0.4,
        "nano-vllm's workload: pagedkv >= 0.4 of its memory bound",
    ),
)


def run(ctx: BenchContext) -> WorkloadResult:
    """Every part that its share of the budget lets start (see the module docstring)."""
    result = WorkloadResult("device")
    sizes = TINY_SIZES if ctx.quick else GPU_SIZES
    checkpoint = _checkpoint(ctx, sizes.tiny)
    result.figures["checkpoint"] = checkpoint.name
    result.figures["sizes"] = asdict(sizes)
    variants = runner_variants(ctx.device)
    result.figures["runner_variants"] = sorted(variants)
    if ctx.device.startswith("cuda"):
        result.figures["gpu"] = torch.cuda.get_device_name(ctx.device)
    shares = split([(name, weight) for name, weight, _ in PARTS], time.perf_counter(), ctx.deadline)
    for name, _, body in PARTS:
        part = Part(ctx, sizes, shares[name], checkpoint, result, variants)
        if part.cut(0, 1, "parts: not started"):
            continue
        started = time.perf_counter()
        ctx.log(f"device: {name}: starting ({shares[name].left():.0f} s left of its share)")
        try:
            body(part)
        except Exception as exc:  # recorded: one part failing must not lose the others
            result.errors[name] = f"{type(exc).__name__}: {exc}"
            ctx.log(f"device: {name}: FAILED: {type(exc).__name__}: {exc}")
        result.figures.setdefault("part_seconds", {})[name] = round(
            time.perf_counter() - started, 1
        )
        gc.collect()
        if ctx.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if not sizes.tiny:
        for ratio_name, threshold, description in TARGETS:
            result.add_target(ratio_name, ">=", threshold, description)
    return result


def _checkpoint(ctx: BenchContext, tiny: bool) -> Checkpoint:
    if tiny:
        return tiny_checkpoint(ctx.cache_dir)
    ctx.log("device: preparing the Qwen3-0.6B-shaped checkpoint (generated once)")
    return qwen3_shaped_checkpoint(ctx.cache_dir)
