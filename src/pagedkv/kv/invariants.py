"""Full consistency check of a :class:`ReferenceKVManager`'s bookkeeping (KVM-031).

O(pages + sequences): meant for tests and debugging, never for the per-step path.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedkv.errors import InvariantViolation

if TYPE_CHECKING:
    from pagedkv.kv.manager import ReferenceKVManager


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)


def check_manager_invariants(manager: ReferenceKVManager) -> None:
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
