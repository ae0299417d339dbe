"""What every endpoint shares: the engine bridge, the served model's name, metrics and the
reasoning parser, kept in ``app.state.server``."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from pagedkv.entrypoints.server.async_engine import AsyncEngine, EngineUnavailable
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.metrics import ServingMetrics
from pagedkv.entrypoints.server.policy import ServerPolicy
from pagedkv.entrypoints.server.reasoning import ReasoningParser


@dataclass(frozen=True, slots=True)
class ServerState:
    """What the endpoints share, kept in ``app.state.server``.

    Attributes:
        engine: the engine bridge.
        model_name: the only model name requests may ask for (and what an absent ``model``
            means).
        created: Unix time (seconds) the app was created, reported by ``/v1/models``.
        metrics: the server's Prometheus metrics.
        policy: what the server admits: API keys and tenants, body size, prompts, queue depth,
            deadlines.
        reasoning: the reasoning parser splitting chat replies, ``None`` for none.
        auto_tool_choice: chat's ``tool_choice: auto`` reads tool calls out of replies
            (``--enable-auto-tool-choice`` with a ``--tool-call-parser``).
    """

    engine: AsyncEngine
    model_name: str
    created: int
    metrics: ServingMetrics
    policy: ServerPolicy
    reasoning: ReasoningParser | None = None
    auto_tool_choice: bool = False


def server_state(request: Request) -> ServerState:
    """The app's shared state.

    Raises:
        EngineUnavailable: the app was built without one (answered 503).
    """
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
