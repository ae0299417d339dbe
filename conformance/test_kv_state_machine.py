"""The KVManager against the oracle, under random workloads (a Hypothesis state machine).

Every rule runs one operation on the backend's manager and on :class:`KVOracle`, and compares
what comes back: the same typed error, or the same hits, cached tokens, fresh-page counts and
page-table sizes. Physical page ids differ between the two, so the machine keeps a map from the
oracle's pages to the backend's: a hit must land on the very page the oracle says holds that
prefix, a fresh page must be neither held by another sequence nor still caching a prefix the
oracle keeps (that would be the wrong eviction), and every live page table must map through it.
After every step the invariants compare the stats, check the accounting identity, ref counts
against page-table holders, and call ``check_invariants()``.

Bounded by the Hypothesis profile (``$PAGEDKV_HYPOTHESIS_PROFILE``: ``ci`` or ``dev``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import ClassVar, Generic, TypeVar

import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv.errors import (
    DoubleFree,
    InvalidRequest,
    PagedKVError,
    UnknownSequence,
)
from pagedkv.interfaces import ForkingKVManager, KVManager, PageCopy, PageTable, PrefixMatch

from .loading import MakeKVManager
from .oracle import KVOracle, NeverAllocated, OracleMatch, oracle_following, pages_for

T = TypeVar("T")
U = TypeVar("U")

#: A tiny alphabet, so prompts collide and prefixes are shared.
TOKENS = st.integers(0, 2)
#: Salts are built at run time, so equal salts are equal strings but distinct objects (KVM-028):
#: a backend comparing salts by identity fails.
SALTS = st.sampled_from([None, None, None, "a", "b"]).map(lambda s: fresh_salt(s and "tenant-" + s))
#: Ids at and above this are never allocated.
UNKNOWN_IDS = 1_000_000
#: How many recent token sequences serve as bases of new prompts.
KNOWN_PROMPTS = 12


#: Page sizes the machine draws (``setup``).
STATE_MACHINE_PAGE_SIZES = (1, 2, 3, 4)


def page_size_supported(make: MakeKVManager, page_size: int) -> bool:
    """Whether ``make`` builds managers of ``page_size``: the suite's factory knows the sizes
    the backend declares (KVM-065); a factory of one's own is taken to support every size."""
    supports: Callable[[int], bool] | None = getattr(make, "supports_page_size", None)
    return supports is None or supports(page_size)


def fresh_salt(salt: str | None) -> str | None:
    """An equal copy of ``salt`` that is a different object (``None`` stays ``None``)."""
    return None if salt is None else "".join(list(salt))


class Outcome(Generic[T, U]):
    """Both results of a call that succeeded on the backend and on the oracle."""

    __slots__ = ("got", "want")

    def __init__(self, got: T, want: U) -> None:
        self.got = got
        self.want = want


