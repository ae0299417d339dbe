"""The radix tree behind the second prefix-index backend (KVM-020, KVM-022, KVM-028)."""

from __future__ import annotations

import pytest

from pagedkv.interfaces import KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.kv.radix_index import RadixPrefixIndex


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
