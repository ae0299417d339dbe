"""Server-sent events: the chunk stream of a generation, whichever endpoint shapes its
chunks, and a response that aborts its generation when the client goes away."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedkv.engine.outputs import RequestOutput
from pagedkv.entrypoints.server.async_engine import GenerationStream
from pagedkv.entrypoints.server.endpoint import ChunkShaper
from pagedkv.entrypoints.server.errors import api_error
from pagedkv.entrypoints.server.openai_format import choice_index, usage
from pagedkv.entrypoints.server.protocol import ErrorResponse
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


async def events(
    stream: GenerationStream, chunks: ChunkShaper, *, n: int, include_usage: bool
) -> AsyncIterator[str]:
    """The events of a streamed response: ``chunks``' opening chunk, then one chunk per
    choice a step added to (or finished), the usage when asked, and ``[DONE]``; a failure of
    the requests ends the stream with an error event before ``[DONE]``.

    Args:
        stream: the accepted submission's outputs.
        chunks: the endpoint's shaper of this response's chunks.
        n: completions per prompt (choice ``i`` of prompt ``p`` is choice ``p * n + i``).
        include_usage: end with a chunk carrying the usage of every prompt.
    """
    finals: dict[int, RequestOutput] = {}
    ended: set[int] = set()  # choice indices whose finish reason went out
    opening = chunks.opening()
    if opening is not None:
        yield sse(opening)
    try:
        async for item in stream:
            for completion in item.output.outputs:
                index = choice_index(item.index, n, completion)
                ending = completion.finished() and index not in ended
                chunk = chunks.delta(item, completion, ending)
                if chunk is None:
                    continue
                if ending:
                    ended.add(index)
                yield sse(chunk)
            if item.output.finished:
                finals[item.index] = item.output
        if include_usage:
            yield sse(chunks.closing(usage(finals.values())))
    except PagedKVError as exc:
        yield _error_event(exc)
    yield DONE
