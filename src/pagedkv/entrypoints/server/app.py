"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from pagedkv import __version__
from pagedkv.accel.cpu.host_memory import release_freed_memory
from pagedkv.entrypoints.server.admission import AdmissionLimits
from pagedkv.entrypoints.server.api_keys import ApiKeys
from pagedkv.entrypoints.server.async_engine import AsyncEngine
from pagedkv.entrypoints.server.errors import install_error_handlers
from pagedkv.entrypoints.server.gate import PolicyGate
from pagedkv.entrypoints.server.metrics import ServingMetrics
from pagedkv.entrypoints.server.policy import ServerPolicy
from pagedkv.entrypoints.server.reasoning import reasoning_parser
from pagedkv.entrypoints.server.routes import router
from pagedkv.entrypoints.server.state import ServerState
from pagedkv.entrypoints.server.stats_log import log_throughput, startup_summary
from pagedkv.entrypoints.server.tokenize import router as tokenize_router
from pagedkv.entrypoints.server.tool_calls import check_tool_parser
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Closable, Engine

#: Default bound of a request body, bytes.
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: Default seconds between two throughput lines in the log.
DEFAULT_LOG_STATS_INTERVAL_S = 10.0

logger = logging.getLogger("pagedkv.server")


@dataclass(frozen=True)
class ServerConfig:
    """How the app admits, authenticates and reports (``pagedkv serve`` flags).

    Attributes:
        limits: admission limits (prompts per request, waiting requests, request deadline).
        api_keys: keys a request must present as ``Authorization: Bearer KEY``; empty for no
            authentication.
        cache_salt_per_api_key: give each API key its own prefix-cache namespace; needs
            ``api_keys``. With several keys this is the default (SRV-073); the flag still
            salts a single key.
        shared_prefix_cache: let several API keys share one prefix cache (the operator's
            explicit choice: a tenant can then learn another's prompts through
            ``cached_tokens``); needs ``api_keys``, contradicts ``cache_salt_per_api_key``.
        metrics_api_key: the only key ``/metrics`` takes (SRV-074); ``None``: with
            ``api_keys``, ``/metrics`` is closed to every key. Must differ from every API key.
        log_stats_interval_s: seconds between throughput lines in the log; ``None`` for none.
        reasoning_parser: a reasoning parser (``qwen3``) splitting chat replies into
            ``reasoning_content`` and ``content``, or ``None``.
        enable_auto_tool_choice: let chat's ``tool_choice: auto`` read tool calls out of
            replies (vLLM's ``--enable-auto-tool-choice``); needs ``tool_call_parser``.
        tool_call_parser: how replies' tool calls are written: ``hermes`` (Qwen3's
            ``<tool_call>`` JSON), or ``None``.
        close_engine: close the engine when the app shuts down (``pagedkv serve``: a
            tensor-parallel engine's workers end with the server, TP-023, even when the
            exit signal then ends the process).
    """

    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    api_keys: tuple[str, ...] = ()
    cache_salt_per_api_key: bool = False
    shared_prefix_cache: bool = False
    metrics_api_key: str | None = None
    log_stats_interval_s: float | None = DEFAULT_LOG_STATS_INTERVAL_S
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    close_engine: bool = False

    def __post_init__(self) -> None:
        check_tool_parser(self.tool_call_parser, self.enable_auto_tool_choice)
        if self.cache_salt_per_api_key and not self.api_keys:
            raise InvalidRequest("cache_salt_per_api_key needs at least one API key")
        if any(not key for key in self.api_keys):
            raise InvalidRequest("API keys must not be empty")
        if self.shared_prefix_cache and not self.api_keys:
            raise InvalidRequest("shared_prefix_cache (--shared-prefix-cache) needs API keys")
        if self.shared_prefix_cache and self.cache_salt_per_api_key:
            raise InvalidRequest(
                "shared_prefix_cache (--shared-prefix-cache) and cache_salt_per_api_key "
                "(--cache-salt-per-api-key) contradict each other: give one"
            )
        if self.metrics_api_key is not None and not self.metrics_api_key:
            raise InvalidRequest("metrics_api_key (--metrics-api-key) must not be empty")
        if self.metrics_api_key is not None and self.metrics_api_key in self.api_keys:
            raise InvalidRequest(
                "metrics_api_key (--metrics-api-key) must differ from every API key: a tenant "
                "holding it would read every tenant's traffic"
            )
        interval = self.log_stats_interval_s
        if interval is not None and not (interval > 0 and math.isfinite(interval)):
            raise InvalidRequest(f"log_stats_interval_s must be > 0, got {interval}")

    @property
    def auth_summary(self) -> str:
        """How requests are authenticated, for the log (never the keys)."""
        if not self.api_keys:
            return "none" if self.metrics_api_key is None else "/metrics behind the metrics key"
        salted = ", one prefix-cache salt per key" if self.tenant_per_key else ""
        shared = ", one prefix cache shared by every key" if self.shared_prefix_cache else ""
        metrics = (
            "/metrics closed" if self.metrics_api_key is None else "/metrics behind the metrics key"
        )
        return f"{len(self.api_keys)} API key(s){salted}{shared}, {metrics}"

    @property
    def tenant_per_key(self) -> bool:
        """Whether each API key gets its own prefix-cache salt: asked for, or several keys
        not explicitly sharing (SRV-073)."""
        several = len(set(self.api_keys)) > 1
        return self.cache_salt_per_api_key or (several and not self.shared_prefix_cache)


