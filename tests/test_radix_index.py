"""The radix tree behind the second prefix-index backend (KVM-020, KVM-022, KVM-028)."""

from __future__ import annotations

import pytest

from pagedkv.interfaces import KVManager, KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.kv.radix_index import RadixPrefixIndex
from pagedkv_conformance.test_kv_state_machine import run_kv_state_machine
from pagedkv_conformance.test_kv_variants import EXPECTED, NUM_PAGES, OnBackend, orphan_example


def radix_manager(num_pages: int = 8, page_size: int = 2) -> ReferenceKVManager:
    config = KVManagerConfig(num_pages, page_size)
    return ReferenceKVManager(config, index=RadixPrefixIndex(num_pages, page_size))


@pytest.mark.spec("KVM-020", "KVM-022")
def test_hits_follow_the_tree_by_token_ids() -> None:
    kv = radix_manager()
    kv.allocate(1, [1, 2, 3, 4, 5], 5)
    assert kv.commit(1, [1, 2, 3, 4, 5]) == 2  # two full pages; the fifth token waits
    kv.check_invariants()
    assert kv.cached_prefix_length([1, 2, 3, 4, 9]) == 4
    assert kv.cached_prefix_length([1, 2, 3, 9, 9]) == 2
    assert kv.cached_prefix_length([9, 2, 3, 4, 9]) == 0  # a different first page: no chain
    assert kv.cached_prefix_length([3, 4, 1, 2, 9]) == 0  # pages in another order: no chain


@pytest.mark.spec("KVM-028")
def test_salts_have_their_own_roots() -> None:
    kv = radix_manager()
    kv.allocate(1, [1, 2, 3], 3, cache_salt="a")
    kv.commit(1, [1, 2, 3])
    assert kv.cached_prefix_length([1, 2, 3], cache_salt="a") == 2
    assert kv.cached_prefix_length([1, 2, 3], cache_salt="b") == 0
    assert kv.cached_prefix_length([1, 2, 3]) == 0


@pytest.mark.spec("KVM-024")
def test_evicted_pages_leave_the_tree() -> None:
    kv = radix_manager(num_pages=3, page_size=2)
    kv.allocate(1, [1, 2, 3, 4, 5], 5)
    kv.commit(1, [1, 2, 3, 4])
    kv.free(1)  # pages cached tail first: the child [3, 4] is evicted before its parent
    kv.allocate(2, [7, 7, 7, 7, 7], 5)  # needs all three pages: evicts both
    kv.check_invariants()
    assert kv.stats().evictions == 2
    assert kv.stats().pages_indexed == 0
    kv.free(2)
    assert kv.cached_prefix_length([1, 2, 3, 4, 5]) == 0


@pytest.mark.spec("KVM-050", "KVM-024", "KVM-027", "KVM-028", "KVM-032")
def test_radix_manager_matches_the_oracle_declaring_detach() -> None:
    """The whole KV state machine on the radix index, its oracle following orphans=detach
    (in process, so that mutation testing of the radix tree sees it)."""

    def make(num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> KVManager:
        config = KVManagerConfig(num_pages, page_size, enable_prefix_caching)
        return ReferenceKVManager(config, index=RadixPrefixIndex(num_pages, page_size))

    run_kv_state_machine(
        make, frozenset({"prefix_caching", "eviction", "reset"}), {"orphans": "detach"}
    )


@pytest.mark.spec("KVM-050")
def test_radix_orphans_detach_in_the_nine_call_example() -> None:
    assert orphan_example(OnBackend(radix_manager(NUM_PAGES, 1))) == EXPECTED["detach"]


@pytest.mark.spec("KVM-024", "KVM-028")
def test_a_salted_first_page_leaves_its_salts_root_when_evicted() -> None:
    kv = radix_manager(num_pages=2, page_size=2)
    kv.allocate(1, [1, 2, 3], 3, cache_salt="s")
    kv.commit(1, [1, 2])
    kv.free(1)
    kv.allocate(2, [9, 9, 9], 4)  # both pages: the salted entry is evicted
    kv.check_invariants()
    kv.free(2)
    assert kv.cached_prefix_length([1, 2, 3], cache_salt="s") == 0
    kv.reset_prefix_cache()
    assert kv.stats().pages_indexed == 0
    assert len(kv.index) == 0
