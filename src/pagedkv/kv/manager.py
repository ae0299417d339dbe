"""The reference KVManager: page tables, prefix reuse and eviction over a :class:`PagePool`.

It never imports torch (KVM-040) and validates every argument before it mutates anything, so a
call that raises leaves the manager exactly as it was (KVM-001, KVM-002).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import (
    DoubleFree,
    DuplicateSequence,
    InvalidRequest,
    OutOfPages,
    PagesInUse,
    StaleMatch,
    UnknownSequence,
)
from pagedkv.interfaces import (
    Allocation,
    Fork,
    KVManagerConfig,
    KVStats,
    PageCopy,
    PageTable,
    PrefixMatch,
)
from pagedkv.kv.in_flight import InFlightPages
from pagedkv.kv.invariants import check_manager_invariants
from pagedkv.kv.page_pool import PagePool
from pagedkv.kv.prefix_index import (
    HashFn,
    PrefixEntry,
    PrefixIndex,
    PrefixLookup,
    builtin_page_hash,
)

#: How many freed sequence ids are remembered to tell a double free from an unknown id.
FREED_IDS_REMEMBERED = 65536


@dataclass(slots=True)
class SequenceState:
    """What the manager knows of one live sequence.

    Attributes:
        pages: physical pages, by logical page.
        num_tokens: token positions reserved.
        cache_salt: salt its pages are published under.
        num_committed_pages: leading pages already hit or published; commit starts after them.
        chain_tail: the index entry of the last committed page, parent of the next one.
        chain_broken: a collision stopped publication; later pages of this sequence stay private.
    """

    pages: list[int]
    num_tokens: int
    cache_salt: str | None
    num_committed_pages: int = 0
    chain_tail: PrefixEntry | None = None
    chain_broken: bool = False


def _pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class ReferenceKVManager:
    """Free list + O(1) LRU + a prefix index of full pages + the pages still in flight.

    The index is the chained-hash :class:`PrefixIndex` with token verification, built with
    ``hash_fn``, unless another :class:`PrefixLookup` (such as the radix tree) is given.
    Every successful state change replaces an opaque state token, which a
    :class:`~pagedkv.interfaces.PrefixMatch` carries, so a match cannot be used stale (KVM-035).
    """

    def __init__(
        self,
        config: KVManagerConfig,
        hash_fn: HashFn = builtin_page_hash,
        index: PrefixLookup | None = None,
        *,
        track_in_flight: bool = True,
        pool: PagePool | None = None,
    ) -> None:
        """Two options let the reference run as a backend declaring a departure would, so the
        conformance suite can be shown to follow each declaration: ``track_in_flight=False``
        keeps no record of the pages live sequences compute, so every match reports none in
        flight (``in-flight=untracked``, KVM-036); ``pool`` replaces the free-list-first pool
        (a :class:`~pagedkv.kv.one_queue_pool.OneQueuePagePool` of ``config.num_pages`` pages
        is ``eviction=one-queue``, KVM-024)."""
        self.config = config
        self.track_in_flight = track_in_flight
        self.pool = pool if pool is not None else PagePool(config.num_pages)
        self.index: PrefixLookup = (
            index if index is not None else PrefixIndex(config.num_pages, config.page_size, hash_fn)
        )
        self.in_flight = InFlightPages(config.page_size)
        self.sequences: dict[int, SequenceState] = {}
        self._freed_ids: OrderedDict[int, None] = OrderedDict()
        self._state = object()
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    # -- lookups ---------------------------------------------------------------------------

    def _match(self, token_ids: Sequence[int], cache_salt: str | None) -> list[PrefixEntry]:
        if not self.config.enable_prefix_caching:
            return []
        # At least one token must stay to compute (KVM-025).
        max_pages = (len(token_ids) - 1) // self.page_size
        return self.index.match(token_ids, cache_salt, max_pages)

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        if not token_ids:
            raise InvalidRequest("token_ids must be non-empty")
        return len(self._match(token_ids, cache_salt)) * self.page_size

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        if not token_ids:
            raise InvalidRequest("token_ids must be non-empty")
        hits = self._match(token_ids, cache_salt)
        max_pages = (len(token_ids) - 1) // self.page_size
        in_flight = self.in_flight.count(token_ids, cache_salt, len(hits), max_pages)
        return PrefixMatch(
            token_ids=tuple(token_ids),
            cache_salt=cache_salt,
            hit_pages=tuple(e.page for e in hits),
            num_cached_tokens=len(hits) * self.page_size,
            num_in_flight_tokens=in_flight * self.page_size,
            state=self._state,
        )

    def _check_match(
        self, match: PrefixMatch, token_ids: Sequence[int], cache_salt: str | None
    ) -> None:
        if match.state is not self._state:
            raise StaleMatch(
                "the prefix match was taken by another manager, or before a change since"
            )
        if match.cache_salt != cache_salt or match.token_ids != tuple(token_ids):
            raise StaleMatch("the prefix match is of another prompt or salt")

    def _changed(self) -> None:
        """Record a successful state change: earlier matches are stale from now on."""
        self._state = object()

    def _sequence(self, seq_id: int) -> SequenceState:
        state = self.sequences.get(seq_id)
        if state is None:
            if seq_id in self._freed_ids:
                raise DoubleFree(seq_id)
            raise UnknownSequence(seq_id)
        return state

    def page_table(self, seq_id: int) -> PageTable:
        state = self._sequence(seq_id)
        return PageTable(seq_id, self.page_size, tuple(state.pages), state.num_tokens)

    def ref_count(self, page: int) -> int:
        return self.pool.ref_count(page)

    # -- allocation ------------------------------------------------------------------------

    def _check_available(self, count: int, pinned: int = 0) -> None:
        """Raise :class:`OutOfPages` unless ``count`` fresh pages can be taken.

        ``pinned`` counts cached pages the caller is about to hit: they are in the LRU now but
        must not be evicted for this same call (KVM-026), so they are not available.
        """
        available = self.pool.num_free + self.pool.num_cached - pinned
        if count > available:
            raise OutOfPages(count, available)

    def _take_fresh(self, count: int) -> list[int]:
        """Take ``count`` fresh pages, or raise having changed nothing."""
        self._check_available(count)
        return self.pool.take_fresh(count, self._evict)

    def _evict(self, page: int) -> None:
        self.index.remove_page(page)
        self._evictions += 1

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        if seq_id in self.sequences:
            raise DuplicateSequence(seq_id)
        if not token_ids:
            raise InvalidRequest("token_ids must be non-empty")
        if num_new_tokens < 1:
            raise InvalidRequest(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        if match is None:
            hits = [e.page for e in self._match(token_ids, cache_salt)]
        else:
            self._check_match(match, token_ids, cache_salt)
            hits = list(match.hit_pages)
        num_cached = len(hits) * self.page_size
        num_tokens = num_cached + num_new_tokens
        # Hit pages waiting in the LRU are not available to this same allocation (KVM-026).
        pinned = sum(1 for page in hits if self.pool.is_cached(page))
        self._check_available(_pages_for(num_tokens, self.page_size) - len(hits), pinned)
        # Nothing can fail past this point. Hold the hits first, so that taking fresh pages
        # cannot evict them.
        for page in hits:
            self.pool.hold(page)
        fresh = self._take_fresh(_pages_for(num_tokens, self.page_size) - len(hits))
        state = SequenceState(
            pages=hits + fresh,
            num_tokens=num_tokens,
            cache_salt=cache_salt,
            num_committed_pages=len(hits),
            chain_tail=self.index.entry_of(hits[-1]) if hits else None,
        )
        self.sequences[seq_id] = state
        self._freed_ids.pop(seq_id, None)
        if self.config.enable_prefix_caching and self.track_in_flight:
            self.in_flight.open(seq_id, token_ids, cache_salt, len(hits))
        self._query_tokens += len(token_ids)
        self._hit_tokens += num_cached
        self._changed()
        return Allocation(self.page_table(seq_id), num_cached, len(fresh))

    def grow(self, seq_id: int, num_tokens: int) -> PageTable:
        state = self._sequence(seq_id)
        if num_tokens < state.num_tokens:
            raise InvalidRequest(
                f"grow to {num_tokens} tokens is below the {state.num_tokens} already reserved"
            )
        needed = _pages_for(num_tokens, self.page_size) - len(state.pages)
        if needed > 0:
            state.pages.extend(self._take_fresh(needed))
        state.num_tokens = num_tokens
        self._changed()
        return self.page_table(seq_id)

    def fork(self, seq_id: int, new_seq_id: int) -> Fork:
        """Open ``new_seq_id`` on ``seq_id``'s pages (KVM-037..039): full pages shared, a
        partial last page replaced by a fresh one that the caller fills by the returned copy."""
        state = self._sequence(seq_id)
        if new_seq_id in self.sequences:
            raise DuplicateSequence(new_seq_id)
        partial = state.num_tokens % self.page_size != 0
        shared = state.pages[:-1] if partial else list(state.pages)
        # Every page of the parent is in use, so taking a fresh one cannot evict it.
        fresh = self._take_fresh(1) if partial else []
        for page in shared:
            self.pool.hold(page)
        self.sequences[new_seq_id] = SequenceState(
            pages=shared + fresh,
            num_tokens=state.num_tokens,
            cache_salt=state.cache_salt,
            num_committed_pages=state.num_committed_pages,
            chain_tail=state.chain_tail,
            chain_broken=state.chain_broken,
        )
        self._freed_ids.pop(new_seq_id, None)
        self._changed()
        copies = (PageCopy(state.pages[-1], fresh[0]),) if partial else ()
        return Fork(self.page_table(new_seq_id), copies)

    # -- publication -----------------------------------------------------------------------

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> int:
        state = self._sequence(seq_id)
        if len(token_ids) > state.num_tokens:
            raise InvalidRequest(
                f"commit of {len(token_ids)} tokens exceeds the {state.num_tokens} reserved "
                f"for sequence {seq_id}"
            )
        self._changed()
        if not self.config.enable_prefix_caching or state.chain_broken:
            return 0
        size = self.page_size
        published = 0
        for i in range(state.num_committed_pages, len(token_ids) // size):
            page_tokens = tuple(token_ids[i * size : (i + 1) * size])
            entry = self.index.entry_of(state.pages[i])
            if entry is not None:  # a sequence sharing the page since a fork published it
                entry = entry if self._continues(state, entry, page_tokens) else None
            else:
                entry = self.index.publish(
                    state.pages[i], state.chain_tail, page_tokens, state.cache_salt
                )
                if entry is not None and entry.page == state.pages[i]:
                    published += 1
            if entry is None:
                state.chain_broken = True
                break
            state.chain_tail = entry
            state.num_committed_pages = i + 1
        if state.chain_broken:
            self.in_flight.close(seq_id)  # it will never publish them
        else:
            self.in_flight.committed(seq_id, state.num_committed_pages)
        return published

    @staticmethod
    def _continues(state: SequenceState, entry: PrefixEntry, page_tokens: tuple[int, ...]) -> bool:
        """Whether ``entry`` is the next link of the sequence's chain for ``page_tokens``."""
        return (
            entry.parent is state.chain_tail
            and entry.token_ids == page_tokens
            and entry.cache_salt == state.cache_salt
        )

    # -- release ---------------------------------------------------------------------------

    def free(self, seq_id: int) -> None:
        state = self._sequence(seq_id)
        del self.sequences[seq_id]
        self._freed_ids[seq_id] = None
        if len(self._freed_ids) > FREED_IDS_REMEMBERED:
            self._freed_ids.popitem(last=False)
        self.in_flight.close(seq_id)
        self.pool.release(reversed(state.pages), self._is_published)
        self._changed()

    def _is_published(self, page: int) -> bool:
        return self.index.entry_of(page) is not None

    def reset_prefix_cache(self) -> None:
        if self.pool.num_in_use:
            raise PagesInUse(self.pool.num_in_use)
        self.pool.uncache_all()
        self.index.clear()
        self._changed()

    # -- observation -----------------------------------------------------------------------

    def stats(self) -> KVStats:
        return KVStats(
            num_pages=self.num_pages,
            pages_in_use=self.pool.num_in_use,
            pages_free=self.pool.num_free,
            pages_cached=self.pool.num_cached,
            pages_indexed=len(self.index),
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            evictions=self._evictions,
        )

    def check_invariants(self) -> None:
        check_manager_invariants(self)
