"""The HTTP client of a certify run: the server is a black box behind its OpenAI API."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from pagedkv.certify.errors import ServerUnreachable

#: Seconds a single request may take before the run gives up on it (CRT-004).
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Answer:
    """A server's answer to one request.

    Attributes:
        status: the HTTP status code.
        body: the decoded JSON body, or ``None`` when it is not JSON.
        text: the raw body text (for reports).
    """

    status: int
    body: Any
    text: str


@dataclass(frozen=True, slots=True)
class Streamed:
    """A server's streamed answer to one request.

    Attributes:
        status: the HTTP status code.
        events: the decoded ``data:`` events before ``[DONE]`` (empty on an error status).
        done: whether the stream ended with ``data: [DONE]``.
    """

    status: int
    events: list[Any]
    done: bool


class ServerClient:
    """Requests to an OpenAI-compatible server at ``base_url`` (ending in ``/v1``).

    Thread-safe: each call opens its own connection, so checks may send concurrently.
    """

    def __init__(self, base_url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def post(self, path: str, body: dict[str, Any]) -> Answer:
        """POST ``body`` as JSON to ``path`` (relative to the base URL).

        Raises:
            ServerUnreachable: no answer within the timeout.
        """
        try:
            response = httpx.post(f"{self.base_url}{path}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"POST {self.base_url}{path}: {exc}") from exc
        return _answer(response)

    def post_raw(self, path: str, content: bytes) -> Answer:
        """POST bytes as ``application/json`` as they are (for malformed bodies)."""
        try:
            response = httpx.post(
                f"{self.base_url}{path}",
                content=content,
                headers={"Content-Type": "application/json"},
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"POST {self.base_url}{path}: {exc}") from exc
        return _answer(response)

    def stream(self, path: str, body: dict[str, Any]) -> Streamed:
        """POST ``body`` with ``stream: true``: the decoded ``data:`` events before
        ``[DONE]`` (none on an error status) and whether ``[DONE]`` came."""
        events: list[Any] = []
        try:
            with httpx.stream(
                "POST", f"{self.base_url}{path}", json=body, timeout=self.timeout_s
            ) as response:
                if response.status_code != 200:
                    response.read()
                    return Streamed(response.status_code, events, False)
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: ") :]
                    if payload == "[DONE]":
                        return Streamed(response.status_code, events, True)
                    events.append(json.loads(payload))
                return Streamed(response.status_code, events, False)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"POST {self.base_url}{path} (stream): {exc}") from exc

    def post_and_leave(self, path: str, body: dict[str, Any], after_s: float) -> bool:
        """POST ``body`` and go away if no answer came ``after_s`` seconds after it was sent (a
        client that gives up on a non-streamed response); ``True`` if it left before the
        answer. Connecting and sending have the client's whole timeout, so a request that
        never reached the server does not count as left."""
        timeout = httpx.Timeout(self.timeout_s, read=after_s)  # only the wait for the answer
        try:
            httpx.post(f"{self.base_url}{path}", json=body, timeout=timeout)
        except httpx.ReadTimeout:
            return True
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"POST {self.base_url}{path}: {exc}") from exc
        return False

    def post_root(self, path: str, body: dict[str, Any]) -> Answer:
        """POST ``body`` to ``path`` beside ``/v1`` (``/tokenize``, as vLLM serves it)."""
        root = self.base_url.removesuffix("/v1")
        try:
            response = httpx.post(f"{root}{path}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"POST {root}{path}: {exc}") from exc
        return _answer(response)

    def get(self, path: str, *, root: bool = False) -> Answer:
        """GET ``path`` under the base URL, or beside ``/v1`` when ``root`` (``/health``)."""
        base = self.base_url.removesuffix("/v1") if root else self.base_url
        try:
            response = httpx.get(f"{base}{path}", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"GET {base}{path}: {exc}") from exc
        return _answer(response)

    def open_stream_and_leave(self, path: str, body: dict[str, Any]) -> int:
        """POST ``body`` with ``stream: true``, read the first event, then close the
        connection mid-stream (a client that goes away); returns the status."""
        try:
            with httpx.stream(
                "POST", f"{self.base_url}{path}", json=body, timeout=self.timeout_s
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        break
                return response.status_code
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"POST {self.base_url}{path} (stream): {exc}") from exc

    def metrics(self) -> str | None:
        """The Prometheus text of ``/metrics`` (next to ``/v1``), or ``None`` without one."""
        root = self.base_url.removesuffix("/v1")
        try:
            response = httpx.get(f"{root}/metrics", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"GET {root}/metrics: {exc}") from exc
        return response.text if response.status_code == 200 else None

    def first_model(self) -> str:
        """The first model ``GET /models`` lists.

        Raises:
            ServerUnreachable: no answer, or no model listed.
        """
        try:
            response = httpx.get(f"{self.base_url}/models", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"GET {self.base_url}/models: {exc}") from exc
        answer = _answer(response)
        try:
            return str(answer.body["data"][0]["id"])
        except (TypeError, KeyError, IndexError) as exc:
            raise ServerUnreachable(
                f"GET {self.base_url}/models listed no model: {answer.text[:200]}"
            ) from exc


def _answer(response: httpx.Response) -> Answer:
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    return Answer(response.status_code, body, response.text)
