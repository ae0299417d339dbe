"""Tool calling offline, written as a vLLM script: the tools are rendered by the model's chat
template, the call is forced with structured outputs (what the server's
``tool_choice="required"`` does), the tool runs, its result goes back as a ``tool`` message,
and the model answers.

Only the import lines differ from vLLM's (``from vllm import LLM, SamplingParams`` and
``from vllm.sampling_params import StructuredOutputsParams``).

    python examples/vllm_compat/tool_call.py [MODEL]

MODEL is a Qwen3 checkpoint directory or a hub id in the local Hugging Face cache (default
Qwen/Qwen3-0.6B).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pagedkv import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams
from pagedkv.sampling_params import StructuredOutputsParams  # vLLM: from vllm.sampling_params

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def get_weather(city: str) -> str:
    return {"Paris": "sunny, 21C", "Oslo": "snow, -3C"}.get(city, "fog, 14C")


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    llm = LLM(model=model, max_model_len=2048)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Oslo?"}]

    # the call, as {"name": ..., "arguments": {...}}: forced by a JSON schema
    call_schema = {
        "type": "object",
        "properties": {
            "name": {"enum": [WEATHER["function"]["name"]]},
            "arguments": WEATHER["function"]["parameters"],
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.0,
        max_tokens=100,
        structured_outputs=StructuredOutputsParams(json=call_schema, disable_any_whitespace=True),
    )
    outputs = llm.chat(messages, params, tools=[WEATHER], use_tqdm=False)
    call = json.loads(outputs[0].outputs[0].text)
    print(f"Tool call: {call['name']}({json.dumps(call['arguments'])})")

    # run the tool, give its result back, and let the model answer
    result = get_weather(**call["arguments"])
    messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": result})
    outputs = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=40), tools=[WEATHER], use_tqdm=False
    )
    print(f"Tool result: {result}")
    print(f"Answer: {outputs[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
