"""Example-based conformance tests of a KVManager (specs/kv-manager.md).

:class:`KVManagerSuite` holds the tests; it is not collected by itself (its name does not start
with ``Test``). ``test_kv_manager.py`` runs it against the backend named by ``--backend``; a
third party can run it against anything that provides a ``make_kv_manager`` fixture::

    from pagedkv_conformance.suite_kv_manager import KVManagerSuite

    class TestMyManager(KVManagerSuite):
        @pytest.fixture
        def make_kv_manager(self) -> MakeKVManager: ...

        @pytest.fixture
        def backend_capabilities(self) -> frozenset[str]:
            return frozenset({"prefix_caching", "eviction", "reset"})

Everything is observed through the :class:`pagedkv.interfaces.KVManager` Protocol only (stats,
page tables, reference counts, ``cached_prefix_length``): no test reads a backend's internals.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest

from pagedkv.errors import (
    DoubleFree,
    DuplicateSequence,
    InvalidRequest,
    OutOfPages,
    PagedKVError,
    PagesInUse,
    UnknownSequence,
)
from pagedkv.interfaces import Allocation, KVManager, KVStats, PageTable

from .loading import MakeKVManager
from .oracle import KVOracle, pages_for

Prompt = tuple[tuple[int, ...], str | None]

CACHING = pytest.mark.requires("prefix_caching")
EVICTION = pytest.mark.requires("prefix_caching", "eviction")
RESET = pytest.mark.requires("prefix_caching", "reset")


# -- helpers ---------------------------------------------------------------------------------


def tokens(start: int, length: int) -> list[int]:
    """``length`` consecutive token ids from ``start``: distinct starts share nothing."""
    return list(range(start, start + length))


def run_prompt(
    kv: KVManager, seq_id: int, prompt: Sequence[int], salt: str | None = None
) -> Allocation:
    """Allocate a whole prompt (the part the cache does not serve), then commit all of it."""
    cached = kv.cached_prefix_length(prompt, salt)
    alloc = kv.allocate(seq_id, prompt, len(prompt) - cached, salt)
    assert alloc.num_cached_tokens == cached, (
        f"allocate took {alloc.num_cached_tokens} cached tokens but cached_prefix_length "
        f"reported {cached} (KVM-032)"
    )
    kv.commit(seq_id, prompt)
    return alloc


def cache_prompt(
    kv: KVManager, seq_id: int, prompt: Sequence[int], salt: str | None = None
) -> PageTable:
    """Run a prompt, commit it and free it: its full pages become cached. Returns its table."""
    run_prompt(kv, seq_id, prompt, salt)
    table = kv.page_table(seq_id)
    kv.free(seq_id)
    return table


def cache_pages(kv: KVManager, seq_id: int, start: int, num_pages: int) -> PageTable:
    """Reserve exactly ``num_pages`` full pages for a fresh prompt, commit them all and free
    the sequence: all ``num_pages`` become cached. Returns its table."""
    size = kv.page_size
    prompt = tokens(start, num_pages * size + 1)
    kv.allocate(seq_id, prompt, num_pages * size)
    kv.commit(seq_id, prompt[: num_pages * size])
    table = kv.page_table(seq_id)
    kv.free(seq_id)
    return table


def assert_accounting(kv: KVManager) -> KVStats:
    """KVM-010: in use + free + cached == total, every count in range."""
    stats = kv.stats()
    assert stats.num_pages == kv.num_pages
    assert min(stats.pages_in_use, stats.pages_free, stats.pages_cached) >= 0
    total = stats.pages_in_use + stats.pages_free + stats.pages_cached
    assert total == stats.num_pages, f"in use + free + cached = {total} != {stats.num_pages}"
    return stats


def assert_ref_counts_match_holders(kv: KVManager, live: Sequence[int]) -> Counter[int]:
    """KVM-015: every page's ref count equals the live page tables holding it; returns them."""
    holders: Counter[int] = Counter()
    for seq_id in live:
        pages = kv.page_table(seq_id).pages
        assert len(set(pages)) == len(pages), f"sequence {seq_id} holds a page twice: {pages}"
        holders.update(pages)
    for page in range(kv.num_pages):
        assert kv.ref_count(page) == holders[page], (
            f"page {page}: ref count {kv.ref_count(page)} but {holders[page]} holders"
        )
    assert kv.stats().pages_in_use == len(holders)
    return holders


@dataclass(frozen=True)
class Snapshot:
    """Everything the Protocol shows of a manager (pure queries only)."""

    stats: KVStats
    page_tables: tuple[PageTable, ...]
    ref_counts: tuple[int, ...]
    cached: tuple[int, ...]


def snapshot(kv: KVManager, live: Sequence[int], prompts: Sequence[Prompt]) -> Snapshot:
    """Stats, the page tables of ``live``, every page's ref count and the cached prefix of
    every prompt in ``prompts``."""
    stats = kv.stats()
    return Snapshot(
        stats=stats,
        page_tables=tuple(kv.page_table(s) for s in live),
        ref_counts=tuple(kv.ref_count(p) for p in range(kv.num_pages)),
        cached=tuple(kv.cached_prefix_length(list(t), salt) for t, salt in prompts),
    )


def eviction_trace(
    kv: KVManager, prompts: Sequence[Prompt], first_id: int = 10_000
) -> list[tuple[KVStats, tuple[int, ...]]]:
    """Fill the pool one fresh page at a time and record, after each page, the stats and the
    cached prefix of every prompt: the order in which prefixes vanish is the LRU order."""
    trace: list[tuple[KVStats, tuple[int, ...]]] = []
    for i in range(kv.num_pages + 1):
        try:
            kv.allocate(first_id + i, [1_000_000 + i], 1)
        except OutOfPages:
            return trace
        cached = tuple(kv.cached_prefix_length(list(t), salt) for t, salt in prompts)
        trace.append((kv.stats(), cached))
    raise AssertionError(f"{kv.num_pages + 1} one-page sequences fit in {kv.num_pages} pages")


# -- a shared scenario -----------------------------------------------------------------------

#: Prompts of :func:`busy_manager` (page size 2): A is live as sequence 1 and hit by sequence
#: 4; B and C were run and freed, so their full pages are cached; D was never seen.
PROMPT_A = tuple(tokens(100, 5))
PROMPT_B = tuple(tokens(200, 5))
PROMPT_C = tuple(tokens(300, 5))
PROMPT_A2 = (*PROMPT_A[:4], 901, 902, 903)
PROMPT_D = tuple(tokens(400, 5))
BUSY_PROMPTS: tuple[Prompt, ...] = tuple(
    (p, None) for p in (PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_A2, PROMPT_D)
)
BUSY_LIVE = (1, 4)


