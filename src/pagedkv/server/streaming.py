"""Server-sent events: the chunk streams of both endpoints and a response that aborts its
generation when the client goes away."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedkv.engine.outputs import RequestOutput
from pagedkv.errors import PagedKVError
from pagedkv.server.async_engine import GenerationStream
from pagedkv.server.errors import api_error
from pagedkv.server.openai_format import (
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    new_logprobs,
    usage,
)
from pagedkv.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    Delta,
    ErrorResponse,
)
from pagedkv.server.reasoning import ReasoningParser, ReasoningSplitter

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


async def completion_events(
    stream: GenerationStream,
    *,
    response_id: str,
    created: int,
    model: str,
    logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    """``text_completion`` chunks, one per step that added text, then usage and ``[DONE]``."""
    offsets: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[CompletionChoice], final: bool = False) -> str:
        body = CompletionResponse(id=response_id, created=created, model=model, choices=choices)
        if final:
            body.usage = usage(finals.values())
        return sse(body)

    try:
        async for item in stream:
            output = item.output
            entries = new_logprobs(output) if logprobs else ()
            if not output.new_text and not output.finished and not entries:
                continue
            choice = CompletionChoice(
                index=item.index, text=output.new_text, finish_reason=finish_reason(output)
            )
            if logprobs:
                offset = offsets.get(item.index, 0)
                choice.logprobs = completion_logprobs(entries, item.token_texts, offset)
                offsets[item.index] = offset + sum(len(t) for t in choice.logprobs.tokens)
            if output.finished:
                finals[item.index] = output
            yield chunk([choice])
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
    logprobs: bool,
    include_usage: bool,
    reasoning: ReasoningParser | None = None,
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events: the assistant role first, then content deltas (with a
    reasoning parser, reasoning deltas apart from content ones), the finish reason with the
    last delta, usage when asked, and ``[DONE]``."""
    finals: dict[int, RequestOutput] = {}
    splitters: dict[int, ReasoningSplitter] = {}

    def chunk(choices: list[ChatChunkChoice], final: bool = False) -> str:
        body = ChatCompletionChunk(id=response_id, created=created, model=model, choices=choices)
        if final:
            body.usage = usage(finals.values())
        return sse(body)

    yield chunk(
        [
            ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
            for i in range(len(stream.request_ids))
        ]
    )
    try:
        async for item in stream:
            output = item.output
            entries = new_logprobs(output) if logprobs else ()
            if reasoning is None:
                delta = Delta(content=output.new_text)
            else:
                if item.index not in splitters:
                    splitters[item.index] = reasoning.splitter(output.prompt_token_ids)
                delta = _split_delta(splitters[item.index], output)
            if not (delta.content or delta.reasoning_content or output.finished or entries):
                continue
            choice = ChatChunkChoice(
                index=item.index, delta=delta, finish_reason=finish_reason(output)
            )
            if logprobs:
                choice.logprobs = chat_logprobs(entries, item.token_texts)
            if output.finished:
                finals[item.index] = output
            yield chunk([choice])
        if include_usage:
            yield chunk([], final=True)
    except PagedKVError as exc:
        yield _error_event(exc)
    yield DONE


def _split_delta(splitter: ReasoningSplitter, output: RequestOutput) -> Delta:
    """The delta of one step's new text, split into reasoning and content (held-back text is
    released when the output finishes)."""
    reasoning, content = splitter.feed(output.new_text)
    if output.finished:
        tail_reasoning, tail_content = splitter.finish()
        reasoning, content = reasoning + tail_reasoning, content + tail_content
    return Delta(content=content or None, reasoning_content=reasoning or None)
