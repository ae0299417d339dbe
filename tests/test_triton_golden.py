"""The engine golden check through the Triton attention, under Triton's interpreter: a tiny
Qwen3 generates token for token what transformers generates (GLD-055)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv.accel.cuda import fused_modules
from pagedkv.accel.cuda.triton_store import TritonPagedStore
from pagedkv.backend import triton_backend
from pagedkv.testing.tiny_qwen3 import PRESETS
from pagedkv_conformance.golden_harness import (
    GoldenCheckpoints,
    golden_prompts,
    greedy_outputs,
    hf_greedy,
    model_engine,
)

#: Four query heads on one KV head, 24 channels (no power of two), attention biases.
PRESET = "tied-gqa4-bias"
#: Tokens generated per prompt: enough to cross pages of 5 and decode beside prefill chunks.
NEW_TOKENS = 10


@pytest.mark.spec("GLD-055", "ENG-199", "ENG-220")
def test_triton_attention_matches_transformers_token_for_token(
    golden_checkpoints: GoldenCheckpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The golden prompts (16, 15, 23 and 1 tokens) on pages of 5 positions, at most 16 token
    positions a step, so the 23-token prompt is prefilled in two chunks (the second continuing
    over the first's pages) while others decode: greedy tokens equal transformers'. Kills any
    kernel whose result moves a logit past the top-2 margin: a causal mask off by one, a
    continuing chunk that forgets its earlier pages, a KV head taken for the wrong query head,
    a slot written one position off."""
    calls: list[int] = []
    attend = TritonPagedStore.attention

    def counted(self: TritonPagedStore, layer: int, query: torch.Tensor, *rest: Any) -> Any:
        calls.append(layer)
        return attend(self, layer, query, *rest)

    monkeypatch.setattr(TritonPagedStore, "attention", counted)
    launches: dict[str, int] = {}
    for name in ("rms_norm", "rms_norm_rope", "swiglu"):
        kernel = getattr(fused_modules, name)

        def launched(*args: Any, name: str = name, kernel: Any = kernel) -> Any:
            launches[name] = launches.get(name, 0) + 1
            return kernel(*args)

        monkeypatch.setattr(fused_modules, name, launched)
    prompts = golden_prompts(PRESETS[PRESET].vocab)
    engine, runner = model_engine(
        triton_backend(),
        golden_checkpoints.path(PRESET),
        page_size=5,
        mode="v1",
        num_pages=64,
        max_num_batched_tokens=16,
    )
    got = greedy_outputs(engine, prompts, NEW_TOKENS)
    want = hf_greedy(golden_checkpoints.reference(PRESET, "float32", "cpu"), prompts, NEW_TOKENS)
    assert got == want
    assert max(runner.tokens_per_step) == 16  # a step was full: the long prompt was chunked
    assert len(calls) == 2 * len(runner.tokens_per_step)  # both layers of every step
    # ENG-220: every norm, rotation and activation of both layers of every step ran the
    # fused kernels (the final norm too).
    steps = len(runner.tokens_per_step)
    assert launches == {"rms_norm": 5 * steps, "rms_norm_rope": 4 * steps, "swiglu": 2 * steps}
