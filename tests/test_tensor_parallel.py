"""Tensor-parallel generation on the CPU with gloo, token for token against one rank and
transformers (specs/tensor-parallel.md, TP-005, TP-010..013).

The worker processes are spawned once per module (one group of two ranks, one of three) and
load each test's model in turn: a load is a message, not a process start.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401  (autouse: one torch thread)

from pagedkv.backend import ReferenceBackend
from pagedkv.engine.config import CacheMode, EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.interfaces import StepRunner
from pagedkv.parallel.group import WorkerGroup
from pagedkv.parallel.runner import TensorParallelRunner
from pagedkv.plan import SeqChunk
from pagedkv.plan_builders import build_paged_plan
from pagedkv.testing.tiny_qwen3 import PRESETS, preset_spec
from pagedkv_conformance.golden_harness import (
    GoldenCheckpoints,
    golden_prompts,
    greedy_outputs,
    hf_greedy,
)

#: (mode, page size) of the golden runs: v1 at pages of 1, 5 and 16 positions, and v0.
PATHS: list[tuple[CacheMode, int]] = [("v1", 1), ("v1", 5), ("v1", 16), ("v0", 16)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def spawn_or_skip(size: int) -> WorkerGroup:
    """A group of ``size`` ranks with one thread each, or a skip where this platform cannot
    start processes or open loopback sockets."""
    try:
        return WorkerGroup.spawn(size, threads=1)
    except OSError as exc:
        pytest.skip(f"cannot start tensor-parallel worker processes here: {exc}")


@pytest.fixture(scope="module")
def pair() -> Iterator[WorkerGroup]:
    group = spawn_or_skip(2)
    yield group
    group.close()
    assert [p.exitcode for p in group.processes] == [0]


@pytest.fixture(scope="module")
def trio() -> Iterator[WorkerGroup]:
    group = spawn_or_skip(3)
    yield group
    group.close()
    assert [p.exitcode for p in group.processes] == [0, 0]


@contextmanager
def loaded(
    group: WorkerGroup, path: Path, *, num_pages: int | None, page_size: int
) -> Iterator[TensorParallelRunner]:
    runner = TensorParallelRunner.load(group, path, num_pages=num_pages, page_size=page_size)
    try:
        yield runner
    finally:
        runner.close()
    assert group.failure is None


def engine_over(runner: StepRunner, config: EngineConfig) -> LLMEngine:
    return ReferenceBackend().create_engine(runner, config)


def single_rank(path: Path, config: EngineConfig) -> LLMEngine:
    pages = config.num_pages if config.mode == "v1" else None
    runner = ModelRunner.from_model_dir(path, num_pages=pages, page_size=config.page_size)
    return engine_over(runner, config)


def tokens(outputs: Sequence[RequestOutput]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.mark.spec("TP-011")
@pytest.mark.parametrize(("mode", "page_size"), PATHS, ids=[f"{m}-p{p}" for m, p in PATHS])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_two_ranks_match_one_and_transformers(
    pair: WorkerGroup,
    golden_checkpoints: GoldenCheckpoints,
    preset: str,
    mode: CacheMode,
    page_size: int,
) -> None:
    path = golden_checkpoints.path(preset)
    prompts = golden_prompts(PRESETS[preset].vocab)
    config = EngineConfig(page_size=page_size, num_pages=512, mode=mode)
    pages = 512 if mode == "v1" else None
    with loaded(pair, path, num_pages=pages, page_size=page_size) as runner:
        got = greedy_outputs(engine_over(runner, config), prompts)
    assert got == golden_checkpoints.expected(preset)
    assert got == greedy_outputs(single_rank(path, config), prompts)


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    """Six prompts sharing a 20-token prefix (five pages of 4), with suffixes of 3..13."""
    generator = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, vocab, (20,), generator=generator).tolist()
    return [
        prefix + torch.randint(0, vocab, (3 + 2 * i,), generator=generator).tolist()
        for i in range(6)
    ]


@pytest.mark.spec("TP-011")
@pytest.mark.parametrize("preset", ["untied-gqa4-wide", "tied-gqa4-bias"])
def test_prefix_hits_chunked_prefill_and_preemption(
    pair: WorkerGroup, golden_checkpoints: GoldenCheckpoints, preset: str
) -> None:
    """A pool too small for the batch (preemption), a step budget below the prompts (chunked
    prefill) and a shared prefix (prefix hits): tokens as one rank's and transformers'."""
    path = golden_checkpoints.path(preset)
    prompts = shared_prefix_prompts(PRESETS[preset].vocab)
    config = EngineConfig(page_size=4, num_pages=24, max_num_batched_tokens=16, max_num_seqs=4)
    with loaded(pair, path, num_pages=config.num_pages, page_size=4) as runner:
        engine = engine_over(runner, config)
        got = tokens(run_to_completion(engine, prompts, GREEDY))
        stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.hit_tokens > 0
    assert stats.pages_in_use == 0
    reference = golden_checkpoints.reference(preset, "float32", "cpu")
    expected = hf_greedy(reference, prompts, GREEDY.max_tokens)
    assert got == [[e] for e in expected]
    assert got == tokens(run_to_completion(single_rank(path, config), prompts, GREEDY))


@pytest.mark.spec("TP-012")
@pytest.mark.parametrize(("mode", "page_size"), [("v1", 5), ("v1", 16), ("v0", 16)])
def test_three_ranks_with_replicated_kv_heads(
    trio: WorkerGroup, golden_checkpoints: GoldenCheckpoints, mode: CacheMode, page_size: int
) -> None:
    preset = "tp3-kv1"
    path = golden_checkpoints.path(preset)
    prompts = golden_prompts(preset_spec(preset).vocab)
    config = EngineConfig(page_size=page_size, num_pages=512, mode=mode)
    pages = 512 if mode == "v1" else None
    with loaded(trio, path, num_pages=pages, page_size=page_size) as runner:
        assert runner.local.model.layout.num_kv_heads == 1
        got = greedy_outputs(engine_over(runner, config), prompts)
    assert got == golden_checkpoints.expected(preset)


@pytest.mark.spec("TP-012")
def test_two_ranks_of_a_moe_model(pair: WorkerGroup, golden_checkpoints: GoldenCheckpoints) -> None:
    preset = "moe-top2-norm"
    path = golden_checkpoints.path(preset)
    prompts = golden_prompts(preset_spec(preset).vocab)
    config = EngineConfig(page_size=5, num_pages=512)
    with loaded(pair, path, num_pages=512, page_size=5) as runner:
        got = greedy_outputs(engine_over(runner, config), prompts)
    assert got == golden_checkpoints.expected(preset)


@pytest.mark.spec("TP-005")
@pytest.mark.parametrize("preset", ["tied-gqa4-bias", "untied-mha"])
def test_logits_of_a_step_match_one_rank(
    pair: WorkerGroup, golden_checkpoints: GoldenCheckpoints, preset: str
) -> None:
    path = golden_checkpoints.path(preset)
    prompts = golden_prompts(PRESETS[preset].vocab)
    chunks, start = [], 0
    for prompt in prompts:
        pages = -(-len(prompt) // 4)
        chunks.append(SeqChunk(tuple(prompt), 0, tuple(range(start, start + pages))))
        start += pages
    plan = build_paged_plan(chunks, 4)
    single = ModelRunner.from_model_dir(path, num_pages=64, page_size=4)
    with loaded(pair, path, num_pages=64, page_size=4) as runner:
        got = runner.execute(plan)
    expected = single.execute(plan)
    assert got.shape == expected.shape == (len(prompts), PRESETS[preset].vocab)
    assert torch.allclose(got, expected, rtol=0.0, atol=1e-4)


@pytest.mark.spec("TP-010")
def test_one_kv_manager_and_a_store_per_rank(
    pair: WorkerGroup, golden_checkpoints: GoldenCheckpoints
) -> None:
    """The engine's page pool is shaped as at one rank; rank 0's store holds its own K/V
    heads for the same pages; forks (parallel sampling) copy their partial page on every
    rank, or the forked sequences would read another rank's stale K/V."""
    preset = "untied-gqa4-wide"
    path = golden_checkpoints.path(preset)
    config = EngineConfig(page_size=5, num_pages=128)
    prompts = [p for p in golden_prompts(PRESETS[preset].vocab) if len(p) % 5]
    forked = SamplingParams(n=3, max_tokens=24, temperature=0.0, ignore_eos=True)
    with loaded(pair, path, num_pages=128, page_size=5) as runner:
        store = runner.local._store
        assert store is not None
        assert store.config.num_pages == config.num_pages
        assert store.config.num_kv_heads == PRESETS[preset].kv_heads // 2
        engine = engine_over(runner, config)
        assert engine.stats().num_pages == config.num_pages
        got = tokens(run_to_completion(engine, prompts, forked))
    expected = tokens(run_to_completion(single_rank(path, config), prompts, forked))
    assert got == expected
    assert all(len(o) == 3 for o in got)


