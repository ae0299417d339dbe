"""Golden logits: our Qwen3 against transformers' on tiny deterministic checkpoints.

The reference is transformers' ``Qwen3ForCausalLM`` loaded from the same directory with
``attn_implementation="eager"`` (plain softmax(QK^T)V with an explicit causal mask), in eval
mode under ``torch.no_grad()``, one prompt at a time with no cache. Tolerances and the figures
measured when they were set are in ``specs/golden.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine.runner import ModelRunner
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import KVManagerConfig, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.plan import SeqChunk, StepPlan
from pagedkv.plan_builders import build_paged_plan, build_recompute_plan
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import (
    PRESETS,
    build_tiny_checkpoint,
    load_hf_reference,
    min_top2_margin,
    model_device,
    one_torch_thread,
    reference_logits,
)

#: Max abs logit difference, float32 weights and activations (GLD-010..GLD-013).
FP32_ATOL = 1e-4
#: Max abs logit difference against transformers run in the same 16-bit dtype (GLD-016).
HALF_ATOL = {"bfloat16": 1.0, "float16": 0.25}
#: Max abs logit difference of our 16-bit model against the float32 reference (GLD-016).
HALF_VS_FP32_ATOL = {"bfloat16": 1.5, "float16": 0.25}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

#: Prompt lengths of the ragged batch: none is a multiple of 5, one of 16, one is 1.
PROMPT_LENGTHS = (13, 1, 32, 7)
PAGE_SIZES = (1, 5, 16)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and much faster on a loaded machine."""
    with one_torch_thread():
        yield


@dataclasses.dataclass(frozen=True)
class Case:
    """One preset's checkpoint, our model and the transformers reference, on ``device``."""

    name: str
    path: Path
    ours: Qwen3ForCausalLM
    reference: Any
    device: str


