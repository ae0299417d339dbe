"""``pagedkv demo``: the embedded model on a batch sharing a long system prompt, run with
prefix caching on and off, side by side."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.entrypoints.cli.engine_args import resolve_model_dir, wrap
from pagedkv.errors import InvalidRequest

if TYPE_CHECKING:
    from pagedkv.engine.outputs import EngineStats, RequestOutput, StepReport
    from pagedkv.engine.params import SamplingParams
    from pagedkv.interfaces import Engine

#: The long system prompt every request of the demo shares.
SYSTEM_PROMPT = '''\
You are a careful Python programmer working on a small standard-library-only code base.
Answer with code only. Follow the conventions of the module below: type hints everywhere,
docstrings that state units and preconditions, small functions, and explicit errors.

"""Utilities for reading configuration files and scheduling background jobs."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration file is missing a key or holds a value of the wrong type."""


@dataclass
class Job:
    """A job run every ``interval`` seconds; ``last_run`` is a time.monotonic() value."""

    name: str
    interval: float
    last_run: float = 0.0
    tags: list[str] = field(default_factory=list)

    def due(self, now: float) -> bool:
        """Whether the job should run at ``now`` (seconds, time.monotonic clock)."""
        return now - self.last_run >= self.interval


def read_config(path: str) -> dict[str, str]:
    """Read ``key = value`` lines from ``path``; blank lines and ``#`` comments are skipped."""
    result: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise ConfigError(f"{path}:{number}: expected key = value")
            result[key.strip()] = value.strip()
    return result
