"""The ASGI middleware that holds every request to the :class:`ServerPolicy` before any
handler runs: its API key first (before any of the body is read), then its body's size."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.entrypoints.server.errors import api_error
from pagedkv.entrypoints.server.policy import Refused, ServerPolicy

#: Where the gate leaves the tenant of an authenticated request in ``scope["state"]``.
_TENANT = "pagedkv_tenant"


def tenant(request: Request) -> str | None:
    """The tenant the policy admitted ``request`` under (per-key salting), else ``None``."""
    found = request.scope.get("state", {}).get(_TENANT)
    return found if isinstance(found, str) else None


class PolicyGate:
    """Answer a request the policy refuses (401 without a valid key, 413 for a body over the
    bound, whether declared by ``Content-Length`` or only seen while reading) before any
    handler runs.

    The accepted body is buffered (at most ``policy.max_body_bytes``) and replayed to the app;
    later ``receive`` calls go to the server, so handlers still see a client's disconnect.
    """

    def __init__(self, app: ASGIApp, policy: ServerPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        decision = self.policy.authenticate(scope["path"], headers.get("authorization", ""))
        if isinstance(decision, Refused):
            await _refuse(decision, scope, receive, send)
            return
        if decision.tenant is not None:
            scope.setdefault("state", {})[_TENANT] = decision.tenant
        declared = _content_length(scope)
        if declared is not None:
            size = self.policy.admit_body(declared)
            if isinstance(size, Refused):
                await _refuse(size, scope, receive, send)
                return
        body = bytearray()
        first: Message | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # a disconnect: let the app see it
                break
            body += message.get("body", b"")
            size = self.policy.admit_body(len(body))
            if isinstance(size, Refused):
                await _refuse(size, scope, receive, send)
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


async def _refuse(decision: Refused, scope: Scope, receive: Receive, send: Send) -> None:
    await api_error(decision.reason).response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
