"""Token-exact golden checks: the backend's model path against transformers' ``generate``.

Checkpoints are tiny Qwen3 models built here with a seeded init (``pagedkv.testing``); no
download. Set ``PAGEDKV_QWEN3_PATH`` to a local Qwen3 checkpoint to run the same check on real
weights and real text.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagedkv.engine.config import CacheMode
from pagedkv.interfaces import Backend
from pagedkv.testing.tiny_qwen3 import PRESETS

from .golden_harness import (
    NEW_TOKENS,
    GoldenCheckpoints,
    golden_prompts,
    greedy_outputs,
    hf_greedy,
    load_hf_eager,
    model_engine,
)

REAL_CHECKPOINT_ENV = "PAGEDKV_QWEN3_PATH"
#: (mode, page size): v1 with pages of 1 and 16 positions and 5, which divides none of the
#: prompt lengths but 15; v0 recomputes everything (its page size is unused).
PATHS: list[tuple[CacheMode, int]] = [("v1", 1), ("v1", 16), ("v1", 5), ("v0", 16)]


def assert_same_tokens(
    got: list[list[int]],
    expected: list[list[int]],
    prompts: list[list[int]],
    checkpoints: GoldenCheckpoints,
    where: tuple[str, str, str],
    margin_allowance: float = 0.0,
) -> None:
    """Tokens must match; at a first divergence, report transformers' top-2 margin there.

    With ``margin_allowance > 0`` (16-bit dtypes), a divergence is tolerated only where the
    reference's own top-2 margin is below it: a near-tie the dtype cannot resolve. The rest of
    that sequence is then not compared.
    """
    preset, dtype, device = where
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        for j, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a == b:
                continue
            context = prompts[i] + theirs[:j]
            margin = checkpoints.top2_margin(preset, dtype, device, context)
            if margin < margin_allowance:
                break
            pytest.fail(
                f"{preset} ({dtype}, {device}) prompt {i} (length {len(prompts[i])}) diverges "
                f"at generated token {j}: ours {a}, transformers {b}; transformers' top-2 logit "
                f"margin there is {margin:.6f}"
            )


@pytest.mark.requires("model")
class GoldenSuite:
    """Greedy generation equals transformers' token for token (specs/golden.md, GLD-020..)."""

    @pytest.mark.spec("GLD-020", "GLD-021", "GLD-025")
    @pytest.mark.parametrize(("mode", "page_size"), PATHS, ids=[f"{m}-p{p}" for m, p in PATHS])
    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_batch_matches_transformers(
        self,
        backend: Backend,
        golden_checkpoints: GoldenCheckpoints,
        preset: str,
        mode: CacheMode,
        page_size: int,
        model_device: str,
    ) -> None:
        prompts = golden_prompts(PRESETS[preset].vocab)
        engine, _ = model_engine(
            backend,
            golden_checkpoints.path(preset),
            page_size=page_size,
            mode=mode,
            device=model_device,
        )
        got = greedy_outputs(engine, prompts)
        expected = golden_checkpoints.expected(preset, "float32", model_device)
        assert_same_tokens(
            got, expected, prompts, golden_checkpoints, (preset, "float32", model_device)
        )

    @pytest.mark.spec("GLD-026")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_positions_fed_per_step(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, mode: CacheMode
    ) -> None:
        """v1 feeds the prompt once, then one position a step; v0 feeds the whole sequence."""
        preset = "tied-gqa2"
        prompt = golden_prompts(PRESETS[preset].vocab)[2]
        engine, runner = model_engine(
            backend, golden_checkpoints.path(preset), page_size=16, mode=mode
        )
        (got,) = greedy_outputs(engine, [prompt])
        assert got == golden_checkpoints.expected(preset)[2]
        n = len(prompt)
        if mode == "v1":
            assert runner.tokens_per_step == [n] + [1] * (NEW_TOKENS - 1)
        else:
            assert runner.tokens_per_step == [n + k for k in range(NEW_TOKENS)]

    @pytest.mark.spec("GLD-023")
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_cuda_matches_transformers(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, dtype: str
    ) -> None:
        """On CUDA: float32 tokens exact; bfloat16 tokens exact wherever transformers' own
        top-2 margin is at least 0.5 (two bfloat16 steps at the logits' magnitude)."""
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available on this machine")
        if "cuda" not in backend.capabilities:
            pytest.skip(f"backend {backend.name!r} does not declare 'cuda'")
        for preset in sorted(PRESETS):
            prompts = golden_prompts(PRESETS[preset].vocab)
            path = golden_checkpoints.path(preset, dtype)
            expected = golden_checkpoints.expected(preset, dtype, "cuda")
            for mode, page_size in PATHS:
                engine, _ = model_engine(
                    backend, path, page_size=page_size, mode=mode, dtype=dtype, device="cuda"
                )
                got = greedy_outputs(engine, prompts)
                allowance = 0.0 if dtype == "float32" else 0.5
                assert_same_tokens(
                    got, expected, prompts, golden_checkpoints, (preset, dtype, "cuda"), allowance
                )

    @pytest.mark.spec("GLD-027")
    @pytest.mark.parametrize(("mode", "page_size"), [("v1", 16), ("v1", 5), ("v0", 16)])
    def test_default_model_matches_transformers(
        self, backend: Backend, model_device: str, mode: CacheMode, page_size: int
    ) -> None:
        """The embedded default model, on text through its tokenizer, in float32."""
        from transformers import AutoTokenizer

        from pagedkv.assets import default_model_dir

        path = default_model_dir()
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        texts = ["def read_config(path):\n", "import os\nimport sys\n", "class Parser("]
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        expected = hf_greedy(load_hf_eager(path, model_device), prompts, 32)
        engine, _ = model_engine(
            backend, path, page_size=page_size, mode=mode, device=model_device, num_pages=64
        )
        assert greedy_outputs(engine, prompts, max_tokens=32) == expected

    @pytest.mark.spec("GLD-024")
    def test_real_checkpoint(self, backend: Backend, model_device: str) -> None:
        """A real Qwen3 checkpoint from ``$PAGEDKV_QWEN3_PATH``, on real text."""
        path = os.environ.get(REAL_CHECKPOINT_ENV)
        if not path:
            pytest.skip(f"set {REAL_CHECKPOINT_ENV} to a local Qwen3 checkpoint to run this")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        texts = [
            "The capital of France is",
            "def fibonacci(n):\n    ",
            "Paged attention stores the KV cache in fixed-size pages so that",
        ]
        prompts = [tokenizer.encode(t) for t in texts]
        expected = hf_greedy(load_hf_eager(path, model_device), prompts, 24)
        engine, _ = model_engine(
            backend, Path(path), page_size=16, mode="v1", device=model_device, num_pages=256
        )
        assert greedy_outputs(engine, prompts, max_tokens=24) == expected
