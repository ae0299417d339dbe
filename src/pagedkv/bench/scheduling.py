"""Scheduling cost of an admission against the running requests (ENG-027).

The engine runs over a stand-in runner that computes nothing, so only the engine's own work is
timed. A shared prefix of :data:`PREFIX_LEN` tokens is cached first; then ``R + 1`` requests,
each the prefix and a unique :data:`SUFFIX_LEN`-token suffix, arrive together and one step
admits them all: admission ``k`` happens with ``k`` running prefills sharing the prefix. The
admission step's CPU time over ``R + 1`` is the cost of one admission (CPU time of the process,
not wall time: a step of 65 admissions lasts long enough for a loaded machine to preempt it;
everything in the step but the scheduler is a few microseconds per request). The step report's
schedule time is recorded beside it. A KVManager plugged in through a backend counts the lookups
each admission costs, and the same manager's ``match_prefix`` of such a prompt, timed alone, is
the floor.

Before the scheduler matched once, each admission also scanned every running request's tokens
against the waiting prompt, so its cost grew with the running prompts (bench/README.md has what
the same burst measured on the code before the change).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedkv.backend import ReferenceBackend
from pagedkv.bench.context import BenchContext
from pagedkv.bench.pagedkv_system import make_engine
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import ratio, rounded
from pagedkv.engine.outputs import StepReport
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import KVManager, KVManagerConfig
from pagedkv.plan import StepPlan
from pagedkv.testing.counting_kv import CountingKVManager

RUNNING = (1, 16, 64)
PREFIX_LEN = 2048
SUFFIX_LEN = 16
PAGE_SIZE = 16
VOCAB = 1000


class NullRunner:
    """A :class:`~pagedkv.interfaces.StepRunner` that computes nothing: uniform logits."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return VOCAB

    @property
    def max_positions(self) -> None:
        return None

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return torch.zeros(plan.num_seqs, VOCAB)


@dataclass(frozen=True)
class CountingBackend(ReferenceBackend):
    """The reference backend, handing out one counting manager and keeping it."""

    managers: list[CountingKVManager] | None = None

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        manager = CountingKVManager(config)
        if self.managers is not None:
            self.managers.append(manager)
        return manager


@dataclass(frozen=True)
class Admissions:
    """One burst: ``admitted`` requests in one step."""

    admitted: int
    step_cpu_s: float
    schedule_s: float
    lookups: int
    match_s: float


def burst(running: int) -> Admissions:
    """Cache the prefix, then admit ``running + 1`` requests sharing it in one step."""
    total = PREFIX_LEN + SUFFIX_LEN
    managers: list[CountingKVManager] = []
    engine = make_engine(
        NullRunner(),
        "v1",
        (running + 3) * (total // PAGE_SIZE + 2),
        max_num_seqs=running + 1,
        max_num_batched_tokens=(running + 1) * total,
        max_model_len=total + 8,
        backend=CountingBackend(managers=managers),
    )
    (manager,) = managers
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prefix = [(7 * i + 3) % VOCAB for i in range(PREFIX_LEN)]
    engine.add_request([*prefix, 1], params)
    while engine.has_unfinished_requests():
        engine.step()
    prompts = [
        [*prefix, *((r * 31 + j) % VOCAB for j in range(SUFFIX_LEN))] for r in range(running + 1)
    ]
    for prompt in prompts:
        engine.add_request(prompt, params)
    reports: list[StepReport] = []
    engine.add_step_observer(reports.append)
    manager.lookups.clear()
    cpu = time.process_time()
    engine.step()
    step_cpu_s = time.process_time() - cpu
    (report,) = reports
    lookups = manager.num_lookups
    start = time.perf_counter()
    manager.match_prefix(prompts[0])
    match_s = time.perf_counter() - start
    return Admissions(report.num_seqs, step_cpu_s, report.schedule_s, lookups, match_s)


def run(ctx: BenchContext) -> WorkloadResult:
    """Per-admission cost and lookups for each number of running prefills."""
    result = WorkloadResult("scheduling")
    repetitions = 7 if ctx.quick else 15
    figures: dict[str, dict[str, float | None]] = {}
    lookups_per_admission = 0.0
    for running in RUNNING:
        ctx.log(f"scheduling: admissions with up to {running} running prefills")
        runs = [burst(running) for _ in range(repetitions)]
        admitted = runs[0].admitted
        lookups = max(r.lookups for r in runs) / admitted
        lookups_per_admission = max(lookups_per_admission, lookups)
        figures[str(running)] = {
            "admitted": admitted,
            "admission_cpu_us": rounded(min(r.step_cpu_s for r in runs) / admitted * 1e6, 1),
            "admission_schedule_wall_us": rounded(
                min(r.schedule_s for r in runs) / admitted * 1e6, 1
            ),
            "lookups_per_admission": rounded(lookups, 3),
            "match_prefix_us": rounded(min(r.match_s for r in runs) * 1e6, 1),
        }
    result.figures["by_running_prefills"] = figures
    result.figures["prompt_tokens"] = PREFIX_LEN + SUFFIX_LEN
    most, fewest = figures[str(RUNNING[-1])], figures[str(RUNNING[0])]
    result.add_ratio(
        "admission_cost_growth",
        ratio(most["admission_cpu_us"] or 0.0, fewest["admission_cpu_us"] or 0.0),
        f"CPU time per admission of a step admitting with up to {RUNNING[-1]} running "
        f"{PREFIX_LEN + SUFFIX_LEN}-token prefills sharing its prefix, over up to "
        f"{RUNNING[0]} (1.0 = flat in the running requests)",
    )
    result.add_target(
        "admission_cost_growth",
        "<=",
        2.0,
        "admission cost flat in the running prefills (generous bound: 2x from 1 to 64)",
    )
    result.add_ratio(
        "admissions_per_lookup",
        1.0 / lookups_per_admission if lookups_per_admission else float("nan"),
        "admissions over KVManager prompt lookups (match_prefix, cached_prefix_length, "
        "allocate without a match) in the admission step; 1.0 = one lookup each",
    )
    result.add_target("admissions_per_lookup", ">=", 1.0, "an admission costs one KVManager lookup")
    return result
