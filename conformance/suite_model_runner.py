"""Model runner conformance tests (specs/golden.md GLD-014, GLD-033), on tiny seeded Qwen3
checkpoints run by the backend's own ``create_model_runner``: a runner's logits depend only on
the plan it is given (and its store), never on the plans it ran before; the context it serves
follows the checkpoint's RoPE scaling, and caps the engine's. Subclass
:class:`ModelRunnerSuite` to run these against a runner of yours.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.interfaces import Backend, ModelBackend, StepRunner
from pagedkv.plan import SeqChunk, StepPlan
from pagedkv.plan_builders import build_recompute_plan
from pagedkv.testing.tiny_qwen3 import PRESETS

from .golden_harness import GoldenCheckpoints, golden_prompts, model_engine


def recompute_plan(runner: StepRunner, prompts: list[list[int]]) -> StepPlan:
    """A cache-less plan of whole prompts, every row's logits wanted."""
    chunks = [SeqChunk(tuple(p), 0, (), True) for p in prompts]
    return build_recompute_plan(chunks, runner.device)


@pytest.mark.requires("model")
class ModelRunnerSuite:
    """What a runner's logits may depend on."""

    @pytest.mark.spec("GLD-014")
    def test_logits_depend_only_on_the_plan(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints
    ) -> None:
        """A runner runs short prompts, then longer ones, then the short ones again; a fresh
        runner runs the longer ones first. Each plan's logits are bit for bit the same
        whatever ran before it."""
        assert isinstance(backend, ModelBackend)
        preset = sorted(PRESETS)[0]
        path = str(golden_checkpoints.path(preset))
        prompts = golden_prompts(PRESETS[preset].vocab)
        short, long = [prompts[1], prompts[3]], [prompts[0], prompts[2]]  # 15, 1; 16, 23 tokens

        def runner() -> StepRunner:
            return backend.create_model_runner(path, num_pages=None, page_size=4)

        used = runner()
        first = used.execute(recompute_plan(used, short)).clone()
        after = used.execute(recompute_plan(used, long)).clone()
        again = used.execute(recompute_plan(used, short))
        fresh = runner()
        alone = fresh.execute(recompute_plan(fresh, long))
        assert torch.equal(again, first), "a plan run again gave other logits"
        assert torch.equal(after, alone), "a plan's logits depend on the plans run before it"

    @pytest.mark.spec("GLD-033")
    @pytest.mark.parametrize(
        ("preset", "served"),
        [("yarn", 4 * 32), ("linear", 2 * 64), ("llama3", 256)],
    )
    def test_the_served_context_follows_the_scaling(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, preset: str, served: int
    ) -> None:
        """YaRN x4 from 32 original positions serves 128 (past ``max_position_embeddings``,
        40), linear x2 of 64 serves 128, Llama 3 scaling serves its 256 unchanged; an engine
        over the runner caps a larger ``max_model_len`` there and keeps a smaller one."""
        path = golden_checkpoints.path(preset)
        engine, runner = model_engine(
            backend, path, page_size=16, mode="v1", num_pages=64, max_model_len=4096
        )
        assert runner.max_positions == served
        assert engine.max_model_len == served
        smaller, _ = model_engine(
            backend, path, page_size=16, mode="v1", num_pages=64, max_model_len=100
        )
        assert smaller.max_model_len == 100
