"""Conformance tests of forking a sequence (specs/kv-manager.md KVM-037..039).

Parallel sampling computes a prompt once and forks the sequence for each further sample:
``fork(seq_id, new_seq_id)`` shares every full page (one more holder, nothing copied) and gives
the new sequence a fresh page in place of a partial last page, naming the copy the caller must
make through the PagedStore. :class:`KVForkSuite` is collected by ``test_kv_fork.py`` for a
backend declaring the ``fork`` capability; subclass it with your own ``make_kv_manager``
fixture as for :class:`~pagedkv_conformance.suite_kv_manager.KVManagerSuite`. Everything is
observed through the :class:`pagedkv.interfaces.ForkingKVManager` Protocol only.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.errors import DoubleFree, DuplicateSequence, OutOfPages, PagedKVError, UnknownSequence
from pagedkv.interfaces import ForkingKVManager, KVManager, PageCopy

from .loading import MakeKVManager
from .suite_kv_manager import (
    CACHING,
    assert_accounting,
    assert_ref_counts_match_holders,
    run_prompt,
    snapshot,
    tokens,
)
from .variants import tracks_in_flight

#: Page size of every scenario.
SIZE = 4
#: Ten tokens: two full pages and a partial third.
PROMPT = tuple(tokens(700, 10))
#: Eight tokens: two full pages, nothing partial.
ALIGNED = tuple(tokens(800, 8))


def forking(kv: KVManager) -> ForkingKVManager:
    """``kv`` as a forking manager (the backend declares ``fork``)."""
    assert isinstance(kv, ForkingKVManager), f"{type(kv).__name__} has no fork method"
    return kv


def prompt_manager(
    make: MakeKVManager, caching: bool = True, num_pages: int = 16
) -> ForkingKVManager:
    """``num_pages`` pages of 4 tokens; sequence 1 computed and committed :data:`PROMPT`."""
    kv = forking(make(num_pages, SIZE, caching))
    run_prompt(kv, 1, PROMPT)
    return kv


@pytest.mark.requires("fork")
class KVForkSuite:
    """Forking: full pages shared by count, the partial one copied, all or nothing."""

    # -- what a fork shares and copies --------------------------------------------------------

    @pytest.mark.spec("KVM-037")
    @pytest.mark.parametrize("caching", [pytest.param(True, marks=CACHING), False])
    def test_fork_shares_full_pages_and_copies_the_partial_one(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """Forking a 10-token sequence three times: each fork holds the parent's two full
        pages (their ref counts rise by one per fork) and a fresh page of its own in place of
        the partial third, which the fork names as the one copy to make; one page more is in
        use per fork, and no query or hit token is counted."""
        kv = prompt_manager(make_kv_manager, caching)
        parent = kv.page_table(1)
        before = kv.stats()
        fresh: set[int] = set()
        for child in (2, 3, 4):
            fork = kv.fork(1, child)
            table = fork.page_table
            assert table == kv.page_table(child)
            assert (table.seq_id, table.num_tokens) == (child, parent.num_tokens)
            assert table.pages[:2] == parent.pages[:2]
            own = table.pages[2]
            assert own not in parent.pages, f"page {own} is the parent's"
            assert own not in fresh, f"page {own} was given to an earlier fork"
            fresh.add(own)
            assert fork.copies == (PageCopy(src=parent.pages[2], dst=own),)
        assert kv.page_table(1) == parent
        assert [kv.ref_count(p) for p in parent.pages] == [4, 4, 1]
        holders = assert_ref_counts_match_holders(kv, [1, 2, 3, 4])
        assert len(holders) == 3 + 3
        stats = assert_accounting(kv)
        assert stats.pages_in_use == before.pages_in_use + 3
        assert (stats.query_tokens, stats.hit_tokens) == (before.query_tokens, before.hit_tokens)
        kv.check_invariants()

    @pytest.mark.spec("KVM-037")
    def test_a_fork_on_a_page_boundary_copies_nothing(self, make_kv_manager: MakeKVManager) -> None:
        """A reservation of whole pages is shared whole: no copy, no page taken."""
        kv = forking(make_kv_manager(8, SIZE))
        run_prompt(kv, 1, ALIGNED)
        before = kv.stats()
        fork = kv.fork(1, 2)
        assert fork.copies == ()
        assert fork.page_table.pages == kv.page_table(1).pages
        assert kv.stats().pages_in_use == before.pages_in_use
        assert_ref_counts_match_holders(kv, [1, 2])
        kv.check_invariants()

    # -- all or nothing -----------------------------------------------------------------------

    @pytest.mark.spec("KVM-038", "KVM-002")
    def test_a_refused_fork_changes_nothing(self, make_kv_manager: MakeKVManager) -> None:
        """Forking an unknown or freed sequence, onto a live id, or with no page left for the
        copy raises the typed error and leaves every page table, ref count and stat as it
        was; the same fork succeeds once a page is free."""
        kv = prompt_manager(make_kv_manager, caching=False, num_pages=4)
        kv.allocate(6, tokens(950, 2), 2)
        kv.free(6)  # freed: a DoubleFree to fork
        run_prompt(kv, 5, tokens(900, 3))  # the last free page
        cases: list[tuple[Callable[[], object], type[PagedKVError]]] = [
            (lambda: kv.fork(77, 2), UnknownSequence),
            (lambda: kv.fork(6, 2), DoubleFree),
            (lambda: kv.fork(1, 5), DuplicateSequence),
            (lambda: kv.fork(1, 1), DuplicateSequence),
            (lambda: kv.fork(1, 2), OutOfPages),
        ]
        for call, error in cases:
            before = snapshot(kv, [1, 5], [(PROMPT, None)])
            with pytest.raises(error):
                call()
            assert snapshot(kv, [1, 5], [(PROMPT, None)]) == before, error.__name__
            kv.check_invariants()
        with pytest.raises(UnknownSequence):
            kv.page_table(2)
        kv.free(5)
        assert kv.fork(1, 2).page_table.pages[:2] == kv.page_table(1).pages[:2]

    # -- independent afterwards ---------------------------------------------------------------

    @pytest.mark.spec("KVM-039")
    @pytest.mark.parametrize("caching", [pytest.param(True, marks=CACHING), False])
    def test_forked_sequences_are_independent(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """Growing the fork leaves the parent's table as it was; freeing the parent leaves
        the fork holding the shared pages (ref count 1, still in use); freeing the fork then
        returns every page exactly once."""
        kv = prompt_manager(make_kv_manager, caching)
        parent = kv.page_table(1)
        kv.fork(1, 2)
        grown = kv.grow(2, 17)
        assert len(grown.pages) == 5
        assert kv.page_table(1) == parent
        kv.free(1)
        assert kv.page_table(2) == grown
        assert [kv.ref_count(p) for p in grown.pages] == [1] * 5
        assert_ref_counts_match_holders(kv, [2])
        kv.free(2)
        stats = assert_accounting(kv)
        assert stats.pages_in_use == 0
        assert all(kv.ref_count(p) == 0 for p in range(kv.num_pages))
        kv.check_invariants()

    @pytest.mark.spec("KVM-039")
    @CACHING
    def test_a_fork_continues_the_parents_chain(self, make_kv_manager: MakeKVManager) -> None:
        """The fork's pages the parent committed count as committed for it: the fork fills
        its own third page and commits it, and a prompt of the fork's tokens then hits all
        three pages, the parent's two and the fork's; the parent's own third page stays its
        own."""
        kv = prompt_manager(make_kv_manager)
        parent = kv.page_table(1)
        kv.fork(1, 2)
        mine = [*PROMPT, 41, 42]
        kv.grow(2, len(mine))
        assert kv.commit(2, mine) == 1  # only its own third page is new
        table = kv.page_table(2)
        match = kv.match_prefix([*mine, 43])
        assert match.hit_pages == table.pages[:3]
        assert match.hit_pages[:2] == parent.pages[:2]
        kv.grow(1, 12)
        assert kv.commit(1, [*PROMPT, 51, 52]) == 1
        other = kv.match_prefix([*PROMPT, 51, 52, 53])
        assert other.hit_pages == (*parent.pages[:2], kv.page_table(1).pages[2])
        kv.check_invariants()

    @pytest.mark.spec("KVM-039")
    @CACHING
    def test_pages_shared_by_a_fork_are_published_once(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """Forked before its pages were committed, whichever of the two commits first
        publishes them, the other publishes nothing more, and a later prompt hits them on
        the shared pages."""
        kv = forking(make_kv_manager(8, SIZE))
        kv.allocate(1, ALIGNED, len(ALIGNED))
        kv.fork(1, 2)
        assert kv.commit(2, ALIGNED) == 2
        assert kv.commit(1, ALIGNED) == 0
        assert kv.stats().pages_indexed == 2
        match = kv.match_prefix([*ALIGNED, 1])
        assert match.hit_pages == kv.page_table(1).pages
        kv.free(1)
        kv.free(2)
        assert kv.stats().pages_cached == 2
        kv.check_invariants()

    @pytest.mark.spec("KVM-039")
    @CACHING
    def test_the_second_to_commit_a_shared_page_publishes_what_follows(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """The fork commits the shared pages first; the parent, committing them after, finds
        them published on its own pages and continues the chain: its next page is published,
        and a prompt of its tokens hits all three."""
        kv = forking(make_kv_manager(8, SIZE))
        kv.allocate(1, ALIGNED, len(ALIGNED))
        kv.fork(1, 2)
        assert kv.commit(2, ALIGNED) == 2
        assert kv.commit(1, ALIGNED) == 0
        longer = [*ALIGNED, 61, 62, 63, 64]
        kv.grow(1, len(longer))
        assert kv.commit(1, longer) == 1
        assert kv.match_prefix([*longer, 65]).hit_pages == kv.page_table(1).pages
        kv.check_invariants()

    @pytest.mark.spec("KVM-039", "KVM-036")
    @CACHING
    def test_a_fork_has_no_pages_in_flight(
        self, make_kv_manager: MakeKVManager, backend_variants: dict[str, str]
    ) -> None:
        """The parent's uncommitted prompt pages are in flight while the parent lives (none
        under the declared ``in-flight=untracked``); the fork holding them adds none, so once
        the parent is freed none is in flight."""
        kv = forking(make_kv_manager(8, SIZE))
        kv.allocate(1, PROMPT, len(PROMPT))
        kv.fork(1, 2)
        in_flight = 8 if tracks_in_flight(backend_variants) else 0
        assert kv.match_prefix(PROMPT).num_in_flight_tokens == in_flight
        kv.free(1)
        assert kv.match_prefix(PROMPT).num_in_flight_tokens == 0
        assert kv.match_prefix(PROMPT).num_cached_tokens == 0
        kv.check_invariants()
