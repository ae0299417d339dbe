"""A deliberately simple model of the KVManager contract (specs/kv-manager.md).

The state machine runs every operation on the backend and on this oracle and compares what it
can observe. The oracle trades speed for obviousness: plain lists and dicts, linear scans, and
prefix entries keyed by the *whole* token prefix (plus the salt) instead of chained hashes, so
it has no hash collisions to verify against (KVM-022 holds by construction).

Where the spec leaves a choice, the oracle follows the backend's declared variant
(``pagedkv_conformance.variants``, KVM-050), the ``orphans`` policy:

* an entry remembers the identity of its parent entry. With ``block`` (the chained-hash
  reference) and ``detach`` (the radix tree) a hit walks from the first page and stops at the
  first page with no entry whose parent is the entry just matched, so an entry orphaned by its
  parent's eviction is never hit, even if the parent's tokens are published again later; with
  ``reattach`` any entry for the page's whole prefix is hit, orphan or not;
* committing a page whose prefix has an entry with a different parent (a stale orphan) stops
  publication for the rest of that sequence under ``block``, publishes the page beside the
  orphan under ``detach``, and continues the chain from the orphan under ``reattach``.

Where the spec leaves no choice:

* committing a page whose prefix another sequence already published (same parent) keeps the
  other page's entry, leaves this page unpublished and continues the chain from the other entry
  (``duplicates=kept-once``); under ``duplicates=replaced`` the entry is dropped (its page, if
  cached, goes free; entries after it are orphaned) and this page published in its place;
* fresh pages come from the free list first, then by evicting the least recently released
  cached page that the same allocation does not hit (KVM-024, KVM-026); under the declared
  departure ``eviction=one-queue`` every unheld page, cached or free, waits in one queue,
  least recently released first, and a fresh page is its first page not hit by the same
  allocation, evicted if cached;
* a fork (KVM-037) shares the parent's full pages, takes the copy of a partial last page like
  any fresh page, and continues the parent's chain; a page two forked sequences share is
  published by whichever commits it first (the other finds the entry, as for a duplicate).

A page is *in flight* (KVM-036) for a live sequence from its allocation until it commits the
page, frees, or stops publishing: the full pages of the prompt it was allocated for, after its
hits. The oracle finds them by comparing the queried prompt with every live sequence's prompt;
under the declared departure ``in-flight=untracked`` a match reports none.
Every successful state change bumps a version, which a match carries (KVM-035).

Physical page ids are the oracle's own; the state machine relates them to the backend's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
from pagedkv.interfaces import KVStats

from .variants import DUPLICATES, EVICTION, IN_FLIGHT, ORPHANS

#: (cache salt, every token id from the start of the prompt to the end of the page)
PrefixKey = tuple[str | None, tuple[int, ...]]


class NeverAllocated(UnknownSequence):
    """Raised by the oracle for an id that was never allocated: the backend must raise
    UnknownSequence, and not its subclass DoubleFree."""


@dataclass(frozen=True, slots=True)
class OracleEntry:
    """A published full page."""

    uid: int
    page: int
    key: PrefixKey
    parent_uid: int | None


@dataclass(slots=True)
class OracleSequence:
    """A live sequence."""

    pages: list[int]
    num_tokens: int
    salt: str | None
    prompt: tuple[int, ...] = ()
    committed_pages: int = 0
    tail: OracleEntry | None = None
    broken: bool = False


@dataclass(frozen=True, slots=True)
class OracleMatch:
    """What the oracle's match_prefix found: ``hit_pages`` are the oracle's own page ids."""

    token_ids: tuple[int, ...]
    salt: str | None
    hit_pages: tuple[int, ...]
    num_cached_tokens: int
    num_in_flight_tokens: int
    version: int


@dataclass(frozen=True, slots=True)
class OracleAllocation:
    """What the oracle's allocate did: ``pages[:num_hit_pages]`` were hits."""

    pages: tuple[int, ...]
    num_cached_tokens: int
    num_hit_pages: int
    num_new_pages: int


@dataclass(frozen=True, slots=True)
class OracleFork:
    """What the oracle's fork did: ``pages`` is the new table; ``copy`` is ``(src, dst)`` of
    the partial last page, ``None`` when the reservation ends on a page boundary."""

    pages: tuple[int, ...]
    copy: tuple[int, int] | None


