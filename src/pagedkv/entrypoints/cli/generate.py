"""``pagedkv generate``: generate from prompts given as flags, a JSONL file or stdin."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pagedkv.entrypoints.cli.engine_args import (
    add_engine_flags,
    add_model_flag,
    close_engine,
    engine_args,
    load_engine,
    seed_flag,
    wrap,
)
from pagedkv.errors import InvalidRequest

if TYPE_CHECKING:
    from pagedkv.engine.outputs import RequestOutput
    from pagedkv.engine.params import SamplingParams
    from pagedkv.interfaces import Engine

EXAMPLES = """\
examples:
  pagedkv generate --prompt 'def fibonacci(n):' --max-tokens 48
  pagedkv generate --chat --prompt 'Write a haiku' --temperature 0.8 --seed 1 --stream
  printf 'import os\\nclass Config:\\n' | pagedkv generate --json
  pagedkv generate --model ./Qwen3-0.6B --jsonl prompts.jsonl --json > outputs.jsonl

JSONL input: one object per line, {"prompt": "text"}, {"prompt": [token ids]} or
{"messages": [{"role": "user", "content": "..."}]} (always through the chat template).
"""

#: A prompt as the user gave it: text, token ids, or chat messages.
Source = str | list[int] | list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One prompt to run.

    Attributes:
        source: the prompt as given, echoed by ``--json``.
        chat: render ``source`` (messages, or text as one user message) through the chat
            template.
    """

    source: Source
    chat: bool