def busy_manager(make: MakeKVManager, caching: bool = True) -> KVManager:
    """A manager of 10 pages of 2 tokens with pages in every state.

    With caching: sequence 1 holds A (3 pages, 2 published), sequence 4 shares A's 2 full
    pages and holds 2 of its own; B's and C's 2 full pages each are cached, C's more recent;
    1 page is free. Without caching: the same calls, so nothing is cached or shared.
    """
    kv = make(10, 2, caching)
    run_prompt(kv, 1, PROMPT_A)
    cache_prompt(kv, 2, PROMPT_B)
    cache_prompt(kv, 3, PROMPT_C)
    run_prompt(kv, 4, PROMPT_A2)
    return kv


WITH_AND_WITHOUT_CACHING = pytest.mark.parametrize(
    "caching",
    [pytest.param(True, marks=EVICTION, id="caching"), pytest.param(False, id="no-caching")],
)


def _error_calls() -> list[object]:
    """(call, expected error) pairs that must fail on :func:`busy_manager` (KVM-002)."""
    calls: list[tuple[str, Callable[[KVManager], object], type[PagedKVError]]] = [
        ("free-freed", lambda kv: kv.free(2), DoubleFree),
        ("free-unknown", lambda kv: kv.free(77), UnknownSequence),
        ("grow-unknown", lambda kv: kv.grow(77, 4), UnknownSequence),
        ("commit-unknown", lambda kv: kv.commit(77, [1]), UnknownSequence),
        ("page-table-unknown", lambda kv: kv.page_table(77), UnknownSequence),
        ("allocate-live-id", lambda kv: kv.allocate(1, [5, 6], 1), DuplicateSequence),
        ("allocate-empty", lambda kv: kv.allocate(9, [], 1), InvalidRequest),
        ("allocate-zero-tokens", lambda kv: kv.allocate(9, list(PROMPT_A), 0), InvalidRequest),
        ("grow-below", lambda kv: kv.grow(1, 2), InvalidRequest),
        ("commit-past", lambda kv: kv.commit(1, tokens(100, 6)), InvalidRequest),
        ("ref-count-negative", lambda kv: kv.ref_count(-1), InvalidRequest),
        ("allocate-too-big", lambda kv: kv.allocate(9, [*PROMPT_A, *range(40)], 40), OutOfPages),
        ("grow-too-big", lambda kv: kv.grow(4, 60), OutOfPages),
    ]
    params: list[object] = [pytest.param(call, err, id=name) for name, call, err in calls]
    params.append(
        pytest.param(
            lambda kv: kv.reset_prefix_cache(),
            PagesInUse,
            id="reset-in-use",
            marks=pytest.mark.requires("reset"),
        )
    )
    return params


# -- the suite -------------------------------------------------------------------------------


