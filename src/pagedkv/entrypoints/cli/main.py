"""The ``pagedkv`` command line: ``demo``, ``generate``, ``serve``, ``bench`` and ``certify``.

Every error is reported as one line on stderr: exit status 2 for a malformed command line
(unknown flag, missing or mistyped value), 1 for anything that fails while running (missing
model, out-of-range value, unsupported checkpoint). ``pagedkv --debug COMMAND ...`` shows the
full traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from pagedkv import __version__
from pagedkv.entrypoints.cli import certify as cli_certify
from pagedkv.entrypoints.cli import demo as cli_demo
from pagedkv.entrypoints.cli import generate as cli_generate
from pagedkv.entrypoints.cli import serve as cli_serve

#: Exit status of a malformed command line.
EXIT_USAGE = 2
#: Exit status of a runtime error.
EXIT_ERROR = 1
#: Exit status after Ctrl-C.
EXIT_INTERRUPTED = 130


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_bench(commands: argparse._SubParsersAction[OneLineParser]) -> None:
    from pagedkv.bench.cli import add_arguments, run

    parser = commands.add_parser(
        "bench",
        help="benchmarks of pagedkv, side by side with transformers; ratios to bench/results.json",
        description="Run the benchmarks (mixed, shared-prefix, decode, memory, scaling, "
        "micro, ...) at all physical cores and write bench/results.json, results.md and plots; "
        "--quick is the short mode and --device cuda the GPU run (skipped without a GPU).",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


def build_parser() -> OneLineParser:
    """The parser of every command."""
    parser = OneLineParser(
        prog="pagedkv",
        description="A reference LLM inference engine for Qwen3 with a paged KV cache, prefix "
        "caching and continuous batching.",
        epilog="Run 'pagedkv COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    commands = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", required=True
    )
    cli_demo.add_parser(commands)
    cli_generate.add_parser(commands)
    cli_serve.add_parser(commands)
    _add_bench(commands)
    cli_certify.add_parser(commands)
    return parser


def _one_line(exc: BaseException) -> str:
    from pagedkv.errors import PagedKVError

    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, PagedKVError | OSError | ValueError):
        return message
    return f"{type(exc).__name__}: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    from pagedkv.entrypoints.cli.config_file import expand_config
    from pagedkv.errors import InvalidRequest

    parser = build_parser()
    try:
        expanded = expand_config(sys.argv[1:] if argv is None else argv)
    except InvalidRequest as exc:
        parser.error(str(exc))
    args = parser.parse_args(expanded)
    try:
        status: int = args.handler(args)
    except KeyboardInterrupt:
        print(f"pagedkv {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (e.g. '| head'): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except Exception as exc:
        if args.debug:
            raise
        print(f"pagedkv {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    return status


if __name__ == "__main__":
    sys.exit(main())
