"""The HTTP endpoints: OpenAI completions and chat completions, models, health, metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedkv.entrypoints.server.async_engine import EngineUnavailable
from pagedkv.entrypoints.server.chat import Chat
from pagedkv.entrypoints.server.completions import Completions
from pagedkv.entrypoints.server.generate import generate
from pagedkv.entrypoints.server.metrics import PROMETHEUS_CONTENT_TYPE
from pagedkv.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pagedkv.entrypoints.server.state import server_state

router = APIRouter()

#: The two generation endpoints, which share one request path and differ in how a prompt is
#: made and how a choice is shaped.
COMPLETIONS = Completions()
CHAT = Chat()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI completions: ``n`` choices per prompt, streamed as server-sent events on
    demand."""
    return await generate(COMPLETIONS, body, request)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions through the model's chat template: ``n`` choices, streamed as
    server-sent events on demand."""
    return await generate(CHAT, body, request)


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
