"""Sampling on the logits' device (specs/engine.md ENG-216..ENG-218), checked on the CPU.

No second device exists here, so the two properties that make sampling on a GPU cheap are
checked where the CPU can see them: every tensor the sampler makes is made where the logits
are (run with a deliberately different default device, ``meta``, so a factory call that
forgets ``device=`` makes a tensor somewhere else), and the values read back to the host during
one step's sampling are the batch's results alone, a fixed number of batched reads whatever the
number of rows (a ``TorchFunctionMode`` sees every ``tolist``, ``item`` and ``bool`` of a
tensor, CPU ones included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from op_watch import OpWatch
from torch.overrides import TorchFunctionMode

from pagedkv.backend import reference_backend
from pagedkv.engine import sampler
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.logit_summary import LogitSummary
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import SampleRow, prompt_logprobs, sample_rows
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 64
CONFIG = EngineConfig(page_size=4, num_pages=64, max_model_len=128)

#: Tensor methods that read a tensor's values on the host.
HOST_READS = frozenset(
    {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
    }
)


class HostReads(TorchFunctionMode):
    """Records ``(method name, shape)`` of every host read of a tensor's values."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in HOST_READS:
            self.reads.append((func.__name__, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


class MadeOn(OpWatch):
    """Records the device of every tensor every op makes or reads."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[tuple[str, torch.device]] = []

    def after(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        flat = [*args, *kwargs.values()]
        flat += list(out) if isinstance(out, tuple | list) else [out]
        for value in flat:
            if isinstance(value, torch.Tensor):
                self.devices.append((str(func), value.device))


@pytest.fixture
def meta_default() -> Iterator[None]:
    """The default device set to ``meta`` for the test, restored after it (the setting is
    global)."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


def allowed(tokens: Sequence[int]) -> torch.Tensor:
    """A packed grammar mask (``int32[VOCAB / 32]``) allowing ``tokens``."""
    bits = [0] * (VOCAB // 32)
    for t in tokens:
        bits[t // 32] |= 1 << (t % 32)
    words = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
    return torch.tensor(words, dtype=torch.int32, device="cpu")


def controlled_rows(count: int) -> list[SampleRow]:
    """``count`` rows cycling through every control: a grammar mask, min_tokens, logit_bias,
    the three penalties, top-k, top-p, min-p, greedy, logprobs with ranks."""
    kinds: list[tuple[SamplingParams, torch.Tensor | None]] = [
        (SamplingParams(temperature=0.8, seed=1, logprobs=3), allowed([1, 5, 9, 40, 63])),
        (SamplingParams(temperature=0.9, seed=2, min_tokens=4, stop_token_ids=(7,)), None),
        (SamplingParams(temperature=1.1, seed=3, logit_bias={4: 3.0, 11: -2.5}), None),
        (
            SamplingParams(
                temperature=0.7,
                seed=4,
                repetition_penalty=1.3,
                frequency_penalty=0.4,
                presence_penalty=0.2,
                logprobs=0,
            ),
            None,
        ),
        (SamplingParams(temperature=1.0, seed=5, top_k=5, top_p=0.8, min_p=0.05), None),
        (SamplingParams(temperature=0.0, logprobs=2), None),
    ]
    rows = []
    for i in range(count):
        params, mask = kinds[i % len(kinds)]
        generator = None if params.greedy else torch.Generator(device="cpu").manual_seed(i)
        rows.append(SampleRow(params, generator, (3, 4, 5, 4), (8, 4, 9), mask))
    return rows


def logits_for(count: int) -> torch.Tensor:
    """Random ``[count, VOCAB]`` float32 logits on the CPU."""
    generator = torch.Generator().manual_seed(count)
    return torch.randn(count, VOCAB, generator=generator, device="cpu")


def engine() -> LLMEngine:
    runner = HashRunner(VOCAB, num_pages=CONFIG.num_pages, page_size=CONFIG.page_size)
    built = reference_backend().create_engine(runner, CONFIG)
    assert isinstance(built, LLMEngine)
    return built


@pytest.mark.spec("ENG-216")
def test_every_tensor_the_sampler_makes_is_on_the_logits_device(meta_default: None) -> None:
    """With the default device ``meta`` and the logits on the CPU, every tensor every op of
    one controlled batch's sampling (every control, a grammar mask, logprobs and ranks) and of
    prompt log-probabilities makes or reads is on the CPU. Kills a factory call that forgets
    ``device=`` (``_vector``, ``_pairs``, ``token_counts``, the bias entries, the ``-inf`` of
    min_tokens, the grammar table or its padding, the rows picked for drawing or ranks): its
    tensor is then made on ``meta``."""
    logits = logits_for(7)
    rows = controlled_rows(7)
    with MadeOn() as seen:
        results = sample_rows(logits, rows, frozenset({2}))
        prompt_logprobs(logits, [3, 1, 4, 1, 5, 9, 2], 2)
    assert len(results) == 7
    assert seen.devices
    elsewhere = {(op, d) for op, d in seen.devices if d != logits.device}
    assert not elsewhere


@pytest.mark.spec("ENG-216")
def test_the_device_check_sees_a_factory_without_a_device(
    meta_default: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above on a sampler whose per-row parameter vectors forget ``device=`` (a
    mutant of ``_vector``): a tensor is made on ``meta``."""

    def forgetful(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=like.dtype).unsqueeze(1)

    monkeypatch.setattr(sampler, "_vector", forgetful)
    logits = logits_for(3)
    with MadeOn() as seen, pytest.raises(RuntimeError):  # meta and CPU tensors do not mix
        sample_rows(logits, controlled_rows(6)[3:6])
    assert any(d.type == "meta" for _, d in seen.devices)


def engine_reads(rows: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The host reads of one engine's sampling of ``rows`` controlled rows, as the device
    sees it: the CPU-only summary kernel declines the logits (as it does off the CPU), each
    read as ``(method, dimensions)``."""
    monkeypatch.setattr(LogitSummary, "takes", lambda self, logits: False)
    llm = engine()
    logits = logits_for(rows)
    with HostReads() as recorded:
        tokens = llm._sample_rows(logits, controlled_rows(rows))
    assert len(tokens) == rows
    return [(name, len(shape)) for name, shape in recorded.reads]


@pytest.mark.spec("ENG-217")
def test_sampling_reads_only_the_batched_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine step's sampling of 3 and of 11 rows (every control, logprobs, ranks) reads
    the same six batched results and nothing else: the largest values (NaN rows), the tokens,
    their log-probabilities, the top logprobs' ids and values, the ranks; no scalar read.
    Kills the former ``bool((top_k < vocab).any())`` (and top-p's, min-p's) branches, which
    read a device scalar mid-sampling, and any per-row read (``float(temperature[i])``), whose
    count grows with the rows."""
    few, many = engine_reads(3, monkeypatch), engine_reads(11, monkeypatch)
    assert few == many
    assert sorted(few) == sorted(
        [("tolist", 1), ("tolist", 1), ("tolist", 1)]
        + [
            ("tolist", 2),
            ("tolist", 2),
            ("tolist", 1),
        ]
    )


@pytest.mark.spec("ENG-217")
def test_top_logprobs_are_read_back_for_the_rows_asking_alone() -> None:
    """Of 11 controlled rows, three ask for top logprobs (3, 2 and 3 of them; two more ask for
    the chosen token's alone): the top ids and values read back are ``[3, 3]`` each, not
    ``[11, 3]``. Kills a top-k over every row of the batch, read back whole."""
    with HostReads() as recorded:
        results = sample_rows(logits_for(11), controlled_rows(11), frozenset({2}))
    tops = [shape for _, shape in recorded.reads if len(shape) == 2]
    assert tops == [(3, 3), (3, 3)]
    assert [len(r.top) for r in results] == [3, 0, 0, 0, 0, 2, 3, 0, 0, 0, 0]


@pytest.mark.spec("ENG-217")
def test_the_read_check_sees_a_per_row_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above on a sampler that reads each row's temperature on the host
    mid-sampling (a mutant of ``filtered_probs_batch``): more reads, growing with the rows."""
    real = sampler.filtered_probs_batch

    def per_row(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        column = sampler._vector([p.temperature for p in params], logits)
        _ = [float(column[i]) for i in range(len(params))]
        return real(logits, params)

    monkeypatch.setattr(sampler, "filtered_probs_batch", per_row)
    few, many = engine_reads(3, monkeypatch), engine_reads(11, monkeypatch)
    assert few != many
    assert ("__float__", 1) in many


@pytest.mark.spec("ENG-218")
def test_a_seeded_request_s_generator_is_made_on_the_runner_s_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every generator a sampled request gets is asked for on the runner's device (recorded
    where ``torch.Generator`` is called). Kills ``torch.Generator()`` (the host's generator,
    whose noise cannot be drawn on a GPU's logits)."""
    llm = engine()
    made: list[object] = []
    real = torch.Generator

    def recording(*args: Any, **kwargs: Any) -> torch.Generator:
        made.append(kwargs.get("device", args[0] if args else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", recording)
    llm.add_request([1, 2, 3], SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=2))
    llm.add_request([4, 5], SamplingParams(temperature=0.8, max_tokens=2))
    llm.add_request([6], SamplingParams(temperature=0.0, max_tokens=2))
    assert made == [llm.runner.device] * 3


def cuda_rows(generators: Sequence[torch.Generator | None]) -> list[SampleRow]:
    rows = controlled_rows(len(generators))
    return [
        SampleRow(r.params, g, r.prompt_token_ids, r.output_token_ids, r.allowed)
        for r, g in zip(rows, generators, strict=True)
    ]


@pytest.mark.spec("ENG-216", "ENG-218", "ENG-041")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampling_is_batch_invariant_and_greedy_exact() -> None:
    """On CUDA: a seeded row (every control in turn) with a CUDA generator draws the same
    token alone as in a batch of twelve; greedy rows take the CPU's argmax exactly; every
    result is that of the same computation on the GPU alone (nothing fell back to the CPU)."""
    cuda = torch.device("cuda")
    logits = logits_for(12).to(cuda)

    def generators() -> list[torch.Generator | None]:
        return [
            None if r.params.greedy else torch.Generator(device=cuda).manual_seed(i)
            for i, r in enumerate(controlled_rows(12))
        ]

    batch = sample_rows(logits, cuda_rows(generators()), frozenset({2}))
    alone_generators = generators()
    for i in range(12):
        (alone,) = sample_rows(
            logits[i : i + 1], cuda_rows(alone_generators)[i : i + 1], frozenset({2})
        )
        assert alone.token_id == batch[i].token_id, i
        if controlled_rows(12)[i].params.greedy:
            processed = sampler.processed_logits(logits.cpu(), controlled_rows(12), frozenset({2}))
            assert batch[i].token_id == int(processed[i].argmax())


@pytest.mark.spec("ENG-218", "ENG-041")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_seeded_request_is_batch_invariant() -> None:
    """On CUDA, through the engine: a runner whose logits are on the GPU; a seeded request
    gives the same tokens alone and among other requests, its generators are CUDA ones, and a
    greedy request gives the CPU engine's tokens."""
    from pagedkv.parallel.messages import plan_to

    class CudaHashRunner(HashRunner):
        @property
        def device(self) -> torch.device:
            return torch.device("cuda")

        def execute(self, plan: Any) -> torch.Tensor:
            return super().execute(plan_to(plan, torch.device("cpu"))).to("cuda")

    def run(runner: HashRunner, others: bool) -> tuple[list[int], list[int]]:
        llm = reference_backend().create_engine(runner, CONFIG)
        assert isinstance(llm, LLMEngine)
        seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        if others:
            llm.add_request([9, 8, 7], SamplingParams(temperature=1.2, max_tokens=5))
        first = llm.add_request([1, 2, 3, 4], seeded)
        second = llm.add_request([5, 6], greedy)
        for sequence in llm.scheduler.waiting:
            if sequence.generator is not None:
                assert sequence.generator.device == runner.device
        tokens: dict[str, list[int]] = {}
        while llm.has_unfinished_requests():
            for output in llm.step():
                if output.finished:
                    tokens[output.request_id] = list(output.outputs[0].token_ids)
        return tokens[first], tokens[second]

    def cuda_runner() -> HashRunner:
        return CudaHashRunner(VOCAB, num_pages=CONFIG.num_pages, page_size=CONFIG.page_size)

    alone = run(cuda_runner(), others=False)
    crowded = run(cuda_runner(), others=True)
    on_cpu = run(HashRunner(VOCAB, num_pages=CONFIG.num_pages, page_size=CONFIG.page_size), False)
    assert alone[0] == crowded[0]
    assert alone[1] == crowded[1] == on_cpu[1]
