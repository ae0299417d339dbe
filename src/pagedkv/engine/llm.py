"""The offline API in the style of vLLM: ``LLM(model).generate(prompts, sampling_params)``.

A vLLM user's script runs unchanged (ENG-061): ``LLM()`` loads the embedded model, its
keyword arguments are vLLM's engine arguments (ENG-180, :mod:`pagedkv.engine.engine_args`),
``generate(prompts, sampling_params=SamplingParams(n=2))`` returns vLLM-shaped outputs
(``out.outputs[i].text``, ``out.outputs[i].logprobs[j][token].logprob``), and prompts may be
text, token ids or vLLM's prompt dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from pagedkv.engine.engine_args import EngineArgs, engine_args_from_kwargs, load_engine_from_args
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import OutputKind, SamplingParams
from pagedkv.engine.prompts import PromptType, is_one_prompt
from pagedkv.engine.tokenizer import Message, Tool
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Closable, Engine

Prompt = PromptType


def run_to_completion(
    engine: Engine,
    prompts: Sequence[PromptType],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    use_tqdm: bool = False,
    cache_salt: str | None = None,
    priority: Sequence[int] | None = None,
) -> list[RequestOutput]:
    """Queue every prompt, step until all finish; outputs in the order of ``prompts`` (ENG-014).

    ``priority`` gives each prompt its priority (ENG-189); ``None`` leaves them all at 0.

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
    priorities = [0] * len(prompts) if priority is None else list(priority)
    if len(priorities) != len(prompts):
        raise InvalidRequest(f"{len(priorities)} priorities for {len(prompts)} prompts")
    ids: list[str] = []
    try:
        for p, sp, rank in zip(prompts, per_prompt, priorities, strict=True):
            if rank:
                ids.append(engine.add_request(p, sp, cache_salt=cache_salt, priority=rank))
            else:
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
        kwargs: vLLM's engine arguments (``dtype``, ``seed``, ``max_model_len``,
            ``block_size``, ``gpu_memory_utilization``, ``enable_prefix_caching``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``enforce_eager``, ``tokenizer``,
            ``chat_template``, ``trust_remote_code``, ``scheduling_policy``,
            ``tensor_parallel_size``, ...) and pagedkv's own (``num_pages``, ``mode``,
            ``device``, ``generation_config``, ``max_step_retries``; ``page_size`` is
            ``block_size``'s older name): see :class:`~pagedkv.engine.engine_args.EngineArgs`.
            Above 1, ``tensor_parallel_size`` starts ``tensor_parallel_size - 1`` worker
            processes on this machine, or under ``torchrun`` joins its ranks; ``close()``, or
            leaving a ``with LLM(...)`` block, ends them.

    Raises:
        UnknownEngineArgument: a keyword argument that is no engine argument, named (ENG-181).
        UnsupportedEngineArgument: a vLLM argument pagedkv does not implement, named with why.
        InvalidRequest: two names of one setting that differ, or a value out of range.
        CheckpointError: no such directory or cached hub id.
    """

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        self.engine_args: EngineArgs = engine_args_from_kwargs(model, kwargs)
        self.engine: Engine = load_engine_from_args(self.engine_args)

    @property
    def llm_engine(self) -> Engine:
        """The engine (vLLM's name for it, ENG-188)."""
        return self.engine

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
        lora_request: object = None,
        priority: Sequence[int] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        ``prompts`` is one prompt or a list of them, each text, token ids,
        ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (ENG-062). ``params`` is the
        name this argument had before it took vLLM's. ``priority`` is one per prompt
        (ENG-189); ``lora_request`` other than ``None`` is refused (ENG-188).
        """
        _refuse_lora(lora_request)
        if sampling_params is not None and params is not None:
            raise InvalidRequest("give sampling_params or params, not both")
        chosen = sampling_params if sampling_params is not None else params
        batch = cast("list[PromptType]", [prompts] if is_one_prompt(prompts) else list(prompts))
        return run_to_completion(
            self.engine,
            batch,
            chosen if chosen is not None else self.get_default_sampling_params(),
            use_tqdm=use_tqdm,
            priority=priority,
        )

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: object = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        params: SamplingParams | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Tool] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation, through the chat template.

        ``chat_template_kwargs`` are further template variables, e.g. ``{"enable_thinking":
        False}`` for Qwen3; a key the template does not read raises ``InvalidRequest``.
        ``chat_template`` replaces the model's template for this call;
        ``add_generation_prompt`` and ``continue_final_message`` are vLLM's (ENG-188).
        ``tools`` (OpenAI's function declarations) are rendered by the template (ENG-196);
        the reply's text holds any ``<tool_call>`` the model writes, as vLLM's does.
        """
        _refuse_lora(lora_request)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequest("chat needs a model directory with a tokenizer")
        if messages and isinstance(messages[0], dict):
            batch: list[Sequence[Message]] = [messages]  # type: ignore[list-item]
        else:
            batch = list(messages)  # type: ignore[arg-type]
        prompts = [
            tokenizer.apply_chat_template(
                c,
                chat_template_kwargs,
                tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            for c in batch
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, params=params)


def _refuse_lora(lora_request: object) -> None:
    """LoRA adapters are not supported: any ``lora_request`` but ``None`` is refused."""
    if lora_request is not None:
        raise InvalidRequest("lora_request is not supported: pagedkv serves no LoRA adapters")