class KVManagerMachine(RuleBasedStateMachine):
    """Random operations on a backend's KVManager, mirrored on the oracle."""

    #: ``(make_kv_manager, capabilities, variants)``; set on a subclass by
    #: :func:`run_kv_state_machine`.
    target: ClassVar[tuple[MakeKVManager, frozenset[str], Mapping[str, str]] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self._kv: KVManager | None = None
        self._oracle: KVOracle | None = None
        self.capabilities: frozenset[str] = frozenset()
        self.live: dict[int, list[int]] = {}  # seq id -> its tokens (>= its reservation)
        self.freed: list[int] = []  # freed ids not allocated again
        self.prompts: list[tuple[tuple[int, ...], str | None]] = []
        self.salts: dict[int, str | None] = {}
        self.next_id = 0
        self.o2b: dict[int, int] = {}  # oracle page -> backend page
        self.b2o: dict[int, int] = {}

    # -- plumbing --------------------------------------------------------------------------

    @property
    def kv(self) -> KVManager:
        assert self._kv is not None
        return self._kv

    @property
    def oracle(self) -> KVOracle:
        assert self._oracle is not None
        return self._oracle

    def _run(self, on_backend: Callable[[], T], on_oracle: Callable[[], U]) -> Outcome[T, U] | None:
        """Run one call on both. ``None`` when both raised the same kind of typed error."""
        try:
            want = on_oracle()
        except PagedKVError as expected:
            try:
                got = on_backend()
            except PagedKVError as error:
                self._check_error(error, expected)
                return None
            raise AssertionError(
                f"the backend returned {got!r} where the oracle raised {expected!r}"
            ) from None
        try:
            got = on_backend()
        except PagedKVError as error:
            raise AssertionError(
                f"the backend raised {error!r} where the oracle returned {want!r}"
            ) from error
        return Outcome(got, want)

    @staticmethod
    def _check_error(error: PagedKVError, expected: PagedKVError) -> None:
        if isinstance(expected, NeverAllocated):
            assert isinstance(error, UnknownSequence), (error, expected)
            assert not isinstance(error, DoubleFree), f"{error!r} for a never-allocated id"
        else:
            assert isinstance(error, type(expected)), f"raised {error!r}, expected {expected!r}"

    def _remember(self, token_ids: list[int], salt: str | None) -> None:
        """Keep a token sequence (at most 4 pages of it) as a base for later prompts."""
        if token_ids:
            known = (tuple(token_ids[: 4 * self.kv.page_size]), salt)
            if known in self.prompts:
                self.prompts.remove(known)
            self.prompts.append(known)
            del self.prompts[:-KNOWN_PROMPTS]

    def _draw_prompt(self, data: st.DataObject, max_suffix: int) -> tuple[list[int], str | None]:
        """A prompt and salt: often a known prompt (cut somewhere) and its salt, plus a suffix."""
        prefix: tuple[int, ...] = ()
        salt = data.draw(SALTS, label="salt")
        if len(self.prompts) > 0 and data.draw(st.integers(0, 2), label="extend a known prompt"):
            base, base_salt = data.draw(st.sampled_from(self.prompts), label="known prompt")
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))), label="cut")
            prefix = base[:cut]
            if data.draw(st.integers(0, 3), label="same salt"):
                salt = fresh_salt(base_salt)
        suffix = data.draw(
            st.lists(TOKENS, min_size=0 if prefix else 1, max_size=max_suffix), label="suffix"
        )
        return [*prefix, *suffix], salt

    def _draw_live(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.live)), label="seq_id")

    def _extend_tokens(self, data: st.DataObject, seq_id: int, num_tokens: int) -> None:
        missing = num_tokens - len(self.live[seq_id])
        if missing > 0:
            self.live[seq_id] += data.draw(
                st.lists(TOKENS, min_size=missing, max_size=missing), label="generated"
            )

    def _map_fresh(self, seq_id: int, backend_pages: tuple[int, ...], pages: list[int]) -> None:
        """Relate the backend's fresh pages to the oracle's, checking KVM-016 and eviction."""
        held = {p for s in self.live if s != seq_id for p in self.kv.page_table(s).pages}
        for b, o in zip(backend_pages, pages, strict=True):
            assert 0 <= b < self.kv.num_pages, f"page {b} outside the pool"
            assert b not in held, f"page {b}, held by another sequence, was handed out fresh"
            old = self.b2o.get(b)
            if old is not None and self.o2b.get(old) == b:
                assert old not in self.oracle.lru, (
                    f"the backend reused page {b}, whose cached prefix the oracle still keeps "
                    "(an eviction out of LRU order, or of a page being hit)"
                )
                del self.o2b[old]
            previous = self.o2b.get(o)
            if previous is not None and self.b2o.get(previous) == o:
                del self.b2o[previous]
            self.o2b[o] = b
            self.b2o[b] = o

    def _commit(self, seq_id: int, length: int) -> None:
        """Commit the sequence's first ``length`` tokens on both; compare what was published."""
        token_ids = self.live[seq_id][:length]
        outcome = self._run(
            lambda: self.kv.commit(seq_id, token_ids),
            lambda: self.oracle.commit(seq_id, token_ids),
        )
        assert outcome is not None
        assert outcome.got == outcome.want, f"published {outcome.got}, expected {outcome.want}"
        self._remember(token_ids, self.salts[seq_id])

    def _allocate(
        self,
        data: st.DataObject,
        seq_id: int,
        prompt: list[int],
        n: int,
        salt: str | None,
        matches: tuple[PrefixMatch, OracleMatch] | None = None,
    ) -> None:
        got_match, want_match = matches if matches is not None else (None, None)
        outcome = self._run(
            lambda: self.kv.allocate(seq_id, prompt, n, salt, match=got_match),
            lambda: self.oracle.allocate(seq_id, prompt, n, salt, match=want_match),
        )
        if outcome is None:
            return
        alloc, want = outcome.got, outcome.want
        assert alloc.num_cached_tokens == want.num_cached_tokens, (alloc, want)
        assert alloc.num_new_pages == want.num_new_pages, (alloc, want)
        table = alloc.page_table
        assert table == self.kv.page_table(seq_id)
        assert (table.seq_id, table.page_size) == (seq_id, self.kv.page_size)
        assert table.num_tokens == want.num_cached_tokens + n
        assert len(table.pages) == len(want.pages)
        hits = want.num_hit_pages
        for b, o in zip(table.pages[:hits], want.pages[:hits], strict=True):
            assert self.o2b.get(o) == b, (
                f"hit on page {b}, but the prefix was published on page {self.o2b.get(o)}"
            )
        assert len(set(table.pages)) == len(table.pages), f"a page held twice: {table.pages}"
        if seq_id in self.freed:
            self.freed.remove(seq_id)
        self._map_fresh(seq_id, table.pages[hits:], list(want.pages[hits:]))
        self.live[seq_id] = list(prompt)
        self.salts[seq_id] = salt
        self._extend_tokens(data, seq_id, table.num_tokens)
        self._remember(prompt, salt)
        then = data.draw(st.sampled_from(["finish", "keep", "commit"]), label="then")
        if then != "keep":
            self._commit(seq_id, table.num_tokens)
        if then == "finish":
            self._free(seq_id)

    def _free(self, seq_id: int) -> None:
        outcome = self._run(lambda: self.kv.free(seq_id), lambda: self.oracle.free(seq_id))
        assert outcome is not None
        self._remember(self.live.pop(seq_id), self.salts.pop(seq_id))
        self.freed.append(seq_id)

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        num_pages=st.one_of(st.integers(2, 5), st.integers(2, 12)),
        page_size=st.one_of(st.integers(1, 2), st.integers(1, 4)),
        mode=st.integers(0, 4),
    )
    def setup(self, num_pages: int, page_size: int, mode: int) -> None:
        """A fresh manager; prefix caching on in 4 of 5 runs when the backend supports it."""
        assert self.target is not None, "use run_kv_state_machine()"
        make, self.capabilities, variants = self.target
        assume(page_size_supported(make, page_size))
        caching = mode > 0 and {"prefix_caching", "eviction"} <= self.capabilities
        self._kv = make(num_pages, page_size, caching)
        self._oracle = oracle_following(variants, num_pages, page_size, caching)

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        """A new (or reused freed) id with a prompt sharing prefixes with earlier ones,
        reserving its uncached part or a chunk of it; then maybe commit the reservation."""
        if self.freed and data.draw(st.integers(0, 3), label="reuse") == 0:
            seq_id = data.draw(st.sampled_from(self.freed), label="freed id")
        else:
            seq_id = self.next_id
            self.next_id += 1
        prompt, salt = self._draw_prompt(data, 3 * self.kv.page_size)
        left = len(prompt) - self.oracle.cached_prefix_length(prompt, salt)
        n = data.draw(
            st.one_of(st.just(left), st.integers(1, left + self.kv.page_size)),
            label="num_new_tokens",
        )
        self._allocate(data, seq_id, prompt, n, salt)

    @rule(data=st.data())
    def allocate_from_a_match(self, data: st.DataObject) -> None:
        """match_prefix once: the oracle's hits (on the very pages it says) and in-flight pages,
        nothing moved. Then allocate with the match, maybe after another successful call or for
        another prompt: StaleMatch, changing nothing, unless the match still holds."""
        seq_id = self.next_id
        self.next_id += 1
        prompt, salt = self._draw_prompt(data, 3 * self.kv.page_size)
        if len(self.live) > 0 and data.draw(st.booleans(), label="share a live sequence's pages"):
            live = self._draw_live(data)  # its uncommitted pages are in flight
            cut = data.draw(st.integers(1, len(self.live[live])), label="cut")
            prompt, salt = [*self.live[live][:cut], *prompt], self.salts[live]
        before = self.kv.stats()
        outcome = self._run(
            lambda: self.kv.match_prefix(prompt, salt),
            lambda: self.oracle.match_prefix(prompt, salt),
        )
        assert outcome is not None
        got, want = outcome.got, outcome.want
        assert self.kv.stats() == before, "match_prefix moved a statistic"
        assert (got.token_ids, got.cache_salt) == (tuple(prompt), salt)
        assert got.num_cached_tokens == want.num_cached_tokens, (got, want)
        assert got.num_cached_tokens == self.kv.cached_prefix_length(prompt, salt)
        assert list(got.hit_pages) == [self.o2b.get(o) for o in want.hit_pages], (got, want)
        assert got.num_in_flight_tokens == want.num_in_flight_tokens, (got, want)
        then = data.draw(st.sampled_from(["allocate", "after a change", "another prompt"]))
        if then == "after a change" and self.live:
            live = self._draw_live(data)
            self._commit(live, data.draw(st.integers(0, self.kv.page_table(live).num_tokens)))
        asked = [*prompt, 0] if then == "another prompt" else prompt
        left = len(prompt) - want.num_cached_tokens
        n = data.draw(st.integers(1, left + self.kv.page_size), label="num_new_tokens")
        self._allocate(data, seq_id, asked, n, salt, matches=(got, want))

    @rule(data=st.data())
    def allocate_under_pressure(self, data: st.DataObject) -> None:
        """A large allocation: it evicts cached pages or raises OutOfPages."""
        seq_id = self.next_id
        self.next_id += 1
        prompt, salt = self._draw_prompt(data, 2)
        size = self.kv.page_size
        n = data.draw(st.integers(size, (self.kv.num_pages + 1) * size), label="num_new_tokens")
        self._allocate(data, seq_id, prompt, n, salt)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        """Reserve more positions (pages already reserved never move); maybe commit them."""
        seq_id = self._draw_live(data)
        before = self.kv.page_table(seq_id)
        extra = data.draw(
            st.one_of(
                st.integers(0, 2 * self.kv.page_size),
                st.integers(0, self.kv.num_pages * self.kv.page_size),
            ),
            label="extra",
        )
        num_tokens = before.num_tokens + extra
        outcome = self._run(
            lambda: self.kv.grow(seq_id, num_tokens),
            lambda: self.oracle.grow(seq_id, num_tokens),
        )
        if outcome is None:
            assert self.kv.page_table(seq_id) == before
            return
        table: PageTable = outcome.got
        assert table == self.kv.page_table(seq_id)
        assert table.num_tokens == num_tokens
        assert table.pages[: len(before.pages)] == before.pages, "grow moved a reserved page"
        added = table.pages[len(before.pages) :]
        assert len(added) == len(outcome.want)
        self._map_fresh(seq_id, added, outcome.want)
        assert len(set(table.pages)) == len(table.pages)
        self._extend_tokens(data, seq_id, num_tokens)
        if data.draw(st.booleans(), label="write and commit the reservation"):
            self._commit(seq_id, num_tokens)

    @precondition(lambda self: bool(self.live) and "fork" in self.capabilities)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Fork a live sequence (or an unknown or freed one, or onto a live id): the full
        pages are the parent's very pages, a partial last page is a fresh page named as the
        copy of the parent's; then maybe commit the fork's reservation."""
        kv = self.kv
        assert isinstance(kv, ForkingKVManager), "the backend declares fork"
        parent = self._draw_live(data)
        child = self.next_id
        kind = data.draw(st.sampled_from(["new", "new", "new", "onto-live", "of-freed"]))
        if kind == "onto-live":
            child = self._draw_live(data)
        elif kind == "of-freed" and self.freed:
            parent = data.draw(st.sampled_from(self.freed), label="freed parent")
        if child == self.next_id:
            self.next_id += 1
        outcome = self._run(lambda: kv.fork(parent, child), lambda: self.oracle.fork(parent, child))
        if outcome is None:
            return
        got, want = outcome.got, outcome.want
        table, source = got.page_table, kv.page_table(parent)
        assert table == kv.page_table(child)
        assert (table.seq_id, table.num_tokens) == (child, source.num_tokens)
        shared = len(want.pages) - (want.copy is not None)
        assert table.pages[:shared] == source.pages[:shared], (table, source)
        if want.copy is None:
            assert got.copies == (), got
        else:
            assert got.copies == (PageCopy(source.pages[-1], table.pages[-1]),), got
            self._map_fresh(child, table.pages[-1:], [want.pages[-1]])
        self.live[child] = self.live[parent][: table.num_tokens]
        self.salts[child] = self.salts[parent]
        if data.draw(st.booleans(), label="commit the fork's reservation"):
            self._commit(child, table.num_tokens)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Publish the full pages of a prefix of the (written) reserved tokens."""
        seq_id = self._draw_live(data)
        reserved = self.kv.page_table(seq_id).num_tokens
        self._commit(seq_id, data.draw(st.integers(0, reserved), label="length"))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """Release a sequence (maybe after committing all it reserved): its committed pages
        become cached, tail first."""
        seq_id = self._draw_live(data)
        if data.draw(st.booleans(), label="commit everything first"):
            self._commit(seq_id, self.kv.page_table(seq_id).num_tokens)
        self._free(seq_id)

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            [
                "double-free",
                "unknown-free",
                "unknown-grow",
                "unknown-commit",
                "unknown-page-table",
                "duplicate",
                "empty-prompt",
                "no-new-tokens",
                "grow-below",
                "commit-past",
                "negative-page",
            ]
        ),
    )
    def misuse(self, data: st.DataObject, kind: str) -> None:
        """A call outside the contract raises its typed error (DoubleFree, UnknownSequence
        and not DoubleFree for a never-allocated id, DuplicateSequence, InvalidRequest) and
        changes nothing (the invariants compare everything afterwards)."""
        kv, oracle = self.kv, self.oracle
        unknown = UNKNOWN_IDS + data.draw(st.integers(0, 2), label="unknown id")
        live = self._draw_live(data) if self.live else None
        reserved = 0 if live is None else kv.page_table(live).num_tokens
        too_long = [] if live is None else [*self.live[live][:reserved], 0]
        fresh = self.next_id
        calls: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            "unknown-free": (lambda: kv.free(unknown), lambda: oracle.free(unknown)),
            "unknown-grow": (lambda: kv.grow(unknown, 1), lambda: oracle.grow(unknown, 1)),
            "unknown-commit": (
                lambda: kv.commit(unknown, [0]),
                lambda: oracle.commit(unknown, [0]),
            ),
            "unknown-page-table": (
                lambda: kv.page_table(unknown),
                lambda: oracle.page_table(unknown),
            ),
            "empty-prompt": (
                lambda: kv.allocate(fresh, [], 1),
                lambda: oracle.allocate(fresh, [], 1),
            ),
            "no-new-tokens": (
                lambda: kv.allocate(fresh, [0, 1], 0),
                lambda: oracle.allocate(fresh, [0, 1], 0),
            ),
        }
        if self.freed:
            freed = data.draw(st.sampled_from(self.freed), label="freed id")
            calls["double-free"] = (lambda: kv.free(freed), lambda: oracle.free(freed))
        if live is not None:
            calls["duplicate"] = (
                lambda: kv.allocate(live, [0, 1], 1),
                lambda: oracle.allocate(live, [0, 1], 1),
            )
            calls["grow-below"] = (
                lambda: kv.grow(live, reserved - 1),
                lambda: oracle.grow(live, reserved - 1),
            )
            calls["commit-past"] = (
                lambda: kv.commit(live, too_long),
                lambda: oracle.commit(live, too_long),
            )
        if kind == "negative-page":
            with pytest.raises(InvalidRequest):
                kv.ref_count(-1 - data.draw(st.integers(0, 3), label="below zero"))
        elif kind in calls:
            assert self._run(*calls[kind]) is None, f"{kind} did not raise"

    @precondition(lambda self: "reset" in self.capabilities)
    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        """reset_prefix_cache (maybe after freeing every sequence): PagesInUse while pages
        are held, else every prefix is forgotten and every cached page freed."""
        if len(self.live) > 0 and data.draw(st.booleans(), label="free every sequence first"):
            for seq_id in sorted(self.live):
                self._free(seq_id)
        self._run(self.kv.reset_prefix_cache, self.oracle.reset_prefix_cache)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def stats_match_and_add_up(self) -> None:
        """KVM-010, KVM-030, KVM-031: the counters equal the oracle's and add up, and the
        backend's own check passes."""
        if self._kv is None:
            return
        stats = self.kv.stats()
        assert stats == self.oracle.stats(), f"stats {stats} != oracle {self.oracle.stats()}"
        assert stats.pages_in_use + stats.pages_free + stats.pages_cached == stats.num_pages
        self.kv.check_invariants()
        self.oracle.check()

    @invariant()
    def cached_prefix_lengths_match(self) -> None:
        """KVM-032, KVM-030: cached_prefix_length of every known prompt (under its salt and
        under no salt) equals the oracle's, and asking moves no statistic."""
        if self._kv is None:
            return
        before = self.kv.stats()
        for prompt, salt in self.prompts:
            for asked in {salt, None}:
                got = self.kv.cached_prefix_length(prompt, fresh_salt(asked))
                want = self.oracle.cached_prefix_length(prompt, asked)
                assert got == want, f"cached_prefix_length({prompt}, {asked!r}): {got} != {want}"
        assert self.kv.stats() == before

    @invariant()
    def page_tables_and_ref_counts_match(self) -> None:
        """KVM-005, KVM-006, KVM-015: every live table has the oracle's size and maps page by
        page onto the oracle's; every page's ref count equals its holders."""
        if self._kv is None:
            return
        holders: Counter[int] = Counter()
        for seq_id in self.live:
            table = self.kv.page_table(seq_id)
            want = self.oracle.page_table(seq_id)
            assert table.num_tokens == self.oracle.num_tokens(seq_id)
            assert len(table.pages) == len(want) == pages_for(table.num_tokens, table.page_size)
            for b, o in zip(table.pages, want, strict=True):
                assert self.o2b.get(o) == b, (seq_id, table, want)
                assert self.b2o.get(b) == o, (seq_id, table, want)
            holders.update(table.pages)
        for page in range(self.kv.num_pages):
            assert self.kv.ref_count(page) == holders[page], (page, holders[page])


