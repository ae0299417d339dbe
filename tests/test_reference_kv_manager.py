"""Reference-only KVManager tests: what the Protocol cannot show a conformance suite.

These reach into :class:`ReferenceKVManager`'s internals: corrupting its bookkeeping must trip
``check_invariants`` (KVM-031), forced hash collisions must never hand out another prompt's
pages (KVM-022), and the module must never import torch (KVM-040).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

import pagedkv.kv.manager as manager_module
from pagedkv.errors import DoubleFree, InvariantViolation, UnknownSequence
from pagedkv.interfaces import KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.kv.prefix_index import HashFn, PrefixEntry


def busy(hash_fn: HashFn | None = None) -> ReferenceKVManager:
    """8 pages of 2 tokens: sequence 1 holds [1..5] (2 pages published), sequence 2 shares
    them, [20..24] was run and freed (2 pages cached), the rest is free."""
    config = KVManagerConfig(8, 2)
    kv = ReferenceKVManager(config) if hash_fn is None else ReferenceKVManager(config, hash_fn)
    kv.allocate(1, [1, 2, 3, 4, 5], 5)
    kv.commit(1, [1, 2, 3, 4, 5])
    kv.allocate(2, [1, 2, 3, 4, 5], 1)
    kv.allocate(3, [20, 21, 22, 23, 24], 5)
    kv.commit(3, [20, 21, 22, 23, 24])
    kv.free(3)
    kv.check_invariants()
    return kv


def _shared(kv: ReferenceKVManager) -> int:
    return kv.page_table(2).pages[0]


def _private(kv: ReferenceKVManager) -> int:
    return kv.page_table(1).pages[2]


def _cached(kv: ReferenceKVManager) -> int:
    return kv.pool.cached_pages()[0]


def _free(kv: ReferenceKVManager) -> int:
    return kv.pool.free_pages()[0]


def _set_ref(kv: ReferenceKVManager, page: int, value: int) -> None:
    kv.pool._ref_counts[page] = value


def _fake_entry(kv: ReferenceKVManager, page: int) -> None:
    kv.index._by_page[page] = PrefixEntry(-1, page, (0, 0), None, None)


CORRUPTIONS: dict[str, Callable[[ReferenceKVManager], None]] = {
    "in-use page on the free list": lambda kv: kv.pool._free.append(_private(kv)),
    "page twice on the free list": lambda kv: kv.pool._free.append(_free(kv)),
    "page both free and cached": lambda kv: kv.pool._cached.__setitem__(_free(kv), None),
    "in-use page cached": lambda kv: kv.pool._cached.__setitem__(_private(kv), None),
    "ref count bumped": lambda kv: _set_ref(kv, _shared(kv), 3),
    "ref count dropped": lambda kv: _set_ref(kv, _shared(kv), 1),
    "free page with a ref count": lambda kv: _set_ref(kv, _free(kv), 1),
    "in-use count off": lambda kv: setattr(kv.pool, "_num_in_use", kv.pool.num_in_use + 1),
    "page lost": lambda kv: kv.pool._free.remove(_free(kv)),
    "sequence holds a page twice": lambda kv: kv.sequences[1].pages.__setitem__(1, _private(kv)),
    "page table too short": lambda kv: setattr(kv.sequences[1], "num_tokens", 9),
    "unfull page committed": lambda kv: setattr(kv.sequences[1], "num_committed_pages", 3),
    "shared page at another logical page": lambda kv: kv.sequences[2].pages.reverse(),
    "cached page without entry": lambda kv: kv.index.remove_page(_cached(kv)),
    "free page with an entry": lambda kv: _fake_entry(kv, _free(kv)),
}


@pytest.mark.spec("KVM-031", "KVM-010", "KVM-011", "KVM-015")
@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_check_invariants_catches_corruption(corrupt: Callable[[ReferenceKVManager], None]) -> None:
    """Each kind of inconsistent bookkeeping (a page in two states or on the free list twice,
    ref counts not matching holders, a lost page, a malformed page table, a page shared at
    two logical positions, a cached page without an entry) makes check_invariants raise
    InvariantViolation."""
    kv = busy()
    corrupt(kv)
    with pytest.raises(InvariantViolation):
        kv.check_invariants()


def _constant_hash(parent: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    return 0


def _parent_blind_hash(parent: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    return hash((token_ids, salt))


@pytest.mark.spec("KVM-022")
def test_constant_hash_never_shares_wrong_pages() -> None:
    """With every page hashing to the same key, only verified hits are taken: a prompt with
    other tokens or another salt hits nothing and shares no page, a colliding commit
    publishes nothing, and the genuine prefix is still hit on its own page."""
    kv = ReferenceKVManager(KVManagerConfig(16, 2), hash_fn=_constant_hash)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    kv.allocate(1, a, 5)
    assert kv.commit(1, a) == 1  # the 2nd page collides with the 1st: the chain stops
    assert kv.cached_prefix_length(a) == 2
    assert kv.cached_prefix_length(b) == 0
    assert kv.cached_prefix_length(a, "salt") == 0
    alloc = kv.allocate(2, b, 5)
    assert alloc.num_cached_tokens == 0
    assert not set(alloc.page_table.pages) & set(kv.page_table(1).pages)
    assert kv.commit(2, b) == 0
    assert kv.stats().pages_indexed == 1
    hit = kv.allocate(3, [1, 2, 9, 9, 9], 3)
    assert hit.num_cached_tokens == 2
    assert hit.page_table.pages[0] == kv.page_table(1).pages[0]
    kv.free(1)
    kv.free(2)
    kv.free(3)
    assert kv.cached_prefix_length(b) == 0
    assert kv.cached_prefix_length(a) == 2
    kv.check_invariants()


@pytest.mark.spec("KVM-022", "KVM-020")
def test_parent_blind_hash_is_caught_by_parent_check() -> None:
    """With a hash that ignores the parent, a page whose tokens match a published second page
    is still not hit at the start of another prompt: hits are verified against the parent
    entry."""
    kv = ReferenceKVManager(KVManagerConfig(16, 2), hash_fn=_parent_blind_hash)
    kv.allocate(1, [1, 2, 3, 4, 5], 5)
    assert kv.commit(1, [1, 2, 3, 4, 5]) == 2
    assert kv.cached_prefix_length([3, 4, 5]) == 0
    assert kv.cached_prefix_length([1, 2, 3, 4, 5]) == 4
    alloc = kv.allocate(2, [3, 4, 5], 3)
    assert alloc.num_cached_tokens == 0
    assert not set(alloc.page_table.pages) & set(kv.page_table(1).pages)
    kv.check_invariants()


@pytest.mark.spec("KVM-040")
def test_reference_kv_manager_never_imports_torch() -> None:
    """Importing pagedkv.kv and pagedkv.backend and running a KVManager through a full life
    (allocate, grow, commit, hit, evict, reset, stats, checks) leaves torch unimported."""
    script = textwrap.dedent(
        """
        import sys

        import pagedkv.backend
        import pagedkv.kv
        from pagedkv.interfaces import KVManagerConfig

        kv = pagedkv.backend.reference_backend().create_kv_manager(KVManagerConfig(6, 2))
        kv.allocate(1, [1, 2, 3, 4, 5], 5)
        kv.grow(1, 6)
        kv.commit(1, [1, 2, 3, 4, 5, 6])
        kv.free(1)
        kv.allocate(2, [1, 2, 3, 4, 5], 1)
        kv.allocate(3, [9] * 5, 5)
        kv.free(2)
        kv.free(3)
        kv.reset_prefix_cache()
        kv.stats()
        kv.check_invariants()
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"torch modules imported: {result.stdout}"


