"""Two source trees of pagedkv side by side: ``python -m pagedkv_bench.revisions OLD NEW``.

A refactor that must not change speed is checked by running each row on both trees, in fresh
interpreters, interleaved and in an order that alternates between repetitions, so that a drift
of the machine falls on both; each row's ratio is the median over repetitions of NEW's figure
over OLD's in the same repetition. OLD and NEW are ``src`` folders (e.g. of a ``git worktree``
of the old revision); the interpreter running this module runs both, each tree put first on
``PYTHONPATH``. Rows: batch-1 decode and batches of 8 and 32 requests (prompt 128, 64 new
tokens, wall time with prefill, generated tokens/s) on the Qwen3-0.6B-shaped checkpoint, in
float32 and bfloat16. Each run also prints its first tokens, which must be the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: Requests per row.
ROWS = {"decode": 1, "bs8": 8, "bs32": 32}
DTYPES = ("float32", "bfloat16")
PROMPT, NEW = 128, 64

#: Run in a fresh interpreter: one row on the tree first on the path; prints one JSON line.
_ROW = """
import json, sys, time
import torch
from pagedkv import LLM, SamplingParams
checkpoint, dtype, batch, prompt, new, threads = sys.argv[1:7]
batch, prompt, new = int(batch), int(prompt), int(new)
torch.set_num_threads(int(threads))
llm = LLM(checkpoint, dtype=dtype, page_size=16, num_pages=batch * 16 + 16, max_model_len=1024)
g = torch.Generator().manual_seed(0)
vocab = 150000  # below the 0.6B shape's 151,936 ids
ids = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
greedy = dict(temperature=0.0, ignore_eos=True)
warm_up = [{"prompt_token_ids": ids[0][:16]}]
llm.generate(warm_up, SamplingParams(max_tokens=4, **greedy), use_tqdm=False)
prompts = [{"prompt_token_ids": i} for i in ids]
start = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=new, **greedy), use_tqdm=False)
wall = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"tok_s": tokens / wall, "first": list(outs[0].outputs[0].token_ids[:8])}))
"""


def run_row(
    tree: Path, checkpoint: Path, dtype: str, batch: int, threads: int
) -> dict[str, object]:
    """One row on ``tree``, in a fresh interpreter: ``{"tok_s": ..., "first": [...]}``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [str(checkpoint), dtype, str(batch), str(PROMPT), str(NEW), str(threads)]
    done = subprocess.run(
        [sys.executable, "-c", _ROW, *args], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the old revision's src folder")
    parser.add_argument("new", type=Path, help="the new revision's src folder")
    parser.add_argument("--checkpoint", type=Path, required=True, help="a Qwen3 checkpoint")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    trees = {"old": args.old, "new": args.new}
    ratios: dict[str, list[float]] = {}
    same = True
    for repetition in range(args.repetitions):
        for dtype in DTYPES:
            for row, batch in ROWS.items():
                order = ("old", "new") if repetition % 2 == 0 else ("new", "old")
                got = {
                    v: run_row(trees[v], args.checkpoint, dtype, batch, args.threads) for v in order
                }
                speeds = {v: float(str(got[v]["tok_s"])) for v in order}
                same &= got["old"]["first"] == got["new"]["first"]
                ratios.setdefault(f"{dtype} {row}", []).append(speeds["new"] / speeds["old"])
                line = f"old {speeds['old']:.2f}, new {speeds['new']:.2f} tok/s"
                print(f"{repetition + 1} {dtype} {row}: {line}", file=sys.stderr)
    print("| row | new/old, median over repetitions (range) |\n|---|---|")
    for name, values in ratios.items():
        print(f"| {name} | {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f}) |")
    print(f"first tokens the same in every run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
