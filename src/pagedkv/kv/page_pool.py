"""Physical pages: reference counts, the free list and the LRU of cached pages.

A page is in exactly one of three states (KVM-011):

* in use: its reference count is positive;
* cached: unheld, but it keeps a published prefix entry; it sits in the LRU until it is hit
  again or evicted;
* free: unheld and holding nothing reusable; it sits on the free list.

Every operation is O(1) per page (KVM-041): the free list is a deque and the LRU an
``OrderedDict``, so a hit can pull a page from the middle of the LRU in O(1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from pagedkv.errors import InvalidRequest


class PagePool:
    """Owns the state of each physical page; knows nothing of sequences or token ids."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise InvalidRequest(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        # Least recently used first. Values unused: an OrderedDict is an O(1) linked set.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._num_in_use = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unheld pages that keep a prefix entry."""
        return len(self._cached)

    @property
    def num_in_use(self) -> int:
        """Pages held by at least one sequence."""
        return self._num_in_use

    def ref_count(self, page: int) -> int:
        """Holders of ``page``."""
        if not 0 <= page < self.num_pages:
            raise InvalidRequest(f"page {page} outside the pool of {self.num_pages} pages")
        return self._ref_counts[page]

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` is unheld and waiting in the LRU."""
        return page in self._cached

    def free_pages(self) -> list[int]:
        """The free list, next to be taken first (for checks and tests)."""
        return list(self._free)

    def cached_pages(self) -> list[int]:
        """The LRU, next to be evicted first (for checks and tests)."""
        return list(self._cached)

    # -- transitions -----------------------------------------------------------------------

    def take_fresh(self, count: int, evict: Callable[[int], None]) -> list[int]:
        """Take ``count`` pages for one holder: free pages first, then LRU-evicted ones.

        ``evict(page)`` is called for each evicted page so its prefix entry can be dropped.
        Precondition (checked by the caller, so failure changes nothing):
        ``count <= num_free + num_cached``.
        """
        taken: list[int] = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                evict(page)
            self._ref_counts[page] = 1
            self._num_in_use += 1
            taken.append(page)
        return taken

    def hold(self, page: int) -> None:
        """Add a holder to an in-use or cached page (a prefix hit)."""
        if self._ref_counts[page] == 0:
            del self._cached[page]  # KeyError here would mean a hit on a free page: a bug
            self._num_in_use += 1
        self._ref_counts[page] += 1

    def release(self, pages: Iterable[int], is_cacheable: Callable[[int], bool]) -> None:
        """Drop one holder from each page, in the order given.

        A page whose last holder leaves goes to the LRU's most-recent end if
        ``is_cacheable(page)``, else to the free list. Callers pass a sequence's pages tail
        first so that, within a chain, the tail is evicted before its parent (KVM-023).
        """
        for page in pages:
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._num_in_use -= 1
                if is_cacheable(page):
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def uncache_all(self) -> list[int]:
        """Move every cached page to the free list; returns them."""
        pages = list(self._cached)
        self._cached.clear()
        self._free.extend(pages)
        return pages
