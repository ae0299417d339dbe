"""KVManager micro-benchmarks: cost per page of allocate/free and prefix match, by pool size.

Each pool is first half filled with published, cached prefix chains (so the prefix index and
the LRU grow with the pool), then each operation is timed on sequences of
:data:`SEQ_PAGES` pages. Every operation should be O(1) per page, so the cost per page should
not grow with the pool: the bench reports the ratio of the largest pool's cost to the
smallest's. ``tests/test_bench_micro.py`` runs the same operations under pytest-benchmark.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.bench.context import BenchContext
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import ratio, rounded
from pagedkv.interfaces import KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager

POOL_SIZES = (1_000, 10_000, 100_000)
PAGE_SIZE = 16
#: Pages of each sequence an operation allocates, frees or matches.
SEQ_PAGES = 64
#: Share of the pool filled with cached prefix chains before timing.
FILL = 0.5


@dataclass
class KVMicro:
    """A prepared ReferenceKVManager and the operations timed on it.

    Attributes:
        manager: the manager, its pool half cached.
        cached_prompt: a prompt whose first ``SEQ_PAGES`` pages are cached: a full hit.
        fresh_prompt: a prompt matching nothing.
    """

    manager: ReferenceKVManager
    cached_prompt: tuple[int, ...]
    fresh_prompt: tuple[int, ...]
    next_seq_id: int = 0

    @classmethod
    def build(cls, num_pages: int, seed: int = 0) -> KVMicro:
        """A pool of ``num_pages`` pages, ``FILL`` of them cached in chains of SEQ_PAGES."""
        rng = random.Random(seed)
        manager = ReferenceKVManager(KVManagerConfig(num_pages, PAGE_SIZE, True))
        length = SEQ_PAGES * PAGE_SIZE
        prompts = [
            tuple(rng.randrange(1 << 30) for _ in range(length))
            for _ in range(max(1, int(num_pages * FILL) // SEQ_PAGES))
        ]
        for seq_id, prompt in enumerate(prompts):
            manager.allocate(seq_id, prompt, len(prompt))
            manager.commit(seq_id, prompt)
            manager.free(seq_id)
        fresh = tuple(rng.randrange(1 << 30) for _ in range(length))
        # One extra token, so that every page of the cached prompt can be a hit (KVM-025).
        return cls(manager, prompts[len(prompts) // 2] + (7,), fresh, len(prompts))

    def _seq(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def allocate_free(self) -> None:
        """Allocate SEQ_PAGES fresh pages for a new sequence, then free them."""
        seq_id = self._seq()
        self.manager.allocate(seq_id, self.fresh_prompt, len(self.fresh_prompt))
        self.manager.free(seq_id)

    def hit_allocate_free(self) -> None:
        """Allocate a sequence whose SEQ_PAGES pages are all prefix hits, then free it."""
        seq_id = self._seq()
        self.manager.allocate(seq_id, self.cached_prompt, 1)
        self.manager.free(seq_id)

    def prefix_match(self) -> int:
        """Look up the cached prompt: walks and verifies SEQ_PAGES chained pages."""
        return self.manager.cached_prefix_length(self.cached_prompt)


def per_page_seconds(op: Callable[[], object], calls: int, batches: int) -> float:
    """Fastest over ``batches`` of the mean seconds of ``op`` per call, divided by SEQ_PAGES.

    The fastest batch is the one least disturbed by other work on the machine.
    """
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            op()
        times.append((time.perf_counter() - start) / calls)
    return min(times) / SEQ_PAGES


def run(ctx: BenchContext) -> WorkloadResult:
    """Time each operation at each pool size; report ns per page and the growth ratios."""
    result = WorkloadResult("micro")
    calls, batches = (20, 5) if ctx.quick else (100, 9)
    table: dict[str, dict[str, float | None]] = {}
    for size in POOL_SIZES:
        ctx.log(f"micro: KVManager with {size} pages")
        micro = KVMicro.build(size, ctx.seed)
        assert micro.prefix_match() == SEQ_PAGES * PAGE_SIZE
        table[str(size)] = {
            "allocate_free_ns_per_page": per_page_seconds(micro.allocate_free, calls, batches),
            "hit_allocate_free_ns_per_page": per_page_seconds(
                micro.hit_allocate_free, calls, batches
            ),
            "prefix_match_ns_per_page": per_page_seconds(micro.prefix_match, calls, batches),
        }
    for row in table.values():
        for key, value in row.items():
            row[key] = rounded((value or 0.0) * 1e9, 1)
    result.figures["ns_per_page"] = table
    result.figures["seq_pages"] = SEQ_PAGES
    result.figures["fill"] = FILL
    small, large = table[str(POOL_SIZES[0])], table[str(POOL_SIZES[-1])]
    growth = max(ratio(large[k] or 0.0, small[k] or 0.0) for k in small)
    result.add_ratio(
        "cost_growth_largest_over_smallest_pool",
        growth,
        f"worst, over operations, of the cost per page at {POOL_SIZES[-1]} pages over "
        f"{POOL_SIZES[0]} pages (1.0 = flat)",
    )
    result.add_target(
        "cost_growth_largest_over_smallest_pool",
        "<=",
        3.0,
        "KVManager cost per page flat in the pool size (generous bound: 3x from 1k to 100k)",
    )
    return result
