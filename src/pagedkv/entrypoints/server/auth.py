"""API keys and tenants: Bearer authentication, and a prefix-cache salt per key.

With API keys configured, every request but ``GET /health`` must carry ``Authorization: Bearer
KEY`` with one of them, else it is answered 401 (vLLM's ``--api-key``; pagedkv also guards
``/metrics``, ``/tokenize`` and the schema, which vLLM leaves open). Keys are compared through
their SHA-256 digests with :func:`hmac.compare_digest`, every key every time, so the time taken
says nothing about how much of a key was right.

Under per-key salting each key is a tenant: the requests it authenticates get a cache salt
derived from the key (combined with any ``cache_salt`` they give), so no two keys ever share a
KV page, and neither ``cached_tokens`` nor time to first token can tell one tenant what another
has sent.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.entrypoints.server.errors import APIError
from pagedkv.errors import InvalidRequest

#: Paths answered without a key (load balancers probe them).
OPEN_PATHS = frozenset({"/health"})
#: Where the middleware leaves the tenant of an authenticated request in ``scope["state"]``.
_TENANT = "pagedkv_tenant"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeyAuth:
    """ASGI middleware answering 401 to a request without one of ``keys``; see the module
    docstring. With ``tenant_per_key``, records the key's tenant for :func:`cache_salt`."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], *, tenant_per_key: bool) -> None:
        if not keys or any(not key for key in keys):
            raise InvalidRequest("API keys must be non-empty strings, and at least one given")
        self.app = app
        self._digests = tuple(_digest(key) for key in keys)
        self._tenant_per_key = tenant_per_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        digest = self._presented(Headers(scope=scope))
        if digest is None:
            error = APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        if self._tenant_per_key:
            scope.setdefault("state", {})[_TENANT] = digest.hex()
        await self.app(scope, receive, send)

    def _presented(self, headers: Headers) -> bytes | None:
        """The digest of the valid key the request presents, else ``None``."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = _digest(token.strip())
        match = False
        for digest in self._digests:  # no early exit: time does not depend on which key
            match |= hmac.compare_digest(presented, digest)
        return presented if match else None


def cache_salt(request: Request, requested: str | None) -> str | None:
    """The prefix-cache salt of a request: its own ``cache_salt``, prefixed by its tenant's
    (a fixed-length hex digest, so the two parts cannot run into each other) under per-key
    salting."""
    tenant = request.scope.get("state", {}).get(_TENANT)
    if tenant is None:
        return requested
    return f"{tenant}:{requested or ''}"
