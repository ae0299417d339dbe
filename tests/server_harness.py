"""Running the real server in tests, and reading what it answers.

:func:`running` starts :class:`pagedkv.entrypoints.server.http.Server` (uvicorn with pagedkv's read
deadlines and graceful shutdown) on a free loopback port in a background thread.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from fastapi import FastAPI

from pagedkv.engine.outputs import EngineStats, StepReport
from pagedkv.entrypoints.server.async_engine import AsyncEngine
from pagedkv.entrypoints.server.http import HTTPOptions, Server


@dataclass(frozen=True)
class Running:
    """A server running in a background thread."""

    url: str
    port: int
    server: Server
    thread: threading.Thread
    bridge: AsyncEngine


@contextmanager
def running(app: FastAPI, options: HTTPOptions | None = None) -> Iterator[Running]:
    """Serve ``app`` on 127.0.0.1 (any free port) until the block ends."""
    options = options or HTTPOptions(port=0, log_level="warning")
    server = Server(app, options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "the server thread ended"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Running(f"http://127.0.0.1:{port}", port, server, thread, app.state.server.engine)
    finally:
        server.should_exit = True
        thread.join(30)


class StepGate:
    """A step observer that can hold the engine thread: once armed with :meth:`hold_after`,
    the step that many steps later does not return (so its outputs reach no client) until
    :meth:`release`, or :data:`HOLD_LIMIT_S` seconds. Lets a test act while a request is
    certainly still in flight, however slowly its client runs."""

    HOLD_LIMIT_S = 30.0

    def __init__(self) -> None:
        self._released = threading.Event()
        self._released.set()
        self._steps_left: int | None = None
        self.held = threading.Event()

    def __call__(self, report: StepReport) -> None:
        if self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left == 0:
            self._steps_left = None
            self.held.set()
            self._released.wait(self.HOLD_LIMIT_S)

    def hold_after(self, steps: int) -> None:
        """Hold the engine in the ``steps``-th step from now (1: the next one)."""
        self._released.clear()
        self.held.clear()
        self._steps_left = steps

    def release(self) -> None:
        self._steps_left = None
        self._released.set()


def wait_idle(bridge: AsyncEngine, timeout: float = 20.0) -> EngineStats:
    """Poll until nothing runs or waits and no page is in use; the final stats."""
    deadline = time.monotonic() + timeout
    stats = bridge.stats()
    while time.monotonic() < deadline:
        stats = bridge.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.pages_in_use == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"the engine did not become idle: {stats}")


def sse_events(lines: Iterator[str]) -> list[str]:
    """The ``data:`` payloads of an event stream, ``[DONE]`` included."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def sse_payloads(body: bytes) -> list[str]:
    """The ``data:`` payloads of a whole event stream, split only where the SSE format splits
    (generated text may hold characters that ``str.splitlines`` takes for line breaks)."""
    events = body.decode("utf-8").split("\n\n")
    return [e[len("data: ") :] for e in events if e.startswith("data: ")]


class HTTPResponse(Protocol):
    """What the checks read of an httpx or test-client response."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def error_of(response: HTTPResponse, status: int) -> dict[str, Any]:
    """The OpenAI error object of a ``status`` response (SRV-010)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_prometheus(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """``(types, samples)``: family name → type, and ``name{labels}`` → value; every line must
    be a comment or a well-formed sample of a declared family."""
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line.startswith("# HELP ") or not line:
            continue
        else:
            match = METRIC_LINE.match(line)
            assert match, f"not a Prometheus sample: {line!r}"
            name = match.group(1)
            family = re.sub(r"_(bucket|sum|count|total|created)$", "", name)
            assert name in types or family in types, f"{name} has no # TYPE"
            samples[name + (match.group(2) or "")] = float(match.group(3))
    return types, samples


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with exactly ``labels`` (0 if there is none)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    _, samples = parse_prometheus(text)
    for key, value in samples.items():
        sample_name, _, rest = key.partition("{")
        found = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample_name == name and found == wanted:
            return value
    return 0.0


def post_json(url: str, body: Any, **headers: str) -> httpx.Response:
    """POST ``body`` as ASCII JSON: lone surrogates travel as ``\\ud800`` escapes, as any JSON
    client may send them."""
    return httpx.post(
        url,
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        timeout=60,
    )
