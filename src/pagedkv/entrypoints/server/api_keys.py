"""The API keys a request may present, compared in constant time.

Keys are kept and compared as SHA-256 digests with :func:`hmac.compare_digest`, every key every
time, so the time taken says nothing about how much of a key was right, nor which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from pagedkv.errors import InvalidRequest


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The SHA-256 digests of the accepted keys (never the keys themselves).

    Attributes:
        digests: one 32-byte digest per key, at least one.
    """

    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, keys: tuple[str, ...]) -> ApiKeys:
        """The digests of ``keys``.

        Raises:
            InvalidRequest: no key, or an empty one.
        """
        if not keys or any(not key for key in keys):
            raise InvalidRequest("API keys must be non-empty strings, and at least one given")
        return cls(tuple(_digest(key) for key in keys))

    def presented(self, authorization: str) -> bytes | None:
        """The digest of the valid key an ``Authorization`` header value (``Bearer KEY``)
        presents, else ``None``."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = _digest(token.strip())
        match = False
        for digest in self.digests:  # no early exit: time does not depend on which key
            match |= hmac.compare_digest(presented, digest)
        return presented if match else None
