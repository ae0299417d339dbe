"""Many clients against the real server while faults are injected (SRV-025).

The server runs the hash stand-in model behind two faults: a runner that raises after a random
1 step in 50 (``FaultyRunner``), and poisoned requests that no step can run (every step holding
one raises, ``PoisonedRunner``). Some clients disconnect in the middle of their stream, or
before their plain response is ready. Every request asks for logprobs, so the model has no
tokenizer and each token comes back as ``token_id:N``: outputs are compared token for token.

The oracle is independent of the engine: the runner records which requests each call held, so
:func:`pagedkv.testing.faults.out_of_tries` says which requests were in three failed steps in a
row (the engine's retry bound) and so must fail; every other request must finish with exactly
the tokens a fault-free engine gives it.

Then the engine alone (``tests/engine_chaos.py``, ENG-179): 600 requests, one never runnable,
2% of steps failing at random; the figure that must be 0 is the innocent requests failed.

``tests/test_server_faults.py`` runs a bounded load; ``make chaos`` a larger one
(``python tests/chaos.py --help``), printing the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from engine_chaos import run_engine_chaos
from stall import MODELS, run_stall, summary

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.entrypoints.server.async_engine import AsyncEngine
from pagedkv.entrypoints.server.http import HTTPOptions, Server
from pagedkv.interfaces import Engine
from pagedkv.testing.faults import FaultyRunner, PoisonedRunner, TracingHashRunner, out_of_tries

VOCAB = 256
#: A request is known by its first two prompt tokens (unique per request).
KEY_LEN = 2
#: The tokens after the key that mark a poisoned request.
POISON = (250, 251, 252)
MODEL = "chaos"
#: Tokens a disconnecting client asks for: it is still generating when the client goes.
LONG_MAX_TOKENS = 200

Disconnect = Literal["", "mid-stream", "before-response"]


@dataclass(frozen=True)
class ChaosConfig:
    """The load and the faults.

    Attributes:
        requests: requests sent, each with one prompt.
        concurrency: clients sending at once.
        fault_rate: probability that a step raises at random.
        poison_every: one request in this many is poisoned (0: none).
        disconnect_every: one request in this many disconnects (0: none), in the middle of
            its stream or before its plain response, alternately.
        seed: seeds the requests and the faults.
        engine: the engine's budgets.
    """

    requests: int = 300
    concurrency: int = 32
    fault_rate: float = 0.02
    poison_every: int = 50
    disconnect_every: int = 10
    seed: int = 0
    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(
            page_size=4,
            num_pages=1024,
            max_num_batched_tokens=1024,
            max_num_seqs=32,
            max_model_len=256,
        )
    )


@dataclass(frozen=True)
class Planned:
    """One request of the load."""

    index: int
    prompt: tuple[int, ...]
    params: SamplingParams
    stream: bool
    poisoned: bool
    disconnect: Disconnect

    @property
    def key(self) -> tuple[int, ...]:
        return self.prompt[:KEY_LEN]

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": list(self.prompt),
            "max_tokens": self.params.max_tokens,
            "temperature": self.params.temperature,
            "logprobs": 0,
            "stream": self.stream,
        }
        if self.params.seed is not None:
            body["seed"] = self.params.seed
        return body


@dataclass(frozen=True)
class Outcome:
    """What a client saw: its tokens, or the error code that ended it, or nothing (it left)."""

    tokens: tuple[int, ...] | None = None
    error: str | None = None
    left: bool = False


@dataclass(frozen=True)
class ChaosReport:
    """The figures of one run; :attr:`ok` when every must-be-zero figure is zero."""

    requests_sent: int
    faults_injected: int
    random_faults: int
    poisoned: int
    disconnected: int
    failed: int
    failed_poisoned: int
    failed_wrongly: int
    finished_wrongly: int
    wrong_outputs: int
    pages_in_use_after: int
    failed_steps_reported: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not (
            self.failed_wrongly
            or self.finished_wrongly
            or self.wrong_outputs
            or self.pages_in_use_after
            or self.failed_steps_reported != self.faults_injected
        )

    def lines(self) -> list[str]:
        poisoned_faults = self.faults_injected - self.random_faults
        return [
            f"requests sent                              {self.requests_sent}",
            f"faults injected (steps that raised)        {self.faults_injected}",
            f"  at random                                {self.random_faults}",
            f"  holding a poisoned request               {poisoned_faults}",
            f"poisoned requests                          {self.poisoned}",
            f"clients that disconnected                  {self.disconnected}",
            f"requests failed                            {self.failed}",
            f"  poisoned                                 {self.failed_poisoned}",
            f"  alone in 3 failed steps, not poisoned    {self.failed - self.failed_poisoned}",
            f"requests failed that should not have been  {self.failed_wrongly}  (must be 0)",
            f"requests out of tries that did not fail    {self.finished_wrongly}  (must be 0)",
            f"outputs unlike a fault-free run            {self.wrong_outputs}  (must be 0)",
            f"KV pages in use after                      {self.pages_in_use_after}  (must be 0)",
            f"failed steps the engine reported           {self.failed_steps_reported}",
            f"wall time                                  {self.seconds:.1f} s",
        ]


def plan(config: ChaosConfig) -> list[Planned]:
    """The requests of the load, reproducible from ``config.seed``."""
    rng = random.Random(config.seed)
    planned = []
    for i in range(config.requests):
        key = divmod(i, VOCAB)
        poisoned = bool(config.poison_every) and i % config.poison_every == config.poison_every // 2
        disconnect: Disconnect = ""
        if config.disconnect_every and i % config.disconnect_every == 0 and not poisoned:
            disconnect = "mid-stream" if (i // config.disconnect_every) % 2 else "before-response"
        body = POISON if poisoned else tuple(rng.randrange(VOCAB - 8) for _ in range(3))
        tail = tuple(rng.randrange(VOCAB - 8) for _ in range(rng.randint(1, 12)))
        max_tokens = LONG_MAX_TOKENS if disconnect else rng.randint(2, 16)
        temperature = rng.choice((0.0, 0.8))
        seed = i if temperature else None
        planned.append(
            Planned(
                index=i,
                prompt=(*key, *body, *tail),
                params=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
                # A client leaving before its response sends a plain request: a stream of
                # events less than its 0.05 s read timeout apart would be read whole.
                stream=disconnect == "mid-stream"
                or (rng.random() < 0.5 and disconnect != "before-response"),
                poisoned=poisoned,
                disconnect=disconnect,
            )
        )
    return planned


def expected_tokens(config: ChaosConfig, requests: list[Planned]) -> dict[int, tuple[int, ...]]:
    """What a fault-free engine gives each request that is neither poisoned nor leaving."""
    kept = [r for r in requests if not r.poisoned and not r.disconnect]
    runner = TracingHashRunner(VOCAB, config.engine.num_pages, config.engine.page_size)
    engine = reference_backend().create_engine(runner, config.engine)
    outputs = run_to_completion(engine, [r.prompt for r in kept], [r.params for r in kept])
    return {r.index: tuple(o.token_ids) for r, o in zip(kept, outputs, strict=True)}


@contextmanager
def serving(engine: Engine) -> Iterator[tuple[str, AsyncEngine]]:
    """The app over ``engine``, served on a free loopback port until the block ends."""
    app = create_app(engine, MODEL, config=ServerConfig(log_stats_interval_s=None))
    server = Server(app, HTTPOptions(port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app.state.server.engine
    finally:
        server.should_exit = True
        thread.join(30)


def _token_ids(logprobs: dict[str, Any] | None) -> list[int]:
    tokens = (logprobs or {}).get("tokens") or []
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _answer(response: httpx.Response) -> Outcome:
    body = response.json()
    if response.status_code != 200:
        return Outcome(error=str(body["error"]["code"]))
    return Outcome(tokens=tuple(_token_ids(body["choices"][0]["logprobs"])))


def send(url: str, request: Planned) -> Outcome:
    """Send one request as its client would, and say what it saw."""
    endpoint = f"{url}/v1/completions"
    if request.disconnect == "before-response":
        try:
            response = httpx.post(endpoint, json=request.body(), timeout=0.05)
        except httpx.TimeoutException:
            return Outcome(left=True)
        return _answer(response)
    if not request.stream:
        return _answer(httpx.post(endpoint, json=request.body(), timeout=120))
    tokens: list[int] = []
    with httpx.stream("POST", endpoint, json=request.body(), timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return Outcome(error=str(event["error"]["code"]))
            if request.disconnect:
                return Outcome(left=True)  # leaves at its first event
            tokens.extend(_token_ids(event["choices"][0].get("logprobs")))
    return Outcome(tokens=tuple(tokens))


def wait_idle(bridge: AsyncEngine, timeout: float = 60.0) -> int:
    """Wait until nothing runs or waits; the pages then in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = bridge.stats()
        if stats.running == stats.waiting == stats.pages_in_use == 0:
            break
        time.sleep(0.02)
    return bridge.stats().pages_in_use


