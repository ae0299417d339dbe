"""``pagedkv certify``: a black-box conformance run against an OpenAI-compatible server
(specs/certify.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(commands: argparse._SubParsersAction[Any]) -> None:
    """Register ``certify`` on the command line."""
    parser = commands.add_parser(
        "certify",
        help="check an OpenAI-compatible server against transformers on the checkpoint it serves",
        description="Send greedy requests built to stress paging to the server at --url and "
        "compare every token with transformers run on --model; writes certify.json and "
        "certify.md to --out. Exit status 0 only if no check fails.",
    )
    parser.add_argument(
        "--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument(
        "--model", required=True, type=Path, help="the checkpoint the server serves"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name requests give (default: the first /v1/models lists)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the quick profile (seconds on a tiny model)"
    )
    parser.add_argument("--out", type=Path, default=Path("certify-report"), help="report directory")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the checks, write the report, print its Markdown path and verdicts."""
    from pagedkv.certify.run import CertifyOptions, certify

    options = CertifyOptions(args.url, args.model, args.served_model_name, args.quick)
    report = certify(options)
    json_path, markdown_path = report.write(args.out)
    for result in report.results:
        print(f"{result.verdict.value:4}  {result.name}: {result.detail}")
    print(f"{'PASS' if report.passed else 'FAIL'}: report in {markdown_path} and {json_path}")
    return report.exit_status
