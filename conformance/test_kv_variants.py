"""Where the spec leaves room (KVM-050, KVM-051): deterministic examples on which correct
backends legitimately differ, checked against the backend's declared choice and, where the
oracle models the choice, against the oracle.

Random state-machine runs rarely reach the orphan example: a sequence publishes a page after
another sequence's chain, the chain's head is evicted, and the prefix is published again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pytest

from pagedkv.interfaces import ForkingKVManager, KVManager

from .loading import MakeKVManager
from .oracle import KVOracle
from .variants import DUPLICATES, ORPHANS


class _Calls(Protocol):
    """What the example calls: the KVManager's methods, on a backend or on the oracle."""

    def allocate(self, seq_id: int, token_ids: list[int], num_new_tokens: int) -> object: ...
    def commit(self, seq_id: int, token_ids: list[int]) -> int: ...
    def free(self, seq_id: int) -> None: ...
    def cached_prefix_length(self, token_ids: list[int]) -> int: ...
    def pages_indexed(self) -> int: ...
    def pages_cached(self) -> int: ...


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
#: The same under ``duplicates=replaced``: C's commit takes A's two entries over, so A's pages
#: go free when A is freed and E evicts nothing of C's chain.
EXPECTED_REPLACED = {
    "block": OrphanOutcome(republished=4, cached_prefix=4, pages_indexed=5),
    "detach": OrphanOutcome(republished=2, cached_prefix=4, pages_indexed=5),
    "reattach": OrphanOutcome(republished=2, cached_prefix=4, pages_indexed=5),
}
assert set(EXPECTED_REPLACED) == set(ORPHANS.choices)

A, C, E, D, F = 0, 1, 2, 3, 4
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


@dataclass(frozen=True)
class DuplicateOutcome:
    """What the duplicate example observes."""

    published_again: int  # pages the second commit of the same prefix published
    pages_indexed: int  # after it
    pages_cached: int  # once the second sequence is freed


#: The outcome each declared ``duplicates`` choice must give (page size 1).
DUPLICATE_EXPECTED = {
    "kept-once": DuplicateOutcome(published_again=0, pages_indexed=1, pages_cached=0),
    "published": DuplicateOutcome(published_again=1, pages_indexed=2, pages_cached=1),
    "replaced": DuplicateOutcome(published_again=1, pages_indexed=1, pages_cached=1),
}
assert set(DUPLICATE_EXPECTED) == set(DUPLICATES.choices)


def duplicate_example(calls: _Calls) -> DuplicateOutcome:
    """Page size 1: A allocates ``[7, 9]`` and commits ``[7]``; B allocates ``[7]``, found
    whole, so its one page is computed again (KVM-025), and commits it; B is freed."""
    calls.allocate(A, [7, 9], 2)
    calls.commit(A, [7])
    calls.allocate(C, [7], 1)
    again = calls.commit(C, [7])
    indexed = calls.pages_indexed()
    calls.free(C)
    return DuplicateOutcome(again, indexed, calls.pages_cached())


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

    def pages_cached(self) -> int:
        return self.kv.stats().pages_cached


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

    def pages_cached(self) -> int:
        return self.oracle.stats().pages_cached


@pytest.mark.requires("prefix_caching", "eviction")
class KVVariantSuite:
    """The rooms of the spec, each checked against the backend's declared choice."""

    @pytest.mark.spec("KVM-050", "KVM-036")
    def test_orphaned_entries_follow_the_declared_variant(
        self, make_kv_manager: MakeKVManager, backend_variants: dict[str, str]
    ) -> None:
        """The nine-call example gives exactly what the declared ``orphans`` choice says (with
        ``duplicates=replaced`` if declared), and so does the state machine's oracle under
        those choices."""
        choice = backend_variants[ORPHANS.name]
        duplicates = backend_variants[DUPLICATES.name]
        want = (EXPECTED_REPLACED if duplicates == "replaced" else EXPECTED)[choice]
        oracle = KVOracle(
            NUM_PAGES, 1, enable_prefix_caching=True, orphans=choice, duplicates=duplicates
        )
        assert orphan_example(OnOracle(oracle)) == want, "the oracle does not follow the variant"
        kv = make_kv_manager(NUM_PAGES, 1)
        got = orphan_example(OnBackend(kv))
        others = [c for c, outcome in EXPECTED.items() if outcome == got]
        assert got == want, (
            f"declared orphans={choice!r} ({ORPHANS.choices[choice].meaning}), but the "
            f"backend behaves as {others or 'no declared choice'}: {got}"
        )
        # D's prompt pages are published, or abandoned where a blocking orphan stopped its
        # chain: none of them is in flight (KVM-036), whatever the choice.
        assert kv.match_prefix([*PROMPT_D, 6]).num_in_flight_tokens == 0
        kv.check_invariants()

    @pytest.mark.spec("KVM-039", "KVM-050")
    @pytest.mark.requires("fork")
    def test_a_fork_publishes_as_its_parent_would_after_the_orphan_example(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """After the nine calls, D is forked and every page C held is evicted (so no orphan
        blocks D's prefix any more): the fork, committing D's tokens, publishes what D itself
        would, which is nothing, whatever the ``orphans`` choice (D's chain is either all
        published or stopped for good)."""
        kv = make_kv_manager(NUM_PAGES, 1)
        orphan_example(OnBackend(kv))
        assert isinstance(kv, ForkingKVManager)
        kv.fork(D, F)
        kv.free(C)
        kv.allocate(E, [9], NUM_PAGES - kv.stats().pages_in_use)  # evicts every cached page
        kv.free(E)
        assert kv.commit(F, PROMPT_D) == 0
        assert kv.commit(D, PROMPT_D) == 0
        kv.check_invariants()

    @pytest.mark.spec("KVM-051")
    def test_duplicate_publication_follows_the_declared_variant(
        self, make_kv_manager: MakeKVManager, backend_variants: dict[str, str]
    ) -> None:
        """A prompt found whole in the cache recomputes its last page (KVM-025) and commits it
        again: the backend publishes it, or not, as its declared ``duplicates`` choice says,
        and the page is cached or free after it is freed accordingly. The oracle models
        ``kept-once`` and ``replaced``."""
        choice = backend_variants[DUPLICATES.name]
        want = DUPLICATE_EXPECTED[choice]
        if choice != "published":
            oracle = KVOracle(NUM_PAGES, 1, enable_prefix_caching=True, duplicates=choice)
            assert duplicate_example(OnOracle(oracle)) == want, "the oracle disagrees"
        kv = make_kv_manager(NUM_PAGES, 1)
        got = duplicate_example(OnBackend(kv))
        others = [c for c, outcome in DUPLICATE_EXPECTED.items() if outcome == got]
        assert got == want, (
            f"declared duplicates={choice!r} ({DUPLICATES.choices[choice].meaning}), but the "
            f"backend behaves as {others or 'no declared choice'}: {got}"
        )
        kv.check_invariants()


class TestKVVariants(KVVariantSuite):
    """The variants against ``--backend``."""
