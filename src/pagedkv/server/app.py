"""The FastAPI application factory."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pagedkv import __version__
from pagedkv.engine.engine import LLMEngine
from pagedkv.errors import InvalidRequest
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.errors import install_error_handlers
from pagedkv.server.limits import BodySizeLimit
from pagedkv.server.reasoning import reasoning_parser
from pagedkv.server.routes import ServerState, router

#: Default bound of a request body, bytes.
DEFAULT_MAX_BODY_BYTES = 1 << 20


def create_app(
    engine: LLMEngine,
    model_name: str,
    max_body_bytes: int,
    *,
    reasoning_parser_name: str | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` as the model ``model_name``.

    The engine is owned by a background thread from the app's startup to its shutdown (the
    ASGI lifespan); nothing else may use it meanwhile. The bridge is reachable as
    ``app.state.server.engine`` (see :class:`~pagedkv.server.routes.ServerState`).

    Args:
        engine: a freshly built engine with no requests.
        model_name: the name requests must give as ``model``.
        max_body_bytes: larger request bodies are answered 413; at least 1.
        reasoning_parser_name: a reasoning parser (``qwen3``) splitting chat replies into
            ``reasoning_content`` and ``content``, or ``None``.

    Raises:
        InvalidRequest: ``max_body_bytes`` < 1, an empty ``model_name``, or a reasoning parser
            that is unknown or that the model's tokenizer cannot support.
    """
    if max_body_bytes < 1:
        raise InvalidRequest(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if not model_name:
        raise InvalidRequest("model_name must not be empty")
    reasoning = (
        None
        if reasoning_parser_name is None
        else reasoning_parser(reasoning_parser_name, engine.tokenizer)
    )
    bridge = AsyncEngine(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bridge.start()
        try:
            yield
        finally:
            bridge.shutdown()

    app = FastAPI(title="pagedkv", version=__version__, lifespan=lifespan)
    app.state.server = ServerState(
        engine=bridge, model_name=model_name, created=int(time.time()), reasoning=reasoning
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)
    app.include_router(router)
    return app
