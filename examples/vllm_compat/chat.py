"""A chat conversation through the model's chat template, written as a vLLM script.

Only the import line differs from vLLM's (``from vllm import LLM, SamplingParams``).

    python examples/vllm_compat/chat.py [MODEL]

MODEL is a Qwen3 checkpoint directory or a hub id in the local Hugging Face cache (default
Qwen/Qwen3-0.6B).
"""

from __future__ import annotations

import sys

from pagedkv import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    llm = LLM(model=model, max_model_len=1024, seed=0)
    sampling_params = SamplingParams(temperature=0.0, max_tokens=32)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a one-line Python function that adds two numbers."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    for output in outputs:
        print(f"Prompt tokens: {len(output.prompt_token_ids)}")
        print(f"Generated text: {output.outputs[0].text!r}")

    # a batch of conversations, and vLLM's template arguments
    batch = [[{"role": "user", "content": f"Count to {n}."}] for n in (2, 3)]
    for output in llm.chat(batch, sampling_params, add_generation_prompt=True, use_tqdm=False):
        print(f"Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