'''

#: The user messages of the demo's requests (cycled when more are asked for).
QUESTIONS = (
    "def parse_duration(text: str) -> float:",
    "class JobQueue:",
    "def env_flag(name: str, default: bool = False) -> bool:",
    "def run_due_jobs(jobs: list[Job], now: float) -> int:",
    "import json\n\ndef load_json_config(path: str) -> dict:",
    "def split_tags(value: str) -> list[str]:",
    "class RetryPolicy:",
    "def format_bytes(size: int) -> str:",
)


@dataclass(frozen=True, slots=True)
class BatchRun:
    """One run of the demo batch.

    Attributes:
        outputs: the finished outputs, in request order.
        wall_s: seconds from the first request's arrival to the last one's end.
        stats: the engine's counters at the end.
        prefill_steps: seconds of each step that computed prompt positions.
        decode_steps: seconds of each step that computed none (decoding only).
    """

    outputs: list[RequestOutput]
    wall_s: float
    stats: EngineStats
    prefill_steps: list[float]
    decode_steps: list[float]

    @property
    def ttft_s(self) -> float:
        """Mean time to first token of the requests sent together (all but the first, which
        arrives alone to warm the cache), seconds."""
        times = [o.metrics.ttft for o in self.outputs[1:] or self.outputs]
        known = [t for t in times if t is not None]
        return sum(known) / len(known) if known else 0.0

    @property
    def prefill_s(self) -> float:
        """Seconds spent in steps that prefilled."""
        return sum(self.prefill_steps)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


def add_parser(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "demo",
        help="run the embedded model on a batch sharing a long system prompt",
        description=wrap(
            "Run the small embedded model on a batch of requests that share a long "
            "system prompt, greedily, with prefix caching on and then off. Prints each "
            "generation, the prefix-cache hit rate, the prefill tokens saved, KV pages in use and "
            "their peak, tokens/s and wall times side by side, and checks that both runs produce "
            "the same outputs. The first request arrives alone and warms the cache; the others "
            "arrive once its prompt is in the cache, as in a server."
        ),
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, metavar="N", help="tokens per request (default 32)"
    )
    parser.add_argument(
        "--num-requests", type=int, default=8, metavar="N", help="requests (default 8)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run)


def build_prompts(engine: Engine, num_requests: int) -> tuple[list[str | list[int]], int]:
    """The demo's prompts and the token count of the prefix they all share."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidRequest("the demo needs a model with a tokenizer")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_requests)]
    prompts: list[str | list[int]] = []
    for question in questions:
        if tokenizer.has_chat_template:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ]
            prompts.append(tokenizer.apply_chat_template(messages))
        else:
            prompts.append(tokenizer.encode(SYSTEM_PROMPT + "\n" + question))
    ids = [p for p in prompts if isinstance(p, list)]
    shared = 0
    while all(len(p) > shared and p[shared] == ids[0][shared] for p in ids):
        shared += 1
    return prompts, shared


def run_batch(
    engine: Engine,
    prompts: Sequence[str | list[int]],
    params: SamplingParams,
    *,
    label: str,
    progress: bool,
) -> BatchRun:
    """Send the first prompt, step until it has its first token (its prompt pages are then
    committed to the prefix cache), send the rest, and step until all finish."""
    from tqdm import tqdm

    prefill: list[float] = []
    decode: list[float] = []

    def observe(report: StepReport) -> None:
        (prefill if report.num_prompt_tokens else decode).append(report.total_s)

    engine.add_step_observer(observe)
    start = time.perf_counter()
    done: dict[str, RequestOutput] = {}
    with tqdm(total=len(prompts), desc=label, unit="req", disable=not progress) as bar:
        first = engine.add_request(prompts[0], params)
        warmed = False
        while not warmed and engine.has_unfinished_requests():
            for output in engine.step():
                warmed = warmed or output.request_id == first
                if output.finished:
                    done[output.request_id] = output
                    bar.update(1)
        ids = [first] + [engine.add_request(p, params) for p in prompts[1:]]
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
                    bar.update(1)
    wall = time.perf_counter() - start
    engine.remove_step_observer(observe)
    return BatchRun([done[i] for i in ids], wall, engine.stats(), prefill, decode)


def _indent(text: str) -> str:
    lines = text.rstrip().splitlines() or [""]
    return "\n".join("    " + line for line in lines)


def report(on: BatchRun, off: BatchRun, shared_tokens: int) -> str:
    """The side-by-side table of both runs."""
    rows = [
        ("time to first token (ms)", f"{on.ttft_s * 1e3:.1f}", f"{off.ttft_s * 1e3:.1f}"),
        ("prefill step time (s)", f"{on.prefill_s:.3f}", f"{off.prefill_s:.3f}"),
        ("wall time (s)", f"{on.wall_s:.2f}", f"{off.wall_s:.2f}"),
        ("generated tokens/s", f"{on.tokens_per_s:.1f}", f"{off.tokens_per_s:.1f}"),
        ("generated tokens", str(on.generated_tokens), str(off.generated_tokens)),
        (
            "prefill tokens computed",
            str(on.stats.prefill_tokens_computed),
            str(off.stats.prefill_tokens_computed),
        ),
        ("prefix-cache hit rate", f"{on.stats.hit_rate:.1%}", f"{off.stats.hit_rate:.1%}"),
        ("prefill tokens saved", str(on.stats.hit_tokens), str(off.stats.hit_tokens)),
        (
            "peak KV pages in use",
            str(on.stats.peak_pages_in_use),
            str(off.stats.peak_pages_in_use),
        ),
        ("KV pages in use now", str(on.stats.pages_in_use), str(off.stats.pages_in_use)),
        ("KV pages cached now", str(on.stats.pages_cached), str(off.stats.pages_cached)),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"{len(on.outputs)} requests sharing a {shared_tokens}-token prefix",
        f"{'':<{width}}  {'prefix caching on':>18}  {'prefix caching off':>18}",
    ]
    lines += [f"{name:<{width}}  {a:>18}  {b:>18}" for name, a, b in rows]
    speedup = off.wall_s / on.wall_s if on.wall_s > 0 else 0.0
    saved_tokens = off.stats.prefill_tokens_computed - on.stats.prefill_tokens_computed
    lines.append(
        f"prefix caching saved {saved_tokens} prefill tokens and "
        f"{off.prefill_s - on.prefill_s:.3f} s of prefill; time to first token "
        f"{_ratio(off.ttft_s, on.ttft_s)} shorter"
    )
    lines.append(f"speed-up of the whole run from prefix caching: {speedup:.2f}x")
    lines.append(why_wall_time_moves(on, off))
    return "\n".join(lines)


def _ratio(slow: float, fast: float) -> str:
    return f"{slow / fast:.2f}x" if fast > 0 else "n/a"


#: Below this speed-up of the whole run, the demo says the wall time moves little.
LITTLE_SPEEDUP = 1.2
#: A prefill step costing less than this many decode steps "costs little more" than one.
CHEAP_PREFILL = 2.0


def why_wall_time_moves(on: BatchRun, off: BatchRun) -> str:
    """One line on where the time of the run without caching goes, and so why caching, which
    removes prefill work only, moves the wall time as much as it did; its words follow the
    figures (SRV-045): "moves little" only under a speed-up of :data:`LITTLE_SPEEDUP`, a
    prefill "costs little more than a decode step" only under :data:`CHEAP_PREFILL` times."""
    decode = off.decode_steps
    per_decode = sum(decode) / len(decode) if decode else 0.0
    per_prefill = off.prefill_s / len(off.prefill_steps) if off.prefill_steps else 0.0
    share = sum(decode) / off.wall_s if off.wall_s > 0 else 0.0
    speedup = off.wall_s / on.wall_s if on.wall_s > 0 else 0.0
    cost = per_prefill / per_decode if per_decode > 0 else 0.0
    if cost < CHEAP_PREFILL:
        prefill = "on a tiny model a prefill step costs little more than a decode step"
    else:
        prefill = f"a prefill step costs {cost:.1f}x a decode step"
    where = (
        f"without caching, {len(off.prefill_steps)} prefill steps of {per_prefill * 1e3:.0f} ms "
        f"and {len(decode)} decode steps of {per_decode * 1e3:.0f} ms ({share:.0%} of the run)"
    )
    if speedup < LITTLE_SPEEDUP:
        return (
            f"why the wall time moves little: {where}; caching removes prefill work only, "
            f"and {prefill}"
        )
    return (
        f"why the wall time moves {speedup:.2f}x: {where}; caching removes prefill work, "
        f"and {prefill}"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0, or 1 if the two runs' greedy outputs differ."""
    from pagedkv.backend import load_engine
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.params import SamplingParams

    if args.num_requests < 1:
        raise InvalidRequest(f"--num-requests must be >= 1, got {args.num_requests}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    model_dir = resolve_model_dir(None)
    runs: list[BatchRun] = []
    shared = 0
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_requests)]
    for caching in (True, False):
        config = EngineConfig(enable_prefix_caching=caching)
        engine = load_engine(model_dir, config)
        prompts, shared = build_prompts(engine, args.num_requests)
        label = f"prefix caching {'on' if caching else 'off'}"
        runs.append(run_batch(engine, prompts, params, label=label, progress=not args.no_progress))
    on, off = runs
    print(f"pagedkv demo: the embedded model, greedy, max {args.max_tokens} tokens per request\n")
    for index, (question, output) in enumerate(zip(questions, on.outputs, strict=True)):
        print(f"[{index}] user: {question.splitlines()[-1]}")
        print(_indent(output.text) + "\n")
    print(report(on, off, shared))
    same = [a.token_ids for a in on.outputs] == [b.token_ids for b in off.outputs]
    print(f"identical greedy outputs with prefix caching on and off: {'yes' if same else 'NO'}")
    return 0 if same else 1
