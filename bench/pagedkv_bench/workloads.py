"""The project's workload table: ``pagedkv bench``'s, with the peers workload after
``parallel``, its full run isolating each workload through :mod:`pagedkv_bench.isolated`."""

from __future__ import annotations

from pagedkv.bench.workloads import PAGEDKV_WORKLOADS, Runner, Workload


def _peers() -> Runner:
    from pagedkv_bench import peers

    return lambda ctx, checkpoint, vocab: peers.run(ctx)


#: Every workload ``make bench`` runs, in run order.
PROJECT_WORKLOADS = PAGEDKV_WORKLOADS.with_workload(
    Workload("peers", _peers, cuda=True),
    after="parallel",
    child_module="pagedkv_bench.isolated",
)