@pytest.mark.spec("KVM-013")
def test_freed_ids_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference remembers the most recently freed ids (to tell a double free from an
    unknown id) up to a bound, forgetting the oldest first."""
    monkeypatch.setattr(manager_module, "FREED_IDS_REMEMBERED", 3)
    kv = ReferenceKVManager(KVManagerConfig(8, 2))
    for seq_id in (0, 1, 2, 0, 3):  # id 0 is allocated again: freed last, remembered longest
        kv.allocate(seq_id, [seq_id], 1)
        kv.free(seq_id)
    for remembered in (3, 2, 0):
        with pytest.raises(DoubleFree):
            kv.free(remembered)
    with pytest.raises(UnknownSequence) as forgotten:
        kv.free(1)
    assert not isinstance(forgotten.value, DoubleFree)


@pytest.mark.spec("KVM-013")
def test_a_fork_onto_a_freed_id_frees_it_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """An id freed, then used again by a fork and freed once more, counts as freed last: the
    oldest freed ids are forgotten before it, as for an id allocated again."""
    monkeypatch.setattr(manager_module, "FREED_IDS_REMEMBERED", 3)
    kv = ReferenceKVManager(KVManagerConfig(8, 2))
    for seq_id in (0, 1):
        kv.allocate(seq_id, [seq_id], 1)
        kv.free(seq_id)
    kv.allocate(5, [5], 1)
    kv.fork(5, 0)  # id 0 is live again: freed after 1 from now on
    kv.free(0)
    kv.free(5)
    kv.allocate(2, [2], 1)
    kv.free(2)  # a fourth remembered id: the oldest, 1, is forgotten
    for remembered in (2, 5, 0):
        with pytest.raises(DoubleFree):
            kv.free(remembered)
    with pytest.raises(UnknownSequence) as forgotten:
        kv.free(1)
    assert not isinstance(forgotten.value, DoubleFree)


@pytest.mark.spec("KVM-039", "KVM-050")
def test_a_shared_page_published_under_an_evicted_parent_breaks_the_later_chain() -> None:
    """Page size 1. Sequence 2, forked from 1, commits the shared pages first, the first one
    meeting sequence 3's entry for ``[1]`` (kept once), so it publishes ``[1, 2]`` under that
    entry. Sequence 3's page is then evicted. Sequence 1, committing next, publishes ``[1]``
    again on its own page, and finds on its shared page an entry whose parent is the evicted
    one: not the next link of its chain, so (``orphans=block``) it publishes nothing more."""
    kv = ReferenceKVManager(KVManagerConfig(6, 1))
    kv.allocate(1, [1, 2, 3, 9], 4)
    kv.allocate(3, [1, 8], 2)
    assert kv.commit(3, [1]) == 1
    kv.fork(1, 2)
    assert kv.commit(2, [1, 2]) == 1  # [1] kept once: sequence 3's entry
    kv.free(3)
    kv.allocate(4, [7, 7], 2)  # takes the free page and evicts sequence 3's cached one
    assert kv.stats().evictions == 1
    assert kv.commit(1, [1, 2, 3]) == 1  # [1] on its own page; the chain stops at [1, 2]
    assert kv.cached_prefix_length([1, 2, 3, 4]) == 1
    kv.check_invariants()
