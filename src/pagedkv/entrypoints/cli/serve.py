"""``pagedkv serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.accel.cpu.host_memory import use_one_arena
from pagedkv.entrypoints.cli.engine_args import (
    add_engine_flags,
    add_model_flag,
    close_engine,
    engine_args,
    load_engine,
    model_of,
    wrap,
)
from pagedkv.entrypoints.server.admission import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_WAITING_REQUESTS,
    AdmissionLimits,
)
from pagedkv.entrypoints.server.reasoning import REASONING_PARSERS
from pagedkv.entrypoints.server.startup_heap import freeze_startup_heap
from pagedkv.errors import InvalidRequest

if TYPE_CHECKING:
    from pagedkv.entrypoints.server.app import ServerConfig

#: Defaults of the HTTP flags, as in ``pagedkv.entrypoints.server.app`` and
#: ``pagedkv.entrypoints.server.http`` (which import FastAPI and uvicorn: only loaded when
#: serving, so that ``--help`` stays fast).
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30
DEFAULT_LOG_STATS_INTERVAL_S = 10.0
#: Environment variable read for an API key when no ``--api-key`` is given.
API_KEY_ENV = "PAGEDKV_API_KEY"
#: Environment variable read for the metrics key when no ``--metrics-api-key`` is given.
METRICS_KEY_ENV = "PAGEDKV_METRICS_API_KEY"

EXAMPLES = """\
endpoints:
  POST /v1/completions, POST /v1/chat/completions (OpenAI schemas, stream=true for SSE),
  GET /v1/models, POST /tokenize, POST /detokenize, GET /version, GET /health,
  GET /metrics (Prometheus text format, vLLM's metric names)

The engine flags are vLLM's engine arguments; --config FILE reads them from a YAML
file (keys as vLLM's: max_model_len, or max-model-len), flags given on the command
line win.

example:
  pagedkv serve --port 8000 &
  pagedkv serve ./Qwen3-0.6B --max-model-len 4096 --dtype bfloat16 &
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"prompt": "def main():", "max_tokens": 32}'
"""


def add_parser(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description=wrap(
            "Serve one model over an OpenAI-compatible HTTP API. Requests from all "
            "clients are batched continuously in one engine."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flag(parser, positional=True)
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a YAML file of flags, keys the flags' names (with _ or -), as vLLM's --config; "
        "flags on the command line win",
    )
    _add_http_flags(parser)
    _add_admission_flags(parser)
    _add_auth_flags(parser)
    add_engine_flags(parser, serve=True)
    parser.add_argument(
        "--generation-config",
        metavar="SOURCE",
        default="auto",
        help="sampling defaults for fields a request leaves out: auto (the model's "
        "generation_config.json), vllm (none: OpenAI's defaults), or a directory holding a "
        "generation_config.json (default auto)",
    )
    parser.set_defaults(handler=run)


def _add_http_flags(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("http")
    http.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    http.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    http.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"larger request bodies are refused with 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    http.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request headers are not in within this time "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    http.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request body is not in within this time after its "
        f"headers (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=int,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, stop admitting and let requests in flight finish for this "
        f"long, then abort them (default {DEFAULT_SHUTDOWN_TIMEOUT_S})",
    )
    http.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split chat replies' thinking into reasoning_content, streamed as its own "
        "deltas (qwen3: <think>...</think>, as vLLM's); the tokenizer must have the think "
        "tokens",
    )
    http.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let chat's tool_choice auto read tool calls out of replies (vLLM's flag); "
        "needs --tool-call-parser",
    )
    http.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how replies write tool calls: hermes (Qwen3's <tool_call> JSON); another name "
        "is refused",
    )
    http.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="server log level (default info)",
    )
    http.add_argument(
        "--log-stats-interval",
        type=float,
        default=DEFAULT_LOG_STATS_INTERVAL_S,
        metavar="SECONDS",
        help="log a throughput line this often; 0 for never "
        f"(default {DEFAULT_LOG_STATS_INTERVAL_S:g})",
    )


def _add_admission_flags(parser: argparse.ArgumentParser) -> None:
    admission = parser.add_argument_group("admission")
    admission.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        metavar="N",
        help="a completions request with more prompts is refused with 400 "
        f"(default {DEFAULT_MAX_PROMPTS_PER_REQUEST})",
    )
    admission.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        metavar="N",
        help="a request that would make more requests wait for the engine is refused with 429 "
        f"and Retry-After (default {DEFAULT_MAX_WAITING_REQUESTS})",
    )
    admission.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abort a request not finished this long after it was accepted (504, or an "
        "error event in a stream); default: no deadline",
    )


def _add_auth_flags(parser: argparse.ArgumentParser) -> None:
    auth = parser.add_argument_group("authentication")
    auth.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
        f"otherwise); repeat for several keys; default: ${API_KEY_ENV} if set, else none",
    )
    auth.add_argument(
        "--cache-salt-per-api-key",
        action="store_true",
        help="give each API key its own prefix cache: tenants never share KV pages, so "
        "cached_tokens and timing reveal nothing of another key's prompts; the default with "
        "several keys, so needed only to salt a single key",
    )
    auth.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="let several API keys share one prefix cache (faster repeats across keys, but a "
        "tenant can then learn another's prompts through cached_tokens); default: each key "
        "has its own",
    )
    auth.add_argument(
        "--metrics-api-key",
        default=None,
        metavar="KEY",
        help="the only key GET /metrics takes once keys are set (tenant keys get 403: the "
        "metrics show every tenant's prompt lengths, timings and repeats); it opens nothing "
        f"else; default: ${METRICS_KEY_ENV} if set, else /metrics is closed when --api-key is "
        "given and open otherwise",
    )


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    """The app's admission, authentication and logging settings from ``serve``'s flags (and
    ``$PAGEDKV_API_KEY``, ``$PAGEDKV_METRICS_API_KEY`` where their flags are not given).

    Raises:
        InvalidRequest: contradicting or empty tenant settings (``ServerConfig``'s checks).
    """
    from pagedkv.entrypoints.server.app import ServerConfig

    api_keys = tuple(args.api_key or ())
    if not api_keys and os.environ.get(API_KEY_ENV):
        api_keys = (os.environ[API_KEY_ENV],)
    metrics_key = args.metrics_api_key
    if metrics_key is None:
        metrics_key = os.environ.get(METRICS_KEY_ENV) or None
    return ServerConfig(
        limits=AdmissionLimits(
            max_prompts_per_request=args.max_prompts_per_request,
            max_waiting_requests=args.max_waiting_requests,
            request_timeout_s=args.request_timeout,
        ),
        api_keys=api_keys,
        cache_salt_per_api_key=args.cache_salt_per_api_key,
        shared_prefix_cache=args.shared_prefix_cache,
        metrics_api_key=metrics_key,
        log_stats_interval_s=args.log_stats_interval or None,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        close_engine=True,
    )


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted; returns the exit status."""
    from pagedkv.assets import DEFAULT_MODEL_NAME
    from pagedkv.entrypoints.server.app import create_app
    from pagedkv.entrypoints.server.http import HTTPOptions, Server
    from pagedkv.entrypoints.server.listen import bind_listener

    if args.max_body_bytes < 1:
        raise InvalidRequest(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    server_config = build_server_config(args)
    options = HTTPOptions(
        host=args.host,
        port=args.port,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        log_level=args.log_level,
    )
    engine_args(args)  # every flag checked before anything is bound or loaded
    model = model_of(args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("pagedkv.server")
    logging.getLogger("pagedkv").setLevel(args.log_level.upper())
    listener = bind_listener(options.host, options.port)  # a busy port fails before the load
    # Before the load starts any thread: each allocates from the arena one release empties
    # when the server idles (SRV-137, SRV-139).
    use_one_arena()
    try:
        # the loader draws its progress bar where stderr is a terminal (SRV-122); no log line
        # here, so that an error while loading stays the one line on stderr (SRV-044)
        engine = load_engine(args)
    except BaseException:
        listener.close()
        raise
    name = args.served_model_name or DEFAULT_MODEL_NAME
    if args.served_model_name is None and model is not None:
        # a hub id is served under its id, as vLLM does
        name = Path(model).resolve().name if Path(model).is_dir() else model
    try:
        app = create_app(engine, name, args.max_body_bytes, config=server_config)
        # What start-up built lives as long as the server: no collection scans it (SRV-140).
        freeze_startup_heap()
        log.info("listening on http://%s:%d/v1", options.host, options.port)
        Server(app, options).run(sockets=[listener])
    finally:
        listener.close()
        close_engine(engine)  # a tensor-parallel model's workers leave with the server
    return 0
