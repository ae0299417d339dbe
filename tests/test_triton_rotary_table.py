"""The rotary table of ``fused_ops="triton"`` (ENG-232): every position's cos/sin rows built once
by the reference's formula, a step's tables one gather of them, the reference module
unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from op_watch import OpWatch
from test_runner_options import generate, paged_runner

from pagedkv.accel.cuda.fused_choice import fused_ops_model
from pagedkv.accel.cuda.rotary_table import TableRotaryEmbedding
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.testing.tiny_qwen3 import build_tiny_checkpoint, preset_spec

FUSED = RunnerOptions(fused_ops="triton")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """YaRN with mscale: an attention factor other than 1 that a table must carry."""
    return build_tiny_checkpoint(preset_spec("moe-yarn-mscale"), tmp_path_factory.mktemp("yarn"))


def table_of(model: Qwen3ForCausalLM) -> TableRotaryEmbedding:
    rotary = fused_ops_model(model, FUSED).rotary
    assert isinstance(rotary, TableRotaryEmbedding)
    return rotary


class Launches(OpWatch):
    """The aten ops a block runs, views left out (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def before(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if not func.is_view:
            self.ops.append(func.__name__)


@pytest.mark.spec("ENG-232")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_table_holds_every_served_position_as_the_reference_computes_it(
    checkpoint: Path, dtype: str
) -> None:
    """The table has ``max_positions`` rows in the activation dtype, each the reference's cos
    then sin row of its position, attention factor included, bit for bit with the reference
    over the same positions. Kills a table without the attention factor, with cos and sin
    swapped, shifted by one position, kept in float32, or shorter than the served context."""
    model = load_model(checkpoint, dtype=dtype, device="cpu")
    assert model.rotary.attention_factor != 1.0
    rotary = table_of(model)
    positions = model.config.max_positions
    assert rotary.table.shape == (positions, 2, model.config.head_dim)
    assert rotary.table.dtype == model.model.embed_tokens.weight.dtype
    cos, sin = model.rotary(torch.arange(positions), rotary.table.dtype)
    assert torch.equal(rotary.table[:, 0], cos)
    assert torch.equal(rotary.table[:, 1], sin)
    assert type(model.rotary) is RotaryEmbedding  # the reference is not changed


@pytest.mark.spec("ENG-232")
def test_a_steps_tables_are_one_gather_of_its_positions(checkpoint: Path) -> None:
    """A step of positions in any order and with repeats gets exactly the table's rows, from
    one launch (the reference's formula takes nine here, YaRN's factor included); a dtype the
    table is not in gets the reference's computation. Kills a substitute that recomputes every
    step, gathers the wrong rows, or serves a bfloat16 table to a float32 step."""
    model = load_model(checkpoint, dtype="bfloat16", device="cpu")
    rotary = table_of(model)
    positions = torch.tensor([5, 0, 63, 5, 17], dtype=torch.int64)
    with Launches() as substituted:
        cos, sin = rotary(positions, torch.bfloat16)
    with Launches() as reference:
        model.rotary(positions, torch.bfloat16)
    assert substituted.ops == ["index_select.default"]
    assert len(reference.ops) == 9
    assert torch.equal(cos, rotary.table[positions, 0])
    assert torch.equal(sin, rotary.table[positions, 1])
    wide = rotary(positions, torch.float32)
    expected = model.rotary(positions, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(wide, expected, strict=True))


@pytest.mark.spec("ENG-232", "ENG-233")
def test_yarn_moe_tokens_through_the_table_and_fused_experts_are_the_references(
    checkpoint: Path,
) -> None:
    """Greedy float32 tokens over the reference store with the table and the Triton expert
    activations equal the reference modules', prefill and decode alike. Kills a table whose
    rows a step reads misplaced (the rotation of every token past the first moves)."""
    fused = paged_runner(checkpoint, FUSED)
    assert isinstance(fused.model.rotary, TableRotaryEmbedding)
    assert generate(fused) == generate(paged_runner(checkpoint))
