"""The offline API in the style of vLLM: ``LLM(model_dir).generate(prompts, SamplingParams())``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tqdm import tqdm

from pagedkv.engine.config import CacheMode, EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.tokenizer import Message
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Engine

Prompt = str | Sequence[int]


def run_to_completion(
    engine: Engine,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    use_tqdm: bool = False,
    cache_salt: str | None = None,
) -> list[RequestOutput]:
    """Queue every prompt, step until all finish; outputs in the order of ``prompts`` (ENG-014)."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise InvalidRequest(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
    ids = [
        engine.add_request(p, sp, cache_salt=cache_salt)
        for p, sp in zip(prompts, per_prompt, strict=True)
    ]
    done: dict[str, RequestOutput] = {}
    with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
                    bar.update(1)
    return [done[i] for i in ids]


class LLM:
    """Load a Qwen3 checkpoint directory and generate from batches of prompts.

    Args:
        model: a Hugging Face format directory (config.json, safetensors, tokenizer files).
        page_size, num_pages, max_num_batched_tokens, max_num_seqs, max_model_len,
        enable_prefix_caching, mode: see :class:`EngineConfig`.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        device: ``cpu`` or ``cuda``.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        page_size: int = 16,
        num_pages: int = 512,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        enable_prefix_caching: bool = True,
        mode: CacheMode = "v1",
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        config = EngineConfig(
            page_size=page_size,
            num_pages=num_pages,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            mode=mode,
        )
        self.engine = LLMEngine.from_model_dir(model, config, dtype=dtype, device=device)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        batch = _as_batch(prompts)
        return run_to_completion(self.engine, batch, params or SamplingParams(), use_tqdm=use_tqdm)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation, through the chat template.

        ``chat_template_kwargs`` are further template variables, e.g. ``{"enable_thinking":
        False}`` for Qwen3; a key the template does not read raises ``InvalidRequest``.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequest("chat needs a model directory with a tokenizer")
        if conversations and isinstance(conversations[0], dict):
            batch: list[Sequence[Message]] = [conversations]  # type: ignore[list-item]
        else:
            batch = list(conversations)  # type: ignore[arg-type]
        prompts = [tokenizer.apply_chat_template(c, chat_template_kwargs) for c in batch]
        return self.generate(prompts, params, use_tqdm=use_tqdm)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or a list of ints) or a list of them, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]
