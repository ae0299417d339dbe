"""The deadlines of accepted submissions, earliest first, kept by the engine thread."""

from __future__ import annotations

import heapq
import itertools


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
