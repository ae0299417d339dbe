"""Admission limits: how much work the server accepts, and how long a request may take.

The limits keep one client from making everyone else wait: a request with more prompts than
:attr:`AdmissionLimits.max_prompts_per_request` can never be accepted (400); one that would
push the engine's queue of waiting requests past :attr:`AdmissionLimits.max_waiting_requests`
is refused for now (429 with ``Retry-After``). A request still unfinished
:attr:`AdmissionLimits.request_timeout_s` seconds after it was accepted is aborted. The
decisions are taken by :class:`~pagedkv.entrypoints.server.policy.ServerPolicy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import InvalidRequest

#: Default most prompts one completions request may carry.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
#: Default most requests (prompts) waiting for the engine to schedule them.
DEFAULT_MAX_WAITING_REQUESTS = 256
#: Seconds a refused client is told to wait before retrying (``Retry-After``).
DEFAULT_RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The server's admission limits (``pagedkv serve`` flags of the same names).

    Attributes:
        max_prompts_per_request: most prompts in one request; at least 1 and at most
            ``max_waiting_requests`` (a larger request could never be queued).
        max_waiting_requests: most requests the engine may hold waiting (not yet scheduled)
            once a new request is added; at least 1.
        request_timeout_s: seconds from acceptance to the end of a request, after which it is
            aborted; ``None`` for no deadline.
        retry_after_s: the ``Retry-After`` seconds of a refusal; at least 1.
    """

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    request_timeout_s: float | None = None
    retry_after_s: int = DEFAULT_RETRY_AFTER_S

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise InvalidRequest(
                f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}"
            )
        if not 1 <= self.max_prompts_per_request <= self.max_waiting_requests:
            raise InvalidRequest(
                f"max_prompts_per_request must be in [1, max_waiting_requests = "
                f"{self.max_waiting_requests}], got {self.max_prompts_per_request}"
            )
        timeout = self.request_timeout_s
        if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
            raise InvalidRequest(f"request_timeout_s must be > 0, got {timeout}")
        if self.retry_after_s < 1:
            raise InvalidRequest(f"retry_after_s must be >= 1, got {self.retry_after_s}")