def run_chaos(config: ChaosConfig) -> ChaosReport:
    """Run the load against a fresh server; the figures."""
    requests = plan(config)
    expected = expected_tokens(config, requests)
    inner = PoisonedRunner(
        VOCAB,
        config.engine.num_pages,
        config.engine.page_size,
        poison=POISON,
        poison_at=KEY_LEN,
        kind="raise",
        key_len=KEY_LEN,
    )
    runner = FaultyRunner(inner, rate=config.fault_rate, seed=config.seed)
    engine = reference_backend().create_engine(runner, config.engine)
    # a warning per failed request and step, and per write to a client that left, otherwise
    quiet = [logging.getLogger(name) for name in ("pagedkv.server", "asyncio")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    start = time.perf_counter()
    try:
        with serving(engine) as (url, bridge), ThreadPoolExecutor(config.concurrency) as pool:
            outcomes = list(pool.map(lambda r: send(url, r), requests))
            pages = wait_idle(bridge)
            failed_steps = bridge.stats().failed_steps
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    seconds = time.perf_counter() - start
    engine.check_invariants()
    faults = set(runner.faults) | set(inner.raised)
    must_fail = out_of_tries(inner.keys, faults, config.engine.max_step_retries)
    failed = [r for r, o in zip(requests, outcomes, strict=True) if o.error is not None]
    seen = [(r, o) for r, o in zip(requests, outcomes, strict=True) if not o.left]
    return ChaosReport(
        requests_sent=len(requests),
        faults_injected=len(faults),
        random_faults=len(runner.faults),
        poisoned=sum(r.poisoned for r in requests),
        disconnected=sum(o.left for o in outcomes),
        failed=len(failed),
        failed_poisoned=sum(r.poisoned for r in failed),
        failed_wrongly=sum(
            o.error != "request_failed" or r.key not in must_fail
            for r, o in seen
            if o.error is not None
        ),
        finished_wrongly=sum(o.error is None and r.key in must_fail for r, o in seen),
        wrong_outputs=sum(
            o.tokens != expected[r.index]
            for r, o in seen
            if o.error is None and r.index in expected
        ),
        pages_in_use_after=pages,
        failed_steps_reported=failed_steps,
        seconds=seconds,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    defaults = ChaosConfig()
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fault-rate", type=float, default=defaults.fault_rate)
    parser.add_argument("--poison-every", type=int, default=defaults.poison_every)
    parser.add_argument("--disconnect-every", type=int, default=defaults.disconnect_every)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--engine-requests", type=int, default=600)
    parser.add_argument(
        "--stall-rounds",
        type=int,
        default=3,
        help="big-body stall measurements of each kind and model (SRV-117)",
    )
    parser.add_argument(
        "--stall-model",
        action="append",
        choices=MODELS,
        help="model served for the stall measurement, repeatable (default: both)",
    )
    args = parser.parse_args(argv)
    engine = EngineConfig(
        page_size=4,
        num_pages=4096,
        max_num_batched_tokens=2048,
        max_num_seqs=args.concurrency,
        max_model_len=256,
    )
    config = ChaosConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        fault_rate=args.fault_rate,
        poison_every=args.poison_every,
        disconnect_every=args.disconnect_every,
        seed=args.seed,
        engine=engine,
    )
    print(
        f"chaos: {config.requests} requests from {config.concurrency} clients at once; a step "
        f"raises at random with probability {config.fault_rate:g}; 1 request in "
        f"{config.poison_every or 'no'} is poisoned, 1 in {config.disconnect_every or 'no'} "
        "disconnects"
    )
    report = run_chaos(config)
    print("\n".join(report.lines()))
    print(
        f"engine chaos: {args.engine_requests} requests, 1 never runnable, a step raises at "
        f"random with probability {config.fault_rate:g}"
    )
    engine_report = run_engine_chaos(args.engine_requests, config.fault_rate, config.seed)
    print("\n".join(engine_report.lines()))
    models = (args.stall_model or MODELS) if args.stall_rounds > 0 else ()
    stalls = [report for model in models for report in run_stall(args.stall_rounds, model=model)]
    for line in [stall.line() for stall in stalls] + summary(stalls):
        print(line)
    ok = report.ok and engine_report.ok and all(s.ok for s in stalls if s.bounded)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
