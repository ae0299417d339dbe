"""vLLM's ``vllm.sampling_params`` module: ``from pagedkv.sampling_params import
StructuredOutputsParams`` is vLLM's import with the package name swapped (ENG-061)."""

from __future__ import annotations

from pagedkv.engine.params import SamplingParams
from pagedkv.engine.structured import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
