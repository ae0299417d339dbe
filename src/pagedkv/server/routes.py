"""The HTTP endpoints: OpenAI completions and chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedkv.server.async_engine import (
    AsyncEngine,
    ChatPrompt,
    EngineUnavailable,
    GenerationStream,
)
from pagedkv.server.auth import cache_salt
from pagedkv.server.errors import APIError
from pagedkv.server.metrics import PROMETHEUS_CONTENT_TYPE, ServingMetrics
from pagedkv.server.openai_format import (
    Collected,
    assistant_message,
    chat_logprobs,
    completion_logprobs,
    completion_prompts,
    finish_reason,
    sampling_params,
    usage,
)
from pagedkv.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
)
from pagedkv.server.reasoning import ReasoningParser
from pagedkv.server.request_checks import check_request
from pagedkv.server.streaming import EventStream, chat_events, completion_events

#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Status of a response nobody reads: the client disconnected before it was ready.
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True, slots=True)
class ServerState:
    """What the endpoints share, kept in ``app.state.server``.

    Attributes:
        engine: the engine bridge.
        model_name: the only model name requests may ask for (and what an absent ``model``
            means).
        created: Unix time (seconds) the app was created, reported by ``/v1/models``.
        metrics: the server's Prometheus metrics.
        reasoning: the reasoning parser splitting chat replies, ``None`` for none.
    """

    engine: AsyncEngine
    model_name: str
    created: int
    metrics: ServingMetrics
    reasoning: ReasoningParser | None = None


router = APIRouter()


def server_state(request: Request) -> ServerState:
    state = getattr(request.app.state, "server", None)
    if not isinstance(state, ServerState):
        raise EngineUnavailable("the app has no engine")
    return state


def check_model(state: ServerState, model: str | None) -> None:
    """Raise 404 unless ``model`` is absent (the served model) or the served model's name."""
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _check_request(state: ServerState, body: SamplingFields) -> None:
    check_request(body)
    check_model(state, body.model)
    if body.n != 1:
        raise APIError(400, f"n must be 1, got {body.n}", param="n", code="unsupported")


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


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI completions: one choice per prompt, streamed as server-sent events on demand."""
    state = server_state(request)
    _check_request(state, body)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs)
    want_logprobs = body.logprobs is not None
    stream = await state.engine.submit(
        completion_prompts(body.prompt),
        params,
        token_texts=want_logprobs,
        cache_salt=cache_salt(request, body.cache_salt),
    )
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = completion_events(
            stream,
            response_id=response_id,
            created=created,
            model=state.model_name,
            logprobs=want_logprobs,
            include_usage=include_usage,
        )
        return EventStream(events, stream)
    collected = await collect(request, stream)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = [
        CompletionChoice(
            index=index,
            text=output.text,
            logprobs=completion_logprobs(output.logprobs or (), texts, 0)
            if want_logprobs
            else None,
            finish_reason=finish_reason(output),
        )
        for index, output, texts in collected.ordered()
    ]
    body_out = CompletionResponse(
        id=response_id,
        created=created,
        model=state.model_name,
        choices=choices,
        usage=usage(collected.outputs.values()),
    )
    return JSONResponse(body_out.model_dump())


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions through the model's chat template."""
    state = server_state(request)
    _check_request(state, body)
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    top = body.top_logprobs or 0
    params = sampling_params(
        body,
        max_tokens=1 if max_tokens is None else max_tokens,
        logprobs=top if body.logprobs else None,
    )
    prompt = ChatPrompt(
        tuple({"role": m.role, "content": m.text} for m in body.messages),
        body.chat_template_kwargs or {},
    )
    stream = await state.engine.submit(
        [prompt],
        params,
        fill_context=max_tokens is None,
        token_texts=body.logprobs,
        cache_salt=cache_salt(request, body.cache_salt),
    )
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = chat_events(
            stream,
            response_id=response_id,
            created=created,
            model=state.model_name,
            logprobs=body.logprobs,
            include_usage=include_usage,
            reasoning=state.reasoning,
        )
        return EventStream(events, stream)
    collected = await collect(request, stream)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = [
        ChatChoice(
            index=index,
            message=assistant_message(output, state.reasoning),
            logprobs=chat_logprobs(output.logprobs or (), texts) if body.logprobs else None,
            finish_reason=finish_reason(output),
        )
        for index, output, texts in collected.ordered()
    ]
    body_out = ChatCompletionResponse(
        id=response_id,
        created=created,
        model=state.model_name,
        choices=choices,
        usage=usage(collected.outputs.values()),
    )
    return JSONResponse(body_out.model_dump())


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The one model this server serves."""
    state = server_state(request)
    card = ModelCard(
        id=state.model_name, created=state.created, max_model_len=state.engine.max_model_len
    )
    return ModelList(data=[card])


@router.get("/health")
async def health(request: Request) -> dict[str, str]:
    """200 ``{"status": "ok"}`` while the engine runs and admits requests, else 503 (also
    while shutting down, so that load balancers stop sending work)."""
    engine = server_state(request).engine
    if not engine.is_running:
        raise EngineUnavailable("the engine is not running")
    if not engine.is_admitting:
        raise EngineUnavailable("the server is shutting down")
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition: request histograms, engine state, process metrics."""
    body = server_state(request).metrics.render()
    return Response(body, media_type=PROMETHEUS_CONTENT_TYPE)
