"""Full consistency check of a KVManager's bookkeeping (KVM-031), given what it reads.

The check reads the page pool, the prefix index, the in-flight tracker and the live sequences
through :class:`KVBookkeeping`, a view of the parts the reference manager is built from, so it
stands below the manager rather than beside it.

O(pages + sequences): meant for tests and debugging, never for the per-step path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

from pagedkv.errors import InvariantViolation
from pagedkv.kv.in_flight import InFlightPages
from pagedkv.kv.page_pool import PagePool
from pagedkv.kv.prefix_index import PrefixLookup


class SequenceBookkeeping(Protocol):
    """What the check reads of one live sequence."""

    @property
    def pages(self) -> Sequence[int]:
        """Physical pages, by logical page."""
        ...

    @property
    def num_tokens(self) -> int:
        """Token positions reserved."""
        ...

    @property
    def num_committed_pages(self) -> int:
        """Leading pages already hit or published."""
        ...


class KVBookkeeping(Protocol):
    """What the check reads of a manager: its parts and its live sequences."""

    @property
    def pool(self) -> PagePool:
        """Reference counts, the free list and the LRU of cached pages."""
        ...

    @property
    def index(self) -> PrefixLookup:
        """The prefix entries of published full pages."""
        ...

    @property
    def in_flight(self) -> InFlightPages:
        """The live sequences' prompt pages not committed yet."""
        ...

    @property
    def sequences(self) -> Mapping[int, SequenceBookkeeping]:
        """Live sequences by id."""
        ...

    @property
    def page_size(self) -> int:
        """Token positions per page."""
        ...

    @property
    def num_pages(self) -> int:
        """Physical pages in the pool."""
        ...


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)


def check_manager_invariants(manager: KVBookkeeping) -> None:
    """Raise :class:`InvariantViolation` naming the first broken invariant."""
    pool, index, size = manager.pool, manager.index, manager.page_size
    free, cached = pool.free_pages(), pool.cached_pages()
    free_set, cached_set = set(free), set(cached)

    # KVM-011: free list and LRU hold each page once, and no page is in both.
    _require(len(free_set) == len(free), "a page is on the free list twice")
    _require(not free_set & cached_set, "a page is both free and cached")

    # KVM-015: reference counts equal holders, who all hold a page at the same logical page
    # (shared pages come from prefix hits or forks, both of which keep the position).
    holders: Counter[int] = Counter()
    logical: dict[int, int] = {}
    for seq_id, state in manager.sequences.items():
        for position, page in enumerate(state.pages):
            _require(
                logical.setdefault(page, position) == position,
                f"page {page} is logical page {logical[page]} of one sequence and {position} "
                f"of sequence {seq_id}",
            )
        _require(
            len(set(state.pages)) == len(state.pages),
            f"sequence {seq_id} holds a page twice",
        )
        _require(
            len(state.pages) == -(-state.num_tokens // size),
            f"sequence {seq_id} holds {len(state.pages)} pages for {state.num_tokens} tokens",
        )
        _require(
            state.num_committed_pages <= state.num_tokens // size,
            f"sequence {seq_id} committed a page that is not full",
        )
        holders.update(state.pages)
    in_use = 0
    for page in range(manager.num_pages):
        ref = pool.ref_count(page)
        _require(
            ref == holders[page], f"page {page} has ref count {ref} but {holders[page]} holders"
        )
        if ref > 0:
            in_use += 1
            _require(page not in free_set, f"page {page} is in use and on the free list")
            _require(page not in cached_set, f"page {page} is in use and cached")
        if page in cached_set:
            _require(index.entry_of(page) is not None, f"cached page {page} has no prefix entry")
        if page in free_set:
            _require(index.entry_of(page) is None, f"free page {page} keeps a prefix entry")

    # KVM-010: the three states cover the pool.
    _require(in_use == pool.num_in_use, f"in-use count {pool.num_in_use} != {in_use}")
    total = in_use + len(free) + len(cached)
    _require(total == manager.num_pages, f"in use + free + cached = {total} != {manager.num_pages}")

    # KVM-036: the in-flight tracker counts exactly the live sequences' uncommitted pages.
    for problem in manager.in_flight.check(manager.sequences):
        _require(False, problem)

    # KVM-020: entries describe full pages and map both ways.
    for entry in index.entries():
        _require(index.entry_of(entry.page) is entry, f"entry of page {entry.page} is not mapped")
        _require(len(entry.token_ids) == size, f"entry of page {entry.page} is not a full page")