class KVManagerSuite:
    """Example tests of every MUST of specs/kv-manager.md that the Protocol can observe.

    Subclass it with a ``make_kv_manager`` fixture (and ``backend_capabilities``) to test a
    KVManager; the plugin provides both for the ``--backend`` under test.
    """

    # -- KVM-001 / KVM-002: all or nothing ---------------------------------------------------

    @pytest.mark.spec("KVM-001")
    @WITH_AND_WITHOUT_CACHING
    def test_allocate_out_of_pages_changes_nothing(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """An allocate that hits cached pages but needs more fresh pages than are free or
        evictable raises OutOfPages, and stats, page tables, every ref count, the cached
        prefix of every known prompt and the LRU order (probed by evicting everything, and
        compared with a twin manager that never saw the call) are exactly as before."""
        kv, twin = busy_manager(make_kv_manager, caching), busy_manager(make_kv_manager, caching)
        before = snapshot(kv, BUSY_LIVE, BUSY_PROMPTS)
        big = [*PROMPT_A[:4], *tokens(500, 20)]
        with pytest.raises(OutOfPages):
            kv.allocate(5, big, 20)
        assert snapshot(kv, BUSY_LIVE, BUSY_PROMPTS) == before
        with pytest.raises(UnknownSequence):
            kv.page_table(5)
        kv.check_invariants()
        assert eviction_trace(kv, BUSY_PROMPTS) == eviction_trace(twin, BUSY_PROMPTS)
        # The scheduler can retry with something smaller.
        kv.free(1)
        assert kv.allocate(5, big, 1).page_table.num_tokens >= 1

    @pytest.mark.spec("KVM-001")
    @WITH_AND_WITHOUT_CACHING
    def test_grow_out_of_pages_changes_nothing(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """A grow that needs more pages than are free or evictable raises OutOfPages and
        moves nothing: the sequence keeps its reservation and pages, and nothing else moves
        (snapshot and twin eviction order as for allocate)."""
        kv, twin = busy_manager(make_kv_manager, caching), busy_manager(make_kv_manager, caching)
        before = snapshot(kv, BUSY_LIVE, BUSY_PROMPTS)
        with pytest.raises(OutOfPages):
            kv.grow(4, 4 * kv.num_pages)
        assert snapshot(kv, BUSY_LIVE, BUSY_PROMPTS) == before
        kv.check_invariants()
        assert eviction_trace(kv, BUSY_PROMPTS) == eviction_trace(twin, BUSY_PROMPTS)

    @pytest.mark.spec("KVM-002", "KVM-013", "KVM-014", "KVM-003")
    @pytest.mark.parametrize(("call", "error"), _error_calls())
    @EVICTION
    def test_failed_call_changes_nothing(
        self,
        make_kv_manager: MakeKVManager,
        call: Callable[[KVManager], object],
        error: type[PagedKVError],
    ) -> None:
        """Each call that raises a PagedKVError raises the documented type and leaves the
        manager exactly as it was, LRU order included (twin comparison)."""
        kv, twin = busy_manager(make_kv_manager), busy_manager(make_kv_manager)
        before = snapshot(kv, BUSY_LIVE, BUSY_PROMPTS)
        with pytest.raises(error):
            call(kv)
        assert snapshot(kv, BUSY_LIVE, BUSY_PROMPTS) == before
        kv.check_invariants()
        assert eviction_trace(kv, BUSY_PROMPTS) == eviction_trace(twin, BUSY_PROMPTS)

    # -- KVM-003: argument ranges ------------------------------------------------------------

    @pytest.mark.spec("KVM-003")
    @pytest.mark.parametrize(
        "call",
        [
            pytest.param(lambda kv: kv.allocate(2, [], 1), id="empty-prompt"),
            pytest.param(lambda kv: kv.cached_prefix_length([]), id="empty-lookup"),
            pytest.param(lambda kv: kv.cached_prefix_length([], "s"), id="empty-salted-lookup"),
            pytest.param(lambda kv: kv.allocate(2, [1, 2], 0), id="zero-new-tokens"),
            pytest.param(lambda kv: kv.allocate(2, [1, 2], -3), id="negative-new-tokens"),
            pytest.param(lambda kv: kv.grow(1, 2), id="grow-below-reservation"),
            pytest.param(lambda kv: kv.grow(1, 0), id="grow-to-zero"),
            pytest.param(lambda kv: kv.commit(1, [1, 2, 3, 4, 5, 6]), id="commit-past"),
            pytest.param(lambda kv: kv.ref_count(-1), id="negative-page"),
            pytest.param(lambda kv: kv.ref_count(kv.num_pages), id="page-past-the-pool"),
        ],
    )
    def test_out_of_range_arguments_raise_invalid_request(
        self, make_kv_manager: MakeKVManager, call: Callable[[KVManager], object]
    ) -> None:
        """Empty prompts (to allocate or to the read-only cached_prefix_length),
        num_new_tokens < 1, a grow below the reservation, a commit past it and a negative page
        id raise InvalidRequest (and nothing moves)."""
        kv = make_kv_manager(8, 4)
        kv.allocate(1, [1, 2, 3, 4, 5], 5)
        before = snapshot(kv, [1], [((1, 2, 3, 4, 5), None)])
        with pytest.raises(InvalidRequest):
            call(kv)
        assert snapshot(kv, [1], [((1, 2, 3, 4, 5), None)]) == before

    # -- KVM-005 / KVM-006: page tables ------------------------------------------------------

    @pytest.mark.spec("KVM-005", "KVM-010", "KVM-023")
    @CACHING
    def test_a_pool_of_one_page_works(self, make_kv_manager: MakeKVManager) -> None:
        """The smallest pool: one sequence at a time; its published page stays cached, cannot
        be evicted for an allocation hitting it (which needs a second page), and is evicted
        for another prompt."""
        kv = make_kv_manager(1, 2)
        first = kv.allocate(1, [5, 6], 2).page_table.pages
        assert len(first) == 1
        with pytest.raises(OutOfPages):
            kv.allocate(2, [1], 1)
        kv.commit(1, [5, 6])
        kv.free(1)
        assert kv.stats().pages_cached == 1
        assert kv.cached_prefix_length([5, 6, 7]) == 2
        with pytest.raises(OutOfPages):
            kv.allocate(3, [5, 6, 7], 1)  # the hit page plus one more
        other = kv.allocate(4, [8], 1)
        assert other.page_table.pages == first
        assert kv.stats().evictions == 1
        kv.check_invariants()

    @pytest.mark.spec("KVM-065", "KVM-005")
    @pytest.mark.parametrize("page_size", [1, 2, 16, 256])
    def test_a_manager_has_the_page_size_it_was_made_with(
        self, make_kv_manager: MakeKVManager, page_size: int
    ) -> None:
        """A manager made with a page size the backend declares (every size if it declares
        none) has that page size, and a one-page prompt of that many tokens takes one page;
        a size it does not declare skips this case, naming the size."""
        kv = make_kv_manager(4, page_size)
        assert kv.page_size == page_size
        table = kv.allocate(1, tokens(1, page_size + 1), page_size + 1).page_table
        assert (table.page_size, len(table.pages)) == (page_size, 2)
        kv.check_invariants()

    @pytest.mark.spec("KVM-005")
    @pytest.mark.parametrize("page_size", [1, 3, 4])
    def test_page_table_size_and_slots(
        self, make_kv_manager: MakeKVManager, page_size: int
    ) -> None:
        """A page table holds ceil(num_tokens / page_size) distinct pages of the pool, the
        slot of position p is pages[p // page_size] * page_size + p % page_size, and sequences
        that share no prefix share no slot."""
        kv = make_kv_manager(40, page_size)
        slots_seen: set[int] = set()
        for seq_id, num_tokens in enumerate([1, 3, 4, 5, 8, 9], start=1):
            table = kv.allocate(seq_id, tokens(1000 * seq_id, num_tokens), num_tokens).page_table
            assert (table.seq_id, table.page_size, table.num_tokens) == (
                seq_id,
                page_size,
                num_tokens,
            )
            assert table == kv.page_table(seq_id)
            assert len(table.pages) == pages_for(num_tokens, page_size)
            assert len(set(table.pages)) == len(table.pages)
            assert all(0 <= p < kv.num_pages for p in table.pages)
            slots = table.slots(0, num_tokens)
            for p in range(num_tokens):
                assert slots[p] == table.pages[p // page_size] * page_size + p % page_size
            assert not slots_seen.intersection(slots)
            slots_seen.update(slots)
        kv.check_invariants()

    @pytest.mark.spec("KVM-006", "KVM-005")
    def test_grow_appends_and_never_moves_pages(self, make_kv_manager: MakeKVManager) -> None:
        """Growing appends pages only when the reservation crosses a page boundary, and the
        pages already reserved never change, whatever other sequences do meanwhile."""
        kv = make_kv_manager(16, 4)
        table = kv.allocate(1, [1, 2, 3], 3).page_table
        history = [table.pages]
        for seq_id, num_tokens in enumerate([3, 4, 5, 8, 9, 16, 17], start=100):
            kv.allocate(seq_id, [seq_id], 1)  # interleave another sequence
            if seq_id % 2:
                kv.free(seq_id)
            table = kv.grow(1, num_tokens)
            assert table == kv.page_table(1)
            assert table.num_tokens == num_tokens
            assert len(table.pages) == pages_for(num_tokens, 4)
            assert table.pages[: len(history[-1])] == history[-1]
            history.append(table.pages)
        kv.commit(1, tokens(1, 16))
        assert kv.page_table(1).pages == history[-1]
        kv.check_invariants()

    # -- KVM-010 / KVM-011 / KVM-012 / KVM-031: accounting -----------------------------------

    @pytest.mark.spec("KVM-010", "KVM-031")
    @WITH_AND_WITHOUT_CACHING
    def test_accounting_identity_holds_throughout(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """Through a mixed workload (shared prefixes, grows, commits, frees, pool pressure),
        pages in use + free + cached == total after every call, ref counts equal holders and
        check_invariants() passes on the healthy manager."""
        kv = make_kv_manager(12, 2, caching)
        for live in _workload(kv, seed=7, steps=120):
            assert_accounting(kv)
            assert_ref_counts_match_holders(kv, live)
            kv.check_invariants()

    @pytest.mark.spec("KVM-011", "KVM-016")
    def test_every_page_is_handed_out_once(self, make_kv_manager: MakeKVManager) -> None:
        """Filling the pool hands out every page exactly once; freed pages come back exactly
        once each (no page is on the free list twice), and the pool is then full again."""
        kv = make_kv_manager(6, 2, False)
        pages = [kv.allocate(s, [s], 1).page_table.pages[0] for s in range(6)]
        assert sorted(pages) == list(range(6))
        with pytest.raises(OutOfPages):
            kv.allocate(6, [6], 1)
        for s in (1, 3, 4):
            kv.free(s)
        assert kv.stats().pages_free == 3
        again = [kv.allocate(s, [s], 1).page_table.pages[0] for s in (10, 11, 12)]
        assert sorted(again) == sorted(pages[s] for s in (1, 3, 4))
        with pytest.raises(OutOfPages):
            kv.allocate(13, [13], 1)
        assert_ref_counts_match_holders(kv, [0, 2, 5, 10, 11, 12])
        kv.check_invariants()

    @pytest.mark.spec("KVM-011", "KVM-024")
    @EVICTION
    def test_cached_pages_are_handed_out_once(self, make_kv_manager: MakeKVManager) -> None:
        """With the pool full of cached pages, fresh allocations evict each cached page once
        and hand out every page exactly once; then the pool is exhausted."""
        kv = make_kv_manager(6, 2)
        cache_pages(kv, 1, 10, 3)
        cache_pages(kv, 2, 20, 3)
        stats = assert_accounting(kv)
        assert stats.pages_free == 0
        assert stats.pages_cached == 6
        pages = [kv.allocate(s, [s], 1).page_table.pages[0] for s in range(100, 106)]
        assert sorted(pages) == list(range(6))
        with pytest.raises(OutOfPages):
            kv.allocate(106, [1], 1)
        stats = assert_accounting(kv)
        assert (stats.pages_in_use, stats.pages_cached, stats.pages_indexed) == (6, 0, 0)
        kv.check_invariants()

    @pytest.mark.spec("KVM-012")
    @WITH_AND_WITHOUT_CACHING
    def test_free_returns_every_page_exactly_once(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """Once every sequence (shared pages included) is freed, no page is in use, free +
        cached == total, and the whole pool can be reserved again by one sequence."""
        kv = busy_manager(make_kv_manager, caching)
        kv.free(1)
        stats = assert_accounting(kv)
        assert stats.pages_in_use == 4  # sequence 4 holds 4 pages (2 of them A's, if caching)
        kv.free(4)
        stats = assert_accounting(kv)
        assert stats.pages_in_use == 0
        assert stats.pages_free + stats.pages_cached == kv.num_pages
        if not caching:
            assert stats.pages_free == kv.num_pages
        assert all(kv.ref_count(p) == 0 for p in range(kv.num_pages))
        table = kv.allocate(50, [7], kv.num_pages * kv.page_size).page_table
        assert sorted(table.pages) == list(range(kv.num_pages))
        kv.check_invariants()

    # -- KVM-013 / KVM-014: sequence ids -----------------------------------------------------

    @pytest.mark.spec("KVM-013")
    def test_double_free_and_unknown_ids(self, make_kv_manager: MakeKVManager) -> None:
        """Freeing twice raises DoubleFree; freeing, growing, committing or reading the page
        table of a never-allocated id raises UnknownSequence (and not DoubleFree)."""
        kv = make_kv_manager(8, 2)
        kv.allocate(1, [1, 2, 3], 3)
        kv.free(1)
        with pytest.raises(DoubleFree):
            kv.free(1)
        calls: list[Callable[[], object]] = [
            lambda: kv.free(42),
            lambda: kv.grow(42, 4),
            lambda: kv.commit(42, [1, 2]),
            lambda: kv.page_table(42),
        ]
        for call in calls:
            with pytest.raises(UnknownSequence) as info:
                call()
            assert not isinstance(info.value, DoubleFree)
        assert kv.stats().pages_in_use == 0
        kv.check_invariants()

    @pytest.mark.spec("KVM-014")
    def test_allocating_a_live_id_raises_duplicate(self, make_kv_manager: MakeKVManager) -> None:
        """Allocating an id that holds pages raises DuplicateSequence and keeps its table;
        once freed, the id can be allocated again."""
        kv = make_kv_manager(8, 2)
        table = kv.allocate(1, [1, 2, 3], 3).page_table
        with pytest.raises(DuplicateSequence):
            kv.allocate(1, [4, 5], 2)
        assert kv.page_table(1) == table
        assert kv.stats().pages_in_use == 2
        kv.free(1)
        assert kv.allocate(1, [4, 5], 2).page_table.num_tokens == 2
        kv.check_invariants()

    # -- KVM-015 / KVM-016: sharing ----------------------------------------------------------

    @pytest.mark.spec("KVM-015")
    @CACHING
    def test_ref_counts_equal_holders_of_shared_pages(self, make_kv_manager: MakeKVManager) -> None:
        """Sequences hitting one committed prompt share its full pages: each shared page's ref
        count equals the number of sequences holding it, private pages count 1, and counts
        fall by one per free."""
        kv = make_kv_manager(16, 2)
        prompt = tokens(1, 5)
        run_prompt(kv, 1, prompt)
        shared = kv.page_table(1).pages[:2]
        for seq_id in (2, 3):
            alloc = kv.allocate(seq_id, prompt, 1)
            assert alloc.num_cached_tokens == 4
            assert alloc.page_table.pages[:2] == shared
        holders = assert_ref_counts_match_holders(kv, [1, 2, 3])
        assert [holders[p] for p in shared] == [3, 3]
        assert [kv.ref_count(p) for p in shared] == [3, 3]
        kv.free(2)
        assert [kv.ref_count(p) for p in shared] == [2, 2]
        assert_ref_counts_match_holders(kv, [1, 3])
        kv.free(1)
        assert_ref_counts_match_holders(kv, [3])
        kv.check_invariants()

    @pytest.mark.spec("KVM-016", "KVM-015")
    @EVICTION
    def test_held_pages_are_never_handed_out_fresh(self, make_kv_manager: MakeKVManager) -> None:
        """After the publisher of a shared prefix is freed, the pages its sharers still hold
        are never given to anyone as fresh pages, even when the pool runs dry and cached
        pages are evicted; num_new_pages counts exactly the fresh pages."""
        kv = busy_manager(make_kv_manager)
        kv.free(1)  # A's full pages stay held by sequence 4
        held = set(kv.page_table(4).pages)
        for seq_id in range(20, 40):
            try:
                alloc = kv.allocate(seq_id, tokens(50 * seq_id, 3), 3)
            except OutOfPages:
                break
            fresh = alloc.page_table.pages[alloc.num_cached_tokens // kv.page_size :]
            assert alloc.num_new_pages == len(fresh)
            assert not held.intersection(fresh), f"held page handed out fresh: {fresh}"
            held.update(fresh)
            assert_ref_counts_match_holders(kv, [4, *range(20, seq_id + 1)])
        else:
            pytest.fail("the pool never ran dry")
        assert kv.stats().pages_in_use == kv.num_pages
        kv.check_invariants()

    # -- KVM-020 .. KVM-022: publication -----------------------------------------------------

    @pytest.mark.spec("KVM-020")
    @CACHING
    def test_only_full_pages_are_published(self, make_kv_manager: MakeKVManager) -> None:
        """commit publishes only pages whose page_size positions are all committed tokens,
        each once; a partial page is published when a later commit fills it."""
        kv = make_kv_manager(16, 4)
        prompt = tokens(1, 10)
        kv.allocate(1, prompt, 10)
        assert kv.commit(1, prompt[:3]) == 0
        assert kv.stats().pages_indexed == 0
        assert kv.commit(1, prompt[:7]) == 1
        assert kv.commit(1, prompt) == 1  # the 2nd page; the 3rd holds only 2 tokens
        assert kv.commit(1, prompt) == 0
        assert kv.stats().pages_indexed == 2
        longer = [*prompt, 11, 12, 13]
        assert kv.cached_prefix_length(longer) == 8
        kv.grow(1, 12)
        assert kv.commit(1, longer[:12]) == 1
        assert kv.stats().pages_indexed == 3
        assert kv.cached_prefix_length(longer) == 12
        kv.check_invariants()

    @pytest.mark.spec("KVM-020", "KVM-022")
    @CACHING
    def test_keys_chain_the_whole_prefix(self, make_kv_manager: MakeKVManager) -> None:
        """A page's entry depends on every token before it: a prompt whose second page equals
        a published second page but whose first page differs hits nothing."""
        kv = make_kv_manager(16, 4)
        prompt = tokens(1, 13)
        run_prompt(kv, 1, prompt)
        assert kv.cached_prefix_length([*prompt[:4], 77, 77, 77, 77, 1]) == 4
        assert kv.cached_prefix_length([77, 77, 77, 77, *prompt[4:8], 1]) == 0
        assert kv.cached_prefix_length([*prompt[4:8], *prompt[:4], 1]) == 0
        alloc = kv.allocate(2, [77, 77, 77, 77, *prompt[4:12], 1], 13)
        assert alloc.num_cached_tokens == 0
        assert not set(alloc.page_table.pages) & set(kv.page_table(1).pages)
        kv.check_invariants()

    @pytest.mark.spec("KVM-021")
    @CACHING
    def test_nothing_is_hit_before_commit(self, make_kv_manager: MakeKVManager) -> None:
        """Pages reserved but not committed are invisible: the same prompt hits nothing and
        gets its own pages, freeing an uncommitted sequence caches nothing, and each commit
        makes exactly the committed full pages hittable."""
        kv = make_kv_manager(16, 4)
        prompt = tokens(1, 9)
        kv.allocate(1, prompt, 9)
        assert kv.cached_prefix_length(prompt) == 0
        alloc = kv.allocate(2, prompt, 9)
        assert alloc.num_cached_tokens == 0
        assert not set(alloc.page_table.pages) & set(kv.page_table(1).pages)
        assert kv.stats().pages_indexed == 0
        kv.free(2)
        assert kv.stats().pages_cached == 0
        assert kv.commit(1, prompt[:4]) == 1
        assert kv.cached_prefix_length(prompt) == 4
        assert kv.commit(1, prompt) == 1
        assert kv.cached_prefix_length(prompt) == 8
        kv.check_invariants()

    @pytest.mark.spec("KVM-022")
    @CACHING
    def test_lookalike_prompts_never_share_pages(self, make_kv_manager: MakeKVManager) -> None:
        """Prompts built to collide under weak hashes (permuted tokens, equal sums, swapped
        salts) hit exactly the pages of the prompt whose tokens, salt and parents really
        match, as an obviously correct model computes, and never another prompt's pages."""
        kv = make_kv_manager(256, 2)
        model = KVOracle(256, 2, True)
        owner: dict[tuple[tuple[int, ...], str | None], tuple[int, ...]] = {}
        seq_ids = itertools.count(1)
        published: list[tuple[list[int], str | None]] = []
        for a, b, c, d in itertools.permutations(range(1, 5)):
            published.append(([a, b, c, d, 9], "x" if a == 4 else None))
        for a, b in itertools.product(range(4), repeat=2):
            published.append(([a + 5, b + 5, 0], None))
        for prompt, salt in published:
            seq_id = next(seq_ids)
            run_prompt(kv, seq_id, prompt, salt)
            model.allocate(seq_id, prompt, len(prompt), salt)
            model.commit(seq_id, prompt)
            pages = kv.page_table(seq_id).pages
            for n in (1, 2):
                owner.setdefault((tuple(prompt[: 2 * n]), salt), pages[:n])
        queries = [(p[:-1] + [8], s) for p, s in published]
        queries += [([d, c, b, a, 8], s) for (a, b, c, d, _), s in published[:24]]
        queries += [(p[:-1] + [8], "y" if s is None else None) for p, s in published]
        queries += [([a, b, 8], None) for a, b in itertools.product(range(10), repeat=2)]
        for query, salt in queries:
            expected = model.cached_prefix_length(query, salt)
            assert kv.cached_prefix_length(query, salt) == expected, (query, salt)
            seq_id = next(seq_ids)
            alloc = kv.allocate(seq_id, query, 1, salt)
            assert alloc.num_cached_tokens == expected, (query, salt)
            hit = alloc.page_table.pages[: expected // 2]
            if expected:
                assert hit == owner[(tuple(query[:expected]), salt)], (query, salt)
            kv.free(seq_id)
        kv.check_invariants()

    # -- KVM-023 .. KVM-026: caching and eviction --------------------------------------------

    @pytest.mark.spec("KVM-023")
    @EVICTION
    def test_freed_published_pages_stay_cached_until_evicted(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """Freeing a committed sequence caches its full pages (the partial one goes free);
        they survive allocations served by free pages and are hit again as the very same
        physical pages."""
        kv = make_kv_manager(9, 2)
        prompt = tokens(1, 5)
        table = cache_prompt(kv, 1, prompt)
        stats = assert_accounting(kv)
        assert (stats.pages_cached, stats.pages_free, stats.pages_indexed) == (2, 7, 2)
        kv.allocate(2, tokens(100, 12), 12)  # 6 of the 7 free pages
        stats = assert_accounting(kv)
        assert (stats.pages_cached, stats.pages_free, stats.evictions) == (2, 1, 0)
        assert kv.cached_prefix_length(prompt) == 4
        alloc = kv.allocate(3, prompt, 1)
        assert alloc.num_cached_tokens == 4
        assert alloc.page_table.pages[:2] == table.pages[:2]
        assert alloc.num_new_pages == 1
        stats = assert_accounting(kv)
        assert (stats.pages_cached, stats.pages_free, stats.evictions) == (0, 0, 0)
        kv.check_invariants()

    @pytest.mark.spec("KVM-024", "KVM-023")
    @EVICTION
    def test_eviction_is_lru_tail_first_and_only_when_free_list_is_empty(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """No cached page is evicted while a free page remains; then cached pages go least
        recently freed first, a chain's tail before its parent, and each evicted page loses
        its entry (its prefix is no longer hit, pages_indexed falls)."""
        kv = make_kv_manager(6, 2)
        a, b = tokens(10, 5), tokens(20, 5)
        cache_prompt(kv, 1, a)
        cache_prompt(kv, 2, b)
        assert (kv.stats().pages_cached, kv.stats().pages_free) == (4, 2)
        expected = [
            (0, 4, 4),  # two allocations use the free pages: nothing evicted
            (0, 4, 4),
            (1, 2, 4),  # then A (least recently freed) loses its tail first
            (2, 0, 4),
            (3, 0, 2),  # then B, tail first
            (4, 0, 0),
        ]
        for i, (evictions, cached_a, cached_b) in enumerate(expected):
            kv.allocate(100 + i, [100 + i], 1)
            stats = assert_accounting(kv)
            assert stats.evictions == evictions, i
            assert stats.pages_indexed == 4 - evictions
            assert (kv.cached_prefix_length(a), kv.cached_prefix_length(b)) == (
                cached_a,
                cached_b,
            ), i
        kv.check_invariants()

    @pytest.mark.spec("KVM-024")
    @EVICTION
    def test_a_hit_refreshes_recency(self, make_kv_manager: MakeKVManager) -> None:
        """A cached prefix that is hit and freed again becomes the most recently used: the
        other prefix, freed in between, is evicted first."""
        kv = make_kv_manager(8, 2)
        a, b = tokens(10, 5), tokens(20, 5)
        cache_prompt(kv, 1, a)
        cache_prompt(kv, 2, b)
        assert kv.allocate(3, a, 1).num_cached_tokens == 4
        kv.free(3)
        trace = eviction_trace(kv, [(tuple(a), None), (tuple(b), None)])
        vanish = [cached for _, cached in trace]
        assert (4, 2) in vanish
        assert (2, 4) not in vanish
        assert vanish[-1] == (0, 0)
        kv.check_invariants()

    @pytest.mark.spec("KVM-025")
    @CACHING
    @pytest.mark.parametrize("page_size", [1, 2, 4])
    def test_whole_prompt_hit_leaves_a_token(
        self, make_kv_manager: MakeKVManager, page_size: int
    ) -> None:
        """A prompt found whole in the cache is served at most len(prompt) - 1 tokens, in
        whole pages; one more token after it gets the whole prompt from the cache."""
        kv = make_kv_manager(32, page_size)
        prompt = tokens(1, 2 * page_size)
        run_prompt(kv, 1, prompt)
        expected = (len(prompt) - 1) // page_size * page_size
        assert kv.cached_prefix_length(prompt) == expected
        alloc = kv.allocate(2, prompt, 1)
        assert alloc.num_cached_tokens == expected < len(prompt)
        assert kv.cached_prefix_length([*prompt, 99]) == len(prompt)
        assert kv.cached_prefix_length(prompt[:1]) == 0
        kv.check_invariants()

    @pytest.mark.spec("KVM-026")
    @EVICTION
    def test_hit_pages_are_not_evicted_for_the_same_allocation(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """With the pool full of cached pages and the hit pages the least recently used, an
        allocation hitting them and needing as many fresh pages as there are other cached
        pages evicts those others, keeps its hits, and holds every page once."""
        kv = make_kv_manager(4, 2)
        a = tokens(10, 5)
        table_a = cache_pages(kv, 1, 10, 2)  # A's 2 pages: the least recently used
        cache_pages(kv, 2, 20, 1)
        cache_pages(kv, 3, 30, 1)
        stats = assert_accounting(kv)
        assert (stats.pages_free, stats.pages_cached) == (0, 4)
        alloc = kv.allocate(4, a, 3)  # 2 hit pages + 2 fresh ones
        pages = alloc.page_table.pages
        assert alloc.num_cached_tokens == 4
        assert pages[:2] == table_a.pages
        assert len(set(pages)) == 4, f"a page is both hit and fresh: {pages}"
        assert alloc.num_new_pages == 2
        assert_ref_counts_match_holders(kv, [4])
        stats = assert_accounting(kv)
        assert (stats.pages_in_use, stats.evictions, stats.pages_indexed) == (4, 2, 2)
        assert kv.cached_prefix_length(tokens(20, 3)) == 0
        kv.free(4)
        assert kv.cached_prefix_length(a) == 4
        kv.check_invariants()

    @pytest.mark.spec("KVM-026", "KVM-001")
    @EVICTION
    def test_allocation_that_would_evict_its_own_hits_fails(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """With the pool full of cached pages, an allocation hitting some of them and needing
        more fresh pages than the other cached pages raises OutOfPages having moved nothing
        (its hit pages are not evicted), or succeeds using only the non-hit pages."""
        kv = make_kv_manager(3, 2)
        a = tokens(10, 8)
        table_a = cache_pages(kv, 1, 10, 2)
        cache_pages(kv, 2, 20, 1)
        prompts: list[Prompt] = [(tuple(a), None), (tuple(tokens(20, 3)), None)]
        before = snapshot(kv, [], prompts)
        assert (before.stats.pages_free, before.stats.pages_cached) == (0, 3)
        assert before.cached == (4, 2)
        try:
            alloc = kv.allocate(3, a, 4)  # 2 hit pages + 2 fresh, but 1 other cached page
        except OutOfPages:
            assert snapshot(kv, [], prompts) == before
        else:
            pages = alloc.page_table.pages
            hits = alloc.num_cached_tokens // 2
            assert len(set(pages)) == len(pages), f"a page is both hit and fresh: {pages}"
            assert pages[:hits] == table_a.pages[:hits]
            assert_ref_counts_match_holders(kv, [3])
        kv.check_invariants()

    # -- KVM-027: reset ----------------------------------------------------------------------

    @pytest.mark.spec("KVM-027")
    @RESET
    def test_reset_forgets_prefixes_and_refuses_while_in_use(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """reset_prefix_cache raises PagesInUse while a page is held and changes nothing;
        once idle it forgets every entry and returns every cached page to the free list."""
        kv = make_kv_manager(10, 2)
        a, b = tokens(10, 5), tokens(20, 5)
        cache_prompt(kv, 1, a)
        cache_prompt(kv, 2, b)
        kv.allocate(3, [1, 2, 3], 3)
        prompts: list[Prompt] = [(tuple(a), None), (tuple(b), None)]
        before = snapshot(kv, [3], prompts)
        with pytest.raises(PagesInUse):
            kv.reset_prefix_cache()
        assert snapshot(kv, [3], prompts) == before
        kv.free(3)
        evictions = kv.stats().evictions
        kv.reset_prefix_cache()
        stats = assert_accounting(kv)
        assert (stats.pages_free, stats.pages_cached, stats.pages_indexed) == (10, 0, 0)
        assert stats.evictions == evictions
        assert kv.cached_prefix_length(a) == kv.cached_prefix_length(b) == 0
        assert kv.allocate(4, a, 20).num_cached_tokens == 0
        kv.free(4)
        kv.reset_prefix_cache()  # idle and empty: a no-op
        kv.check_invariants()

    # -- KVM-028 / KVM-029: salts and the switch ---------------------------------------------

    @pytest.mark.spec("KVM-028")
    @CACHING
    def test_salts_isolate_and_equal_salts_share(self, make_kv_manager: MakeKVManager) -> None:
        """A prefix published under one salt is hit only under that salt: other salts and no
        salt get their own pages, equal salts (and None with None) share."""
        kv = make_kv_manager(32, 2)
        prompt = tokens(1, 5)
        run_prompt(kv, 1, prompt, "s1")
        for salt in ("s2", None):
            assert kv.cached_prefix_length(prompt, salt) == 0
        assert kv.cached_prefix_length(prompt, "s1") == 4
        other = run_prompt(kv, 2, prompt, "s2")
        assert other.num_cached_tokens == 0
        assert not set(other.page_table.pages) & set(kv.page_table(1).pages)
        same = kv.allocate(3, prompt, 1, "s1")
        assert same.page_table.pages[:2] == kv.page_table(1).pages[:2]
        run_prompt(kv, 4, prompt)
        unsalted = kv.allocate(5, prompt, 1)
        assert unsalted.num_cached_tokens == 4
        assert unsalted.page_table.pages[:2] == kv.page_table(4).pages[:2]
        assert not set(kv.page_table(4).pages) & (
            set(kv.page_table(1).pages) | set(kv.page_table(2).pages)
        )
        assert kv.stats().pages_indexed == 6
        assert_ref_counts_match_holders(kv, [1, 2, 3, 4, 5])
        kv.check_invariants()

    @pytest.mark.spec("KVM-028")
    @CACHING
    def test_equal_salts_built_at_run_time_share(self, make_kv_manager: MakeKVManager) -> None:
        """Salts are compared as strings, not as objects: a salt equal to the publisher's but
        built at run time (a different object, as one parsed from a request would be) hits
        its pages, and an unequal one does not."""
        kv = make_kv_manager(32, 2)
        prompt = tokens(1, 5)
        published = "".join(["tenant", "-", "a"])
        run_prompt(kv, 1, prompt, published)
        equal = "".join(list("tenant-a"))
        assert equal == published
        assert equal is not published
        assert kv.cached_prefix_length(prompt, equal) == 4
        hit = kv.allocate(2, prompt, 1, equal)
        assert hit.num_cached_tokens == 4
        assert hit.page_table.pages[:2] == kv.page_table(1).pages[:2]
        kv.commit(2, prompt)  # nothing new: the pages are the publisher's
        assert kv.stats().pages_indexed == 2
        assert kv.cached_prefix_length(prompt, "".join(["tenant", "-", "b"])) == 0
        kv.check_invariants()

    @pytest.mark.spec("KVM-028")
    @CACHING
    def test_empty_salt_is_a_salt_of_its_own(self, make_kv_manager: MakeKVManager) -> None:
        """The empty string is a salt like any other, not the absence of one: a prefix
        published under "" is hit under "" only, and an unsalted request gets its own pages."""
        kv = make_kv_manager(16, 2)
        prompt = tokens(1, 5)
        run_prompt(kv, 1, prompt, "")
        assert kv.cached_prefix_length(prompt, "") == 4
        assert kv.cached_prefix_length(prompt, None) == 0
        unsalted = run_prompt(kv, 2, prompt)
        assert unsalted.num_cached_tokens == 0
        assert not set(unsalted.page_table.pages) & set(kv.page_table(1).pages)
        assert kv.cached_prefix_length(prompt, "") == kv.cached_prefix_length(prompt, None) == 4
        assert_ref_counts_match_holders(kv, [1, 2])
        kv.check_invariants()

    @pytest.mark.spec("KVM-029")
    def test_disabled_prefix_caching_publishes_and_hits_nothing(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """With prefix caching disabled, commit publishes nothing, identical prompts share no
        page, and freed pages all go back to the free list."""
        kv = make_kv_manager(16, 2, False)
        prompt = tokens(1, 7)
        kv.allocate(1, prompt, 7)
        assert kv.commit(1, prompt) == 0
        assert kv.cached_prefix_length([*prompt, 8]) == 0
        alloc = kv.allocate(2, [*prompt, 8], 8)
        assert alloc.num_cached_tokens == 0
        assert not set(alloc.page_table.pages) & set(kv.page_table(1).pages)
        kv.commit(2, [*prompt, 8])
        kv.free(1)
        kv.free(2)
        stats = assert_accounting(kv)
        assert (stats.pages_free, stats.pages_cached, stats.pages_indexed) == (16, 0, 0)
        assert (stats.query_tokens, stats.hit_tokens) == (15, 0)
        kv.check_invariants()

    # -- KVM-030 / KVM-032: statistics and lookups -------------------------------------------

    @pytest.mark.spec("KVM-030")
    @EVICTION
    def test_stats_count_what_happened(self, make_kv_manager: MakeKVManager) -> None:
        """stats() reports in-use, free, cached and indexed pages, query tokens of successful
        allocations only, hit tokens and evictions; cached_prefix_length moves no statistic."""
        kv = make_kv_manager(6, 2)
        assert kv.stats() == KVStats(6, 0, 6, 0, 0, 0, 0, 0)
        assert kv.stats().hit_rate == 0.0
        prompt = tokens(1, 5)
        run_prompt(kv, 1, prompt)
        assert kv.stats() == KVStats(6, 3, 3, 0, 2, 5, 0, 0)
        for _ in range(3):
            kv.cached_prefix_length(prompt)
            kv.cached_prefix_length(tokens(50, 9))
        assert kv.stats() == KVStats(6, 3, 3, 0, 2, 5, 0, 0)
        kv.allocate(2, prompt, 1)
        assert kv.stats() == KVStats(6, 4, 2, 0, 2, 10, 4, 0)
        assert kv.stats().hit_rate == 0.4
        with pytest.raises(OutOfPages):
            kv.allocate(3, tokens(60, 9), 9)
        with pytest.raises(InvalidRequest):
            kv.allocate(3, [], 1)
        assert kv.stats() == KVStats(6, 4, 2, 0, 2, 10, 4, 0)
        kv.free(1)
        kv.free(2)
        assert kv.stats() == KVStats(6, 0, 4, 2, 2, 10, 4, 0)
        kv.allocate(3, tokens(60, 9), 9)  # 5 pages: 4 free, 1 evicted
        assert kv.stats() == KVStats(6, 5, 0, 1, 1, 19, 4, 1)
        kv.check_invariants()

    @pytest.mark.spec("KVM-032")
    @CACHING
    def test_longest_run_is_taken_and_reported(self, make_kv_manager: MakeKVManager) -> None:
        """allocate takes the longest run of cached full pages at the start of the prompt,
        and cached_prefix_length reports exactly that, prompt by prompt."""
        kv = make_kv_manager(64, 2)
        base = tokens(1, 9)  # 4 full pages published
        run_prompt(kv, 1, base)
        pages = kv.page_table(1).pages
        cases = {
            (7,): 0,
            (*base[:1], 7): 0,
            (*base[:2], 7): 2,
            (*base[:3], 7): 2,
            (*base[:6], 7, 7, 7): 6,
            tuple(base[:8]): 6,
            tuple(base): 8,
            (*base, 10, 11): 8,
        }
        for seq_id, (prompt, expected) in enumerate(cases.items(), start=10):
            assert kv.cached_prefix_length(prompt) == expected, prompt
            alloc = kv.allocate(seq_id, prompt, 2)
            assert alloc.num_cached_tokens == expected, prompt
            assert alloc.page_table.pages[: expected // 2] == pages[: expected // 2]
            assert alloc.page_table.num_tokens == expected + 2
        kv.check_invariants()

    @pytest.mark.spec("KVM-032", "KVM-030")
    @EVICTION
    def test_cached_prefix_length_is_pure(self, make_kv_manager: MakeKVManager) -> None:
        """Asking cached_prefix_length, however often, moves no statistic and no LRU position:
        the eviction order afterwards equals that of a twin manager never asked."""
        kv, twin = busy_manager(make_kv_manager), busy_manager(make_kv_manager)
        before = snapshot(kv, BUSY_LIVE, BUSY_PROMPTS)
        for _ in range(3):
            for prompt, salt in BUSY_PROMPTS:
                kv.cached_prefix_length(list(prompt), salt)
        assert snapshot(kv, BUSY_LIVE, BUSY_PROMPTS) == before
        assert eviction_trace(kv, BUSY_PROMPTS) == eviction_trace(twin, BUSY_PROMPTS)

    @pytest.mark.spec("KVM-031")
    @EVICTION
    def test_check_invariants_passes_on_a_healthy_manager(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """check_invariants() passes after every call of a busy history: fresh, shared,
        cached, evicted and reset pages alike."""
        kv = make_kv_manager(8, 2)
        kv.check_invariants()
        for _ in _workload(kv, seed=3, steps=80):
            kv.check_invariants()


def _workload(kv: KVManager, seed: int, steps: int) -> Iterator[list[int]]:
    """A deterministic mixed workload over shared-prefix prompts; yields the live ids after
    every call. OutOfPages is expected under pool pressure and must change nothing."""
    rng = random.Random(seed)
    stems = [tokens(100 * i, 6) for i in range(3)]
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(steps):
        op = rng.choice(["allocate", "allocate", "grow", "commit", "free"])
        if op == "allocate" or not live:
            stem = rng.choice(stems)
            prompt = stem[: rng.randint(1, len(stem))] + [rng.randint(0, 3)]
            salt = rng.choice([None, None, "s"])
            try:
                alloc = kv.allocate(next_id, prompt, rng.randint(1, 6), salt)
            except OutOfPages:
                pass
            else:
                needed = alloc.page_table.num_tokens - len(prompt)
                live[next_id] = prompt + [rng.randint(0, 3) for _ in range(max(0, needed))]
            next_id += 1
        else:
            seq_id = rng.choice(sorted(live))
            reserved = kv.page_table(seq_id).num_tokens
            if op == "grow":
                try:
                    kv.grow(seq_id, reserved + rng.randint(0, 4))
                except OutOfPages:
                    pass
                else:
                    reserved = kv.page_table(seq_id).num_tokens
                    while len(live[seq_id]) < reserved:
                        live[seq_id].append(rng.randint(0, 3))
            elif op == "commit":
                kv.commit(seq_id, live[seq_id][: rng.randint(0, reserved)])
            else:
                kv.free(seq_id)
                del live[seq_id]
        yield sorted(live)
    for seq_id in sorted(live):
        kv.free(seq_id)
    yield []
