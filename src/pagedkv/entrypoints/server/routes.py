"""The HTTP endpoints: OpenAI completions and chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedkv.entrypoints.server.async_engine import (
    ChatPrompt,
    EngineUnavailable,
    GenerationStream,
    PromptInput,
)
from pagedkv.entrypoints.server.auth import cache_salt
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.metrics import PROMETHEUS_CONTENT_TYPE
from pagedkv.entrypoints.server.openai_format import (
    Collected,
    assistant_message,
    chat_logprobs,
    completion_prompts,
    finish_reason,
    prompt_logprobs,
    sampling_params,
    usage,
)
from pagedkv.entrypoints.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
)
from pagedkv.entrypoints.server.request_checks import check_request
from pagedkv.entrypoints.server.state import ServerState, check_model, server_state
from pagedkv.entrypoints.server.streaming import (
    ChoiceFormat,
    EventStream,
    chat_events,
    completion_choice,
    completion_events,
)

#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Status of a response nobody reads: the client disconnected before it was ready.
CLIENT_CLOSED_REQUEST = 499


router = APIRouter()


def _check_request(state: ServerState, body: SamplingFields) -> None:
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


async def echo_texts(state: ServerState, prompts: list[PromptInput]) -> list[str]:
    """The text each prompt echoes: a text prompt as sent, token ids decoded."""
    texts = []
    for prompt in prompts:
        if isinstance(prompt, str):
            texts.append(prompt)
        elif isinstance(prompt, tuple):
            texts.append((await state.engine.detokenize(prompt))[0])
        else:
            raise APIError(400, "echo applies to completion prompts only", param="echo")
    return texts


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI completions: ``n`` choices per prompt, streamed as server-sent events on
    demand."""
    state = server_state(request)
    _check_request(state, body)
    defaults = state.engine.generation_defaults
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = defaults.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    want_logprobs = body.logprobs is not None
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed tokens carry logprobs too
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    params = sampling_params(
        body,
        defaults,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    prompts = completion_prompts(body.prompt)
    echoed = await echo_texts(state, prompts) if body.echo else None
    stream = await state.engine.submit(
        prompts,
        params,
        token_texts=want_logprobs or prompt_logprobs is not None,
        cache_salt=cache_salt(request, body.cache_salt),
    )
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    choice = ChoiceFormat(
        n=params.n,
        logprobs=want_logprobs,
        echo=echoed,
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = completion_events(
            stream,
            response_id=response_id,
            created=created,
            model=state.model_name,
            choice=choice,
            include_usage=include_usage,
        )
        return EventStream(events, stream)
    collected = await collect(request, stream)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = [
        completion_choice(choice, index, output, completion, texts, first=True, final=True)
        for index, output, texts in collected.ordered()
        for completion in output.outputs
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
    """OpenAI chat completions through the model's chat template: ``n`` choices."""
    state = server_state(request)
    _check_request(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400,
            "top_logprobs needs logprobs: true",
            param="top_logprobs",
            code="invalid_sampling_params",
        )
    defaults = state.engine.generation_defaults
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    top = body.top_logprobs or 0
    params = sampling_params(
        body,
        defaults,
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
        token_texts=body.logprobs or body.prompt_logprobs is not None,
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
            n=params.n,
            logprobs=body.logprobs,
            include_usage=include_usage,
            reasoning=state.reasoning,
        )
        return EventStream(events, stream)
    collected = await collect(request, stream)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    ((_, output, texts),) = collected.ordered()
    choices = [
        ChatChoice(
            index=completion.index,
            message=assistant_message(completion, output.prompt_token_ids, state.reasoning),
            logprobs=chat_logprobs(completion.logprobs or (), texts) if body.logprobs else None,
            finish_reason=finish_reason(completion),
            stop_reason=completion.stop_reason,
        )
        for completion in output.outputs
    ]
    body_out = ChatCompletionResponse(
        id=response_id,
        created=created,
        model=state.model_name,
        choices=choices,
        usage=usage(collected.outputs.values()),
        prompt_logprobs=prompt_logprobs(output, texts),
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
