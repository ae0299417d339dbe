"""Engine configuration: the budgets the scheduler works under and the shape of the KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedkv.errors import InvalidRequest

#: ``v1`` keeps each token's K/V in the paged cache; ``v0`` recomputes every sequence from its
#: first token at every step (the baseline without a cache).
CacheMode = Literal["v0", "v1"]
#: Orders of admission and preemption (ENG-189): ``fcfs`` by arrival; ``priority`` by each
#: request's priority (lowest value first), arrival among equals.
SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class EngineConfig:
    """How much work one step may carry and how the KV cache is laid out.

    Attributes:
        page_size: token positions per KV page.
        num_pages: pages in the pool (each holds ``page_size`` positions for every layer).
        max_num_batched_tokens: token positions computed in one step, all sequences together;
            prompts longer than this are prefilled in chunks.
        max_num_seqs: sequences in one step.
        max_model_len: most positions one sequence may reach (prompt + generated tokens).
        enable_prefix_caching: reuse cached full pages across requests.
        mode: ``v1`` (paged KV cache) or ``v0`` (recompute everything every step).
        max_step_retries: times a request whose step raised while it ran alone is scheduled
            again before it fails with finish reason ``error``; a failed step of several
            requests counts against none of them (they run again in halves until the failure
            is pinned on one request running alone), so only a request that fails on its own
            is failed (ENG-071, ENG-072).
        seed: seeds the generator that seeds each sampled request given no seed of its own
            (ENG-184); in ``[0, 2**64)``.
        scheduling_policy: ``fcfs`` (a request priority other than 0 is refused) or
            ``priority`` (ENG-189).
    """

    page_size: int = 16
    num_pages: int = 512
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    mode: CacheMode = "v1"
    max_step_retries: int = 2
    seed: int = 0
    scheduling_policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_step_retries < 0:
            raise InvalidRequest(f"max_step_retries must be >= 0, got {self.max_step_retries}")
        if self.max_model_len < 2:
            raise InvalidRequest(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.seed < 2**64:
            raise InvalidRequest(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidRequest(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.mode not in ("v0", "v1"):
            raise InvalidRequest(f"mode must be 'v0' or 'v1', got {self.mode!r}")
