"""Conformance tests of the KVManager's prefix match (specs/kv-manager.md KVM-033..036).

``match_prefix`` is the one lookup an admission needs: the pages ``allocate`` would hit, and
the pages after them that live sequences are still computing for the same prefix (in flight).
``allocate(..., match=m)`` opens the sequence from that match without looking again, and refuses
a match that no longer describes the manager. :class:`KVMatchSuite` is collected by
``test_kv_match.py``; subclass it with your own ``make_kv_manager`` fixture as for
:class:`~pagedkv_conformance.suite_kv_manager.KVManagerSuite`. Everything is observed through
the :class:`pagedkv.interfaces.KVManager` Protocol only.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.errors import InvalidRequest, OutOfPages, StaleMatch
from pagedkv.interfaces import Allocation, KVManager

from .loading import MakeKVManager
from .suite_kv_manager import (
    BUSY_LIVE,
    BUSY_PROMPTS,
    CACHING,
    PROMPT_A,
    PROMPT_B,
    PROMPT_D,
    RESET,
    busy_manager,
    cache_prompt,
    snapshot,
    tokens,
)
from .variants import tracks_in_flight

#: Page size of the in-flight scenarios.
SIZE = 4
#: Sequence 1's prompt in :func:`in_flight_manager`: three full pages and one more token.
LIVE_PROMPT = tuple(tokens(500, 3 * SIZE + 1))


def in_flight_manager(make: MakeKVManager, caching: bool = True) -> KVManager:
    """16 pages of 4 tokens; sequence 1 allocated for :data:`LIVE_PROMPT`, nothing committed:
    its three full prompt pages are in flight."""
    kv = make(16, SIZE, caching)
    kv.allocate(1, LIVE_PROMPT, len(LIVE_PROMPT))
    return kv


def sharing(pages: int, *suffix: int) -> list[int]:
    """A prompt sharing the first ``pages`` pages of :data:`LIVE_PROMPT`, then ``suffix``."""
    return [*LIVE_PROMPT[: pages * SIZE], *suffix]


def _shape(alloc: Allocation) -> tuple[int, int, int, int]:
    """An allocation without its physical page ids: cached tokens, new pages, reservation."""
    table = alloc.page_table
    return alloc.num_cached_tokens, alloc.num_new_pages, table.num_tokens, len(table.pages)


#: State changes that make an earlier match stale, each on :func:`busy_manager` (KVM-035).
CHANGES: dict[str, Callable[[KVManager], object]] = {
    "allocate": lambda kv: kv.allocate(20, list(PROMPT_D), 1),
    "grow": lambda kv: kv.grow(1, kv.page_table(1).num_tokens + 1),
    "commit": lambda kv: kv.commit(4, list(PROMPT_A[:2])),
    "free": lambda kv: kv.free(4),
}


class KVMatchSuite:
    """The prefix match: one lookup, taken by ``allocate``, never used stale."""

    # -- the lookup --------------------------------------------------------------------------

    @pytest.mark.spec("KVM-033")
    @pytest.mark.parametrize("caching", [pytest.param(True, marks=CACHING), False])
    def test_match_is_pure_and_agrees_with_allocate(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """For every prompt of the busy manager: the match's hits are exactly the pages
        ``allocate`` then takes, its cached tokens those ``cached_prefix_length`` reports, and
        matching moves nothing."""
        kv = busy_manager(make_kv_manager, caching)
        before = snapshot(kv, BUSY_LIVE, BUSY_PROMPTS)
        matches = [kv.match_prefix(list(p), salt) for p, salt in BUSY_PROMPTS]
        assert snapshot(kv, BUSY_LIVE, BUSY_PROMPTS) == before
        for (prompt, salt), match in zip(BUSY_PROMPTS, matches, strict=True):
            assert (match.token_ids, match.cache_salt) == (prompt, salt)
            assert match.num_cached_tokens == len(match.hit_pages) * kv.page_size
            assert match.num_cached_tokens == kv.cached_prefix_length(list(prompt), salt)
            assert match.num_cached_tokens <= len(prompt) - 1  # KVM-025
        for seq_id, (prompt, salt) in enumerate(BUSY_PROMPTS, start=30):
            match = kv.match_prefix(list(prompt), salt)
            alloc = kv.allocate(seq_id, list(prompt), 1, salt)
            hits = len(match.hit_pages)
            assert alloc.num_cached_tokens == match.num_cached_tokens
            assert alloc.page_table.pages[:hits] == match.hit_pages
            kv.free(seq_id)
        if caching:
            assert any(m.hit_pages for m in matches), "the busy manager has cached prefixes"

    @pytest.mark.spec("KVM-033")
    def test_match_of_an_empty_prompt_raises(self, make_kv_manager: MakeKVManager) -> None:
        with pytest.raises(InvalidRequest):
            busy_manager(make_kv_manager, caching=False).match_prefix([])

    # -- allocating from a match ------------------------------------------------------------

    @pytest.mark.spec("KVM-034")
    @pytest.mark.parametrize("caching", [pytest.param(True, marks=CACHING), False])
    def test_allocate_from_a_match_equals_allocate(
        self, make_kv_manager: MakeKVManager, caching: bool
    ) -> None:
        """Two managers driven alike: one allocates every prompt from a fresh match, the other
        without one. The allocations agree, the hits are the match's pages, and the stats stay
        identical."""
        plain = busy_manager(make_kv_manager, caching)
        matched = busy_manager(make_kv_manager, caching)
        for seq_id, (prompt, salt) in enumerate(BUSY_PROMPTS, start=30):
            want = plain.allocate(seq_id, list(prompt), 2, salt)
            match = matched.match_prefix(list(prompt), salt)
            got = matched.allocate(seq_id, list(prompt), 2, salt, match=match)
            assert _shape(got) == _shape(want)
            assert got.page_table.pages[: len(match.hit_pages)] == match.hit_pages
            assert got.page_table == matched.page_table(seq_id)
            assert matched.stats() == plain.stats()
            plain.free(seq_id)
            matched.free(seq_id)

    @pytest.mark.spec("KVM-034", "KVM-002")
    def test_a_failed_call_leaves_a_match_valid(self, make_kv_manager: MakeKVManager) -> None:
        """A call that raised changed nothing, so a match taken before it still holds."""
        kv = busy_manager(make_kv_manager, caching=False)
        match = kv.match_prefix(list(PROMPT_B))
        with pytest.raises(OutOfPages):
            kv.allocate(20, list(PROMPT_D), 100)
        alloc = kv.allocate(21, list(PROMPT_B), 1, match=match)
        assert alloc.page_table.num_tokens == 1

    # -- stale matches ------------------------------------------------------------------------

    @pytest.mark.spec("KVM-035")
    @pytest.mark.parametrize("change", sorted(CHANGES))
    @pytest.mark.parametrize("caching", [pytest.param(True, marks=CACHING), False])
    def test_a_match_is_stale_after_any_change(
        self, make_kv_manager: MakeKVManager, caching: bool, change: str
    ) -> None:
        """After a successful allocate, grow, commit or free, allocate refuses an earlier match
        with StaleMatch and changes nothing; a fresh match works."""
        kv = busy_manager(make_kv_manager, caching)
        prompt = list(PROMPT_B)
        match = kv.match_prefix(prompt)
        CHANGES[change](kv)
        live = {"allocate": (1, 4, 20), "free": (1,)}.get(change, BUSY_LIVE)
        before = snapshot(kv, live, BUSY_PROMPTS)
        with pytest.raises(StaleMatch):
            kv.allocate(21, prompt, 1, match=match)
        assert snapshot(kv, live, BUSY_PROMPTS) == before
        fresh = kv.match_prefix(prompt)
        assert kv.allocate(21, prompt, 1, match=fresh).num_cached_tokens == fresh.num_cached_tokens

    @pytest.mark.spec("KVM-035", "KVM-027")
    @RESET
    def test_a_match_is_stale_after_a_reset(self, make_kv_manager: MakeKVManager) -> None:
        kv = make_kv_manager(8, 2)
        cache_prompt(kv, 1, PROMPT_B)
        match = kv.match_prefix(list(PROMPT_B))
        assert match.hit_pages
        kv.reset_prefix_cache()
        with pytest.raises(StaleMatch):
            kv.allocate(2, list(PROMPT_B), 1, match=match)
        assert kv.stats().pages_in_use == 0

    @pytest.mark.spec("KVM-035")
    def test_a_match_of_another_prompt_salt_or_manager_is_refused(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        kv = busy_manager(make_kv_manager, caching=False)
        other = busy_manager(make_kv_manager, caching=False)
        prompt = list(PROMPT_B)
        match = kv.match_prefix(prompt)
        before = snapshot(kv, BUSY_LIVE, BUSY_PROMPTS)
        refused: list[Callable[[], object]] = [
            lambda: kv.allocate(20, [*prompt, 1], 1, match=match),
            lambda: kv.allocate(20, prompt[:-1], 1, match=match),
            lambda: kv.allocate(20, prompt, 1, "salted", match=match),
            lambda: kv.allocate(20, prompt, 1, match=other.match_prefix(prompt)),
        ]
        for call in refused:
            with pytest.raises(StaleMatch):
                call()
        assert snapshot(kv, BUSY_LIVE, BUSY_PROMPTS) == before
        assert kv.allocate(20, prompt, 1, match=match).page_table.num_tokens == 1

    @pytest.mark.spec("KVM-035")
    def test_a_match_of_another_fresh_manager_is_refused(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """Two managers that have done nothing yet: a match taken on one is still another
        manager's on the other."""
        kv, other = make_kv_manager(8, 2), make_kv_manager(8, 2)
        with pytest.raises(StaleMatch):
            kv.allocate(1, [1, 2, 3], 3, match=other.match_prefix([1, 2, 3]))
        assert kv.stats().pages_in_use == 0

    # -- pages in flight ---------------------------------------------------------------------

    @pytest.mark.spec("KVM-036", "KVM-021")
    @CACHING
    def test_uncommitted_pages_are_in_flight_never_hit(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """A live sequence's uncommitted prompt pages are reported in flight to a prompt sharing
        them, are never hit, and move to the hits as they are committed."""
        kv = in_flight_manager(make_kv_manager)
        match = kv.match_prefix(sharing(3, 7))
        assert (match.num_cached_tokens, match.num_in_flight_tokens) == (0, 3 * SIZE)
        alloc = kv.allocate(2, sharing(3, 7), 1, match=match)
        assert alloc.num_cached_tokens == 0
        assert all(kv.ref_count(p) == 1 for p in kv.page_table(1).pages), "an in-flight page hit"
        kv.free(2)
        kv.commit(1, list(LIVE_PROMPT[: 2 * SIZE + 1]))
        match = kv.match_prefix(sharing(3, 7))
        assert (match.num_cached_tokens, match.num_in_flight_tokens) == (2 * SIZE, SIZE)
        assert match.hit_pages == kv.page_table(1).pages[:2]
        kv.commit(1, list(LIVE_PROMPT))
        match = kv.match_prefix(sharing(3, 7))
        assert (match.num_cached_tokens, match.num_in_flight_tokens) == (3 * SIZE, 0)

    @pytest.mark.spec("KVM-036")
    @CACHING
    def test_in_flight_needs_the_same_tokens_and_salt(self, make_kv_manager: MakeKVManager) -> None:
        kv = in_flight_manager(make_kv_manager)
        diverging = [*LIVE_PROMPT[: 2 * SIZE], 9, *LIVE_PROMPT[2 * SIZE + 1 :]]
        cases = {
            "two shared pages": (sharing(2, 7), None, 2),
            "diverges in page 3": (diverging, None, 2),
            "diverges in page 1": ([9, *LIVE_PROMPT[1:]], None, 0),
            "another salt": (sharing(3, 7), "salted", 0),
            "unrelated": (tokens(900, 13), None, 0),
        }
        for name, (prompt, salt, pages) in cases.items():
            match = kv.match_prefix(prompt, salt)
            assert match.num_in_flight_tokens == pages * SIZE, name
            assert match.num_cached_tokens == 0, name

    @pytest.mark.spec("KVM-036", "KVM-025")
    @CACHING
    def test_in_flight_leaves_a_token_to_compute(self, make_kv_manager: MakeKVManager) -> None:
        """A prompt made only of in-flight pages counts all but its last page (KVM-025)."""
        kv = in_flight_manager(make_kv_manager)
        assert kv.match_prefix(sharing(3)).num_in_flight_tokens == 2 * SIZE
        assert kv.match_prefix(sharing(3, 7)).num_in_flight_tokens == 3 * SIZE

    @pytest.mark.spec("KVM-036")
    @CACHING
    def test_a_chunked_allocation_puts_its_whole_prompt_in_flight(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """In flight are the full pages of the prompt the sequence was allocated for, reserved
        yet or not: it will compute them chunk by chunk."""
        kv = make_kv_manager(16, SIZE)
        kv.allocate(1, LIVE_PROMPT, SIZE)
        assert kv.match_prefix(sharing(3, 7)).num_in_flight_tokens == 3 * SIZE

    @pytest.mark.spec("KVM-036")
    @CACHING
    def test_freeing_ends_in_flight(self, make_kv_manager: MakeKVManager) -> None:
        kv = in_flight_manager(make_kv_manager)
        kv.allocate(2, sharing(3, 5), 2 * SIZE)  # a second sequence computing the same pages
        kv.free(1)
        assert kv.match_prefix(sharing(3, 7)).num_in_flight_tokens == 3 * SIZE
        kv.free(2)
        match = kv.match_prefix(sharing(3, 7))
        assert (match.num_cached_tokens, match.num_in_flight_tokens) == (0, 0)

    @pytest.mark.spec("KVM-036")
    @CACHING
    def test_pages_found_already_published_are_not_in_flight(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        """Sequence 2 computes the same prompt as sequence 1 and commits after it: its pages
        were found already published, so none is in flight, also once sequence 1's pages
        are evicted (whether sequence 2's own pages were published beside them, instead of
        them or not at all is the ``duplicates`` variant, KVM-051: either way they are hits
        or nothing)."""
        kv = make_kv_manager(10, SIZE)
        kv.allocate(1, LIVE_PROMPT, len(LIVE_PROMPT))
        kv.allocate(2, LIVE_PROMPT, len(LIVE_PROMPT))
        kv.commit(1, list(LIVE_PROMPT))
        kv.commit(2, list(LIVE_PROMPT))
        kv.free(1)
        cached = kv.stats().pages_cached  # 3, fewer where sequence 2 took entries over
        kv.allocate(3, tokens(900, 6 * SIZE), 6 * SIZE)  # every unheld page: evicts them all
        assert kv.stats().evictions == cached
        match = kv.match_prefix(sharing(3, 7))
        assert match.num_in_flight_tokens == 0
        assert match.num_cached_tokens == kv.cached_prefix_length(sharing(3, 7))
        kv.check_invariants()

    @pytest.mark.spec("KVM-036", "KVM-031")
    @CACHING
    def test_a_partly_committed_shared_prompt_stays_consistent(
        self, make_kv_manager: MakeKVManager, backend_variants: dict[str, str]
    ) -> None:
        """Two sequences computing the same prompt, one committing part of it, the other
        freed: the committed page is a hit, the rest in flight (none under the declared
        ``in-flight=untracked``), and check_invariants passes after every call."""
        in_flight = 2 * SIZE if tracks_in_flight(backend_variants) else 0
        kv = in_flight_manager(make_kv_manager)
        kv.allocate(2, LIVE_PROMPT, SIZE + 1)
        kv.check_invariants()
        kv.commit(2, list(LIVE_PROMPT[: SIZE + 1]))
        kv.check_invariants()
        kv.free(1)
        kv.check_invariants()
        match = kv.match_prefix(sharing(3, 7))
        assert (match.num_cached_tokens, match.num_in_flight_tokens) == (SIZE, in_flight)
        kv.free(2)
        kv.check_invariants()

    @pytest.mark.spec("KVM-036", "KVM-029")
    def test_nothing_is_in_flight_without_prefix_caching(
        self, make_kv_manager: MakeKVManager
    ) -> None:
        kv = in_flight_manager(make_kv_manager, caching=False)
        match = kv.match_prefix(sharing(3, 7))
        assert (match.num_cached_tokens, match.num_in_flight_tokens) == (0, 0)
