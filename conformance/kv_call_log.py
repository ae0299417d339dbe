"""A KVManager proxy that records the calls an engine makes to its manager (ENG-027, ENG-175).

The suite hands it, wrapped around the backend's own KVManager, to an engine of a backend that
declares ``supplied_kv_manager``. It delegates every call through the KVManager Protocol only
(no subclassing, no internals) and records the prompt lookups (``match_prefix``,
``cached_prefix_length``, ``allocate`` without a match, which looks the prompt up itself), and
for each ``allocate`` given a match whether that match is the very object the last lookup of
the same prompt and salt returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.interfaces import (
    Allocation,
    Fork,
    ForkingKVManager,
    KVManager,
    KVStats,
    PageTable,
    PrefixMatch,
)

#: Names the lookups are recorded under.
MATCH_PREFIX = "match_prefix"
CACHED_PREFIX_LENGTH = "cached_prefix_length"
ALLOCATE_WITHOUT_MATCH = "allocate without a match"


@dataclass(frozen=True)
class AllocateCall:
    """One ``allocate`` the engine made.

    Attributes:
        seq_id: the sequence it opened.
        with_match: whether it was given a match.
        match_is_last_lookup: the match given is the object the latest ``match_prefix`` of
            the same prompt and salt returned (``False`` without a match).
        lookups_before: lookups recorded before this call, since the previous ``allocate``.
    """

    seq_id: int
    with_match: bool
    match_is_last_lookup: bool
    lookups_before: int


@dataclass
class KVCallLog:
    """What the engine asked of its manager, in order."""

    lookups: list[str] = field(default_factory=list)
    allocations: list[AllocateCall] = field(default_factory=list)


class RecordingKVManager:
    """Delegates to ``inner``, recording lookups and allocations in :attr:`log`."""

    def __init__(self, inner: KVManager) -> None:
        self.inner = inner
        self.log = KVCallLog()
        self._last_match: dict[tuple[tuple[int, ...], str | None], PrefixMatch] = {}
        self._lookups_since_allocate = 0

    def _looked_up(self, name: str) -> None:
        self.log.lookups.append(name)
        self._lookups_since_allocate += 1

    @property
    def page_size(self) -> int:
        return self.inner.page_size

    @property
    def num_pages(self) -> int:
        return self.inner.num_pages

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        self._looked_up(CACHED_PREFIX_LENGTH)
        return self.inner.cached_prefix_length(token_ids, cache_salt)

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        self._looked_up(MATCH_PREFIX)
        match = self.inner.match_prefix(token_ids, cache_salt)
        self._last_match[(tuple(token_ids), cache_salt)] = match
        return match

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        if match is None:
            self._looked_up(ALLOCATE_WITHOUT_MATCH)
        last = self._last_match.get((tuple(token_ids), cache_salt))
        self.log.allocations.append(
            AllocateCall(
                seq_id,
                with_match=match is not None,
                match_is_last_lookup=match is not None and match is last,
                lookups_before=self._lookups_since_allocate,
            )
        )
        self._lookups_since_allocate = 0
        return self.inner.allocate(seq_id, token_ids, num_new_tokens, cache_salt, match=match)

    def grow(self, seq_id: int, num_tokens: int) -> PageTable:
        return self.inner.grow(seq_id, num_tokens)

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> int:
        return self.inner.commit(seq_id, token_ids)

    def free(self, seq_id: int) -> None:
        self.inner.free(seq_id)

    def page_table(self, seq_id: int) -> PageTable:
        return self.inner.page_table(seq_id)

    def ref_count(self, page: int) -> int:
        return self.inner.ref_count(page)

    def reset_prefix_cache(self) -> None:
        self.inner.reset_prefix_cache()

    def stats(self) -> KVStats:
        return self.inner.stats()

    def check_invariants(self) -> None:
        self.inner.check_invariants()


class RecordingForkingKVManager(RecordingKVManager):
    """The same for a :class:`~pagedkv.interfaces.ForkingKVManager`, whose forks it passes on
    (an engine forks parallel samples only on a manager that can)."""

    def __init__(self, inner: ForkingKVManager) -> None:
        super().__init__(inner)
        self.forking = inner

    def fork(self, seq_id: int, new_seq_id: int) -> Fork:
        return self.forking.fork(seq_id, new_seq_id)


def recording(inner: KVManager) -> RecordingKVManager:
    """``inner`` behind a recorder that forks where ``inner`` forks."""
    if isinstance(inner, ForkingKVManager):
        return RecordingForkingKVManager(inner)
    return RecordingKVManager(inner)