def create_app(
    engine: Engine,
    model_name: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    config: ServerConfig | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` as the model ``model_name``.

    The engine is owned by a background thread from the app's startup to its shutdown (the
    ASGI lifespan); nothing else may use it meanwhile. The bridge is reachable as
    ``app.state.server.engine`` (see :class:`~pagedkv.entrypoints.server.state.ServerState`).

    Args:
        engine: a freshly built engine with no requests.
        model_name: the name requests may give as ``model``.
        max_body_bytes: larger request bodies are answered 413; at least 1.
        config: limits, authentication, logging and the reasoning parser (defaults when
            ``None``).

    Raises:
        InvalidRequest: ``max_body_bytes`` < 1, an empty ``model_name``, or a reasoning parser
            that is unknown or that the model's tokenizer cannot support.
    """
    config = config or ServerConfig()
    policy = ServerPolicy(
        max_body_bytes,
        config.limits,
        ApiKeys.of(config.api_keys) if config.api_keys else None,
        tenant_per_key=config.tenant_per_key,
        metrics_key=(
            None if config.metrics_api_key is None else ApiKeys.of((config.metrics_api_key,))
        ),
    )
    if not model_name:
        raise InvalidRequest("model_name must not be empty")
    reasoning = (
        None
        if config.reasoning_parser is None
        else reasoning_parser(config.reasoning_parser, engine.tokenizer)
    )
    metrics = ServingMetrics(model_name, engine.max_model_len)
    # Retained freed memory goes back to the system once the engine idles (SRV-137).
    bridge = AsyncEngine(
        engine, policy, observer=metrics.observe, release_memory=release_freed_memory
    )
    metrics.watch_engine(bridge.stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bridge.start()
        logger.info("%s", startup_summary(model_name, bridge, config.auth_summary))
        reporter = None
        if config.log_stats_interval_s is not None:
            reporter = asyncio.ensure_future(
                log_throughput(bridge, metrics, config.log_stats_interval_s)
            )
        try:
            yield
        finally:
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
            in_flight = bridge.stats()
            bridge.shutdown()
            if config.close_engine and isinstance(engine, Closable):
                engine.close()
            stats = bridge.stats()
            log = logger.info if stats.pages_in_use == 0 else logger.error
            log(
                "engine stopped: %d requests aborted, %d KV pages in use",
                in_flight.running + in_flight.waiting,
                stats.pages_in_use,
            )

    app = FastAPI(title="pagedkv", version=__version__, lifespan=lifespan)
    app.state.server = ServerState(
        engine=bridge,
        model_name=model_name,
        created=int(time.time()),
        metrics=metrics,
        policy=policy,
        reasoning=reasoning,
        auto_tool_choice=config.enable_auto_tool_choice,
    )
    install_error_handlers(app)
    app.add_middleware(PolicyGate, policy=policy)
    app.include_router(router)
    app.include_router(tokenize_router)
    return app
