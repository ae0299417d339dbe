"""The deadlines of accepted submissions, earliest first, kept by the engine thread."""

from __future__ import annotations

import heapq
import itertools

#: Entries of submissions whose requests all ended kept at most, beyond twice the requests
#: still waiting for their deadline, before the heap is rebuilt without them.
SLACK = 8


class Deadlines:
    """Deadlines of submissions, earliest first (engine thread only).

    A request that ends before its deadline is forgotten (:meth:`forget`): it is never
    returned by :meth:`due`, and the heap entries of submissions whose requests all ended are
    dropped once they outnumber the rest (all of them once no request waits for its deadline),
    so what is kept is bounded by the requests still unfinished (SRV-138), not by how many a
    long-running server accepted within a timeout.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, tuple[str, ...]]] = []
        self._order = itertools.count()
        #: Request ids still waiting for their deadline, each with its entry's order (an id
        #: used again by a later submission belongs to the later entry only).
        self._pending: dict[str, int] = {}

    def add(self, deadline: float, request_ids: tuple[str, ...]) -> None:
        """Remember that ``request_ids`` must end by ``deadline`` (``time.monotonic`` seconds)."""
        order = next(self._order)
        heapq.heappush(self._heap, (deadline, order, request_ids))
        self._pending.update(dict.fromkeys(request_ids, order))

    def forget(self, request_id: str) -> None:
        """``request_id`` ended before its deadline (or has none); unknown ids are ignored."""
        self._pending.pop(request_id, None)
        if not self._pending:
            self._heap.clear()
        elif len(self._heap) > 2 * len(self._pending) + SLACK:
            self._heap = [e for e in self._heap if self._holds_pending(e[1], e[2])]
            heapq.heapify(self._heap)

    def _holds_pending(self, order: int, request_ids: tuple[str, ...]) -> bool:
        return any(self._pending.get(request_id) == order for request_id in request_ids)

    def due(self, now: float) -> list[str]:
        """Forget and return the request ids not forgotten whose deadline is ``now`` or
        earlier."""
        expired: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            _, order, request_ids = heapq.heappop(self._heap)
            for request_id in request_ids:
                if self._pending.get(request_id) == order:
                    del self._pending[request_id]
                    expired.append(request_id)
        return expired

    def __len__(self) -> int:
        """Submissions' entries kept (some may hold only requests already forgotten)."""
        return len(self._heap)
