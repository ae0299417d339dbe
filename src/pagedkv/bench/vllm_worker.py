"""Runs vLLM's CPU backend on the benchmark's workloads, inside vLLM's own virtualenv.

``python -m pagedkv.bench.vllm_worker`` is started by :mod:`pagedkv.bench.vllm_peer` with the
interpreter of ``.venv-vllm`` (``make vllm-install``); it imports nothing of pagedkv but this
file, so only vLLM and the standard library need to be there. It reads a JSON job on standard
input::

    {"model": DIR, "dtype": "float32", "block_size": 32, "max_model_len": 512,
     "max_num_seqs": 32, "max_num_batched_tokens": 4096,
     "rows": [{"name": "fp32-bs8", "kind": "batch", "requests": [[[ids...], max_tokens], ...]},
              {"name": "fp32-bs1", "kind": "decode", "requests": [[[ids...], max_tokens]]}]}

and prints one JSON line ``{"rows": {name: {...}}, "vllm": version}`` on standard output:

* ``batch``: every request submitted at once, greedy, exactly ``max_tokens`` each (EOS ignored);
  ``output_tokens_per_s`` over the wall time of the whole ``generate`` call (prefill included),
  as the other systems' batch rows are timed;
* ``decode``: batch-1 decode: the same request run for ``max_tokens`` and for one token;
  ``decode_tokens_per_s = (max_tokens - 1) / (t_full - t_one)`` (prefill excluded).

Each row runs once untimed first; every timed call starts from an empty prefix cache (SRV-047),
as pagedkv's fresh engine does. The engine runs in this process (no engine-core process):
on a machine of a few cores a second busy process would only take cores from the model.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any


def _generate(llm: Any, sampling: Any, requests: list[list[Any]]) -> float:
    """Seconds to run ``requests`` (``[prompt ids, max_tokens]``) to completion together."""
    prompts = [{"prompt_token_ids": list(prompt)} for prompt, _ in requests]
    params = [
        sampling(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        for _, n in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for output, (_, n) in zip(outputs, requests, strict=True):
        got = len(output.outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"vLLM generated {got} tokens, {n} were asked for")
    return seconds


def _timed(llm: Any, sampling: Any, requests: list[list[Any]]) -> float:
    """:func:`_generate` from an empty prefix cache (SRV-047): vLLM caches prompts by default,
    so without clearing a timed call would reuse the prompts its warm-up prefilled, where
    pagedkv's fresh engine computes them."""
    if llm.reset_prefix_cache() is False:
        raise RuntimeError("vLLM refused to clear its prefix cache before a timed run")
    return _generate(llm, sampling, requests)


def _row(llm: Any, sampling: Any, row: dict[str, Any]) -> dict[str, float]:
    requests: list[list[Any]] = row["requests"]
    if row["kind"] == "batch":
        _generate(llm, sampling, requests)  # warm-up
        seconds = _timed(llm, sampling, requests)
        tokens = sum(n for _, n in requests)
        return {"output_tokens_per_s": tokens / seconds, "wall_s": seconds}
    (prompt, n) = requests[0]
    _generate(llm, sampling, [[prompt, n]])  # warm-up
    one = _timed(llm, sampling, [[prompt, 1]])
    full = _timed(llm, sampling, [[prompt, n]])
    return {"decode_tokens_per_s": (n - 1) / (full - one), "wall_s": full}


def main() -> int:
    """Run the job on standard input; the exit status."""
    job = json.load(sys.stdin)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm: Any = importlib.import_module("vllm")  # only in vLLM's own virtualenv
    llm = vllm.LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype=job["dtype"],
        block_size=job["block_size"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        seed=0,
    )
    rows = {row["name"]: _row(llm, vllm.SamplingParams, row) for row in job["rows"]}
    print(json.dumps({"rows": rows, "vllm": vllm.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
