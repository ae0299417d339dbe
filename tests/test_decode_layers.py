"""A decode step's layers in one C call (ENG-160): the modules' logits and K/V to the bit, in
float32 and bfloat16, for every decode step it takes; the modules for every step it does not;
and the option refused where the program cannot run."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedkv.accel.cpu.decode_layers import DecodeLayers, decode_program
from pagedkv.backend import ReferenceBackend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.model.loader import load_model
from pagedkv.plan import StepPlan
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import build_tiny_checkpoint, preset_spec, torch_threads

PAGE, PAGES = 4, 256


@pytest.fixture(autouse=True, scope="module")
def _two_torch_threads() -> Iterator[None]:
    with torch_threads(2):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    names = ("tied-gqa2", "untied-mha", "moe-top2-norm", "tied-gqa4-bias")
    return {n: build_tiny_checkpoint(preset_spec(n), tmp_path_factory.mktemp(n)) for n in names}


def runner(path: Path, dtype: str, **options: bool | None) -> ModelRunner:
    return ModelRunner.from_model_dir(
        path,
        num_pages=PAGES,
        page_size=PAGE,
        dtype=dtype,
        options=replace(RunnerOptions(), **options),
    )


def program_of(runner: ModelRunner) -> DecodeLayers:
    program = decode_program(runner.model)
    if program is None:
        pytest.skip("the decode layers program cannot run here (no packed kernel this CPU)")
    return program


class Recorded:
    """A runner's ``execute``, recording each step's plan shape and logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.inner = runner.execute
        self.steps: list[tuple[int, int, torch.Tensor]] = []
        runner.execute = self  # type: ignore[method-assign]

    def __call__(self, plan: StepPlan) -> torch.Tensor:
        logits = self.inner(plan)
        self.steps.append((plan.num_tokens, plan.num_seqs, logits))
        return logits


def run(runner: ModelRunner, count: int) -> list[tuple[list[int], list[float]]]:
    """``count`` greedy requests of unequal prompts at once, 9 tokens each; their tokens and
    chosen log-probabilities."""
    config = EngineConfig(page_size=PAGE, num_pages=PAGES, max_num_seqs=64)
    engine = ReferenceBackend().create_engine(runner, config)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [
        engine.add_request([(7 * i + j) % 90 + 3 for j in range(2 + i % 7)], params)
        for i in range(count)
    ]
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    results = []
    for request_id in ids:
        (completion,) = done[request_id].outputs
        logprobs = [entry.logprob for entry in completion.logprobs or ()]
        results.append((list(completion.token_ids), logprobs))
    return results


def store_of(runner: ModelRunner) -> TorchPagedStore:
    store = runner._store
    assert isinstance(store, TorchPagedStore)
    return store


def pools(runner: ModelRunner) -> list[torch.Tensor]:
    store = store_of(runner)
    layers = store.config.num_layers
    return [store.key_pool(i) for i in range(layers)] + [store.value_pool(i) for i in range(layers)]


@pytest.mark.spec("ENG-160")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["tied-gqa2", "untied-mha"])
def test_the_program_gives_the_modules_logits_and_cache_to_the_bit(
    checkpoints: dict[str, Path], preset: str, dtype: str
) -> None:
    """One sequence, a few, as many as the products take, and more: every decode step of at
    most that many rows runs in the program, every other step through the modules, and each
    step's logits, the tokens, their log-probabilities and the K/V pools equal the modules'."""
    fused = runner(checkpoints[preset], dtype)
    plain = runner(checkpoints[preset], dtype, decode_layers=False)
    assert decode_program(plain.model) is None
    program = program_of(fused)
    calls: list[int] = []
    entry = program._entry

    def counted(*args: object) -> int:
        calls.append(1)
        result: int = entry(*args)
        return result

    program._entry = counted
    for count in sorted({1, 3, program.max_rows, program.max_rows + 2}):
        calls.clear()
        recorded, reference = Recorded(fused), Recorded(plain)
        assert run(fused, count) == run(plain, count)
        assert len(recorded.steps) == len(reference.steps)
        for got, want in zip(recorded.steps, reference.steps, strict=True):
            assert torch.equal(got[2], want[2])
        decodes = [s for s in recorded.steps if s[0] == s[1]]
        assert decodes
        taken = sum(1 for tokens, _, _ in decodes if tokens <= program.max_rows)
        assert len(calls) == taken == (len(decodes) if count <= program.max_rows else 0)
        for got_pool, want_pool in zip(pools(fused), pools(plain), strict=True):
            assert torch.equal(got_pool, want_pool)
        fused.execute, plain.execute = recorded.inner, reference.inner  # type: ignore[method-assign]


@pytest.mark.spec("ENG-160", "ENG-111")
def test_the_option_is_refused_where_the_program_cannot_run(
    checkpoints: dict[str, Path],
) -> None:
    tied = checkpoints["tied-gqa2"]
    program_of(runner(tied, "float32"))
    cases: list[tuple[str, dict[str, bool], str]] = [
        ("tied-gqa2", {"fused_norms": False}, "fused norms"),
        ("tied-gqa2", {"fused_swiglu": False}, "fused norms and SwiGLU"),
        ("tied-gqa2", {"packed_gemv": False}, "packed_gemv"),
        ("moe-top2-norm", {}, "dense MLPs"),
        ("tied-gqa4-bias", {}, "bias-free"),
        ("tied-gqa2", {"compile": True}, "compiled or captured"),
    ]
    for preset, options, reason in cases:
        with pytest.raises(InvalidRequest, match=f"decode_layers: .*{reason}"):
            runner(checkpoints[preset], "float32", decode_layers=True, **options)
        assert decode_program(runner(checkpoints[preset], "float32", **options).model) is None
    model = load_model(tied)
    with pytest.raises(InvalidRequest, match="decode_layers: it runs v1 steps"):
        ModelRunner.recompute(model, RunnerOptions(decode_layers=True))
    config = store_of(runner(tied, "float32")).config
    gathered = TorchPagedStore(config, fused_decode=False)
    other_dtype = TorchPagedStore(replace(config, dtype="bfloat16"))
    with pytest.raises(InvalidRequest, match=r"decode_layers: .*K/V pools must be torch.float32"):
        ModelRunner.paged(model, other_dtype, RunnerOptions(decode_layers=True))
    assert decode_program(ModelRunner.paged(model, other_dtype).model) is None
    with pytest.raises(InvalidRequest, match=r"decode_layers: .*not its C kernel"):
        ModelRunner.paged(model, gathered, RunnerOptions(decode_layers=True))
    assert decode_program(ModelRunner.paged(model, gathered).model) is None
