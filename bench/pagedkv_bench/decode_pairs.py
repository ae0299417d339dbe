"""Batch-1 decode of pagedkv against llama.cpp alone, in paired repetitions:
``python -m pagedkv_bench.decode_pairs [--repetitions N] [--threads T] [--dtype D ...]``.

The peers workload's decode row (:mod:`pagedkv_bench.peers`: one request, a 128-token prompt,
64 new tokens, decode tokens/s with the prefill excluded, the same threads) on its two
systems only, so that many repetitions fit where a full peers run would take an hour: each
repetition runs both, the one that leads alternating, and each ratio is pagedkv's figure over
llama.cpp's within one repetition (SRV-104). Prints every repetition with the machine's
1-minute load average after it (on a shared machine, other work on the cores slows both, and
llama.cpp's spinning thread barriers far more: read the ratios with it), then per dtype the
median ratio and its range. Needs ``make llamacpp-install``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedkv.bench.checkpoints import QWEN3_0_6B, qwen3_shaped_checkpoint
from pagedkv.bench.context import default_cache_dir
from pagedkv.bench.pagedkv_system import PAGE_SIZE, load_runner, make_engine, warm_up
from pagedkv.bench.system import SystemUnderTest
from pagedkv_bench import peers
from pagedkv_bench.llamacpp_peer import LLAMA_CPP, LlamaCppPeer


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", action="append", choices=peers.DTYPES, default=None)
    parser.add_argument("--prompt", type=int, default=peers.PROMPT_LEN)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = qwen3_shaped_checkpoint(args.cache_dir)
    row = peers.Row("float32", 1, args.prompt)
    num_pages = -(-(args.prompt + peers.NEW_TOKENS) // PAGE_SIZE) + 16
    for dtype in args.dtype or list(peers.DTYPES):
        runner = load_runner(checkpoint, num_pages, dtype=dtype)
        warm_up(make_engine(runner, "v1", num_pages), QWEN3_0_6B.vocab)
        systems: list[SystemUnderTest] = [
            peers.pagedkv_system(runner, num_pages),
            LlamaCppPeer(
                checkpoint.path, dtype, threads=args.threads, batch_tokens=peers.STEP_TOKENS
            ),
        ]
        requests = row.requests(QWEN3_0_6B.vocab, 0)
        for system in systems:  # a warm-up run each
            system.run(requests)
        ratios: list[float] = []
        for repetition in range(args.repetitions):
            turn = repetition % 2
            rates = {}
            for system in systems[turn:] + systems[:turn]:
                rates[system.name] = system.run(requests).decode_tokens_per_s
            ours, theirs = rates[peers.PAGEDKV], rates[LLAMA_CPP]
            ratios.append(ours / theirs)
            print(
                f"{dtype} repetition {repetition + 1}: pagedkv {ours:.2f}, llama.cpp "
                f"{theirs:.2f} decode tok/s, ratio {ratios[-1]:.3f} (load average "
                f"{os.getloadavg()[0]:.2f})",
                flush=True,
            )
        print(
            f"{dtype}: pagedkv / llama.cpp, batch-1 decode after {args.prompt} tokens, "
            f"{args.threads} threads: median {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} repetitions)",
            flush=True,
        )
        del runner, systems
    return 0


if __name__ == "__main__":
    sys.exit(main())
