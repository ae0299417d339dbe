"""Admission control: how much work the server accepts, and how long a request may take.

The limits keep one client from making everyone else wait: a request with more prompts than
:attr:`AdmissionLimits.max_prompts_per_request` can never be accepted (400); one that would
push the engine's queue of waiting requests past :attr:`AdmissionLimits.max_waiting_requests`
is refused for now (429 with ``Retry-After``). A request still unfinished
:attr:`AdmissionLimits.request_timeout_s` seconds after it was accepted is aborted.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from pagedkv.errors import InvalidRequest, PagedKVError

#: Default most prompts one completions request may carry.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
#: Default most requests (prompts) waiting for the engine to schedule them.
DEFAULT_MAX_WAITING_REQUESTS = 256
#: Seconds a refused client is told to wait before retrying (``Retry-After``).
DEFAULT_RETRY_AFTER_S = 1


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

    def check_prompts(self, num_prompts: int) -> None:
        """Raise :class:`TooManyPrompts` if one request carries more prompts than allowed."""
        if num_prompts > self.max_prompts_per_request:
            raise TooManyPrompts(
                f"the request has {num_prompts} prompts; at most "
                f"{self.max_prompts_per_request} are accepted in one request"
            )

    def check_queue(self, waiting: int, num_prompts: int) -> None:
        """Raise :class:`QueueFull` if ``num_prompts`` more requests on top of ``waiting``
        would exceed the queue limit."""
        if waiting + num_prompts > self.max_waiting_requests:
            raise QueueFull(
                f"the server is busy: {waiting} requests are waiting and the limit is "
                f"{self.max_waiting_requests}; retry later",
                self.retry_after_s,
            )


class Deadlines:
    """Deadlines of submissions, earliest first (engine thread only).

    Entries are never removed early: a submission that finished before its deadline is simply
    found finished when the deadline comes.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, tuple[str, ...]]] = []
        self._order = itertools.count()

    def add(self, deadline: float, request_ids: tuple[str, ...]) -> None:
        """Remember that ``request_ids`` must end by ``deadline`` (``time.monotonic`` seconds)."""
        heapq.heappush(self._heap, (deadline, next(self._order), request_ids))

    def due(self, now: float) -> list[str]:
        """Forget and return the request ids whose deadline is ``now`` or earlier."""
        expired: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            expired.extend(heapq.heappop(self._heap)[2])
        return expired
