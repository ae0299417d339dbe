"""ASGI middleware bounding the size of request bodies."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.entrypoints.server.errors import error_response


class BodySizeLimit:
    """Reject a request whose body exceeds ``max_body_bytes`` with 413, before any handler
    runs, whether the size is declared (``Content-Length``) or only seen while reading.

    The accepted body is buffered (at most ``max_body_bytes``) and replayed to the app; later
    ``receive`` calls go to the server, so handlers still see a client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._reject(scope, receive, send)
            return
        body = bytearray()
        first: Message | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # a disconnect: let the app see it
                break
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay: Message = first or {"type": "http.request", "body": bytes(body), "more_body": False}
        replayed = False

        async def replay_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return replay
            return await receive()

        await self.app(scope, replay_receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"request body exceeds the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