def add_parser(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "generate",
        help="generate text from prompts",
        description=wrap(
            "Generate from prompts given with --prompt, a JSONL file, or stdin (one "
            "prompt per line). All prompts run together in one continuously batched engine. "
            "Decoding is greedy unless --temperature is set."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flag(parser)
    prompts = parser.add_argument_group("prompts")
    source = prompts.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt; repeat for several (default: read prompts from stdin, one per line)",
    )
    source.add_argument("--jsonl", metavar="FILE", help="read prompts from a JSONL file")
    prompts.add_argument(
        "--chat", action="store_true", help="send text prompts as user messages, chat template"
    )
    prompts.add_argument("--system", metavar="TEXT", help="with --chat: a system message first")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, metavar="N", help="default 64")
    sampling.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy"
    )
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P", help="in (0, 1]")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="0 keeps all")
    sampling.add_argument("--min-p", type=float, default=0.0, metavar="P", help="in [0, 1]")
    sampling.add_argument(
        "--seed",
        type=seed_flag,
        default=None,
        metavar="N",
        help="per-request sampling seed, in [0, 2**64 - 1]",
    )
    sampling.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string; repeatable"
    )
    sampling.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens"
    )
    output = parser.add_argument_group("output")
    mode = output.add_mutually_exclusive_group()
    mode.add_argument(
        "--stream",
        action="store_true",
        help="print tokens as they are generated (prompts run one after another)",
    )
    mode.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt: prompt, text, token_ids, finish_reason, metrics",
    )
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_flags(parser)
    parser.set_defaults(handler=run)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as parameters; raises ``InvalidSamplingParams`` naming the field."""
    from pagedkv.engine.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _record(obj: Any, where: str, chat: bool) -> PromptRecord:
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}: expected a JSON object")
    if "messages" in obj:
        messages = obj["messages"]
        valid = isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        )
        if not valid or not messages:
            raise InvalidRequest(f"{where}: 'messages' must be a list of role/content objects")
        return PromptRecord([{str(k): str(v) for k, v in m.items()} for m in messages], True)
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        return PromptRecord(prompt, chat)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        if chat:
            raise InvalidRequest(f"{where}: --chat needs text prompts, not token ids")
        return PromptRecord([int(t) for t in prompt], False)
    raise InvalidRequest(f"{where}: 'prompt' must be a string or a list of token ids")


def read_prompts(args: argparse.Namespace, stdin: TextIO) -> list[PromptRecord]:
    """The prompts of ``--prompt``, ``--jsonl`` or stdin (one per non-blank line).

    Raises:
        InvalidRequest: no prompt, or a malformed JSONL line (the message gives its number).
        OSError: the JSONL file cannot be read.
    """
    records: list[PromptRecord] = []
    if args.prompt:
        records = [PromptRecord(p, args.chat) for p in args.prompt]
    elif args.jsonl:
        path = Path(args.jsonl)
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{where}: invalid JSON ({exc.msg})") from exc
            records.append(_record(obj, where, args.chat))
    else:
        if stdin.isatty():
            print("reading prompts from stdin, one per line; end with Ctrl-D", file=sys.stderr)
        records = [PromptRecord(line, args.chat) for line in stdin.read().splitlines() if line]
    if not records:
        raise InvalidRequest("no prompts: pass --prompt, --jsonl FILE, or prompts on stdin")
    return records


def engine_prompt(engine: Engine, record: PromptRecord, system: str | None) -> str | list[int]:
    """What ``add_request`` takes for ``record``: text, or token ids of a rendered chat."""
    if not record.chat:
        return record.source  # type: ignore[return-value]
    if engine.tokenizer is None:
        raise InvalidRequest("--chat needs a model directory with a tokenizer")
    if isinstance(record.source, str):
        messages = [{"role": "user", "content": record.source}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
    else:
        messages = record.source  # type: ignore[assignment]
    return engine.tokenizer.apply_chat_template(messages)


def output_json(index: int, record: PromptRecord, output: RequestOutput) -> str:
    """The ``--json`` line of one finished prompt."""
    metrics = output.metrics
    return json.dumps(
        {
            "index": index,
            "prompt": record.source,
            "text": output.text,
            "token_ids": list(output.token_ids),
            "finish_reason": str(output.finish_reason) if output.finish_reason else None,
            "error": output.error,
            "metrics": {
                "prompt_tokens": metrics.prompt_tokens,
                "cached_tokens": metrics.cached_tokens,
                "generated_tokens": metrics.generated_tokens,
                "preemptions": metrics.preemptions,
                "ttft_s": metrics.ttft,
                "decode_time_s": metrics.decode_time,
            },
        },
        ensure_ascii=False,
    )


def _shown(engine: Engine, text: str, token_ids: Sequence[int]) -> str:
    """Text, or the token ids when the model has no tokenizer."""
    return text if engine.tokenizer is not None else " ".join(str(t) for t in token_ids)


def run(args: argparse.Namespace) -> int:
    """Run ``generate``; returns the exit status. Flags and prompts are checked before the
    model is loaded."""
    params = sampling_params(args)
    engine_args(args)  # checked before the model loads
    records = read_prompts(args, sys.stdin)
    engine = load_engine(args)
    try:
        return _generate(args, engine, records, params)
    finally:
        close_engine(engine)


def _generate(
    args: argparse.Namespace,
    engine: Engine,
    records: list[PromptRecord],
    params: SamplingParams,
) -> int:
    """Generate for every prompt record, write the outputs; returns the exit status."""
    from pagedkv.engine.llm import run_to_completion

    prompts = [engine_prompt(engine, r, args.system) for r in records]
    out = sys.stdout
    errors: list[tuple[int, str]] = []
    if args.stream:
        for index, prompt in enumerate(prompts):
            if len(prompts) > 1:
                out.write(f"### {index}\n")
            for step in engine.stream(prompt, params):
                out.write(_shown(engine, step.new_text, step.new_token_ids))
                if engine.tokenizer is None and step.new_token_ids and not step.finished:
                    out.write(" ")
                out.flush()
                if step.error is not None:
                    errors.append((index, step.error))
            out.write("\n")
        return _report_failures(errors)
    progress = not args.no_progress and sys.stderr.isatty()
    outputs = run_to_completion(engine, prompts, params, use_tqdm=progress)
    for index, (record, output) in enumerate(zip(records, outputs, strict=True)):
        if output.error is not None:
            errors.append((index, output.error))
        if args.json:
            out.write(output_json(index, record, output) + "\n")
            continue
        if len(outputs) > 1:
            out.write(f"### {index}\n")
        out.write(_shown(engine, output.text, output.token_ids) + "\n")
    out.flush()
    return _report_failures(errors)


def _report_failures(errors: list[tuple[int, str]]) -> int:
    """One stderr line per prompt whose request failed (finish reason ``error``); the exit
    status: 1 if any did, else 0."""
    for index, error in errors:
        print(f"pagedkv generate: prompt {index} failed: {error}", file=sys.stderr)
    return 1 if errors else 0
