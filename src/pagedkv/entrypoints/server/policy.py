"""What the server lets in: who may call it, how large a body, how many prompts, how deep a
queue, and how long a request may take.

The app consults one :class:`ServerPolicy`. Each check answers a decision value,
:class:`Admitted` or :class:`Refused`; a refusal carries the typed error that answers it
(:mod:`pagedkv.entrypoints.server.errors` gives each its status):

- **API keys.** With keys configured, every request but ``GET /health`` must carry
  ``Authorization: Bearer KEY`` with one of them, else it is refused with
  :class:`Unauthenticated` (401; vLLM's ``--api-key``; pagedkv also guards ``/metrics``,
  ``/tokenize`` and the schema, which vLLM leaves open).
- **Tenants.** Under per-key salting each key is a tenant: the requests it authenticates get a
  cache salt derived from the key (combined with any ``cache_salt`` they give), so no two keys
  ever share a KV page, and neither ``cached_tokens`` nor time to first token can tell one
  tenant what another has sent. Per-key salting is the default with several keys (SRV-073);
  the operator shares the prefix cache between keys only on purpose.
- **Metrics.** With keys or a metrics key configured, ``GET /metrics`` (other tenants' prompt
  lengths, timings and repeats) takes only the metrics key: a tenant's key is refused with
  :class:`Forbidden` (403), no key with :class:`Unauthenticated`; the metrics key opens nothing
  else (SRV-074).
- **Bodies.** A body larger than ``max_body_bytes`` is refused with :class:`BodyTooLarge` (413).
- **Admission** (:class:`~pagedkv.entrypoints.server.admission.AdmissionLimits`): too many
  prompts in one request, :class:`TooManyPrompts` (400); a queue of waiting requests that would
  grow past its limit, :class:`QueueFull` (429 with ``Retry-After``).
- **Deadlines.** A request unfinished ``request_timeout_s`` seconds after it was accepted ends
  with :class:`DeadlineExceeded` (504) and is aborted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.entrypoints.server.admission import AdmissionLimits
from pagedkv.entrypoints.server.api_keys import ApiKeys
from pagedkv.errors import InvalidRequest, PagedKVError

#: Paths answered without a key (load balancers probe them).
OPEN_PATHS = frozenset({"/health"})
#: The path only the metrics key opens, once any key is configured.
METRICS_PATH = "/metrics"


class Unauthenticated(PagedKVError):
    """The request presents none of the configured API keys (401)."""


class Forbidden(PagedKVError):
    """The request presents a valid key that this path does not take: a tenant's key on
    ``/metrics`` (403)."""


class BodyTooLarge(PagedKVError):
    """The request's body exceeds the server's bound (413).

    Attributes:
        max_body_bytes: the bound, bytes.
    """

    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(f"request body exceeds the limit of {max_body_bytes} bytes")
        self.max_body_bytes = max_body_bytes


class TooManyPrompts(InvalidRequest):
    """A request carries more prompts than one request may (answered 400: it never fits)."""


class QueueFull(PagedKVError):
    """Accepting a request now would queue more waiting requests than the limit (429).

    Attributes:
        retry_after_s: seconds the client should wait before retrying.
    """

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(PagedKVError):
    """A request was still unfinished at its deadline; it was aborted and its pages freed."""


#: Why a request was refused.
Refusal = Unauthenticated | Forbidden | BodyTooLarge | TooManyPrompts | QueueFull


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request may go on.

    Attributes:
        tenant: the tenant its API key makes it under per-key salting (a hex digest), else
            ``None``.
    """

    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """The request goes no further and is answered with ``reason``."""

    reason: Refusal


#: What a check decides.
Decision = Admitted | Refused

#: The decision of every check that lets a request on without a tenant.
ADMITTED = Admitted()


