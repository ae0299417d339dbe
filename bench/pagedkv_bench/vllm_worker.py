"""Runs vLLM's CPU backend on the benchmark's rows, inside vLLM's own virtualenv.

``python -m pagedkv_bench.vllm_worker`` is started by :mod:`pagedkv_bench.vllm_peer` with the
interpreter of ``.venv-vllm`` (``make vllm-install``); it imports nothing of pagedkv, and of
its own package only this file (the package's ``__init__`` imports nothing), so only vLLM and
the standard library need to be there. It speaks JSON lines on standard
input and output. The first line sets the engine up::

    {"model": DIR, "dtype": "float32", "block_size": 32, "max_model_len": 512,
     "max_num_seqs": 32, "max_num_batched_tokens": 4096}

and is answered ``{"vllm": version}`` once the model is loaded. Every later line is one timed
run, answered with its counts and seconds, until standard input ends::

    {"kind": "batch", "requests": [[[ids...], max_tokens], ...]}

* ``batch``: every request submitted at once, greedy, exactly ``max_tokens`` each (EOS ignored),
  answered ``{"output_tokens": n, "wall_s": s}``, ``s`` the wall time of the whole ``generate``
  call (prefill included), as the other systems' batch runs are timed;
* ``decode``: batch-1 decode: the same request run for ``max_tokens`` and for one token,
  answered with ``output_tokens`` and ``wall_s`` of the full run, ``decode_tokens =
  max_tokens - 1`` and ``decode_s = t_full - t_one`` (prefill excluded).

The first run of a kind and requests is preceded by an untimed one (its warm-up); every timed call
starts from an empty prefix cache (SRV-047), as pagedkv's fresh engine does. The process stays
up between rows so that the caller can interleave them with the other systems' (SRV-104). The
engine runs in this process (no engine-core process): on a machine of a few cores a second busy
process would only take cores from the model.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any, TextIO


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


def _row(llm: Any, sampling: Any, row: dict[str, Any], warm_up: bool = True) -> dict[str, float]:
    """One timed run of ``row``, after an untimed one where ``warm_up``: its counts and
    seconds."""
    requests: list[list[Any]] = row["requests"]
    if row["kind"] == "batch":
        if warm_up:
            _generate(llm, sampling, requests)
        seconds = _timed(llm, sampling, requests)
        tokens = sum(n for _, n in requests)
        return {"output_tokens": tokens, "wall_s": seconds}
    (prompt, n) = requests[0]
    if warm_up:
        _generate(llm, sampling, [[prompt, n]])
    one = _timed(llm, sampling, [[prompt, 1]])
    full = _timed(llm, sampling, [[prompt, n]])
    return {"output_tokens": n, "wall_s": full, "decode_tokens": n - 1, "decode_s": full - one}


def serve(llm: Any, sampling: Any, lines: TextIO, out: TextIO) -> None:
    """Answer each run on ``lines`` with one line of its counts and seconds, warming a kind
    and its requests up the first time they come."""
    warmed: set[str] = set()
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        key = json.dumps([row["kind"], row["requests"]])
        figures = _row(llm, sampling, row, warm_up=key not in warmed)
        warmed.add(key)
        print(json.dumps(figures), file=out, flush=True)


def main() -> int:
    """Set the engine up from the first line of standard input, then serve rows; the exit
    status."""
    setup = json.loads(sys.stdin.readline())
    # The answers keep standard output to themselves: whatever vLLM (or a library under it,
    # from C) prints goes to standard error.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm: Any = importlib.import_module("vllm")  # only in vLLM's own virtualenv
    llm = vllm.LLM(
        model=setup["model"],
        skip_tokenizer_init=True,
        dtype=setup["dtype"],
        block_size=setup["block_size"],
        max_model_len=setup["max_model_len"],
        max_num_seqs=setup["max_num_seqs"],
        max_num_batched_tokens=setup["max_num_batched_tokens"],
        seed=0,
    )
    print(json.dumps({"vllm": vllm.__version__}), file=answers, flush=True)
    serve(llm, vllm.SamplingParams, sys.stdin, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
