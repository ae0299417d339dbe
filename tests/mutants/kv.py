"""Deliberately broken KVManagers: the reference KVManager with one small, plausible bug each.

Their ``check_invariants`` is as blind as the bug (it always passes), so the suite must catch
them by behaviour seen through the Protocol alone, as it would a third-party backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pagedkv.errors import OutOfPages
from pagedkv.interfaces import Allocation, KVManagerConfig, PageTable, PrefixMatch
from pagedkv.kv.manager import ReferenceKVManager, SequenceState
from pagedkv.kv.page_pool import PagePool
from pagedkv.kv.prefix_index import PrefixEntry, PrefixIndex


class _Mutant(ReferenceKVManager):
    def check_invariants(self) -> None:
        """Blind, like the bug it hides."""


class LeakOnFree(_Mutant):
    """(a) free forgets to release the sequence's last page: it stays in use forever."""

    def free(self, seq_id: int) -> None:
        state = self._sequence(seq_id)
        del self.sequences[seq_id]
        self._freed_ids[seq_id] = None
        self.pool.release(reversed(state.pages[:-1]), self._is_published)


class FreeSharedPage(_Mutant):
    """(b) free hands a page still held by another sequence back to the free list (keeping
    the counters consistent), so it can be given out again as a fresh page."""

    def free(self, seq_id: int) -> None:
        shared = [p for p in self._sequence(seq_id).pages if self.pool.ref_count(p) > 1]
        super().free(seq_id)
        for page in shared:
            self.pool._free.append(page)
            self.pool._num_in_use -= 1


class PublishBeforeCommit(_Mutant):
    """(c) allocate publishes the prompt's full pages at once, before their K/V are written."""

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        alloc = super().allocate(seq_id, token_ids, num_new_tokens, cache_salt, match=match)
        self.commit(seq_id, list(token_ids)[: alloc.page_table.num_tokens])
        return alloc


class _MostRecentFirstPool(PagePool):
    def take_fresh(self, count: int, evict: Callable[[int], None]) -> list[int]:
        taken: list[int] = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=True)
                evict(page)
            self._ref_counts[page] = 1
            self._num_in_use += 1
            taken.append(page)
        return taken


class MruEviction(_Mutant):
    """(d) eviction takes the most recently used cached page instead of the least."""

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config)
        self.pool = _MostRecentFirstPool(config.num_pages)


class EvictOwnHits(_Mutant):
    """(e) allocate takes its fresh pages before holding its hits, so eviction can pop a page
    the same allocation is hitting and hand it out twice."""

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        if seq_id in self.sequences or not token_ids or num_new_tokens < 1:
            return super().allocate(seq_id, token_ids, num_new_tokens, cache_salt, match=match)
        if match is not None:
            self._check_match(match, token_ids, cache_salt)
        hits = self._match(token_ids, cache_salt)
        num_cached = len(hits) * self.page_size
        num_tokens = num_cached + num_new_tokens
        count = -(-num_tokens // self.page_size) - len(hits)
        pinned = sum(1 for e in hits if self.pool.is_cached(e.page))
        available = self.pool.num_free + self.pool.num_cached - pinned
        if count > available:
            raise OutOfPages(count, available)
        fresh = self.pool.take_fresh(count, self._evict)
        for entry in hits:
            self.pool.hold(entry.page)
        self.sequences[seq_id] = SequenceState(
            pages=[e.page for e in hits] + fresh,
            num_tokens=num_tokens,
            cache_salt=cache_salt,
            num_committed_pages=len(hits),
            chain_tail=hits[-1] if hits else None,
        )
        self._freed_ids.pop(seq_id, None)
        if self.config.enable_prefix_caching:
            self.in_flight.open(seq_id, token_ids, cache_salt, len(hits))
        self._query_tokens += len(token_ids)
        self._hit_tokens += num_cached
        self._changed()
        return Allocation(self.page_table(seq_id), num_cached, len(fresh))


class ParentFirstFree(_Mutant):
    """(f) free queues a chain's pages head first, so a parent is evicted before its tail."""

    def free(self, seq_id: int) -> None:
        state = self._sequence(seq_id)
        del self.sequences[seq_id]
        self._freed_ids[seq_id] = None
        self.pool.release(state.pages, self._is_published)


class SaltBlind(_Mutant):
    """(g) the cache salt is ignored: requests with different salts share pages."""

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return super().cached_prefix_length(token_ids, None)

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        return super().match_prefix(token_ids, None)

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        return super().allocate(seq_id, token_ids, num_new_tokens, None, match=match)


class _TrustingIndex(PrefixIndex):
    """Believes its hash: no verification of tokens, salt or parent."""

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_pages: int
    ) -> list[PrefixEntry]:
        size = self.page_size
        chain: list[PrefixEntry] = []
        parent: PrefixEntry | None = None
        for i in range(min(max_pages, len(token_ids) // size)):
            entry = self._by_key.get(
                self.key_of(parent, tuple(token_ids[i * size : (i + 1) * size]), salt)
            )
            if entry is None:
                break
            chain.append(entry)
            parent = entry
        return chain


def _order_blind_hash(parent: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    return hash((parent, tuple(sorted(token_ids)), salt))


class UnverifiedHash(_Mutant):
    """(h) a weak page hash (blind to token order) and hits taken on the hash alone."""

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config, hash_fn=_order_blind_hash)
        self.index = _TrustingIndex(config.num_pages, config.page_size, _order_blind_hash)


class PartialGrow(_Mutant):
    """(i) a grow that runs out of pages keeps the pages it managed to take."""

    def grow(self, seq_id: int, num_tokens: int) -> PageTable:
        state = self._sequence(seq_id)
        needed = -(-num_tokens // self.page_size) - len(state.pages)
        available = self.pool.num_free + self.pool.num_cached
        if needed > available:
            state.pages.extend(self.pool.take_fresh(available, self._evict))
            state.num_tokens = len(state.pages) * self.page_size
            raise OutOfPages(needed, available)
        return super().grow(seq_id, num_tokens)


class InFlightBlind(_Mutant):
    """(j) a match never reports pages in flight: requests sharing a prefix that is still being
    computed compute it again."""

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        return dataclasses.replace(
            super().match_prefix(token_ids, cache_salt), num_in_flight_tokens=0
        )


class StaleMatchTaken(_Mutant):
    """(k) allocate takes whatever match it is given: hits that were evicted or never matched
    this prompt are held again."""

    def _check_match(
        self, match: PrefixMatch, token_ids: Sequence[int], cache_salt: str | None
    ) -> None:
        """Trusts the match."""


class EmptyLookupIsZero(_Mutant):
    """(l) cached_prefix_length answers 0 for an empty prompt instead of raising (KVM-003)."""

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        if not token_ids:
            return 0
        return super().cached_prefix_length(token_ids, cache_salt)


class _IdentitySaltIndex(PrefixIndex):
    """Verifies a hit's salt by identity (``is``) instead of equality."""

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_pages: int
    ) -> list[PrefixEntry]:
        chain = super().match(token_ids, salt, max_pages)
        for i, entry in enumerate(chain):
            if entry.cache_salt is not salt:
                return chain[:i]
        return chain


class SaltByIdentity(_Mutant):
    """(m) salts are compared as objects: an equal salt built at run time misses (KVM-028)."""

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config)
        self.index = _IdentitySaltIndex(config.num_pages, config.page_size)
