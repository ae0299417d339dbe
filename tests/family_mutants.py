"""Deliberately broken model runners, to prove the family golden suite can fail.

Each mutant is the reference backend whose model runner carries one small, plausible bug in
the MoE block or the rotary embedding. ``tests/test_family_mutants.py`` runs the suite's tests
on each and expects them to fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv.backend import ReferenceBackend
from pagedkv.engine.runner import ModelRunner
from pagedkv.model.moe import Qwen3MoeSparseBlock
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.model.rope_config import RopeConfig

if TYPE_CHECKING:
    from pagedkv.interfaces import StepRunner


def _moe_blocks(model: Qwen3ForCausalLM) -> list[Qwen3MoeSparseBlock]:
    return [m for m in model.modules() if isinstance(m, Qwen3MoeSparseBlock)]


def flip_norm_topk_prob(model: Qwen3ForCausalLM) -> None:
    """The router renormalises the top-k weights when it should not, and the reverse."""
    for block in _moe_blocks(model):
        block.norm_topk_prob = not block.norm_topk_prob


def top_one_routing(model: Qwen3ForCausalLM) -> None:
    """Every token goes to its best expert only."""
    for block in _moe_blocks(model):
        block.top_k = 1


def swap_gate_and_up(model: Qwen3ForCausalLM) -> None:
    """Per-expert ``gate_proj`` and ``up_proj`` loaded into each other's rows."""
    for block in _moe_blocks(model):
        half = block.experts.intermediate
        with torch.no_grad():
            weights = block.experts.gate_up_proj
            weights.copy_(torch.cat((weights[:, half:], weights[:, :half]), dim=1))


def drop_attention_factor(model: Qwen3ForCausalLM) -> None:
    """YaRN's frequencies without its cos/sin scale (``mscale``)."""
    model.rotary.attention_factor = 1.0


def plain_rope(model: Qwen3ForCausalLM) -> None:
    """The rope scaling ignored: default RoPE with the config's base."""
    config = model.config
    model.rotary = RotaryEmbedding(RopeConfig("default", config.rope_theta), config.head_dim)


class _UnscaledRunner(ModelRunner):
    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings


@dataclass(frozen=True)
class MutantModelBackend(ReferenceBackend):
    """The reference backend whose model gets ``mutate`` applied after loading."""

    mutate: Callable[[Qwen3ForCausalLM], None] | None = None
    unscaled_context: bool = False

    def create_model_runner(
        self,
        model_dir: str,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> StepRunner:
        runner_class = _UnscaledRunner if self.unscaled_context else ModelRunner
        runner = runner_class.from_model_dir(
            model_dir, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        if self.mutate is not None:
            self.mutate(runner.model)
        return runner


MUTANTS: dict[str, MutantModelBackend] = {
    "flip_norm_topk_prob": MutantModelBackend(name="mutant", mutate=flip_norm_topk_prob),
    "top_one_routing": MutantModelBackend(name="mutant", mutate=top_one_routing),
    "swap_gate_and_up": MutantModelBackend(name="mutant", mutate=swap_gate_and_up),
    "drop_attention_factor": MutantModelBackend(name="mutant", mutate=drop_attention_factor),
    "plain_rope": MutantModelBackend(name="mutant", mutate=plain_rope),
    "unscaled_context": MutantModelBackend(name="mutant", unscaled_context=True),
}
