"""Token-exact golden checks for the rest of the Qwen3 family: Qwen3-MoE and scaled RoPE.

The checkpoints are the ``FAMILY_PRESETS`` of ``pagedkv.testing`` (tiny, seeded, built with
transformers' ``Qwen3MoeConfig``/``Qwen3Config`` and ``save_pretrained``, so the experts are
stored per expert as released checkpoints store them). Generation goes past every preset's
``original_max_position_embeddings``, so scaled RoPE is exercised where it differs from plain
RoPE. The reference is transformers' greedy ``generate`` (eager attention, eager experts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagedkv.engine.config import CacheMode
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.errors import RequestTooLong
from pagedkv.interfaces import Backend
from pagedkv.testing.tiny_qwen3 import FAMILY_PRESETS, one_torch_thread

from .golden_harness import (
    NEW_TOKENS,
    GoldenCheckpoints,
    golden_prompts,
    hf_greedy,
    model_engine,
)
from .suite_golden import PATHS, assert_same_tokens

FAMILY = sorted(FAMILY_PRESETS)
MOE = sorted(n for n, s in FAMILY_PRESETS.items() if s.is_moe)
#: The context each preset serves: YaRN ``original * factor``, linear ``max_pos * factor``,
#: the others ``max_position_embeddings``.
SERVED_POSITIONS = {"yarn": 128, "moe-yarn-mscale": 192, "linear": 128, "llama3": 256}
#: A shared prefix of 21 tokens: four full pages of 5, one of 16.
PREFIX_LENGTH = 21
#: Tokens generated from each prompt sharing that prefix.
PREFIX_NEW_TOKENS = 24


def generate(
    backend: Backend,
    checkpoints: GoldenCheckpoints,
    preset: str,
    prompts: list[list[int]],
    device: str,
    *,
    waves: tuple[int, ...] | None = None,
    max_tokens: int = NEW_TOKENS,
    mode: CacheMode = "v1",
    page_size: int,
    **options: Any,
) -> list[RequestOutput]:
    """Greedy outputs (EOS ignored) of ``prompts`` on one engine of the backend, added in
    ``waves`` (counts of prompts run to completion one after the other; default all at once);
    ``options`` are further ``EngineConfig`` fields."""
    engine, _ = model_engine(
        backend, checkpoints.path(preset), page_size=page_size, mode=mode, device=device, **options
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: list[RequestOutput] = []
    for size in waves or (len(prompts),):
        outputs += run_to_completion(engine, prompts[len(outputs) : len(outputs) + size], params)
    return outputs


def assert_tokens(
    outputs: list[RequestOutput],
    expected: list[list[int]],
    prompts: list[list[int]],
    checkpoints: GoldenCheckpoints,
    preset: str,
    device: str,
) -> None:
    """The outputs' tokens are transformers' (float32), as :func:`assert_same_tokens`."""
    got = [list(o.token_ids) for o in outputs]
    assert_same_tokens(got, expected, prompts, checkpoints, (preset, "float32", device))


@pytest.mark.requires("model")
class GoldenFamilySuite:
    """specs/golden.md GLD-050..: MoE and scaled-RoPE checkpoints through the engine."""

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _one_torch_thread(cls) -> Iterator[None]:
        """Tiny models: one intra-op thread is faster, and much faster on a loaded machine."""
        with one_torch_thread():
            yield

    @pytest.mark.spec("GLD-050")
    @pytest.mark.parametrize(("mode", "page_size"), PATHS, ids=[f"{m}-p{p}" for m, p in PATHS])
    @pytest.mark.parametrize("preset", FAMILY)
    def test_family_batch_matches_transformers(
        self,
        backend: Backend,
        golden_checkpoints: GoldenCheckpoints,
        preset: str,
        mode: CacheMode,
        page_size: int,
        model_device: str,
    ) -> None:
        prompts = golden_prompts(FAMILY_PRESETS[preset].vocab)
        checkpoints = golden_checkpoints
        outputs = generate(
            backend, checkpoints, preset, prompts, model_device, mode=mode, page_size=page_size
        )
        expected = golden_checkpoints.expected(preset, "float32", model_device)
        assert_tokens(outputs, expected, prompts, golden_checkpoints, preset, model_device)

    @pytest.mark.spec("GLD-051")
    @pytest.mark.parametrize("preset", [*MOE, "yarn"])
    def test_prefix_cache_hits_keep_tokens_exact(
        self,
        backend: Backend,
        golden_checkpoints: GoldenCheckpoints,
        preset: str,
        model_device: str,
    ) -> None:
        """Prompts sharing a prefix: the later ones reuse its cached pages (of 16 and of 5
        positions), chunked prefill splits the rest, and every generation still equals
        transformers'."""
        if "prefix_caching" not in backend.capabilities:
            pytest.skip(f"backend {backend.name!r} does not declare 'prefix_caching'")
        vocab = FAMILY_PRESETS[preset].vocab
        prefix = golden_prompts(vocab, seed=3)[2][:PREFIX_LENGTH]
        prompts = [prefix + tail[:7] for tail in golden_prompts(vocab, seed=4)]
        reference = golden_checkpoints.reference(preset, "float32", model_device)
        expected = hf_greedy(reference, prompts, PREFIX_NEW_TOKENS)
        for page_size in (16, 5):
            outputs = generate(
                backend,
                golden_checkpoints,
                preset,
                prompts,
                model_device,
                waves=(1, len(prompts) - 1),
                max_tokens=PREFIX_NEW_TOKENS,
                page_size=page_size,
                max_num_batched_tokens=24,
            )
            assert_tokens(outputs, expected, prompts, golden_checkpoints, preset, model_device)
            full_pages = PREFIX_LENGTH // page_size * page_size
            assert all(o.metrics.cached_tokens >= full_pages for o in outputs[1:]), page_size

    @pytest.mark.spec("GLD-052")
    @pytest.mark.parametrize("preset", [*MOE, "yarn"])
    def test_preemption_keeps_tokens_exact(
        self,
        backend: Backend,
        golden_checkpoints: GoldenCheckpoints,
        preset: str,
        model_device: str,
    ) -> None:
        """A pool too small for the whole batch: requests are preempted and recomputed, and
        every generation still equals transformers'."""
        prompts = golden_prompts(FAMILY_PRESETS[preset].vocab)
        outputs = generate(
            backend, golden_checkpoints, preset, prompts, model_device, page_size=5, num_pages=16
        )
        expected = golden_checkpoints.expected(preset, "float32", model_device)
        assert_tokens(outputs, expected, prompts, golden_checkpoints, preset, model_device)
        assert sum(o.metrics.preemptions for o in outputs) > 0

    @pytest.mark.spec("GLD-053")
    @pytest.mark.parametrize("preset", sorted(SERVED_POSITIONS))
    def test_scaled_rope_serves_the_scaled_context(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, preset: str
    ) -> None:
        """The runner reports the scaled context as its positions; the engine accepts a
        request filling it and refuses one past it."""
        served = SERVED_POSITIONS[preset]
        engine, runner = model_engine(
            backend, golden_checkpoints.path(preset), page_size=16, mode="v1", num_pages=64
        )
        assert runner.max_positions == served
        prompt = golden_prompts(FAMILY_PRESETS[preset].vocab)[0]
        fits = SamplingParams(max_tokens=served - len(prompt), temperature=0.0)
        engine.abort(engine.add_request(prompt, fits))
        too_long = SamplingParams(max_tokens=served - len(prompt) + 1, temperature=0.0)
        with pytest.raises(RequestTooLong):
            engine.add_request(prompt, too_long)

    @pytest.mark.spec("GLD-054")
    def test_cuda_family_matches_transformers(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints
    ) -> None:
        """On CUDA, float32: every family preset's tokens on every path equal transformers'
        on the GPU."""
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available on this machine")
        if "cuda" not in backend.capabilities:
            pytest.skip(f"backend {backend.name!r} does not declare 'cuda'")
        for preset in FAMILY:
            prompts = golden_prompts(FAMILY_PRESETS[preset].vocab)
            expected = golden_checkpoints.expected(preset, "float32", "cuda")
            for mode, ps in PATHS:
                outputs = generate(
                    backend, golden_checkpoints, preset, prompts, "cuda", mode=mode, page_size=ps
                )
                assert_tokens(outputs, expected, prompts, golden_checkpoints, preset, "cuda")
