"""Structured outputs offline, written as a vLLM script: a JSON schema, a regex, a choice and
a grammar, each constraining what the model writes.

Only the import lines differ from vLLM's (``from vllm import LLM, SamplingParams`` and
``from vllm.sampling_params import StructuredOutputsParams``).

    python examples/vllm_compat/structured_output.py [MODEL]

MODEL is a Qwen3 checkpoint directory or a hub id in the local Hugging Face cache (default
Qwen/Qwen3-0.6B).
"""

from __future__ import annotations

import json
import sys

from pagedkv import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams
from pagedkv.sampling_params import StructuredOutputsParams  # vLLM: from vllm.sampling_params

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["Python", "C", "Rust"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    llm = LLM(model=model, max_model_len=1024)

    # a JSON schema: the output parses and validates
    params = SamplingParams(
        temperature=0.8,
        seed=0,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    )
    outputs = llm.generate(["Describe a programmer as JSON: "], params, use_tqdm=False)
    person = json.loads(outputs[0].outputs[0].text)
    print(f"JSON: {json.dumps(person)}")

    # a regular expression, a choice and a Lark grammar
    for constraint in (
        StructuredOutputsParams(regex=r"[a-z]+@[a-z]+\.com"),
        StructuredOutputsParams(choice=["positive", "negative"]),
        StructuredOutputsParams(
            grammar='start: "SELECT " COLUMN " FROM users"\nCOLUMN: /[a-z]{1,8}/'
        ),
    ):
        params = SamplingParams(
            temperature=0.8, seed=0, max_tokens=60, structured_outputs=constraint
        )
        outputs = llm.generate(["Answer: "], params, use_tqdm=False)
        print(f"{constraint.kind}: {outputs[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
