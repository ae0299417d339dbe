"""Offline batched generation with log-probabilities, written as a vLLM script.

Only the import line differs from vLLM's (``from vllm import LLM, SamplingParams``): the
engine arguments, ``SamplingParams``, ``generate`` and the outputs, log-probabilities as
``list[dict[int, Logprob]]`` included, are vLLM's.

    python examples/vllm_compat/offline_generate.py [MODEL]

MODEL is a Qwen3 checkpoint directory or a hub id in the local Hugging Face cache (default
Qwen/Qwen3-0.6B).
"""

from __future__ import annotations

import sys

from pagedkv import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    llm = LLM(
        model=model,
        dtype="float32",
        seed=0,
        max_model_len=512,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        trust_remote_code=True,
        enable_prefix_caching=True,
    )
    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, logprobs=2)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt: {output.prompt!r}, Generated text: {completion.text!r}")
        token_ids = completion.token_ids + []  # a list, as vLLM's
        assert completion.logprobs is not None
        for token_id, position in zip(token_ids, completion.logprobs, strict=True):
            chosen = position[token_id]
            print(
                f"  token {token_id:>6} {chosen.decoded_token!r:>12} "
                f"logprob {chosen.logprob:8.4f} rank {chosen.rank}"
            )
        print(f"  cumulative logprob: {completion.cumulative_logprob:.4f}")


if __name__ == "__main__":
    main()
