"""The one request path of both generation endpoints.

A request is checked (schema-level checks, the model, what this server refuses), prepared by
its endpoint (:mod:`~pagedkv.entrypoints.server.endpoint`), submitted, and answered either as
one body once every prompt has finished, or as server-sent events while they run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedkv.engine.structured import InvalidStructuredOutputs
from pagedkv.entrypoints.server.async_engine import GenerationStream
from pagedkv.entrypoints.server.endpoint import Collected, Endpoint, ResponseHead
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.gate import tenant
from pagedkv.entrypoints.server.protocol import SamplingFields
from pagedkv.entrypoints.server.request_checks import check_fields, check_request, log_noted
from pagedkv.entrypoints.server.state import ServerState, check_model, server_state
from pagedkv.entrypoints.server.streaming import EventStream, events

BodyT = TypeVar("BodyT", bound=SamplingFields)

#: Status of a response nobody reads: the client disconnected before it was ready.
CLIENT_CLOSED_REQUEST = 499


async def generate(endpoint: Endpoint[BodyT], body: BodyT, request: Request) -> Response:
    """Answer one generation request of ``endpoint``: ``n`` choices per prompt, streamed as
    server-sent events when ``body.stream``.

    Raises:
        APIError, InvalidRequest: the request is refused (4xx) before anything is submitted.
        QueueFull, EngineUnavailable: the engine cannot take it now (429, 503).
    """
    state = server_state(request)
    _check_request(state, body)
    prepared = await endpoint.prepare(body, state)
    submission = prepared.submission
    # a given request_id names the response, as vLLM's: cmpl-ID, chatcmpl-ID (SRV-118)
    response_id = f"{endpoint.id_prefix}-{body.request_id or uuid.uuid4().hex}"
    try:
        stream = await state.engine.submit(
            submission.prompts,
            submission.params,
            fill_context=submission.fill_context,
            token_texts=submission.token_texts,
            cache_salt=state.policy.cache_salt(tenant(request), body.cache_salt),
            priority=body.priority,
            add_special_tokens=body.add_special_tokens,
            request_id=response_id,
        )
    except InvalidStructuredOutputs as exc:  # SRV-131: the field the request used
        field = submission.constraint_field or "structured_outputs"
        raise APIError(
            400, f"{field}: {exc}", param=field, code="invalid_structured_outputs"
        ) from None
    log_noted(body, response_id)
    head = ResponseHead(id=response_id, created=int(time.time()), model=state.model_name)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = prepared.shape.chunks(head)
        n = submission.params.n
        return EventStream(events(stream, chunks, n=n, include_usage=include_usage), stream)
    collected = await collect(request, stream)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(prepared.shape.response(head, collected).model_dump())


def _check_request(state: ServerState, body: SamplingFields) -> None:
    """Refuse what neither endpoint serves: invalid text, unsupported fields, another model,
    or a streamed ``best_of`` other than ``n``."""
    check_fields(body)  # first: a refused part's own fields are not reported as ignored
    check_request(body)
    check_model(state, body.model)
    if body.stream and body.best_of is not None and body.best_of != body.n:
        raise APIError(
            400,
            f"best_of must equal n when streaming: best_of={body.best_of} chooses among "
            f"completions only once all have finished, n={body.n}",
            param="best_of",
            code="unsupported",
        )


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, stream: GenerationStream) -> Collected | None:
    """Every output of ``stream``, or ``None`` if the client disconnected first (the requests
    are then aborted)."""
    collected = Collected()

    async def consume() -> None:
        async for item in stream:
            collected.add(item)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer not in done:
            return None
        consumer.result()  # re-raise an engine failure
        return collected
    finally:
        consumer.cancel()
        watcher.cancel()
        stream.abort()
