"""Servers made wrong on purpose for the certify tests: a loopback proxy in front of pagedkv's
own server that forwards every request and corrupts what one ``Mutation`` says.

Each mutation is a fault a real engine could have (a page of a shared prefix lost, one token
of a response changed, usage miscounted, a stream's chunk lost, bad input answered 500); a
certify run against the proxy must fail the check that covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response

from pagedkv.entrypoints.server.http import HTTPOptions, Server

#: A body rewriter: the request body, or the response body, changed in place.
Rewrite = Callable[[dict[str, Any]], None]


class Mutation:
    """What the proxy changes; the default changes nothing (a faithful proxy)."""

    def refuse(self, path: str, body: dict[str, Any]) -> int | None:
        """A status to answer with instead of forwarding the request, or ``None``."""
        return None

    def request(self, path: str, body: dict[str, Any]) -> None:
        """Change a request body before it is forwarded."""

    def response(self, path: str, body: dict[str, Any]) -> None:
        """Change a non-streamed 200 response body before it is returned."""

    async def exchange(self, path: str, body: dict[str, Any]) -> None:
        """Change a non-streamed 200 response body, on the proxy's event loop (it may wait
        for other responses)."""
        self.response(path, body)

    def status(self, status: int) -> int:
        """The status returned for the upstream's ``status``."""
        return status

    def error(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON body returned for the upstream's non-200 JSON ``body``."""
        return body

    def stream_event(self, index: int, payload: bytes) -> bytes | None:
        """A streamed ``data:`` event (``None`` drops it)."""
        return payload

    def metrics(self, text: str) -> str:
        """The ``/metrics`` text returned for the upstream's ``text``."""
        return text


class DropSharedPage(Mutation):
    """Loses one page of a shared prefix: a prompt whose first ``page`` tokens an earlier
    prompt began with has its second page (tokens ``page`` to ``2 * page``) dropped, as an
    engine that maps a cached page wrongly would compute it."""

    def __init__(self, page: int) -> None:
        self.page = page
        self._seen: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()

    def request(self, path: str, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and len(prompt) > 2 * self.page):
            return
        head = tuple(prompt[: self.page])
        with self._lock:
            shared = head in self._seen
            self._seen.add(head)
        if shared:
            body["prompt"] = prompt[: self.page] + prompt[2 * self.page :]


class CorruptOneToken(Mutation):
    """Changes the last whole character of the first response whose text is long enough: one
    wrong token at the end, past the first token of any response."""

    def __init__(self) -> None:
        self._done = False
        self._lock = threading.Lock()

    def response(self, path: str, body: dict[str, Any]) -> None:
        choices = body.get("choices") or []
        text = choices[0].get("text", "") if choices else ""
        if len(text) < 4:
            return
        with self._lock:
            if self._done:
                return
            self._done = True
        # The last whole character (past the first token whichever response comes first); a
        # trailing incomplete UTF-8 character is left alone, as certify drops it.
        last = len(text.rstrip("\ufffd")) - 1
        replacement = "#" if text[last] != "#" else "@"
        choices[0]["text"] = text[:last] + replacement + text[last + 1 :]


class SwapTwoResponses(Mutation):
    """Gives two concurrent requests each other's text, once: the first response waits (at
    most :attr:`WAIT_S` seconds) for the next one, and they swap, as an engine that mixes up
    two sequences' rows would answer."""

    WAIT_S = 10.0

    def __init__(self) -> None:
        self._waiting: tuple[dict[str, Any], asyncio.Event] | None = None
        self._done = False

    async def exchange(self, path: str, body: dict[str, Any]) -> None:
        if self._done or not body.get("choices"):
            return
        if self._waiting is None:
            partner_arrived = asyncio.Event()
            self._waiting = (body, partner_arrived)
            try:
                await asyncio.wait_for(partner_arrived.wait(), self.WAIT_S)
            except TimeoutError:
                self._waiting = None
            return
        other, partner_arrived = self._waiting
        self._done = True
        mine, theirs = body["choices"][0], other["choices"][0]
        mine["text"], theirs["text"] = theirs["text"], mine["text"]
        partner_arrived.set()


class MiscountUsage(Mutation):
    """Reports one completion token too many."""

    def response(self, path: str, body: dict[str, Any]) -> None:
        usage = body.get("usage")
        if isinstance(usage, dict):
            usage["completion_tokens"] += 1
            usage["total_tokens"] += 1


class DropStreamChunk(Mutation):
    """Loses the second event of every stream."""

    def stream_event(self, index: int, payload: bytes) -> bytes | None:
        return None if index == 1 else payload


class RefuseStreams(Mutation):
    """A server without streaming: ``stream: true`` is answered 400 (a capability it lacks,
    which certify must report as skipped, not passed)."""

    def request(self, path: str, body: dict[str, Any]) -> None:
        if body.get("stream"):
            body["best_of"] = -1  # a request pagedkv's server answers 400


class IgnoreCacheSalt(Mutation):
    """Drops ``cache_salt``: every tenant shares one prefix cache."""

    def request(self, path: str, body: dict[str, Any]) -> None:
        body.pop("cache_salt", None)


class ClaimEveryPromptCached(Mutation):
    """Reports every prompt token as cached, seen before or not."""

    def response(self, path: str, body: dict[str, Any]) -> None:
        usage = body.get("usage")
        if isinstance(usage, dict):
            usage["prompt_tokens_details"] = {"cached_tokens": usage["prompt_tokens"]}


class DropField(Mutation):
    """Drops one field from every request: a server that ignores it."""

    def __init__(self, field: str) -> None:
        self.field = field

    def request(self, path: str, body: dict[str, Any]) -> None:
        body.pop(self.field, None)


class LeakKVOnStreams(Mutation):
    """Once a stream was forwarded, reports half the KV cache more in use than the upstream:
    a server whose streamed requests never give their pages back."""

    def __init__(self) -> None:
        self._streamed = False

    def request(self, path: str, body: dict[str, Any]) -> None:
        self._streamed = self._streamed or bool(body.get("stream"))

    def metrics(self, text: str) -> str:
        return _more_kv_in_use(text) if self._streamed else text


class BrokenAfterStreams(Mutation):
    """Answers 503 to every request after a stream was forwarded: a server that a client
    going away leaves unable to serve."""

    def __init__(self) -> None:
        self._streamed = False

    def refuse(self, path: str, body: dict[str, Any]) -> int | None:
        if body.get("stream"):
            self._streamed = True
            return None
        return 503 if self._streamed else None


class ShiftLogprobs(Mutation):
    """Adds 0.01 nats to one log-probability of each response (its last)."""

    def response(self, path: str, body: dict[str, Any]) -> None:
        for choice in body.get("choices") or []:
            logprobs = choice.get("logprobs") or {}
            values = logprobs.get("token_logprobs")
            if values:
                values[-1] += 0.01
            content = logprobs.get("content")
            if content:
                content[-1]["logprob"] += 0.01


class ServerErrorOnBadInput(Mutation):
    """Answers 500 where the server answered 400 or 422."""

    def status(self, status: int) -> int:
        return 500 if status in (400, 422) else status


class BareErrorBody(Mutation):
    """Answers errors with FastAPI's default body, ``{"detail": ...}``, not OpenAI's."""

    def error(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"detail": json.dumps(body)}


class DropErrorParam(Mutation):
    """Answers errors without naming the field: ``param`` is ``null``."""

    def error(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if isinstance(body.get("error"), dict):
            body["error"]["param"] = None
        return body


class ServeAnyModel(Mutation):
    """Answers a request naming any model as if it named none: a server that never checks
    the model it is asked for."""

    def request(self, path: str, body: dict[str, Any]) -> None:
        body.pop("model", None)


class ReverseChoices(Mutation):
    """Returns the choices of a request of several prompts in reverse order, each keeping
    its ``index``'s text swapped: an engine that mixes up which prompt a row belongs to."""

    def response(self, path: str, body: dict[str, Any]) -> None:
        choices = body.get("choices") or []
        texts = [c.get("text") for c in choices]
        if len(choices) > 1 and isinstance(body.get("usage"), dict):
            for choice, text in zip(choices, reversed(texts), strict=True):
                choice["text"] = text


class ShiftTokenize(Mutation):
    """Answers ``/tokenize`` with its first token id one higher."""

    def response(self, path: str, body: dict[str, Any]) -> None:
        if path == "tokenize" and body.get("tokens"):
            body["tokens"][0] += 1


class RefuseUnknownFields(Mutation):
    """Answers 400 to a body with a field the OpenAI API does not declare (certify's own)."""

    def refuse(self, path: str, body: dict[str, Any]) -> int | None:
        return 400 if any(key.startswith("x_certify") for key in body) else None


class DropDone(Mutation):
    """Ends every stream without its ``data: [DONE]``."""

    def stream_event(self, index: int, payload: bytes) -> bytes | None:
        return None if payload.strip() == b"data: [DONE]" else payload


class FailBesidePoison(Mutation):
    """An engine whose whole step fails for one request's sampling value (a temperature below
    1e-30): the next greedy request after it is answered 500, and every completion answered
    is held until it was seen (at most 10 s) and then comes back wrong, as a neighbour
    sharing its step would. Either way a neighbour is hurt, whatever order the
    check's concurrent requests reach the proxy in."""

    def __init__(self) -> None:
        self._poisoned = False
        self._seen: asyncio.Event | None = None
        self._lock = threading.Lock()

    def _event(self) -> asyncio.Event:
        if self._seen is None:  # made on the proxy's event loop, where every hook runs
            self._seen = asyncio.Event()
        return self._seen

    def refuse(self, path: str, body: dict[str, Any]) -> int | None:
        temperature = body.get("temperature")
        with self._lock:
            if isinstance(temperature, float) and 0 < temperature < 1e-30:
                self._poisoned = True
                self._event().set()
                return None
            if self._poisoned and temperature == 0:
                self._poisoned = False
                return 500
        return None

    async def exchange(self, path: str, body: dict[str, Any]) -> None:
        seen = self._event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.wait(), 10)
        for choice in body.get("choices", []):
            if isinstance(choice, dict) and isinstance(choice.get("text"), str):
                choice["text"] += " (from a failed step)"


class LeakKVOnLongRequests(Mutation):
    """Once a non-streamed request of 128 tokens or more was forwarded, reports half the KV
    cache more in use than the upstream: a server whose abandoned requests keep their pages."""

    def __init__(self) -> None:
        self._long = False

    def request(self, path: str, body: dict[str, Any]) -> None:
        max_tokens = body.get("max_tokens")
        if not body.get("stream") and isinstance(max_tokens, int) and max_tokens >= 128:
            self._long = True

    def metrics(self, text: str) -> str:
        return _more_kv_in_use(text) if self._long else text


def _more_kv_in_use(text: str) -> str:
    """``text`` with ``vllm:kv_cache_usage_perc`` half the cache higher."""
    lines = []
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "vllm:kv_cache_usage_perc" or name.startswith("vllm:kv_cache_usage_perc{"):
            line = f"{name} {float(value) + 0.5}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def proxy_app(upstream: str, mutation: Mutation) -> FastAPI:
    """A FastAPI app forwarding every POST (``/v1/...`` and vLLM's ``/tokenize`` beside it),
    ``/v1/models``, ``/metrics`` and ``/health`` to ``upstream`` (a base URL without ``/v1``);
    mutations see paths without ``v1/``."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.get(f"{upstream}/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.get(f"{upstream}/metrics")
        return Response(mutation.metrics(answer.text), answer.status_code, media_type="text/plain")

    @app.get("/health")
    async def health() -> Response:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.get(f"{upstream}/health")
        return Response(answer.content, answer.status_code)

    @app.post("/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        name = path.removeprefix("v1/")
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict):
            refused = mutation.refuse(name, body)
            if refused is not None:
                return Response(b'{"error": "refused"}', refused, media_type="application/json")
            mutation.request(name, body)
            raw = json.dumps(body).encode()
        async with httpx.AsyncClient(timeout=120) as client:
            if isinstance(body, dict) and body.get("stream"):
                return await _forward_stream(client, f"{upstream}/{path}", raw, mutation)
            answer = await client.post(
                f"{upstream}/{path}", content=raw, headers={"Content-Type": "application/json"}
            )
        content = answer.content
        if answer.status_code == 200:
            decoded = json.loads(content)
            await mutation.exchange(name, decoded)
            content = json.dumps(decoded).encode()
        else:
            try:
                error = json.loads(content)
            except ValueError:
                error = None
            if isinstance(error, dict):
                content = json.dumps(mutation.error(name, error)).encode()
        return Response(content, mutation.status(answer.status_code), media_type="application/json")

    return app


async def _forward_stream(
    client: httpx.AsyncClient, url: str, raw: bytes, mutation: Mutation
) -> Response:
    """The whole upstream stream, read then returned with the mutation's events."""
    answer = await client.post(url, content=raw, headers={"Content-Type": "application/json"})
    events = [e for e in answer.content.split(b"\n\n") if e.startswith(b"data: ")]
    kept = [mutation.stream_event(i, e) for i, e in enumerate(events)]
    body = b"".join(e + b"\n\n" for e in kept if e is not None)
    return Response(body, mutation.status(answer.status_code), media_type="text/event-stream")


@contextmanager
def proxy(upstream: str, mutation: Mutation) -> Iterator[str]:
    """A proxy on a free loopback port until the block ends; yields its ``/v1`` base URL."""
    server = Server(proxy_app(upstream, mutation), HTTPOptions(port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "the proxy thread ended"
        assert time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
