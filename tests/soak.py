"""The server's resident memory over a long run (SRV-106): ``make soak``.

Starts ``pagedkv serve`` on the embedded model in its own process, then:

1. ``--rounds`` rounds of ``--requests`` mixed requests from ``--clients`` clients at once:
   completions and chat, streamed or not, ``n`` of 1 to 3, logprobs, prompts of 1 to about 200
   tokens, and one client in ten leaving in the middle of its stream. The server's resident
   size (``VmRSS`` of its process) is printed after each round, once the server is idle and
   has given back the memory its steps freed (SRV-137: one second after it went idle).
2. After that warm-up, ``--lengths`` distinct prompt lengths (1, 2, ... tokens), one request at a
   time, without prefix caching's help (each prompt differs from the first token): the
   resident size every 50 lengths, measured the same way.

It prints the growth SRV-106 bounds: from the end of round 3 to the end of the last round
(at most 5 MB), and over the sweep of lengths (at most 100 MB). Exit status 1 when a bound is
exceeded. Smaller loads (``--rounds 4 --requests 60``) show the shape of it in minutes.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagedkv.entrypoints.server.async_engine import IDLE_RELEASE_S

#: Bounds of SRV-106, in MB.
ROUNDS_BOUND_MB = 5.0
SWEEP_BOUND_MB = 100.0
#: The round the rounds' growth is counted from (its end).
FROM_ROUND = 3
#: Seconds waited, beyond the server's idle release delay, before its size is read: the
#: release itself takes milliseconds, but the engine thread may wait for a core here.
SETTLE_S = 1.0
WORDS = [
    *("def", "class", "return", "import", "self", "value", "list", "dict", "index", "range"),
    *("print", "yield", "lambda", "async", "await", "while", "for", "if", "else", "try"),
    *("except", "with", "open", "read", "write", "path", "node", "tree", "page", "cache"),
    *("token", "model", "layer", "batch", "step", "queue"),
]


@dataclass(frozen=True)
class SoakConfig:
    rounds: int = 10
    requests: int = 600
    clients: int = 48
    lengths: int = 600
    seed: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def resident_mb(pid: int) -> float:
    """``VmRSS`` of process ``pid``, in MB (2**20 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _body(rng: random.Random, index: int) -> tuple[str, dict[str, Any], bool]:
    """The endpoint, body and whether the client leaves mid-stream, of request ``index``."""
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    leaves = index % 10 == 5
    body: dict[str, Any] = {
        "model": "pagedkv-default",
        "max_tokens": rng.randint(1, 24) if not leaves else 64,
        "temperature": rng.choice((0.0, 0.7)),
        "n": rng.choice((1, 1, 2, 3)),
        "stream": stream or leaves,
        "seed": index,
    }
    text = _text(rng, rng.randint(1, 120))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.5:
            body["logprobs"] = True
            body["top_logprobs"] = 2
        return "/v1/chat/completions", body, leaves
    body["prompt"] = text
    if rng.random() < 0.5:
        body["logprobs"] = 2
    return "/v1/completions", body, leaves


def _send(client: httpx.Client, url: str, path: str, body: dict[str, Any], leaves: bool) -> int:
    if not body["stream"]:
        return client.post(url + path, json=body, timeout=300).status_code
    with client.stream("POST", url + path, json=body, timeout=300) as response:
        for line in response.iter_lines():
            if leaves and line.startswith("data: "):
                break  # leaves at its first event: the server must abort it
        return response.status_code


def _wait_idle(client: httpx.Client, url: str) -> None:
    """Until the server's metrics show nothing running or waiting (at most a minute)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = client.get(url + "/metrics").text
        busy = [
            line
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
            and float(line.split()[-1]) > 0
        ]
        if not busy:
            return
        time.sleep(0.1)


def settled_mb(client: httpx.Client, url: str, pid: int) -> float:
    """The server's resident size once it is idle and has released what its steps freed."""
    _wait_idle(client, url)
    time.sleep(IDLE_RELEASE_S + SETTLE_S)
    return resident_mb(pid)


def _round(url: str, config: SoakConfig, round_: int) -> int:
    rng = random.Random(config.seed * 1000 + round_)
    planned = [_body(rng, i) for i in range(config.requests)]
    with httpx.Client() as client, ThreadPoolExecutor(config.clients) as pool:
        codes = list(pool.map(lambda p: _send(client, url, *p), planned))
    return sum(code != 200 for code in codes)


def _sweep(url: str, pid: int, lengths: int) -> list[tuple[int, float]]:
    """One completion per prompt length 1..``lengths`` (token ids, each prompt starting with
    its own first token); the resident size every 50 lengths."""
    figures = []
    with httpx.Client() as client:
        for n in range(1, lengths + 1):
            prompt = [(n * 7 + 3 * i) % 4000 + 10 for i in range(n)]
            body = {"model": "pagedkv-default", "prompt": prompt, "max_tokens": 2}
            response = client.post(url + "/v1/completions", json=body, timeout=300)
            response.raise_for_status()
            if n % 50 == 0 or n == lengths:
                figures.append((n, settled_mb(client, url, pid)))
                print(f"  sweep: {n:4d} lengths   RSS {figures[-1][1]:8.1f} MB", flush=True)
    return figures


def run_soak(config: SoakConfig) -> bool:
    """Run the soak against a fresh server process; whether both bounds held."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedkv", "serve", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        print(f"server up          RSS {resident_mb(server.pid):8.1f} MB", flush=True)
        after: list[float] = []
        for r in range(1, config.rounds + 1):
            started = time.monotonic()
            failed = _round(url, config, r)
            with httpx.Client() as client:
                after.append(settled_mb(client, url, server.pid))
            grown = after[-1] - after[-2] if len(after) > 1 else 0.0
            print(
                f"round {r:2d}: {config.requests} requests, {failed} not 200, "
                f"{time.monotonic() - started:6.1f} s   RSS {after[-1]:8.1f} MB  ({grown:+.1f})",
                flush=True,
            )
        ok = True
        if config.rounds > FROM_ROUND:
            rounds_growth = after[-1] - after[FROM_ROUND - 1]
            held = rounds_growth <= ROUNDS_BOUND_MB
            ok &= held
            print(
                f"growth, end of round {FROM_ROUND} to round {config.rounds}: "
                f"{rounds_growth:+.1f} MB (bound {ROUNDS_BOUND_MB} MB) "
                f"{'held' if held else 'EXCEEDED'}",
                flush=True,
            )
        if config.lengths:
            before = after[-1] if after else resident_mb(server.pid)
            figures = _sweep(url, server.pid, config.lengths)
            sweep_growth = figures[-1][1] - before
            held = sweep_growth <= SWEEP_BOUND_MB
            ok &= held
            print(
                f"growth over {config.lengths} distinct prompt lengths: {sweep_growth:+.1f} MB "
                f"(bound {SWEEP_BOUND_MB} MB) {'held' if held else 'EXCEEDED'}",
                flush=True,
            )
        return ok
    finally:
        server.terminate()
        server.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = SoakConfig()
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--clients", type=int, default=defaults.clients)
    parser.add_argument("--lengths", type=int, default=defaults.lengths, help="0: no sweep")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    config = SoakConfig(args.rounds, args.requests, args.clients, args.lengths, args.seed)
    print(f"pid {os.getpid()}; {config}", flush=True)
    return 0 if run_soak(config) else 1


if __name__ == "__main__":
    sys.exit(main())
