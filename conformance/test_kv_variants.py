"""Where the spec leaves room (KVM-050): a deterministic example on which correct backends
legitimately differ, checked against the backend's declared choice and against the oracle.

Random state-machine runs rarely reach it: a sequence publishes a page after another
sequence's chain, the chain's head is evicted, and the prefix is published again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pytest

from pagedkv.interfaces import KVManager

from .loading import MakeKVManager
from .oracle import KVOracle
from .variants import ORPHANS


class _Calls(Protocol):
    """What the example calls: the KVManager's methods, on a backend or on the oracle."""

    def allocate(self, seq_id: int, token_ids: list[int], num_new_tokens: int) -> object: ...
    def commit(self, seq_id: int, token_ids: list[int]) -> int: ...
    def free(self, seq_id: int) -> None: ...
    def cached_prefix_length(self, token_ids: list[int]) -> int: ...
    def pages_indexed(self) -> int: ...


@dataclass(frozen=True)
class OrphanOutcome:
    """What the example observes at its end."""

    republished: int  # pages the last commit published
    cached_prefix: int  # cached_prefix_length of the republished prompt
    pages_indexed: int


#: The outcome each declared ``orphans`` choice must give (page size 1, tokens = pages).
EXPECTED = {
    "block": OrphanOutcome(republished=2, cached_prefix=2, pages_indexed=3),
    "detach": OrphanOutcome(republished=5, cached_prefix=4, pages_indexed=6),
    "reattach": OrphanOutcome(republished=4, cached_prefix=4, pages_indexed=5),
}
assert set(EXPECTED) == set(ORPHANS.choices)

A, C, E, D = 0, 1, 2, 3
PROMPT_A = [1, 2]
PROMPT_C = [1, 2, 3]
PROMPT_D = [1, 2, 3, 4, 5]
NUM_PAGES = 8


def orphan_example(calls: _Calls) -> OrphanOutcome:
    """The nine calls (page size 1, 8 pages):

    1. A allocates ``[1, 2]``; 2. C allocates ``[1, 2, 3]`` before A commits, so it hits
    nothing; 3. A commits (publishes pages for ``[1]`` and ``[1, 2]``); 4. C commits (reuses
    A's two entries, publishes its own third page after A's second); 5. A is freed (its two
    pages become cached); 6. E allocates five pages: the three free ones and A's two, evicted,
    so C's third entry is orphaned; 7. E is freed; 8. D allocates ``[1, 2, 3, 4, 5]`` (no hit)
    and 9. commits it, publishing the prefix again up to the orphan and past it.
    """
    calls.allocate(A, PROMPT_A, 2)
    calls.allocate(C, PROMPT_C, 3)
    calls.commit(A, PROMPT_A)
    calls.commit(C, PROMPT_C)
    calls.free(A)
    calls.allocate(E, [9], 5)
    calls.free(E)
    calls.allocate(D, PROMPT_D, 5)
    republished = calls.commit(D, PROMPT_D)
    return OrphanOutcome(republished, calls.cached_prefix_length(PROMPT_D), calls.pages_indexed())


@dataclass
class OnBackend:
    kv: KVManager

    def allocate(self, seq_id: int, token_ids: list[int], num_new_tokens: int) -> object:
        return self.kv.allocate(seq_id, token_ids, num_new_tokens)

    def commit(self, seq_id: int, token_ids: list[int]) -> int:
        return self.kv.commit(seq_id, token_ids)

    def free(self, seq_id: int) -> None:
        self.kv.free(seq_id)

    def cached_prefix_length(self, token_ids: list[int]) -> int:
        return self.kv.cached_prefix_length(token_ids)

    def pages_indexed(self) -> int:
        return self.kv.stats().pages_indexed


@dataclass
class OnOracle:
    oracle: KVOracle

    def allocate(self, seq_id: int, token_ids: list[int], num_new_tokens: int) -> object:
        return self.oracle.allocate(seq_id, token_ids, num_new_tokens)

    def commit(self, seq_id: int, token_ids: list[int]) -> int:
        return self.oracle.commit(seq_id, token_ids)

    def free(self, seq_id: int) -> None:
        self.oracle.free(seq_id)

    def cached_prefix_length(self, token_ids: list[int]) -> int:
        return self.oracle.cached_prefix_length(token_ids)

    def pages_indexed(self) -> int:
        return self.oracle.stats().pages_indexed


@pytest.mark.requires("prefix_caching", "eviction")
class KVVariantSuite:
    """The rooms of the spec, each checked against the backend's declared choice."""

    @pytest.mark.spec("KVM-050")
    def test_orphaned_entries_follow_the_declared_variant(
        self, make_kv_manager: MakeKVManager, backend_variants: dict[str, str]
    ) -> None:
        """The nine-call example gives exactly what the declared ``orphans`` choice says, and
        so does the state machine's oracle under that choice."""
        choice = backend_variants[ORPHANS.name]
        want = EXPECTED[choice]
        oracle = KVOracle(NUM_PAGES, 1, enable_prefix_caching=True, orphans=choice)
        assert orphan_example(OnOracle(oracle)) == want, "the oracle does not follow the variant"
        kv = make_kv_manager(NUM_PAGES, 1)
        got = orphan_example(OnBackend(kv))
        others = [c for c, outcome in EXPECTED.items() if outcome == got]
        assert got == want, (
            f"declared orphans={choice!r} ({ORPHANS.choices[choice]}), but the backend behaves "
            f"as {others or 'no declared choice'}: {got}"
        )
        kv.check_invariants()


class TestKVVariants(KVVariantSuite):
    """The variants against ``--backend``."""
