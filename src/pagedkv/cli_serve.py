"""``pagedkv serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedkv.cli_engine import (
    add_engine_flags,
    add_model_flag,
    engine_config,
    load_engine,
    resolve_model_dir,
    wrap,
)
from pagedkv.errors import InvalidRequest
from pagedkv.server.reasoning import REASONING_PARSERS

#: Default bound of a request body, bytes (as ``pagedkv.server.app.DEFAULT_MAX_BODY_BYTES``).
DEFAULT_MAX_BODY_BYTES = 1 << 20

EXAMPLES = """\
endpoints:
  POST /v1/completions, POST /v1/chat/completions (OpenAI schemas, stream=true for SSE),
  GET /v1/models, GET /health, GET /metrics (Prometheus text format)

example:
  pagedkv serve --port 8000 &
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "pagedkv-default", "prompt": "def main():", "max_tokens": 32}'
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
    add_model_flag(parser)
    http = parser.add_argument_group("http")
    http.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    http.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    http.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model name clients must send (default: the model directory's name, or "
        "pagedkv-default for the embedded model)",
    )
    http.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"larger request bodies are refused with 413 (default {DEFAULT_MAX_BODY_BYTES})",
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
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="server log level (default info)",
    )
    add_engine_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted; returns the exit status."""
    if args.max_body_bytes < 1:
        raise InvalidRequest(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if not 0 <= args.port <= 65535:
        raise InvalidRequest(f"--port must be in [0, 65535], got {args.port}")
    config = engine_config(args)
    model_dir = resolve_model_dir(args.model)
    import uvicorn

    from pagedkv.assets import DEFAULT_MODEL_NAME
    from pagedkv.server.app import create_app

    engine = load_engine(model_dir, config, args)
    name = args.served_model_name or (
        DEFAULT_MODEL_NAME if args.model is None else model_dir.resolve().name
    )
    app = create_app(engine, name, args.max_body_bytes, reasoning_parser_name=args.reasoning_parser)
    print(f"pagedkv: serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
