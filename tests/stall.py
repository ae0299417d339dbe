"""How long big request bodies can stall a running stream (SRV-115, ``make chaos``).

One stream of the embedded model (its real byte-level BPE tokenizer) generates
:data:`STREAM_TOKENS` tokens; its largest gap between two events is measured alone, then while
:data:`BIG_BODIES` ``/tokenize`` bodies of :data:`BIG_CHARS` characters and one completion whose
prompt has one character more arrive (each is tokenized or refused). A server that tokenizes on
its engine thread stops every stream for the time those bodies take; one that tokenizes apart
from it keeps the stream's pace.

The figures are wall-clock times on a shared machine, so they are compared within one run: the
stream alone and the stream under the bodies, on the same server, one after the other.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import multiprocessing
import random
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.entrypoints.server.async_engine import AsyncEngine
from pagedkv.entrypoints.server.http import HTTPOptions, Server
from pagedkv.entrypoints.server.startup_heap import freeze_startup_heap

MODEL = "stall"
#: Tokens the measured stream generates.
STREAM_TOKENS = 200
#: Big bodies sent to ``/tokenize`` at once while the stream runs.
BIG_BODIES = 3
#: Characters of each big text: its JSON body stays under the server's 1 MiB limit.
BIG_CHARS = 1_000_000
#: Events of the stream before the big bodies are sent (the stream is well under way).
EVENTS_BEFORE = 20
#: Largest gap (seconds) accepted whatever the stream's gap alone. On a shared 2-core machine
#: the scheduler alone stretches a 15 ms gap past twice: at a load average of 16 the stream
#: gapped 130 ms alone and 713 ms while the four bodies were refused. The stall this catches,
#: tokenization on the engine thread, was 3.4-12 s (12 s at a load of 12-17). Refusing the four
#: bodies takes the event loop about 4 ms of CPU each (receiving and parsing 1 MB of JSON), under
#: the interpreter's lock wherever it runs: parsed on another thread, or not parsed at all, the
#: gap under the bodies was no shorter (SRV-117's rationale has the figures), so no floor of a
#: few times the gap alone would hold.
STALL_FLOOR_S = 1.5


@dataclass(frozen=True)
class StallReport:
    """The stream's largest gaps between events (seconds) and what the big bodies got.

    Attributes:
        alone_s: largest gap of the stream alone.
        loaded_s: largest gap of the stream while the big bodies arrived.
        statuses: HTTP status of each big body (``/tokenize`` ones first, then the completion).
        bodies_s: seconds from sending the first big body to the last one's answer.
        bounded: the server refused texts by their size (SRV-116); without it, every body is
            tokenized in full.
        model: the served model (one of :data:`MODELS`).
    """

    alone_s: float
    loaded_s: float
    statuses: tuple[int, ...]
    bodies_s: float
    bounded: bool = True
    model: str = "embedded"

    @property
    def ratio(self) -> float:
        return self.loaded_s / self.alone_s

    @property
    def ok(self) -> bool:
        """The stream kept its pace: under twice its gap alone, or under the floor."""
        return self.loaded_s < max(2 * self.alone_s, STALL_FLOOR_S)

    def line(self) -> str:
        under = "under" if self.ratio < 2 else "NOT under"
        return (
            f"stall ({self.model}): a stream's largest gap between events "
            f"{self.alone_s * 1000:.0f} ms alone, "
            f"{self.loaded_s * 1000:.0f} ms ({self.ratio:.2f}x, {under} 2x) while {BIG_BODIES} "
            f"/tokenize bodies of {BIG_CHARS:,} characters and a completion of {BIG_CHARS + 1:,} "
            "arrived "
            f"{'' if self.bounded else 'with no size bound, so all tokenized '}"
            f"(answered {', '.join(map(str, self.statuses))} within {self.bodies_s:.2f} s)"
        )


def big_text(chars: int, seed: int = 0) -> str:
    """``chars`` characters of Python-like source (what the default model's tokenizer knows),
    varied so no cache of any kind makes it cheap."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "for", "in", "range", "if", "else", "x", "y"]
    parts: list[str] = []
    size = 0
    while size < chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        line = f"{line} {rng.randint(0, 10**6)}\n"
        parts.append(line)
        size += len(line)
    return "".join(parts)[:chars]


def stream_gaps(
    client: httpx.Client, url: str, started: threading.Event | None = None
) -> list[float]:
    """The gaps (seconds) between the events of one streamed greedy completion of
    :data:`STREAM_TOKENS` tokens; ``started`` is set after :data:`EVENTS_BEFORE` events."""
    body = {
        "model": MODEL,
        "prompt": "def add(a, b):",
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            times.append(time.perf_counter())
            if started is not None and len(times) == EVENTS_BEFORE:
                started.set()
    return [b - a for a, b in itertools.pairwise(times[1:])]  # after the first token's step


def big_bodies() -> list[tuple[str, bytes]]:
    """``(path, JSON body)`` of the big requests, encoded once in advance."""
    bodies = [
        ("/tokenize", json.dumps({"model": MODEL, "prompt": big_text(BIG_CHARS, seed)}).encode())
        for seed in range(BIG_BODIES)
    ]
    long_prompt = big_text(BIG_CHARS + 1, seed=BIG_BODIES)
    completion = {"model": MODEL, "prompt": long_prompt, "max_tokens": 1}
    bodies.append(("/v1/completions", json.dumps(completion).encode()))
    return bodies


def measure(url: str, bounded: bool = True, model: str = "embedded") -> StallReport:
    """The stream alone, then the stream while the big bodies arrive (see the module);
    ``bounded``: whether the server refuses texts by their size (reported only).

    The clients (one per request, connected in advance) and the bodies are made before the
    measurement: a client made per request spends tens of milliseconds of this process's CPU
    (and GIL) on its TLS context, which would be counted as the server's stall.
    """
    bodies = big_bodies()
    clients = [httpx.Client(timeout=120) for _ in range(len(bodies) + 1)]
    try:
        for client in clients:  # connect each, so that no request pays for it
            client.get(f"{url}/health")
        stream_gaps(clients[0], url)  # warm-up: first steps of a fresh server are slower
        alone = max(stream_gaps(clients[0], url))
        started = threading.Event()
        with ThreadPoolExecutor(len(bodies) + 1) as pool:
            gaps = pool.submit(stream_gaps, clients[0], url, started)
            if not started.wait(60):
                raise RuntimeError("the stream did not start")
            begun = time.perf_counter()
            headers = {"Content-Type": "application/json"}
            answers = [
                pool.submit(client.post, url + path, content=content, headers=headers)
                for client, (path, content) in zip(clients[1:], bodies, strict=True)
            ]
            statuses = tuple(a.result().status_code for a in answers)
            bodies_s = time.perf_counter() - begun
            loaded = max(gaps.result())
    finally:
        for client in clients:
            client.close()
    return StallReport(alone, loaded, statuses, bodies_s, bounded, model)


#: The served models the measurement knows: the embedded one, and one with Qwen3-0.6B's layers
#: (random weights, bfloat16) whose vocabulary is the embedded tokenizer's, so that every token
#: it generates has a text and each step sends an event.
MODELS = ("embedded", "qwen3-0.6b-shape")


def _model_dir(model: str) -> Path | None:
    """The checkpoint of ``model`` (one of :data:`MODELS`); ``None``: the embedded model."""
    if model == "embedded":
        return None
    from pagedkv.assets import default_model_dir
    from pagedkv.bench.checkpoints import Qwen3Shape, qwen3_shaped_checkpoint

    vocab = json.loads((default_model_dir() / "config.json").read_text())["vocab_size"]
    cache = Path.home() / ".cache" / "pagedkv" / "bench"
    path = qwen3_shaped_checkpoint(cache, Qwen3Shape(vocab=vocab)).path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (path / name).is_file():
            shutil.copy(default_model_dir() / name, path / name)
    return path


@contextmanager
def serving(model: str = "embedded") -> Iterator[tuple[str, AsyncEngine]]:
    """The app over ``model`` (see :data:`MODELS`; the embedded tokenizer in both), on a free
    loopback port, and its bridge to the engine. Built as ``pagedkv serve`` builds it: the
    start-up heap frozen once the app exists (SRV-140), given back to the collector after."""
    dtype = "float32" if model == "embedded" else "bfloat16"
    engine = reference_backend().load_engine(
        _model_dir(model),
        EngineConfig(num_pages=256, page_size=16, max_model_len=1024),
        dtype=dtype,
    )
    app = create_app(engine, MODEL, config=ServerConfig(log_stats_interval_s=None))
    freeze_startup_heap()
    server = Server(app, HTTPOptions(port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", app.state.server.engine
    finally:
        server.should_exit = True
        thread.join(30)
        gc.unfreeze()


def run_stall(
    rounds: int = 1, *, unbounded: bool = True, model: str = "embedded"
) -> list[StallReport]:
    """``rounds`` measurements with the size bound, then with ``unbounded`` as many with it
    lifted (every body tokenized in full, to show the tokenization itself holds up no
    stream), on ``model`` (see :data:`MODELS`).

    The clients run in a process of their own, as a server's clients do: in the server's
    process their threads would share its interpreter lock, and the measurement would count
    the clients' own work (reading the stream, sending 4 MB) as the server's stall.
    """
    reports = []
    spawn = multiprocessing.get_context("spawn")
    with (
        serving(model) as (url, bridge),
        ProcessPoolExecutor(max_workers=1, mp_context=spawn) as clients,
    ):
        for _ in range(rounds):
            reports.append(clients.submit(measure, url, model=model).result())
        if not unbounded:
            return reports
        bound = bridge.text.max_text_bytes
        bridge.text.max_text_bytes = None
        try:
            for _ in range(rounds):
                reports.append(clients.submit(measure, url, bounded=False, model=model).result())
        finally:
            bridge.text.max_text_bytes = bound
    return reports


def summary(reports: list[StallReport]) -> list[str]:
    """One line per model and kind of round (bounded or not): the median ratio, and in how
    many rounds the gap stayed under twice its value alone."""
    lines = []
    for model in dict.fromkeys(r.model for r in reports):
        for bounded in (True, False):
            kind = [r for r in reports if r.model == model and r.bounded is bounded]
            if not kind:
                continue
            under = sum(r.ratio < 2 for r in kind)
            what = "refused by size" if bounded else "tokenized in full"
            lines.append(
                f"stall ({model}, {what}): median {statistics.median(r.ratio for r in kind):.2f}x "
                f"over {len(kind)} round{'s' if len(kind) != 1 else ''}, under 2x in {under}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=1, help="measurements of each kind")
    parser.add_argument("--model", choices=MODELS, default="embedded", help="the served model")
    args = parser.parse_args(argv)
    reports = run_stall(args.rounds, model=args.model)
    for line in [report.line() for report in reports] + summary(reports):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
