"""Golden logits of the rest of the Qwen3 family against transformers: Qwen3-MoE checkpoints and
scaled RoPE (YaRN, linear, Llama 3, proportional), at positions past the original context.

The reference is as in ``test_model_golden_logits.py`` (eager attention), with eager experts
for MoE; the float32 tolerance is the dense one. Tolerances and the figures measured when they
were set are in ``specs/golden.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_model_golden_logits import (
    FP32_ATOL,
    Case,
    PagedRun,
    check_chunked_prefill_mixed_with_decodes,
    check_v1_prefill_then_first_decode,
    every_row,
    make_case,
    max_diff,
    per_position_reference,
    run,
    v0_plan,
)
from test_model_golden_logits import (
    prompts_for as dense_prompts_for,
)

from pagedkv.model.loader import load_model
from pagedkv.model.moe import Qwen3MoeExperts, Qwen3MoeSparseBlock
from pagedkv.model.rope_config import RopeConfig
from pagedkv.testing.tiny_qwen3 import (
    FAMILY_PRESETS,
    build_tiny_checkpoint,
    min_router_margin,
    min_top2_margin,
    model_device,
    one_torch_thread,
)
from pagedkv_conformance.golden_harness import NEW_TOKENS, golden_prompts, hf_greedy

#: Max abs difference of router logits against transformers' (GLD-043).
ROUTER_ATOL = 2e-5
#: Prompt lengths: 60 reaches past every preset's original_max_position_embeddings (24, 32).
PROMPT_LENGTHS = (13, 1, 60, 7)
PAGE_SIZES = (1, 5, 16)
MOE = sorted(n for n, s in FAMILY_PRESETS.items() if s.is_moe)
SCALED = sorted(n for n, s in FAMILY_PRESETS.items() if s.rope_scaling)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and much faster on a loaded machine."""
    with one_torch_thread():
        yield


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    return dense_prompts_for(vocab, seed, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family")
    return {n: build_tiny_checkpoint(s, root / n) for n, s in FAMILY_PRESETS.items()}


@pytest.fixture(scope="module", params=sorted(FAMILY_PRESETS))
def family(request: pytest.FixtureRequest, family_checkpoints: dict[str, Path]) -> Case:
    name: str = request.param
    return make_case(name, family_checkpoints[name], model_device())


@pytest.fixture(scope="module", params=MOE)
def moe_case(request: pytest.FixtureRequest, family_checkpoints: dict[str, Path]) -> Case:
    name: str = request.param
    return make_case(name, family_checkpoints[name], model_device())


# -- logits, float32 ----------------------------------------------------------------------------


@pytest.mark.spec("GLD-032", "GLD-041")
def test_v0_logits_at_every_position(family: Case) -> None:
    prompts = prompts_for(family.ours.config.vocab_size)
    ours = run(family.ours, every_row(v0_plan(prompts, family.device)), None)
    assert max_diff(ours, per_position_reference(family, prompts)) <= FP32_ATOL


@pytest.mark.spec("GLD-032", "GLD-041")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_v1_prefill_then_decode_past_the_original_context(family: Case, page_size: int) -> None:
    prompts = prompts_for(family.ours.config.vocab_size)
    check_v1_prefill_then_first_decode(family, prompts, page_size)


@pytest.mark.spec("GLD-032", "GLD-041")
def test_v1_chunked_prefill_mixed_with_decode_tokens(family: Case) -> None:
    prompts = prompts_for(family.ours.config.vocab_size, seed=1)
    check_chunked_prefill_mixed_with_decodes(family, prompts[2], prompts[3], 33)  # 60, 7 tokens


@pytest.mark.spec("GLD-032", "GLD-041")
def test_greedy_margins_are_far_above_the_tolerance(family: Case) -> None:
    """As GLD-018: a token-exact check means something only if no greedy step is a near-tie."""
    prompts = prompts_for(family.ours.config.vocab_size)
    assert min_top2_margin(family.reference, [prompts[1], prompts[3]], 8) > 100 * FP32_ATOL


@pytest.mark.spec("GLD-032")
@pytest.mark.parametrize("name", SCALED)
def test_scaling_changes_the_logits(
    name: str, family_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The same weights with the scaling removed give other logits: the scaled rope is seen."""
    spec = FAMILY_PRESETS[name]
    device = model_device()
    scaled = load_model(family_checkpoints[name], device=device)
    plain = load_model(
        build_tiny_checkpoint(dataclasses.replace(spec, rope_scaling=()), tmp_path), device=device
    )
    plan = v0_plan([prompts_for(spec.vocab)[2]], device)
    assert max_diff(run(scaled, plan, None), run(plain, plan, None)) > 1000 * FP32_ATOL


# -- MoE routing --------------------------------------------------------------------------------


def router_logits(case: Case, prompt: list[int]) -> list[torch.Tensor]:
    """Our router logits of ``prompt`` (a v0 plan), one ``[T, num_experts]`` per sparse layer."""
    captured: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out.cpu()))
        for layer in case.ours.model.layers
        if isinstance(layer.mlp, Qwen3MoeSparseBlock)
    ]
    try:
        run(case.ours, v0_plan([prompt], case.device), None)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


@pytest.mark.spec("GLD-043")
def test_router_logits_match_and_top_k_is_far_from_ties(moe_case: Case) -> None:
    """Routing is identical to transformers': router logits agree within ROUTER_ATOL, and the
    k-th and (k+1)-th logits are at least 100 ROUTER_ATOL apart on every token of the logit
    prompts and of the engine suite's greedy paths, so no rounding can swap an expert."""
    vocab = moe_case.ours.config.vocab_size
    prompts = prompts_for(vocab) + prompts_for(vocab, seed=1)
    for prompt in prompts:
        device = next(moe_case.reference.parameters()).device
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            theirs = moe_case.reference(input_ids=ids, output_router_logits=True).router_logits
        ours = router_logits(moe_case, prompt)
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs, strict=True):
            assert max_diff(a, b.reshape(a.shape).float()) <= ROUTER_ATOL
    golden = golden_prompts(vocab)
    generated = hf_greedy(moe_case.reference, golden, NEW_TOKENS)
    paths = [p + g for p, g in zip(golden, generated, strict=True)]
    assert min_router_margin(moe_case.reference, prompts + paths) > 100 * ROUTER_ATOL


@pytest.mark.spec("GLD-044")
def test_sparse_and_dense_layers_follow_the_config(moe_case: Case) -> None:
    """Each layer is sparse or dense as transformers builds it (decoder_sparse_step,
    mlp_only_layers)."""
    for ours, theirs in zip(
        moe_case.ours.model.layers, moe_case.reference.model.layers, strict=True
    ):
        assert isinstance(ours.mlp, Qwen3MoeSparseBlock) == hasattr(theirs.mlp, "experts")


@pytest.mark.spec("GLD-045")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_experts_equal_the_per_token_sum(dtype: torch.dtype) -> None:
    """Experts grouped by expert give each token ``sum_k w_k down(silu(gate x) * up x)``."""
    from pagedkv.model.config import MoeConfig

    gen = torch.Generator().manual_seed(0)
    moe = MoeConfig(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=8)
    experts = Qwen3MoeExperts(12, moe).to(dtype).requires_grad_(False)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    hidden = torch.randn(9, 12, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(5, generator=gen)[:3] for _ in range(9)])
    weights = torch.rand(9, 3, generator=gen).to(dtype)
    with torch.no_grad():
        got = experts(hidden, ids, weights)
    for t in range(9):
        expected = torch.zeros(12, dtype=torch.float32)
        for k in range(3):
            e = int(ids[t, k])
            gate, up = experts.gate_up_proj[e].float().split(8)
            inner = torch.nn.functional.silu(gate @ hidden[t].float()) * (up @ hidden[t].float())
            expected += weights[t, k].float() * (experts.down_proj[e].float() @ inner)
        tol = 1e-5 if dtype == torch.float32 else 0.05
        assert float((got[t].float() - expected).abs().max()) <= tol, t


# -- the scaled context -------------------------------------------------------------------------


@pytest.mark.spec("GLD-033")
def test_rope_types_of_the_presets(family: Case) -> None:
    """Each preset's config is read as the RoPE type it declares."""
    spec = FAMILY_PRESETS[family.name]
    rope: RopeConfig = family.ours.config.rope
    assert rope.rope_type == dict(spec.rope_scaling).get("rope_type", "default")
    assert rope.theta == spec.rope_theta


# -- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.spec("GLD-046")
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is false"
)
@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_cuda_family_logits_match_transformers(
    name: str, family_checkpoints: dict[str, Path]
) -> None:
    case = make_case(name, family_checkpoints[name], "cuda")
    prompts = prompts_for(case.ours.config.vocab_size)
    expected = per_position_reference(case, prompts)
    v0 = run(case.ours, every_row(v0_plan(prompts, "cuda")), None)
    assert next(case.ours.parameters()).device.type == "cuda"
    assert max_diff(v0, expected) <= FP32_ATOL
    for page_size in PAGE_SIZES:
        v1 = PagedRun(case.ours, page_size, "cuda").step(list(enumerate(prompts)), all_rows=True)
        assert max_diff(v1, expected) <= FP32_ATOL
