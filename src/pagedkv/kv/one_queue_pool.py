"""A page pool keeping every unheld page, cached or free, in one least-recently-released queue.

The reference :class:`~pagedkv.kv.page_pool.PagePool` takes free pages before it evicts a
cached one (KVM-024). vLLM's v1 block pool keeps one ``free_block_queue`` instead: a freed
page joins its tail whether it keeps a prefix entry or not, and a fresh page is the queue's
head, evicted if it is cached. A cached page may then be evicted while an uncached free page
exists, which is the declared departure ``eviction=one-queue``; hits stay correct. This pool
lets the reference run that way, so the conformance suite can be shown to follow the
declaration.

Every operation stays O(1) per page: the queue and the set of cached pages are
``OrderedDict`` s (the free list is what the queue holds beyond the cached pages).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from pagedkv.kv.page_pool import PagePool


class OneQueuePagePool(PagePool):
    """Unheld pages in one queue, least recently released first; the head is taken next."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self._free.clear()  # the queue holds the free pages too
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))

    @property
    def num_free(self) -> int:
        """Unheld pages without a prefix entry."""
        return len(self._queue) - len(self._cached)

    def free_pages(self) -> list[int]:
        """The unheld pages without a prefix entry, in queue order (for checks and tests)."""
        return [page for page in self._queue if page not in self._cached]

    def cached_pages(self) -> list[int]:
        """The unheld pages with a prefix entry, in queue order (for checks and tests)."""
        return [page for page in self._queue if page in self._cached]

    def take_fresh(self, count: int, evict: Callable[[int], None]) -> list[int]:
        """Take the queue's ``count`` first pages, evicting those that are cached.

        Precondition (checked by the caller): ``count <= num_free + num_cached``.
        """
        taken: list[int] = []
        for _ in range(count):
            page, _ = self._queue.popitem(last=False)
            if page in self._cached:
                del self._cached[page]
                evict(page)
            self._ref_counts[page] = 1
            self._num_in_use += 1
            taken.append(page)
        return taken

    def hold(self, page: int) -> None:
        """Add a holder to an in-use or cached page (a prefix hit), taking it off the queue."""
        if self._ref_counts[page] == 0:
            del self._queue[page]
        super().hold(page)

    def release(self, pages: Iterable[int], is_cacheable: Callable[[int], bool]) -> None:
        """Drop one holder from each page, in the order given; a page whose last holder leaves
        joins the queue's tail, cached if ``is_cacheable(page)``."""
        for page in pages:
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._num_in_use -= 1
                self._queue[page] = None
                if is_cacheable(page):
                    self._cached[page] = None

    def uncache_all(self) -> list[int]:
        """Forget which pages are cached; every page keeps its place in the queue."""
        pages = list(self._cached)
        self._cached.clear()
        return pages