def run_kv_state_machine(
    make_kv_manager: MakeKVManager,
    capabilities: frozenset[str],
    variants: Mapping[str, str] | None = None,
) -> None:
    """Run :class:`KVManagerMachine` on managers from ``make_kv_manager``, bounded by the
    active Hypothesis profile; the oracle follows ``variants`` (default: the defaults)."""
    sizes = [
        size for size in STATE_MACHINE_PAGE_SIZES if page_size_supported(make_kv_manager, size)
    ]
    if not sizes:
        pytest.skip(f"backend declares none of the page sizes {STATE_MACHINE_PAGE_SIZES}")

    class Machine(KVManagerMachine):
        target = (make_kv_manager, capabilities, dict(variants or {}))

    run_state_machine_as_test(Machine, settings=settings(deadline=None))


class KVStateMachineSuite:
    """The state machine as a test; subclass it with ``make_kv_manager`` and
    ``backend_capabilities`` fixtures to run it on your own KVManager."""

    @pytest.mark.spec(
        "KVM-001",
        "KVM-002",
        "KVM-003",
        "KVM-005",
        "KVM-006",
        "KVM-010",
        "KVM-012",
        "KVM-013",
        "KVM-014",
        "KVM-015",
        "KVM-016",
        "KVM-021",
        "KVM-023",
        "KVM-024",
        "KVM-025",
        "KVM-026",
        "KVM-027",
        "KVM-028",
        "KVM-029",
        "KVM-030",
        "KVM-031",
        "KVM-032",
        "KVM-033",
        "KVM-034",
        "KVM-035",
        "KVM-036",
        "KVM-037",
        "KVM-038",
        "KVM-039",
    )
    def test_kv_manager_matches_the_oracle(
        self,
        make_kv_manager: MakeKVManager,
        backend_capabilities: frozenset[str],
        backend_variants: dict[str, str],
    ) -> None:
        """Random interleavings of every operation, pool pressure and error included, agree
        with the oracle (following the backend's declared variants) step by step, and every
        invariant holds after every step."""
        run_kv_state_machine(make_kv_manager, backend_capabilities, backend_variants)


class TestKVStateMachine(KVStateMachineSuite):
    """The state machine against ``--backend``."""
