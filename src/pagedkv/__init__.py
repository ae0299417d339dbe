"""pagedkv: a spec-driven reference inference engine for Qwen3 on a paged KV cache.

The public API is imported lazily, so that ``import pagedkv.kv`` (the KVManager) never pulls in
torch (KVM-040).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.engine_args import EngineArgs
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.prompts import TextPrompt, TokensPrompt
    from pagedkv.engine.structured import StructuredOutputsParams

_LAZY = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.engine",
    "EngineConfig": "pagedkv.engine.config",
    "SamplingParams": "pagedkv.engine.params",
    "StructuredOutputsParams": "pagedkv.engine.structured",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
    "Logprob": "pagedkv.engine.outputs",
    "EngineArgs": "pagedkv.engine.engine_args",
    "TextPrompt": "pagedkv.engine.prompts",
    "TokensPrompt": "pagedkv.engine.prompts",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