def prompts_for(
    vocab: int, seed: int = 0, lengths: tuple[int, ...] = PROMPT_LENGTHS
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("golden")
    return {name: build_tiny_checkpoint(spec, root / name) for name, spec in PRESETS.items()}


def make_case(name: str, path: Path, device: str, dtype: str = "float32") -> Case:
    return Case(
        name=name,
        path=path,
        ours=load_model(path, dtype=dtype, device=device),
        reference=load_hf_reference(path, dtype=dtype, device=device),
        device=device,
    )


@pytest.fixture(scope="module", params=sorted(PRESETS))
def case(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Case:
    name: str = request.param
    return make_case(name, checkpoints[name], model_device())


def every_row(plan: StepPlan) -> StepPlan:
    """The plan asking for the logits of every row, not only each sequence's last."""
    rows = torch.arange(plan.num_tokens, device=plan.input_ids.device)
    return dataclasses.replace(plan, logits_indices=rows)


def run(model: Qwen3ForCausalLM, plan: StepPlan, store: TorchPagedStore | None) -> torch.Tensor:
    """The model's logits of ``plan``, over ``store`` (v1) or none (v0), as a runner runs it."""
    runner = ModelRunner.recompute(model) if store is None else ModelRunner.paged(model, store)
    return runner.execute(plan)


def store_for(
    model: Qwen3ForCausalLM, page_size: int, num_pages: int, device: str
) -> TorchPagedStore:
    cfg = model.config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return TorchPagedStore(
        StoreConfig(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            page_size=page_size,
            num_pages=num_pages,
            dtype=dtype,
            device=device,
        )
    )


class PagedRun:
    """Drives a model over a ReferenceKVManager + TorchPagedStore, like a minimal engine."""

    def __init__(self, model: Qwen3ForCausalLM, page_size: int, device: str) -> None:
        self.model = model
        self.page_size = page_size
        self.device = device
        self.manager = ReferenceKVManager(
            KVManagerConfig(num_pages=256, page_size=page_size, enable_prefix_caching=False)
        )
        self.store = store_for(model, page_size, 256, device)
        self.lengths: dict[int, int] = {}

    def chunk(self, seq: int, tokens: list[int]) -> SeqChunk:
        """Reserve and describe the next ``tokens`` of ``seq``."""
        start = self.lengths.get(seq, 0)
        if start == 0:
            table = self.manager.allocate(seq, tokens, len(tokens)).page_table
        else:
            table = self.manager.grow(seq, start + len(tokens))
        self.lengths[seq] = start + len(tokens)
        return SeqChunk(tuple(tokens), start, table.pages)

    def step(self, work: list[tuple[int, list[int]]], all_rows: bool = False) -> torch.Tensor:
        plan = build_paged_plan([self.chunk(s, t) for s, t in work], self.page_size, self.device)
        return run(self.model, every_row(plan) if all_rows else plan, self.store).cpu()


def v0_plan(prompts: list[list[int]], device: str) -> StepPlan:
    return build_recompute_plan([SeqChunk(tuple(p), 0) for p in prompts], device)


def per_position_reference(case: Case, prompts: list[list[int]]) -> torch.Tensor:
    return torch.cat([reference_logits(case.reference, p).cpu() for p in prompts])


def max_diff(ours: torch.Tensor, expected: torch.Tensor) -> float:
    assert ours.shape == expected.shape
    assert ours.dtype == torch.float32
    return float((ours.cpu() - expected.cpu()).abs().max())


# -- float32 ------------------------------------------------------------------------------------


@pytest.mark.spec("GLD-010")
def test_v0_prefill_logits_at_every_position(case: Case) -> None:
    prompts = prompts_for(case.ours.config.vocab_size)
    ours = run(case.ours, every_row(v0_plan(prompts, case.device)), None)
    assert max_diff(ours, per_position_reference(case, prompts)) <= FP32_ATOL


@pytest.mark.spec("GLD-010")
def test_v0_default_logits_are_each_sequences_last_row(case: Case) -> None:
    prompts = prompts_for(case.ours.config.vocab_size)
    ours = run(case.ours, v0_plan(prompts, case.device), None)
    expected = torch.stack([reference_logits(case.reference, p)[-1].cpu() for p in prompts])
    assert ours.shape == (len(prompts), case.ours.config.vocab_size)
    assert max_diff(ours, expected) <= FP32_ATOL


def check_v1_prefill_then_first_decode(
    case: Case, prompts: list[list[int]], page_size: int
) -> None:
    """A v1 prefill of ``prompts`` in one plan, then one decode token each, within tolerance."""
    paged = PagedRun(case.ours, page_size, case.device)
    prefill = paged.step(list(enumerate(prompts)), all_rows=True)
    assert max_diff(prefill, per_position_reference(case, prompts)) <= FP32_ATOL

    next_tokens = [int(reference_logits(case.reference, p)[-1].argmax()) for p in prompts]
    decode = paged.step([(s, [t]) for s, t in enumerate(next_tokens)])
    expected = torch.stack(
        [
            reference_logits(case.reference, [*p, t])[-1].cpu()
            for p, t in zip(prompts, next_tokens, strict=True)
        ]
    )
    assert max_diff(decode, expected) <= FP32_ATOL


@pytest.mark.spec("GLD-011", "GLD-012")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_v1_ragged_prefill_then_first_decode_step(case: Case, page_size: int) -> None:
    check_v1_prefill_then_first_decode(case, prompts_for(case.ours.config.vocab_size), page_size)


@pytest.mark.spec("GLD-012")
def test_v0_first_decode_step_recomputes_the_whole_sequence(case: Case) -> None:
    prompts = prompts_for(case.ours.config.vocab_size)
    extended = [[*p, int(reference_logits(case.reference, p)[-1].argmax())] for p in prompts]
    ours = run(case.ours, v0_plan(extended, case.device), None)
    expected = torch.stack([reference_logits(case.reference, p)[-1].cpu() for p in extended])
    assert max_diff(ours, expected) <= FP32_ATOL


def check_chunked_prefill_mixed_with_decodes(
    case: Case, long: list[int], short: list[int], split: int
) -> None:
    """``long`` prefilled in two chunks (``split`` positions, then the rest, starting mid-page
    of 5), each sharing its step with a decode token of ``short``; all within tolerance."""
    paged = PagedRun(case.ours, 5, case.device)
    paged.step([(1, short)])
    first = paged.step([(0, long[:split]), (1, [long[0]])], all_rows=True)
    second = paged.step([(1, [long[1]]), (0, long[split:])], all_rows=True)
    reference_long = reference_logits(case.reference, long).cpu()
    reference_short = reference_logits(case.reference, [*short, *long[:2]]).cpu()
    assert max_diff(first[:split], reference_long[:split]) <= FP32_ATOL
    assert max_diff(first[split:], reference_short[-2:-1]) <= FP32_ATOL
    assert max_diff(second[:1], reference_short[-1:]) <= FP32_ATOL
    assert max_diff(second[1:], reference_long[split:]) <= FP32_ATOL


@pytest.mark.spec("GLD-013")
def test_v1_chunked_prefill_mixed_with_decode_tokens(case: Case) -> None:
    """Prompts computed over several steps, chunks sharing steps with other sequences' decodes."""
    prompts = prompts_for(case.ours.config.vocab_size, seed=1)
    check_chunked_prefill_mixed_with_decodes(case, prompts[2], prompts[3], 11)  # 32, 7 tokens


@pytest.mark.spec("GLD-014")
def test_the_model_keeps_no_state_between_steps(case: Case) -> None:
    prompts = prompts_for(case.ours.config.vocab_size)
    plan_a = v0_plan(prompts[:2], case.device)
    plan_b = v0_plan(prompts[2:], case.device)
    first = run(case.ours, plan_a, None)
    run(case.ours, plan_b, None)
    PagedRun(case.ours, 16, case.device).step(list(enumerate(prompts)))
    assert torch.equal(run(case.ours, plan_a, None), first)


@pytest.mark.spec("GLD-015")
def test_a_cached_plan_needs_a_matching_store(case: Case) -> None:
    prompts = prompts_for(case.ours.config.vocab_size)
    plan = build_paged_plan([SeqChunk(tuple(prompts[0]), 0, tuple(range(13)))], 1, case.device)
    with pytest.raises(InvalidRequest, match="PagedStore"):
        run(case.ours, plan, None)
    cfg = case.ours.config
    wrong = TorchPagedStore(
        StoreConfig(cfg.num_hidden_layers + 1, cfg.num_key_value_heads, cfg.head_dim, 1, 16)
    )
    with pytest.raises(InvalidRequest, match="layers"):
        run(case.ours, plan, wrong)


@pytest.mark.spec("GLD-018")
def test_the_checkpoints_make_context_matter(case: Case) -> None:
    """Tolerances mean something only if attention moves the logits far more than them."""
    prompt = prompts_for(case.ours.config.vocab_size)[0]
    changed = [(prompt[0] + 1) % case.ours.config.vocab_size, *prompt[1:]]
    logits = run(case.ours, v0_plan([prompt, changed], case.device), None)
    assert float((logits[0] - logits[1]).abs().max()) > 1000 * FP32_ATOL


@pytest.mark.spec("GLD-018")
def test_greedy_margins_are_far_above_the_fp32_tolerance(case: Case) -> None:
    prompts = prompts_for(case.ours.config.vocab_size)
    assert min_top2_margin(case.reference, [prompts[1], prompts[3]], 8) > 100 * FP32_ATOL


# -- 16-bit ------------------------------------------------------------------------------------


@pytest.mark.spec("GLD-016")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_weights_load_and_run(
    dtype: str, case: Case, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A checkpoint stored in 16 bits, run in 16 bits, against transformers in the same dtype."""
    path = build_tiny_checkpoint(PRESETS[case.name], tmp_path_factory.mktemp(dtype), dtype=dtype)
    half = make_case(case.name, path, case.device, dtype=dtype)
    assert next(half.ours.parameters()).dtype == DTYPES[dtype]
    prompts = prompts_for(half.ours.config.vocab_size)
    v0 = run(half.ours, every_row(v0_plan(prompts, case.device)), None)
    v1 = PagedRun(half.ours, 5, case.device).step(list(enumerate(prompts)), all_rows=True)
    assert torch.isfinite(v1).all()
    expected = per_position_reference(half, prompts)
    assert max_diff(v0, expected) <= HALF_ATOL[dtype]
    assert max_diff(v1, expected) <= HALF_ATOL[dtype]
    assert max_diff(v1, per_position_reference(case, prompts)) <= HALF_VS_FP32_ATOL[dtype]


@pytest.mark.spec("GLD-005")
def test_converting_on_load_equals_a_checkpoint_stored_in_that_dtype(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    stored = build_tiny_checkpoint(
        PRESETS["tied-gqa4-bias"], tmp_path_factory.mktemp("bf16"), dtype="bfloat16"
    )
    converted = load_model(checkpoints["tied-gqa4-bias"], dtype="bfloat16")
    native = load_model(stored, dtype="bfloat16")
    for (name, a), (_, b) in zip(
        converted.named_parameters(), native.named_parameters(), strict=True
    ):
        assert a.dtype == torch.bfloat16, name
        assert torch.equal(a, b), name


# -- CUDA --------------------------------------------------------------------------------------


@pytest.mark.spec("GLD-017")
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is false"
)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_cuda_logits_match_transformers(name: str, checkpoints: dict[str, Path]) -> None:
    case = make_case(name, checkpoints[name], "cuda")
    prompts = prompts_for(case.ours.config.vocab_size)
    expected = per_position_reference(case, prompts)
    v0 = run(case.ours, every_row(v0_plan(prompts, "cuda")), None)
    assert next(case.ours.parameters()).device.type == "cuda"
    assert max_diff(v0, expected) <= FP32_ATOL
    for page_size in PAGE_SIZES:
        v1 = PagedRun(case.ours, page_size, "cuda").step(list(enumerate(prompts)), all_rows=True)
        assert max_diff(v1, expected) <= FP32_ATOL
