"""Correct KVManagers whose choice in a room of the spec (KVM-050) differs from the reference's.

They must pass the suite when they declare their choice, and fail when they declare another:
the oracle follows the declaration, never one implementation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagedkv.errors import StaleMatch
from pagedkv.interfaces import Allocation, KVManagerConfig, KVStats, PrefixMatch
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.kv.one_queue_pool import OneQueuePagePool
from pagedkv.kv.prefix_index import PrefixEntry, PrefixIndex
from pagedkv.kv.radix_index import RadixPrefixIndex

#: (salt, every token id from the start of the prompt to the end of the page)
_Key = tuple[str | None, tuple[int, ...]]


def _whole_prefix(entry: PrefixEntry) -> tuple[int, ...]:
    """Every token of ``entry``'s chain, its own page last (parents stay reachable even once
    evicted: an entry keeps a reference to its parent)."""
    parts: list[tuple[int, ...]] = []
    node: PrefixEntry | None = entry
    while node is not None:
        parts.append(node.token_ids)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


class WholePrefixIndex:
    """A prefix index keyed by the whole token prefix and the salt, as a dict.

    A hit is verified by construction (the key is the whole prefix), and an entry whose parent
    was evicted is found again once the parent's tokens are published again: its K/V are still
    those of that prefix. That is the ``reattach`` choice of KVM-050.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._by_key: dict[_Key, PrefixEntry] = {}
        self._by_page: list[PrefixEntry | None] = [None] * num_pages

    def __len__(self) -> int:
        return len(self._by_key)

    def entry_of(self, page: int) -> PrefixEntry | None:
        return self._by_page[page]

    def entries(self) -> list[PrefixEntry]:
        return list(self._by_key.values())

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_pages: int
    ) -> list[PrefixEntry]:
        size = self.page_size
        chain: list[PrefixEntry] = []
        for i in range(min(max_pages, len(token_ids) // size)):
            entry = self._by_key.get((salt, tuple(token_ids[: (i + 1) * size])))
            if entry is None:
                break
            chain.append(entry)
        return chain

    def publish(
        self, page: int, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: str | None
    ) -> PrefixEntry | None:
        prefix = () if parent is None else _whole_prefix(parent)
        key = (salt, prefix + token_ids)
        existing = self._by_key.get(key)
        if existing is not None:
            return existing
        entry = PrefixEntry(
            key=hash(key), page=page, token_ids=token_ids, cache_salt=salt, parent=parent
        )
        self._by_key[key] = entry
        self._by_page[page] = entry
        return entry

    def remove_page(self, page: int) -> None:
        entry = self._by_page[page]
        if entry is None:
            return
        self._by_page[page] = None
        del self._by_key[(entry.cache_salt, _whole_prefix(entry))]

    def clear(self) -> None:
        self._by_key.clear()
        self._by_page = [None] * len(self._by_page)


class ReattachingKVManager(ReferenceKVManager):
    """The reference KVManager over :class:`WholePrefixIndex` (``orphans = reattach``)."""

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config, index=WholePrefixIndex(config.num_pages, config.page_size))


class RadixKVManager(ReferenceKVManager):
    """The reference KVManager over the radix tree (``orphans = detach``)."""

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config, index=RadixPrefixIndex(config.num_pages, config.page_size))


class UntrackedInFlightKVManager(ReferenceKVManager):
    """The reference KVManager keeping no record of pages in flight (``in-flight=untracked``,
    a declared departure from KVM-036)."""

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config, track_in_flight=False)


class OneQueueKVManager(ReferenceKVManager):
    """The reference KVManager over one queue of cached and free pages
    (``eviction=one-queue``, a declared departure from KVM-024)."""

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config, pool=OneQueuePagePool(config.num_pages))


class EmptySaltIsNoSaltKVManager(ReferenceKVManager):
    """The reference KVManager taking the empty salt for no salt (``empty-salt=no-salt``, a
    declared departure from KVM-028)."""

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return super().cached_prefix_length(token_ids, cache_salt or None)

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        match = super().match_prefix(token_ids, cache_salt or None)
        return dataclasses.replace(match, cache_salt=cache_salt)

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        if match is not None and match.cache_salt != cache_salt:
            raise StaleMatch("the prefix match is of another salt")
        if match is not None:
            match = dataclasses.replace(match, cache_salt=cache_salt or None)
        return super().allocate(seq_id, token_ids, num_new_tokens, cache_salt or None, match=match)


class QueriesCountedOnLookupKVManager(ReferenceKVManager):
    """The reference KVManager counting no query tokens with prefix caching off
    (``query-counting=on-lookup``, a declared departure from KVM-030)."""

    def stats(self) -> KVStats:
        stats = super().stats()
        if self.config.enable_prefix_caching:
            return stats
        return dataclasses.replace(stats, query_tokens=0, hit_tokens=0)


class ReplacingPrefixIndex(PrefixIndex):
    """The chained-hash index where a commit meeting an equal entry takes it over
    (``duplicates=replaced``, KVM-051): the old entry is dropped, so entries after it no
    longer match their parent (orphans), and the pages that lost their entry are kept for the
    manager to take off the cache."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.replaced: list[int] = []

    def publish(
        self, page: int, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: str | None
    ) -> PrefixEntry | None:
        existing = super().publish(page, parent, token_ids, salt)
        if existing is None or existing.page == page:
            return existing
        self.remove_page(existing.page)
        self.replaced.append(existing.page)
        return super().publish(page, parent, token_ids, salt)


class ReplacingKVManager(ReferenceKVManager):
    """The reference KVManager over :class:`ReplacingPrefixIndex`: a page whose entry was taken
    over goes from the cache to the free list (``duplicates=replaced``)."""

    def __init__(self, config: KVManagerConfig) -> None:
        self.replacing = ReplacingPrefixIndex(config.num_pages, config.page_size)
        super().__init__(config, index=self.replacing)

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> int:
        published = super().commit(seq_id, token_ids)
        for page in self.replacing.replaced:
            if self.pool.is_cached(page):
                del self.pool._cached[page]
                self.pool._free.append(page)
        self.replacing.replaced.clear()
        return published