@pytest.mark.spec("TP-013")
def test_engine_invariants_at_two_ranks(
    pair: WorkerGroup, golden_checkpoints: GoldenCheckpoints
) -> None:
    """Prefix hits, preemption, chunked prefill, forks and aborts; the invariants after every
    step, no page in use at the end, the single-rank engine's outputs."""
    preset = "tied-gqa2"
    path = golden_checkpoints.path(preset)
    prompts = shared_prefix_prompts(PRESETS[preset].vocab)
    config = EngineConfig(page_size=4, num_pages=24, max_num_batched_tokens=12, max_num_seqs=5)
    with loaded(pair, path, num_pages=config.num_pages, page_size=4) as runner:
        ours = scripted_run(engine_over(runner, config), prompts)
    theirs = scripted_run(single_rank(path, config), prompts)
    assert ours == theirs


def scripted_run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """Queue the prompts (one with two greedy forks), abort one mid-way, step to the end
    checking the invariants; every request's tokens."""
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(n=2, max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done: dict[str, list[list[int]]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [list(c.token_ids) for c in output.outputs]
        engine.check_invariants()
        steps += 1
        if steps == 6:
            aborted = engine.abort(ids[3])
            assert aborted is not None
            done[ids[3]] = [[len(c.token_ids)] for c in aborted.outputs]
    stats = engine.stats()
    assert stats.pages_in_use == 0
    assert stats.preemptions > 0
    assert stats.hit_tokens > 0
    return done
