"""Faults charged to their cause, at the engine (ENG-072, ENG-179): one request no step can run
among many, and steps failing at random beside it.

The engine runs the hash stand-in model behind two faults: a runner that raises after a random
step in 50 (``FaultyRunner``), and one poisoned request (the fault is injected for that
request alone: every step holding it raises, ``PoisonedRunner``). Requests arrive a few per
step, so the poisoned one shares its steps with dozens of others. An innocent request is one
not poisoned: the figure that must be 0 is how many of them failed. Each innocent request must
also finish with exactly the tokens a fault-free engine gives it.

``tests/test_engine_faults.py`` runs it; ``make chaos`` prints its figures.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.testing.faults import FaultyRunner, PoisonedRunner, TracingHashRunner, out_of_tries

VOCAB = 256
#: A request is known by its first two prompt tokens (unique per request).
KEY_LEN = 2
#: The tokens after the key that mark the poisoned request.
POISON = (250, 251, 252)
#: Requests added before each step.
ARRIVALS_PER_STEP = 2
#: Steps a run may take at most (it ends long before).
MAX_STEPS = 100_000


@dataclass(frozen=True)
class EngineChaosReport:
    """The figures of one run; :attr:`ok` when every must-be-zero figure is zero."""

    requests: int
    steps: int
    random_faults: int
    poisoned_faults: int
    poisoned_failed: bool
    innocent_failures: int
    out_of_tries: int
    wrong_outputs: int
    pages_in_use_after: int
    seconds: float

    @property
    def ok(self) -> bool:
        return (
            self.poisoned_failed
            and not self.innocent_failures
            and not self.wrong_outputs
            and not self.pages_in_use_after
        )

    def lines(self) -> list[str]:
        return [
            f"engine requests                            {self.requests}  (1 never runnable)",
            f"engine steps                               {self.steps}",
            f"steps failed at random                     {self.random_faults}",
            f"steps failed holding the poisoned request  {self.poisoned_faults}",
            f"poisoned request failed                    {self.poisoned_failed}  (must be True)",
            f"innocent requests failed                   {self.innocent_failures}  (must be 0)",
            f"innocent requests alone in 3 failed steps  {self.out_of_tries}",
            f"innocent outputs unlike a fault-free run   {self.wrong_outputs}  (must be 0)",
            f"KV pages in use after                      {self.pages_in_use_after}  (must be 0)",
            f"wall time                                  {self.seconds:.1f} s",
        ]


def _prompts(requests: int, seed: int) -> tuple[list[tuple[int, ...]], int]:
    """The prompts, each unique by its key, and the index of the poisoned one (the middle)."""
    rng = random.Random(seed)
    poisoned = requests // 2
    prompts = []
    for i in range(requests):
        body = POISON if i == poisoned else tuple(rng.randrange(VOCAB - 8) for _ in range(3))
        tail = tuple(rng.randrange(VOCAB - 8) for _ in range(rng.randint(1, 12)))
        prompts.append((*divmod(i, VOCAB), *body, *tail))
    return prompts, poisoned


def run_engine_chaos(
    requests: int = 600,
    fault_rate: float = 0.02,
    seed: int = 0,
    config: EngineConfig | None = None,
    mutate: Callable[[LLMEngine], None] | None = None,
    compare: bool = True,
) -> EngineChaosReport:
    """Run ``requests`` requests, one of them poisoned, with steps failing at ``fault_rate``;
    ``mutate`` breaks the engine on purpose (a test shows the figures catch it). With
    ``compare``, every innocent request's tokens are checked against a fault-free run (else
    ``wrong_outputs`` is 0 unchecked)."""
    config = config or EngineConfig(
        page_size=4, num_pages=2048, max_num_batched_tokens=512, max_num_seqs=32, max_model_len=256
    )
    prompts, poisoned = _prompts(requests, seed)
    rng = random.Random(seed + 1)
    params = [
        SamplingParams(max_tokens=rng.randint(4, 32), temperature=t, seed=i if t else None)
        for i, t in enumerate(rng.choice((0.0, 0.8)) for _ in range(requests))
    ]
    inner = PoisonedRunner(
        VOCAB,
        config.num_pages,
        config.page_size,
        poison=POISON,
        poison_at=KEY_LEN,
        kind="raise",
        key_len=KEY_LEN,
    )
    runner = FaultyRunner(inner, rate=fault_rate, seed=seed)
    engine = reference_backend().create_engine(runner, config)
    if mutate is not None:
        mutate(engine)
    start = time.perf_counter()
    ids: list[str] = []
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while (len(ids) < requests or engine.has_unfinished_requests()) and steps < MAX_STEPS:
        for i in range(len(ids), min(requests, len(ids) + ARRIVALS_PER_STEP)):
            ids.append(engine.add_request(list(prompts[i]), params[i]))
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        steps += 1
    seconds = time.perf_counter() - start
    engine.check_invariants()
    innocent = [i for i in range(requests) if i != poisoned]
    expected: dict[int, tuple[int, ...]] = {}
    if compare:
        fault_free = reference_backend().create_engine(
            TracingHashRunner(VOCAB, config.num_pages, config.page_size), config
        )
        outputs = run_to_completion(
            fault_free, [list(prompts[i]) for i in innocent], [params[i] for i in innocent]
        )
        expected = {i: tuple(o.token_ids) for i, o in zip(innocent, outputs, strict=True)}
    faults = set(runner.faults) | set(inner.raised)
    must_fail = out_of_tries(inner.keys, faults, config.max_step_retries)

    def failed(i: int) -> bool:
        output = finals.get(ids[i])
        return output is None or output.outputs[0].finish_reason == FinishReason.ERROR.value

    return EngineChaosReport(
        requests=requests,
        steps=steps,
        random_faults=len(runner.faults),
        poisoned_faults=len(set(inner.raised) - set(runner.faults)),
        poisoned_failed=failed(poisoned),
        innocent_failures=sum(failed(i) for i in innocent),
        out_of_tries=sum(prompts[i][:KEY_LEN] in must_fail for i in innocent),
        wrong_outputs=sum(
            not failed(i) and tuple(finals[ids[i]].outputs[0].token_ids) != want
            for i, want in expected.items()
        ),
        pages_in_use_after=engine.stats().pages_in_use,
        seconds=seconds,
    )
