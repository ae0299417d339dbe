"""Translation between OpenAI request/response bodies and engine parameters/outputs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pagedkv.engine.outputs import RequestOutput, TokenLogprobs
from pagedkv.engine.params import SamplingParams
from pagedkv.server.async_engine import PromptInput, StreamItem
from pagedkv.server.protocol import (
    AssistantMessage,
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagedkv.server.reasoning import ReasoningParser


def sampling_params(
    body: SamplingFields, *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """Engine parameters of a request; OpenAI's defaults (temperature 1, top_p 1) apply to
    absent fields.

    Raises:
        InvalidSamplingParams: a value is out of range; the message names the field.
    """
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
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


def finish_reason(output: RequestOutput) -> str | None:
    """OpenAI's ``finish_reason``: ``stop``, ``length`` (``abort`` and ``error`` never reach a
    client: the request was aborted, or answered with an error)."""
    return None if output.finish_reason is None else str(output.finish_reason)


def assistant_message(output: RequestOutput, reasoning: ReasoningParser | None) -> AssistantMessage:
    """The reply of a final output; a reasoning parser splits its thinking from its content."""
    if reasoning is None:
        return AssistantMessage(content=output.text)
    split = reasoning.split(output.text, output.prompt_token_ids)
    return AssistantMessage(content=split.content, reasoning_content=split.reasoning)


def usage(outputs: Iterable[RequestOutput]) -> Usage:
    """Token counts summed over the final outputs of every prompt of a response."""
    prompt = completion = cached = 0
    for output in outputs:
        prompt += len(output.prompt_token_ids)
        completion += len(output.token_ids)
        cached += output.metrics.cached_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def new_logprobs(output: RequestOutput) -> tuple[TokenLogprobs, ...]:
    """The logprobs entries of the tokens this output added."""
    if output.logprobs is None or not output.new_token_ids:
        return ()
    return output.logprobs[-len(output.new_token_ids) :]


def completion_logprobs(
    entries: Sequence[TokenLogprobs], texts: Mapping[int, str], offset: int
) -> CompletionLogprobs:
    """Legacy completions logprobs of ``entries``; ``offset`` is the text offset (characters)
    of the first entry's token within the generated text."""
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


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: Mapping[int, str]) -> ChoiceLogprobs:
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


class Collected:
    """The final output and the token texts of each prompt of a non-streamed response."""

    def __init__(self) -> None:
        self.outputs: dict[int, RequestOutput] = {}
        self.texts: dict[int, dict[int, str]] = {}

    def add(self, item: StreamItem) -> None:
        self.outputs[item.index] = item.output
        self.texts.setdefault(item.index, {}).update(item.token_texts)

    def ordered(self) -> list[tuple[int, RequestOutput, Mapping[int, str]]]:
        """``(index, final output, token texts)`` in prompt order."""
        return [(i, self.outputs[i], self.texts.get(i, {})) for i in sorted(self.outputs)]
