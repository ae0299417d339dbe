"""A reference KVManager that counts the prompt lookups its caller makes (ENG-027).

Used by the tests and the scheduling benchmark to show that an admission costs one lookup:
``match_prefix``, ``cached_prefix_length`` and ``allocate`` without a match (which looks the
prompt up by itself) are counted by name in :attr:`CountingKVManager.lookups`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedkv.interfaces import Allocation, KVManagerConfig, PrefixMatch
from pagedkv.kv.manager import ReferenceKVManager

#: The name ``allocate`` without a match is counted under.
ALLOCATE_WITHOUT_MATCH = "allocate without a match"


class CountingKVManager(ReferenceKVManager):
    """The reference manager, counting its lookups and the matches that reported pages in
    flight.

    Attributes:
        lookups: calls by name; ``allocate`` from a match is counted as ``allocate``.
        in_flight_reports: matches that reported pages in flight.
    """

    def __init__(self, config: KVManagerConfig) -> None:
        super().__init__(config)
        self.lookups: Counter[str] = Counter()
        self.in_flight_reports = 0

    @property
    def num_lookups(self) -> int:
        """Every lookup of a prompt, whatever the method."""
        return sum(n for name, n in self.lookups.items() if name != "allocate")

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        self.lookups["match_prefix"] += 1
        match = super().match_prefix(token_ids, cache_salt)
        self.in_flight_reports += match.num_in_flight_tokens > 0
        return match

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        self.lookups["cached_prefix_length"] += 1
        return super().cached_prefix_length(token_ids, cache_salt)

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        self.lookups["allocate" if match is not None else ALLOCATE_WITHOUT_MATCH] += 1
        return super().allocate(seq_id, token_ids, num_new_tokens, cache_salt, match=match)
