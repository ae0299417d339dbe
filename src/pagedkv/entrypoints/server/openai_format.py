"""Translation between OpenAI request/response bodies and engine parameters/outputs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pagedkv.engine.generation_config import GenerationDefaults
from pagedkv.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedkv.engine.params import MAX_LOGIT_BIAS, InvalidSamplingParams, SamplingParams
from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.entrypoints.server.async_engine import PromptInput
from pagedkv.entrypoints.server.protocol import (
    AssistantMessage,
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagedkv.entrypoints.server.reasoning import ReasoningParser


def logit_bias(bias: Mapping[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings) as token ids, each bias clamped to
    ``[-100, 100]`` as vLLM's server does, so a vLLM client's request is not refused here
    (SRV-105; the body's schema has refused non-finite values already).

    Raises:
        InvalidSamplingParams: a key that is not a token id.
    """
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
        except ValueError:
            raise InvalidSamplingParams(f"logit_bias keys must be token ids, got {key!r}") from None
    return out


def sampling_params(
    body: SamplingFields,
    defaults: GenerationDefaults,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Engine parameters of a request: a field the body leaves out takes the model's
    generation-config default, then the library's (OpenAI's: temperature 1, top_p 1).

    Raises:
        InvalidSamplingParams: a value is out of range; the message names the field.
    """
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return defaults.sampling_params(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        n=body.n,
        best_of=body.best_of,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=logit_bias(body.logit_bias),
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else body.prompt_logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured_outputs=structured_outputs,
    )


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptInput]:
    """The prompts of a completions request: one per text or per list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    prompts: list[PromptInput] = []
    if prompt and all(isinstance(p, int) for p in prompt):
        return [tuple(int(t) for t in prompt)]  # type: ignore[arg-type]
    for item in prompt:
        prompts.append(item if isinstance(item, str) else tuple(item))  # type: ignore[arg-type]
    return prompts


def finish_reason(completion: CompletionOutput) -> str | None:
    """OpenAI's ``finish_reason``: ``stop``, ``length`` (``abort`` and ``error`` never reach a
    client: the request was aborted, or answered with an error)."""
    return None if completion.finish_reason is None else str(completion.finish_reason)


def choice_index(prompt_index: int, n: int, completion: CompletionOutput) -> int:
    """A choice's index: prompt by prompt, ``n`` completions each (vLLM's order)."""
    return prompt_index * n + completion.index


def assistant_message(
    completion: CompletionOutput,
    prompt_token_ids: Sequence[int],
    reasoning: ReasoningParser | None,
) -> AssistantMessage:
    """The reply of a finished completion; a reasoning parser splits its thinking from its
    content."""
    if reasoning is None:
        return AssistantMessage(content=completion.text)
    split = reasoning.split(completion.text, prompt_token_ids)
    return AssistantMessage(content=split.content, reasoning_content=split.reasoning)


def usage(outputs: Iterable[RequestOutput]) -> Usage:
    """Token counts summed over the final outputs of every prompt of a response: each prompt
    once, the tokens of every completion returned."""
    prompt = completion = cached = 0
    for output in outputs:
        prompt += len(output.prompt_token_ids)
        completion += sum(len(c.token_ids) for c in output.outputs)
        cached += output.metrics.cached_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def new_logprobs(completion: CompletionOutput) -> list[PositionLogprobs]:
    """The logprobs entries of the tokens this output added to a completion."""
    if completion.logprobs is None or not completion.new_token_ids:
        return []
    return completion.logprobs[-len(completion.new_token_ids) :]


def completion_logprobs(
    entries: Sequence[PositionLogprobs], texts: Mapping[int, str], offset: int
) -> CompletionLogprobs:
    """Legacy completions logprobs of ``entries``; ``offset`` is the text offset (characters)
    of the first entry's token within the choice's text."""
    tokens = [texts.get(e.token_id, "") for e in entries]
    offsets: list[int] = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{texts.get(t, ""): lp for t, lp in e.top} for e in entries],
        text_offset=offsets,
    )


def echo_logprobs(
    prompt_ids: Sequence[int],
    prompt_entries: Sequence[PositionLogprobs | None] | None,
    texts: Mapping[int, str],
) -> CompletionLogprobs:
    """The legacy logprobs of an echoed prompt: its tokens, the first without a value."""
    entries = prompt_entries or [None] * len(prompt_ids)
    tokens = [texts.get(t, "") for t in prompt_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else e.logprob for e in entries],
        top_logprobs=[
            None if e is None else {texts.get(t, ""): lp for t, lp in e.top} for e in entries
        ],
        text_offset=offsets,
    )


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """Two runs of legacy logprobs, one after the other."""
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def prompt_logprobs(output: RequestOutput, texts: Mapping[int, str]) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a request: per prompt position, ``None`` for the first,
    then the token's entry and its alternatives', by token id."""
    if output.prompt_logprobs is None:
        return None
    result: PromptLogprobs = []
    for entry in output.prompt_logprobs:
        if entry is None:
            result.append(None)
            continue
        ranked = {
            str(t): PromptLogprob(logprob=lp, rank=rank, decoded_token=texts.get(t, ""))
            for rank, (t, lp) in enumerate(entry.top, start=1)
        }
        ranked.setdefault(
            str(entry.token_id),
            PromptLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=texts.get(entry.token_id, "")
            ),
        )
        result.append(ranked)
    return result


def chat_logprobs(entries: Sequence[PositionLogprobs], texts: Mapping[int, str]) -> ChoiceLogprobs:
    """Chat logprobs of ``entries``: token text, logprob, UTF-8 bytes and top alternatives."""
    content: list[TokenLogprob] = []
    for entry in entries:
        token = texts.get(entry.token_id, "")
        top = [
            TopLogprob(token=texts.get(t, ""), logprob=lp, bytes=list(texts.get(t, "").encode()))
            for t, lp in entry.top
        ]
        content.append(
            TokenLogprob(
                token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChoiceLogprobs(content=content)
