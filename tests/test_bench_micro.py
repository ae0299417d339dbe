"""Micro-benchmarks of the ReferenceKVManager per operation, at 1k, 10k and 100k pages.

pytest-benchmark records the cost of allocate/free (fresh pages), allocate/free of a sequence
whose pages are all prefix hits, and a prefix match, each over a sequence of 64 pages, with
the pool half full of cached prefix chains. Compare the groups across pool sizes to see that
the cost per page does not grow with the pool. Nothing here asserts a time: the assertions
check only that each operation did what it should (timings are for reading, and for the bench's
own ratio, ``micro.cost_growth_largest_over_smallest_pool``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.bench.micro import PAGE_SIZE, POOL_SIZES, SEQ_PAGES, KVMicro

#: Keep the benchmarks short: they run in ``make test``.
BENCH = pytest.mark.benchmark(max_time=0.1, min_rounds=5, warmup=False)

_MICROS: dict[int, KVMicro] = {}


def prepared(num_pages: int) -> KVMicro:
    """One prepared manager per pool size, shared by the tests of this module."""
    if num_pages not in _MICROS:
        _MICROS[num_pages] = KVMicro.build(num_pages)
    return _MICROS[num_pages]


@BENCH
@pytest.mark.parametrize("num_pages", POOL_SIZES)
def test_allocate_free(benchmark: Any, num_pages: int) -> None:
    micro = prepared(num_pages)
    before = micro.manager.stats()
    benchmark.group = f"allocate+free {SEQ_PAGES} fresh pages"
    benchmark(micro.allocate_free)
    after = micro.manager.stats()
    assert after.pages_in_use == before.pages_in_use == 0
    assert after.pages_free == before.pages_free


@BENCH
@pytest.mark.parametrize("num_pages", POOL_SIZES)
def test_hit_allocate_free(benchmark: Any, num_pages: int) -> None:
    micro = prepared(num_pages)
    benchmark.group = f"allocate+free {SEQ_PAGES} prefix-hit pages"
    benchmark(micro.hit_allocate_free)
    stats = micro.manager.stats()
    assert stats.pages_in_use == 0
    assert stats.hit_tokens >= SEQ_PAGES * PAGE_SIZE


@BENCH
@pytest.mark.parametrize("num_pages", POOL_SIZES)
def test_prefix_match(benchmark: Any, num_pages: int) -> None:
    micro = prepared(num_pages)
    benchmark.group = f"prefix match of {SEQ_PAGES} pages"
    assert benchmark(micro.prefix_match) == SEQ_PAGES * PAGE_SIZE
