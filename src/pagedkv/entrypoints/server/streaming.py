"""Server-sent events: the chunk streams of both endpoints and a response that aborts its
generation when the client goes away."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.entrypoints.server.async_engine import GenerationStream
from pagedkv.entrypoints.server.errors import api_error
from pagedkv.entrypoints.server.openai_format import (
    chat_logprobs,
    choice_index,
    completion_logprobs,
    echo_logprobs,
    finish_reason,
    joined,
    new_logprobs,
    prompt_logprobs,
    usage,
)
from pagedkv.entrypoints.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    Delta,
    ErrorResponse,
)
from pagedkv.entrypoints.server.reasoning import ReasoningParser, ReasoningSplitter
from pagedkv.errors import PagedKVError

#: The event that ends every stream.
DONE = "data: [DONE]\n\n"


def sse(body: BaseModel) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {body.model_dump_json()}\n\n"


def _error_event(exc: PagedKVError) -> str:
    """The event ending a stream whose requests failed: the error the same failure gets as a
    plain response (``engine_failure``, ``deadline_exceeded``, ``unavailable``, ...)."""
    return sse(ErrorResponse(error=api_error(exc).info))


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that aborts its generation when it ends early.

    The client's disconnect cancels the sending task (Starlette listens for it while
    streaming); whatever way the response ends, every unfinished request of the generation is
    aborted so its pages are freed at once.
    """

    def __init__(self, events: AsyncIterator[str], generation: GenerationStream) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.abort()


@dataclass(frozen=True, slots=True)
class ChoiceFormat:
    """How a completions request's choices are shaped.

    Attributes:
        n: completions per prompt.
        logprobs: include the legacy logprobs.
        echo: per prompt, the text its choices begin with; ``None`` without ``echo``.
        prompt_logprobs: include vLLM's ``prompt_logprobs``.
    """

    n: int
    logprobs: bool
    echo: list[str] | None
    prompt_logprobs: bool


def completion_choice(
    choice: ChoiceFormat,
    prompt_index: int,
    output: RequestOutput,
    completion: CompletionOutput,
    texts: Mapping[int, str],
    *,
    first: bool,
    final: bool,
    offset: int = 0,
) -> CompletionChoice:
    """One choice: the whole completion (``final``) or this step's delta of it; ``first``
    marks the choice's first chunk, which carries the echoed prompt and the prompt
    log-probabilities. ``offset``: characters of the choice already sent."""
    prefix = choice.echo[prompt_index] if choice.echo is not None and first else ""
    done = completion.finished() and (final or bool(completion.new_token_ids))
    result = CompletionChoice(
        index=choice_index(prompt_index, choice.n, completion),
        text=prefix + (completion.text if final else completion.new_text),
        finish_reason=finish_reason(completion) if done else None,
        stop_reason=completion.stop_reason if done else None,
    )
    if choice.logprobs:
        entries = completion.logprobs or () if final else new_logprobs(completion)
        logprobs = completion_logprobs(entries, texts, offset + len(prefix))
        if prefix:
            echoed = echo_logprobs(output.prompt_token_ids, output.prompt_logprobs, texts)
            logprobs = joined(echoed, logprobs)
        result.logprobs = logprobs
    if choice.prompt_logprobs and first:
        result.prompt_logprobs = prompt_logprobs(output, texts)
    return result


async def completion_events(
    stream: GenerationStream,
    *,
    response_id: str,
    created: int,
    model: str,
    choice: ChoiceFormat,
    include_usage: bool,
) -> AsyncIterator[str]:
    """``text_completion`` chunks, one per choice a step added to (or finished), then usage
    and ``[DONE]``."""
    sent: dict[int, int] = {}  # choice index -> characters sent
    ended: set[int] = set()
    texts: dict[int, dict[int, str]] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[CompletionChoice], final: bool = False) -> str:
        body = CompletionResponse(id=response_id, created=created, model=model, choices=choices)
        if final:
            body.usage = usage(finals.values())
        return sse(body)

    try:
        async for item in stream:
            output = item.output
            known = texts.setdefault(item.index, {})
            known.update(item.token_texts)
            for completion in output.outputs:
                index = choice_index(item.index, choice.n, completion)
                first = index not in sent
                ending = completion.finished() and index not in ended
                entries = new_logprobs(completion) if choice.logprobs else ()
                opening = first and (choice.echo is not None or choice.prompt_logprobs)
                if not (completion.new_text or ending or entries or opening):
                    continue
                body = completion_choice(
                    choice,
                    item.index,
                    output,
                    completion,
                    known,
                    first=first,
                    final=False,
                    offset=sent.get(index, 0),
                )
                sent[index] = sent.get(index, 0) + len(body.text)
                if ending:
                    ended.add(index)
                yield chunk([body])
            if output.finished:
                finals[item.index] = output
        if include_usage:
            yield chunk([], final=True)
    except PagedKVError as exc:
        yield _error_event(exc)
    yield DONE


async def chat_events(
    stream: GenerationStream,
    *,
    response_id: str,
    created: int,
    model: str,
    n: int,
    logprobs: bool,
    include_usage: bool,
    reasoning: ReasoningParser | None = None,
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events: the assistant role of each of the ``n`` choices
    first, then content deltas (with a reasoning parser, reasoning deltas apart from content
    ones), each choice's finish reason with its last delta, usage when asked, and
    ``[DONE]``."""
    finals: dict[int, RequestOutput] = {}
    ended: set[int] = set()
    splitters: dict[int, ReasoningSplitter] = {}

    def chunk(choices: list[ChatChunkChoice], final: bool = False) -> str:
        body = ChatCompletionChunk(id=response_id, created=created, model=model, choices=choices)
        if final:
            body.usage = usage(finals.values())
        return sse(body)

    yield chunk(
        [ChatChunkChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(n)]
    )
    try:
        async for item in stream:
            output = item.output
            for completion in output.outputs:
                ending = completion.finished() and completion.index not in ended
                entries = new_logprobs(completion) if logprobs else ()
                if reasoning is None:
                    delta = Delta(content=completion.new_text)
                else:
                    if completion.index not in splitters:
                        splitter = reasoning.splitter(output.prompt_token_ids)
                        splitters[completion.index] = splitter
                    delta = _split_delta(splitters[completion.index], completion.new_text, ending)
                if not (delta.content or delta.reasoning_content or ending or entries):
                    continue
                body = ChatChunkChoice(
                    index=completion.index,
                    delta=delta,
                    finish_reason=finish_reason(completion) if ending else None,
                    stop_reason=completion.stop_reason if ending else None,
                )
                if logprobs:
                    body.logprobs = chat_logprobs(entries, item.token_texts)
                if ending:
                    ended.add(completion.index)
                yield chunk([body])
            if output.finished:
                finals[item.index] = output
        if include_usage:
            yield chunk([], final=True)
    except PagedKVError as exc:
        yield _error_event(exc)
    yield DONE


def _split_delta(splitter: ReasoningSplitter, new_text: str, finished: bool) -> Delta:
    """The delta of one step's new text of a completion, split into reasoning and content
    (held-back text is released when the completion finishes)."""
    reasoning, content = splitter.feed(new_text)
    if finished:
        tail_reasoning, tail_content = splitter.finish()
        reasoning, content = reasoning + tail_reasoning, content + tail_content
    return Delta(content=content or None, reasoning_content=reasoning or None)
