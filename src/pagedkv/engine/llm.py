"""The offline API in the style of vLLM: ``LLM(model).generate(prompts, sampling_params)``.

A vLLM user's script runs unchanged (ENG-061): ``LLM()`` loads the embedded model,
``generate(prompts, sampling_params=SamplingParams(n=2))`` returns vLLM-shaped outputs
(``out.outputs[i].text``), prompts may be text, token ids or vLLM's prompt dicts, and
``block_size`` is accepted as vLLM's name for ``page_size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from pagedkv.device import DEFAULT_DEVICE
from pagedkv.engine.config import CacheMode, EngineConfig
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import OutputKind, SamplingParams
from pagedkv.engine.prompts import PromptType, is_one_prompt
from pagedkv.engine.tokenizer import Message
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Closable, Engine

Prompt = PromptType
#: Tokens per KV page when neither ``page_size`` nor ``block_size`` is given.
DEFAULT_PAGE_SIZE = 16


def run_to_completion(
    engine: Engine,
    prompts: Sequence[PromptType],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    use_tqdm: bool = False,
    cache_salt: str | None = None,
) -> list[RequestOutput]:
    """Queue every prompt, step until all finish; outputs in the order of ``prompts`` (ENG-014).

    Every request runs ``final_only`` (ENG-157): only final outputs are returned, so the
    engine builds no other.

    Raises:
        InvalidRequest: a prompt or its SamplingParams refused; the prompts queued before it are
            aborted, so the call leaves nothing queued (ENG-151).
    """
    given = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    per_prompt = [replace(p, output_kind=OutputKind.FINAL_ONLY) for p in given]
    if len(per_prompt) != len(prompts):
        raise InvalidRequest(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
    ids: list[str] = []
    try:
        for p, sp in zip(prompts, per_prompt, strict=True):
            ids.append(engine.add_request(p, sp, cache_salt=cache_salt))
    except BaseException:
        for queued in ids:
            engine.abort(queued)
        raise
    done: dict[str, RequestOutput] = {}
    with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
                    bar.update(1)
    return [done[i] for i in ids]


class LLM:
    """Load a Qwen3 checkpoint and generate from batches of prompts.

    Args:
        model: a Hugging Face format directory (config.json, safetensors, tokenizer files), a
            hub id already in the local Hugging Face cache, or ``None`` for the small model
            embedded in pagedkv (ENG-061, ENG-082).
        page_size: token positions per KV page; ``block_size`` is vLLM's name for it (give
            one, or both equal).
        num_pages, max_num_batched_tokens, max_num_seqs, max_model_len,
        enable_prefix_caching, mode: see :class:`EngineConfig`.
        dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto`` for the checkpoint's own.
        device: ``cpu`` or ``cuda``.
        generation_config: where sampling defaults come from: ``auto`` (the checkpoint's
            ``generation_config.json``), ``vllm`` (none), or a directory holding one; they
            apply when ``generate`` is given no SamplingParams (ENG-080).
        tensor_parallel_size: ranks the model is split over (specs/tensor-parallel.md):
            above 1, ``LLM`` starts ``tensor_parallel_size - 1`` worker processes on this
            machine, or under ``torchrun`` joins its ranks (a rank other than 0 serves rank 0
            and leaves with ``SystemExit(0)`` when it closes). ``close()``, or leaving a
            ``with LLM(...)`` block, ends them.

    Raises:
        InvalidRequest: ``page_size`` and ``block_size`` that differ, or an engine setting out
            of range.
        CheckpointError: no such directory or cached hub id.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        page_size: int | None = None,
        block_size: int | None = None,
        num_pages: int = 512,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        enable_prefix_caching: bool = True,
        mode: CacheMode = "v1",
        dtype: str = "float32",
        device: str = DEFAULT_DEVICE,
        generation_config: str = "auto",
        tensor_parallel_size: int = 1,
    ) -> None:
        if page_size is not None and block_size is not None and page_size != block_size:
            raise InvalidRequest(
                f"page_size={page_size} and block_size={block_size} name the same setting"
            )
        size = page_size if page_size is not None else block_size
        config = EngineConfig(
            page_size=DEFAULT_PAGE_SIZE if size is None else size,
            num_pages=num_pages,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            mode=mode,
        )
        from pagedkv.backend import load_engine

        self.engine: Engine = load_engine(
            model,
            config,
            dtype=dtype,
            device=device,
            generation_config=generation_config,
            tensor_parallel_size=tensor_parallel_size,
        )

    def close(self) -> None:
        """End the engine and release its runner: a tensor-parallel model's workers exit and
        are joined (TP-023). Idempotent; the LLM generates nothing after."""
        if isinstance(self.engine, Closable):
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, as vLLM's ``get_tokenizer`` returns it.

        Raises:
            InvalidRequest: the model has no tokenizer.
        """
        if self.engine.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer")
        return self.engine.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` uses when given none: the model's generation-config
        defaults over the library's."""
        return self.engine.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        ``prompts`` is one prompt or a list of them, each text, token ids,
        ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (ENG-062). ``params`` is the
        name this argument had before it took vLLM's.
        """
        if sampling_params is not None and params is not None:
            raise InvalidRequest("give sampling_params or params, not both")
        chosen = sampling_params if sampling_params is not None else params
        batch = cast("list[PromptType]", [prompts] if is_one_prompt(prompts) else list(prompts))
        return run_to_completion(
            self.engine,
            batch,
            chosen if chosen is not None else self.get_default_sampling_params(),
            use_tqdm=use_tqdm,
        )

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        params: SamplingParams | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation, through the chat template.

        ``chat_template_kwargs`` are further template variables, e.g. ``{"enable_thinking":
        False}`` for Qwen3; a key the template does not read raises ``InvalidRequest``.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequest("chat needs a model directory with a tokenizer")
        if messages and isinstance(messages[0], dict):
            batch: list[Sequence[Message]] = [messages]  # type: ignore[list-item]
        else:
            batch = list(messages)  # type: ignore[arg-type]
        prompts = [tokenizer.apply_chat_template(c, chat_template_kwargs) for c in batch]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, params=params)