def pages_for(num_tokens: int, page_size: int) -> int:
    """``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


def oracle_following(
    variants: Mapping[str, str], num_pages: int, page_size: int, enable_prefix_caching: bool
) -> KVOracle:
    """A fresh oracle following every declared choice it models (``variants``, completed with
    the defaults where a name is missing): ``orphans``, ``in-flight``, ``eviction`` and
    ``duplicates`` (``kept-once`` or ``replaced``; ``published`` is not modelled)."""
    return KVOracle(
        num_pages,
        page_size,
        enable_prefix_caching,
        orphans=variants.get(ORPHANS.name, ORPHANS.default),
        in_flight=variants.get(IN_FLIGHT.name, IN_FLIGHT.default),
        eviction=variants.get(EVICTION.name, EVICTION.default),
        duplicates=variants.get(DUPLICATES.name, DUPLICATES.default),
    )


class KVOracle:
    """The model. Methods mirror :class:`pagedkv.interfaces.KVManager` and raise the same
    typed errors, having changed nothing."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool,
        orphans: str = "block",
        in_flight: str = "tracked",
        eviction: str = "free-first",
        duplicates: str = "kept-once",
    ) -> None:
        if orphans not in ("block", "detach", "reattach"):
            raise ValueError(f"unknown orphans policy {orphans!r}")
        if in_flight not in ("tracked", "untracked"):
            raise ValueError(f"unknown in-flight choice {in_flight!r}")
        if eviction not in ("free-first", "one-queue"):
            raise ValueError(f"unknown eviction choice {eviction!r}")
        self.one_queue = eviction == "one-queue"
        if duplicates not in ("kept-once", "replaced"):
            raise ValueError(f"the oracle does not model duplicates={duplicates!r}")
        self.replaces = duplicates == "replaced"
        self.orphans = orphans
        self.tracks_in_flight = in_flight == "tracked"
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref: list[int] = [0] * num_pages
        self.free_list: list[int] = list(range(num_pages))
        self.lru: list[int] = []  # cached pages, least recently released first
        #: Under ``eviction=one-queue``: every unheld page, least recently released first.
        self.queue: list[int] = list(range(num_pages))
        #: Entries by prefix; more than one only under ``detach`` (orphans beside live ones).
        self.entries: dict[PrefixKey, list[OracleEntry]] = {}
        self.entry_of_page: dict[int, OracleEntry] = {}
        self.sequences: dict[int, OracleSequence] = {}
        self.freed: set[int] = set()
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.version = 0
        self._next_uid = 0

    # -- lookups ---------------------------------------------------------------------------

    def _sequence(self, seq_id: int) -> OracleSequence:
        if seq_id in self.sequences:
            return self.sequences[seq_id]
        if seq_id in self.freed:
            raise UnknownSequence(seq_id)
        raise NeverAllocated(seq_id)

    def _hittable(self, key: PrefixKey, parent: OracleEntry | None) -> OracleEntry | None:
        """The entry a chain continuing from ``parent`` hits for ``key``, if any."""
        candidates = self.entries.get(key, [])
        if self.orphans == "reattach":
            return candidates[0] if candidates else None
        parent_uid = None if parent is None else parent.uid
        return next((e for e in candidates if e.parent_uid == parent_uid), None)

    def match(self, token_ids: Sequence[int], salt: str | None) -> list[OracleEntry]:
        """The longest run of entries for the prompt's leading full pages, leaving >= 1 token."""
        if not self.enable_prefix_caching:
            return []
        chain: list[OracleEntry] = []
        parent: OracleEntry | None = None
        for i in range((len(token_ids) - 1) // self.page_size):
            entry = self._hittable((salt, tuple(token_ids[: (i + 1) * self.page_size])), parent)
            if entry is None:
                break
            chain.append(entry)
            parent = entry
        return chain

    @property
    def num_entries(self) -> int:
        """Published entries, orphans included."""
        return sum(len(entries) for entries in self.entries.values())

    def cached_prefix_length(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        if not token_ids:
            raise InvalidRequest("empty prompt")
        return len(self.match(token_ids, salt)) * self.page_size

    def _in_flight(self, token_ids: Sequence[int], salt: str | None, page: int) -> bool:
        """Whether a live sequence, publishing under ``salt``, was allocated for a prompt that
        has ``token_ids``' tokens up to the end of ``page`` and has not committed that page."""
        end = (page + 1) * self.page_size
        prefix = tuple(token_ids[:end])
        return any(
            seq.salt == salt
            and not seq.broken
            and seq.committed_pages <= page < len(seq.prompt) // self.page_size
            and seq.prompt[:end] == prefix
            for seq in self.sequences.values()
        )

    def match_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> OracleMatch:
        if not token_ids:
            raise InvalidRequest("empty prompt")
        hits = self.match(token_ids, salt)
        in_flight = 0
        if self.enable_prefix_caching and self.tracks_in_flight:
            for page in range(len(hits), (len(token_ids) - 1) // self.page_size):
                if not self._in_flight(token_ids, salt, page):
                    break
                in_flight += 1
        return OracleMatch(
            tuple(token_ids),
            salt,
            tuple(e.page for e in hits),
            len(hits) * self.page_size,
            in_flight * self.page_size,
            self.version,
        )

    def page_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._sequence(seq_id).pages)

    def num_tokens(self, seq_id: int) -> int:
        return self._sequence(seq_id).num_tokens

    def stats(self) -> KVStats:
        return KVStats(
            num_pages=self.num_pages,
            pages_in_use=sum(1 for r in self.ref if r > 0),
            pages_free=len(self.free_list),
            pages_cached=len(self.lru),
            pages_indexed=self.num_entries,
            query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens,
            evictions=self.evictions,
        )

    # -- transitions -----------------------------------------------------------------------

    def _take_fresh(self, count: int, pinned: set[int]) -> list[int]:
        available = len(self.free_list) + sum(1 for p in self.lru if p not in pinned)
        if count > available:
            raise OutOfPages(count, available)
        taken: list[int] = []
        for _ in range(count):
            if self.one_queue:
                page = next(p for p in self.queue if p not in pinned)
            elif self.free_list:
                page = self.free_list[0]
            else:
                page = next(p for p in self.lru if p not in pinned)
            self.queue.remove(page)
            if page in self.free_list:
                self.free_list.remove(page)
            else:
                self.lru.remove(page)
                entry = self.entry_of_page.pop(page)
                siblings = self.entries[entry.key]
                siblings.remove(entry)
                if not siblings:
                    del self.entries[entry.key]
                self.evictions += 1
            self.ref[page] = 1
            taken.append(page)
        return taken

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        salt: str | None = None,
        match: OracleMatch | None = None,
    ) -> OracleAllocation:
        if seq_id in self.sequences:
            raise DuplicateSequence(seq_id)
        if not token_ids:
            raise InvalidRequest("empty prompt")
        if num_new_tokens < 1:
            raise InvalidRequest(f"num_new_tokens {num_new_tokens} < 1")
        if match is not None and (
            match.version != self.version
            or match.salt != salt
            or match.token_ids != tuple(token_ids)
        ):
            raise StaleMatch("stale match")
        hits = self.match(token_ids, salt)
        num_cached = len(hits) * self.page_size
        num_tokens = num_cached + num_new_tokens
        hit_pages = [e.page for e in hits]
        fresh = self._take_fresh(pages_for(num_tokens, self.page_size) - len(hits), set(hit_pages))
        for page in hit_pages:
            if page in self.lru:
                self.lru.remove(page)
                self.queue.remove(page)
            self.ref[page] += 1
        self.sequences[seq_id] = OracleSequence(
            pages=hit_pages + fresh,
            num_tokens=num_tokens,
            salt=salt,
            prompt=tuple(token_ids),
            committed_pages=len(hits),
            tail=hits[-1] if hits else None,
        )
        self.freed.discard(seq_id)
        self.query_tokens += len(token_ids)
        self.hit_tokens += num_cached
        self.version += 1
        return OracleAllocation(tuple(hit_pages + fresh), num_cached, len(hits), len(fresh))

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Returns the pages appended."""
        seq = self._sequence(seq_id)
        if num_tokens < seq.num_tokens:
            raise InvalidRequest(f"grow to {num_tokens} below {seq.num_tokens}")
        needed = pages_for(num_tokens, self.page_size) - len(seq.pages)
        fresh = self._take_fresh(needed, set()) if needed > 0 else []
        seq.pages.extend(fresh)
        seq.num_tokens = num_tokens
        self.version += 1
        return fresh

    def fork(self, seq_id: int, new_seq_id: int) -> OracleFork:
        """Share the full pages, copy a partial last page to a fresh one, continue the chain;
        the new sequence has no prompt, so nothing of it is in flight (KVM-037..039)."""
        seq = self._sequence(seq_id)
        if new_seq_id in self.sequences:
            raise DuplicateSequence(new_seq_id)
        partial = seq.num_tokens % self.page_size != 0
        shared = seq.pages[:-1] if partial else list(seq.pages)
        fresh = self._take_fresh(1, set()) if partial else []
        for page in shared:
            self.ref[page] += 1
        self.sequences[new_seq_id] = OracleSequence(
            pages=shared + fresh,
            num_tokens=seq.num_tokens,
            salt=seq.salt,
            committed_pages=seq.committed_pages,
            tail=seq.tail,
            broken=seq.broken,
        )
        self.freed.discard(new_seq_id)
        self.version += 1
        return OracleFork(tuple(shared + fresh), (seq.pages[-1], fresh[0]) if partial else None)

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> int:
        seq = self._sequence(seq_id)
        if len(token_ids) > seq.num_tokens:
            raise InvalidRequest(f"commit of {len(token_ids)} past {seq.num_tokens}")
        self.version += 1
        if not self.enable_prefix_caching or seq.broken:
            return 0
        size = self.page_size
        published = 0
        for i in range(seq.committed_pages, len(token_ids) // size):
            prefix = () if seq.tail is None else seq.tail.key[1]
            key = (seq.salt, prefix + tuple(token_ids[i * size : (i + 1) * size]))
            parent_uid = None if seq.tail is None else seq.tail.uid
            existing = self._hittable(key, seq.tail)
            if existing is None and self.orphans == "block" and self.entries.get(key):
                seq.broken = True  # a stale orphan holds the key
                break
            if existing is not None and self.replaces and existing.page != seq.pages[i]:
                self._unpublish(existing)
                existing = None
            if existing is not None:
                entry = existing
            else:
                entry = OracleEntry(self._next_uid, seq.pages[i], key, parent_uid)
                self._next_uid += 1
                self.entries.setdefault(key, []).append(entry)
                self.entry_of_page[entry.page] = entry
                published += 1
            seq.tail = entry
            seq.committed_pages = i + 1
        return published

    def _unpublish(self, entry: OracleEntry) -> None:
        """Drop ``entry`` (replaced by a later commit): its page, if cached, goes free and keeps
        its place in the one queue."""
        siblings = self.entries[entry.key]
        siblings.remove(entry)
        if not siblings:
            del self.entries[entry.key]
        del self.entry_of_page[entry.page]
        if entry.page in self.lru:
            self.lru.remove(entry.page)
            self.free_list.append(entry.page)

    def free(self, seq_id: int) -> None:
        if seq_id not in self.sequences and seq_id in self.freed:
            raise DoubleFree(seq_id)
        seq = self._sequence(seq_id)
        del self.sequences[seq_id]
        self.freed.add(seq_id)
        self.version += 1
        for page in reversed(seq.pages):  # the chain's tail first (KVM-023)
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.queue.append(page)
                if page in self.entry_of_page:
                    self.lru.append(page)
                else:
                    self.free_list.append(page)

    def reset_prefix_cache(self) -> None:
        in_use = sum(1 for r in self.ref if r > 0)
        if in_use:
            raise PagesInUse(in_use)
        self.free_list.extend(self.lru)
        self.lru.clear()
        self.entries.clear()
        self.entry_of_page.clear()
        self.version += 1

    def check(self) -> None:
        """The oracle's own consistency (a bug here is a bug in the suite, not the backend)."""
        holders = [0] * self.num_pages
        for seq in self.sequences.values():
            assert len(seq.pages) == pages_for(seq.num_tokens, self.page_size)
            for page in seq.pages:
                holders[page] += 1
        assert holders == self.ref
        states = [p for p in range(self.num_pages) if self.ref[p] > 0]
        assert sorted(states + self.free_list + self.lru) == list(range(self.num_pages))
        assert all(p in self.entry_of_page for p in self.lru)
        assert not any(p in self.entry_of_page for p in self.free_list)
        assert sorted(self.queue) == sorted(self.free_list + self.lru)