@dataclass(frozen=True, slots=True)
class ServerPolicy:
    """Every rule the server admits requests by; see the module docstring.

    Attributes:
        max_body_bytes: the largest request body accepted, bytes; at least 1.
        limits: prompts per request, waiting requests, request deadline.
        api_keys: the keys a request must present; ``None`` for no authentication.
        tenant_per_key: give each API key its own prefix-cache namespace; needs ``api_keys``.
        metrics_key: the one key ``/metrics`` takes (``None``: with ``api_keys``, ``/metrics``
            is closed to every key; without, open to all).
    """

    max_body_bytes: int
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    api_keys: ApiKeys | None = None
    tenant_per_key: bool = False
    metrics_key: ApiKeys | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise InvalidRequest(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.tenant_per_key and self.api_keys is None:
            raise InvalidRequest("cache_salt_per_api_key needs at least one API key")

    def authenticate(self, path: str, authorization: str) -> Decision:
        """Whether a request for ``path`` with this ``Authorization`` header value (``""``
        when absent) may go on, and under which tenant."""
        if path == METRICS_PATH:
            return self._authenticate_metrics(authorization)
        if self.api_keys is None or path in OPEN_PATHS:
            return ADMITTED
        digest = self.api_keys.presented(authorization)
        if digest is None:
            return Refused(
                Unauthenticated("invalid or missing API key: send 'Authorization: Bearer KEY'")
            )
        return Admitted(digest.hex() if self.tenant_per_key else None)

    def _authenticate_metrics(self, authorization: str) -> Decision:
        """``/metrics``: open without any key configured; else the metrics key alone."""
        if self.api_keys is None and self.metrics_key is None:
            return ADMITTED
        if self.metrics_key is not None and self.metrics_key.presented(authorization):
            return ADMITTED
        if self.api_keys is not None and self.api_keys.presented(authorization):
            return Refused(
                Forbidden(
                    "/metrics shows every tenant's traffic: it takes only the metrics key "
                    "(pagedkv serve --metrics-api-key), not a tenant's API key"
                )
            )
        return Refused(
            Unauthenticated("invalid or missing metrics key: send 'Authorization: Bearer KEY'")
        )

    def admit_body(self, size: int) -> Decision:
        """Whether a body of ``size`` bytes (declared, or read so far) may be read on."""
        if size > self.max_body_bytes:
            return Refused(BodyTooLarge(self.max_body_bytes))
        return ADMITTED

    def admit_prompts(self, count: int) -> Decision:
        """Whether one request may carry ``count`` prompts."""
        limit = self.limits.max_prompts_per_request
        if count > limit:
            return Refused(
                TooManyPrompts(
                    f"the request has {count} prompts; at most {limit} are accepted in one request"
                )
            )
        return ADMITTED

    def admit_queue(self, waiting: int, count: int) -> Decision:
        """Whether ``count`` more requests may join the ``waiting`` ones now."""
        limit = self.limits.max_waiting_requests
        if waiting + count > limit:
            message = (
                f"the server is busy: {waiting} requests are waiting and the limit is {limit}; "
                "retry later"
            )
            return Refused(QueueFull(message, self.limits.retry_after_s))
        return ADMITTED

    def deadline(self, accepted_at: float) -> float | None:
        """When a submission accepted at ``accepted_at`` must have ended (both
        ``time.monotonic`` seconds), ``None`` for never."""
        timeout = self.limits.request_timeout_s
        return None if timeout is None else accepted_at + timeout

    def expired(self) -> DeadlineExceeded:
        """The error that ends a submission at its deadline."""
        timeout = self.limits.request_timeout_s
        return DeadlineExceeded(f"the request did not finish within {timeout} seconds")

    def cache_salt(self, tenant: str | None, requested: str | None) -> str | None:
        """The prefix-cache salt of a request: its own ``cache_salt``, prefixed by its
        tenant's (a fixed-length hex digest, so the two parts cannot run into each other)."""
        if tenant is None:
            return requested
        return f"{tenant}:{requested or ''}"
