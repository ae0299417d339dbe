"""Sizes of the device workload's parts (ENG-208): the GPU run's, and the tiny ones that run
the same code on the CPU in seconds (``--quick``), so ``make test`` checks the plumbing.

torch-free: the sizes are read by the command line's tests without loading a model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagedkv.bench.mixed import FULL
from pagedkv.bench.requests import BenchRequest, LengthDistribution, MixedSpec

#: The mixed workload of the device run: the full mode's of :mod:`pagedkv.bench.mixed`.
DEVICE_MIXED = FULL
TINY_MIXED = MixedSpec(
    num_requests=4,
    prompt=LengthDistribution(median=8, sigma=0.5, low=4, high=16),
    output=LengthDistribution(median=4, sigma=0.5, low=2, high=6),
)
#: Token ids of nano-vllm's benchmark prompts are drawn from ``[0, 10000]``.
NANOVLLM_TOKEN_HIGH = 10000


@dataclass(frozen=True, slots=True)
class DeviceSizes:
    """Sizes of every part of the device workload.

    Attributes:
        tiny: the CPU plumbing sizes (a tiny checkpoint), not the 0.6B shape.
        dtypes: dtypes of the decode and request rows, in run order.
        decode_prompt: prompt tokens of the batch-1 decode row.
        decode_tokens: decode tokens timed after the first (prefill excluded).
        decode_repeats: timed runs of each system in the decode row.
        batches: request counts of the batched rows.
        rows_prompt: prompt tokens of each request of a batched row.
        rows_new: tokens each request of a batched row generates.
        rows_repeats: timed runs of each system in each batched row.
        mixed: the mixed workload (pagedkv against ``generate_batch``).
        mixed_repeats: timed runs of each system on it.
        nano_seqs: sequences of nano-vllm's workload.
        nano_low: shortest prompt and output, tokens.
        nano_high: longest prompt and output, tokens.
        nano_step_tokens: pagedkv's token budget per step on nano-vllm's workload.
        copy_bytes: bytes of the tensor whose device copy measures the memory rate.
        step_tokens: pagedkv's token budget per step on the other parts.
    """

    tiny: bool
    dtypes: tuple[str, ...]
    decode_prompt: int
    decode_tokens: int
    decode_repeats: int
    batches: tuple[int, ...]
    rows_prompt: int
    rows_new: int
    rows_repeats: int
    mixed: MixedSpec
    mixed_repeats: int
    nano_seqs: int
    nano_low: int
    nano_high: int
    nano_step_tokens: int
    copy_bytes: int
    step_tokens: int


#: The GPU run: bfloat16 first (the rows the targets name), then float32.
GPU_SIZES = DeviceSizes(
    tiny=False,
    dtypes=("bfloat16", "float32"),
    decode_prompt=128,
    decode_tokens=256,
    decode_repeats=3,
    batches=(8, 32),
    rows_prompt=128,
    rows_new=64,
    rows_repeats=3,
    mixed=DEVICE_MIXED,
    mixed_repeats=2,
    nano_seqs=256,
    nano_low=100,
    nano_high=1024,
    nano_step_tokens=8192,
    copy_bytes=2**30,
    step_tokens=4096,
)

#: The CPU plumbing run of ``--quick``: every part, on a tiny checkpoint, in seconds.
TINY_SIZES = DeviceSizes(
    tiny=True,
    dtypes=("bfloat16", "float32"),
    decode_prompt=8,
    decode_tokens=6,
    decode_repeats=1,
    batches=(2, 4),
    rows_prompt=8,
    rows_new=4,
    rows_repeats=1,
    mixed=TINY_MIXED,
    mixed_repeats=1,
    nano_seqs=4,
    nano_low=4,
    nano_high=10,
    nano_step_tokens=64,
    copy_bytes=2**22,
    step_tokens=64,
)


def nanovllm_requests(
    count: int, low: int, high: int, vocab: int, seed: int = 0
) -> list[BenchRequest]:
    """nano-vllm's benchmark workload (its ``bench.py``): with Python's ``random`` seeded by
    ``seed``, every prompt first (a length uniform in ``[low, high]``, then its token ids
    uniform in ``[0, 10000]``), then every output length uniform in ``[low, high]``. Token ids
    are capped below ``vocab`` for a tiny checkpoint's vocabulary."""
    rng = random.Random(seed)
    top = min(NANOVLLM_TOKEN_HIGH, vocab - 1)
    prompts = [
        tuple(rng.randint(0, top) for _ in range(rng.randint(low, high))) for _ in range(count)
    ]
    outputs = [rng.randint(low, high) for _ in range(count)]
    return [BenchRequest(p, n) for p, n in zip(prompts, outputs, strict=True)]
