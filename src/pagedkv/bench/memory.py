"""KV-cache memory: utilisation of allocated pages, and concurrency in a fixed byte budget.

* Utilisation: the mixed workload (the same requests as :mod:`~pagedkv.bench.mixed`) runs on
  the v1 engine with pages of 16 tokens; after every step, the positions holding K/V (each
  running request's computed tokens) are divided by the token capacity of the pages in use.
  Requests generate exactly ``max_tokens``, so the schedule, and with it every page, does not
  depend on the model: the engine runs over a stand-in runner (a hash of the context instead of
  a transformer) and the figure is exact and free of timing noise.
* Concurrency: how many sequences of the mixed distribution, each at its full length, the
  ReferenceKVManager fits in a fixed KV byte budget, against a contiguous reservation of the
  workload's maximum length per request (what a static cache reserves).
"""

from __future__ import annotations

from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.mixed import pages_needed, spec_for
from pagedkv.bench.pagedkv_system import PAGE_SIZE, make_engine, run_engine
from pagedkv.bench.requests import MixedSpec, mixed_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import ratio, rounded
from pagedkv.engine.outputs import StepReport
from pagedkv.errors import OutOfPages
from pagedkv.interfaces import KVManagerConfig, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.model.config import ModelConfig
from pagedkv.store.paged_store import bytes_per_page
from pagedkv.testing.hash_runner import HashRunner

#: KV byte budget of the concurrency comparison, bytes.
KV_BUDGET_BYTES = 64 * 2**20
#: Sequences drawn for the concurrency count (more than can ever fit).
CONCURRENCY_SAMPLES = 2000


class UtilisationProbe:
    """A step observer sampling the KV cache after every step: positions stored and positions
    allocated (pages in use times ``page_size``)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.stored: list[int] = []
        self.capacity: list[int] = []

    def __call__(self, report: StepReport) -> None:
        pages = report.stats.pages_in_use
        if pages == 0:
            return
        self.stored.append(report.kv_positions)
        self.capacity.append(pages * self.page_size)

    def mean(self) -> float:
        """Mean over steps of stored / capacity."""
        shares = [s / c for s, c in zip(self.stored, self.capacity, strict=True)]
        return sum(shares) / len(shares) if shares else float("nan")

    def at_peak(self) -> float:
        """Stored / capacity at the step with the most pages in use."""
        if not self.capacity:
            return float("nan")
        peak = max(range(len(self.capacity)), key=self.capacity.__getitem__)
        return self.stored[peak] / self.capacity[peak]

    def minimum(self) -> float:
        """The lowest stored / capacity of any step."""
        shares = [s / c for s, c in zip(self.stored, self.capacity, strict=True)]
        return min(shares) if shares else float("nan")


def run(ctx: BenchContext, checkpoint: Checkpoint, vocab: int) -> WorkloadResult:
    """Measure utilisation on the mixed workload, then concurrency in a byte budget."""
    result = WorkloadResult("memory")
    spec = spec_for(ctx.quick)
    requests = mixed_requests(spec, vocab, ctx.seed)
    num_pages = pages_needed(requests)
    ctx.log("memory: KV utilisation on the mixed workload")
    engine = make_engine(HashRunner(vocab, num_pages, PAGE_SIZE), "v1", num_pages)
    probe = UtilisationProbe(PAGE_SIZE)
    run_engine(engine, requests, "pagedkv-v1", observer=probe)
    result.figures["utilisation"] = {
        "page_size": PAGE_SIZE,
        "steps_sampled": len(probe.stored),
        "mean": rounded(probe.mean()),
        "at_peak_pages": rounded(probe.at_peak()),
        "minimum": rounded(probe.minimum()),
        "peak_pages_in_use": engine.stats().peak_pages_in_use,
    }
    result.add_ratio(
        "kv_utilisation",
        probe.mean(),
        "positions holding K/V over the token capacity of the pages in use, mean over the "
        "steps of the mixed workload (page size 16)",
    )
    result.add_target("kv_utilisation", ">=", 0.96, "KV utilisation >= 96% with page size 16")
    ctx.log("memory: concurrency in a fixed KV byte budget")
    _concurrency(ctx, result, checkpoint, spec, vocab)
    return result


def _concurrency(
    ctx: BenchContext, result: WorkloadResult, checkpoint: Checkpoint, spec: MixedSpec, vocab: int
) -> None:
    config = ModelConfig.from_dir(checkpoint.path)
    store = StoreConfig(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        page_size=PAGE_SIZE,
        num_pages=1,
        dtype="float32",
    )
    page_bytes = bytes_per_page(store)
    token_bytes = page_bytes // PAGE_SIZE
    num_pages = KV_BUDGET_BYTES // page_bytes
    manager = ReferenceKVManager(KVManagerConfig(num_pages, PAGE_SIZE, False))
    sample = MixedSpec(CONCURRENCY_SAMPLES, spec.prompt, spec.output)
    fitted = 0
    for seq_id, request in enumerate(mixed_requests(sample, vocab, ctx.seed + 1)):
        try:
            manager.allocate(seq_id, request.prompt, request.total_len)
        except OutOfPages:
            break
        fitted += 1
    budget_tokens = KV_BUDGET_BYTES // token_bytes
    contiguous = budget_tokens // spec.max_total_len
    exact = 0
    used = 0
    for request in mixed_requests(sample, vocab, ctx.seed + 1):
        used += request.total_len
        if used > budget_tokens:
            break
        exact += 1
    result.figures["concurrency"] = {
        "kv_budget_bytes": KV_BUDGET_BYTES,
        "bytes_per_token": token_bytes,
        "pages_in_budget": num_pages,
        "paged_sequences": fitted,
        "contiguous_max_len_tokens": spec.max_total_len,
        "contiguous_max_len_sequences": contiguous,
        "contiguous_exact_len_sequences": exact,
    }
    result.add_ratio(
        "concurrency_vs_contiguous",
        ratio(fitted, contiguous),
        "sequences at full length that fit a fixed KV byte budget in pages of 16 tokens, over "
        "a contiguous reservation of the workload's maximum length per request",
    )
    result.add_ratio(
        "concurrency_vs_exact_reservation",
        ratio(fitted, exact),
        "the same over a contiguous reservation of each request's exact final length (an "
        "oracle without fragmentation; below 1.0 by the partial last pages)",
    )
