"""The family golden suite can fail: each mutant model runner in ``tests/family_mutants.py``
fails the suite's tests on the presets its bug touches (GLD-050, GLD-053)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from family_mutants import MUTANTS

from pagedkv.errors import PagedKVError
from pagedkv.testing.tiny_qwen3 import one_torch_thread
from pagedkv_conformance.golden_harness import GoldenCheckpoints
from pagedkv_conformance.suite_golden_family import GoldenFamilySuite

#: (mutant, a preset whose golden generation it must break).
BROKEN_GENERATIONS = [
    ("flip_norm_topk_prob", "moe-top2-norm"),
    ("flip_norm_topk_prob", "moe-mixed-dense"),
    ("top_one_routing", "moe-mixed-dense"),
    ("swap_gate_and_up", "moe-top2-norm"),
    ("drop_attention_factor", "moe-yarn-mscale"),
    ("drop_attention_factor", "yarn"),
    ("plain_rope", "yarn"),
    ("plain_rope", "linear"),
    ("plain_rope", "llama3"),
    ("plain_rope", "proportional"),
    ("unscaled_context", "yarn"),
]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is faster, and much faster on a loaded machine."""
    with one_torch_thread():
        yield


@pytest.mark.spec("GLD-050")
@pytest.mark.parametrize(("mutant", "preset"), BROKEN_GENERATIONS)
def test_family_generation_fails_on_the_mutant(
    mutant: str, preset: str, golden_checkpoints: GoldenCheckpoints
) -> None:
    suite = GoldenFamilySuite()
    with pytest.raises((AssertionError, pytest.fail.Exception, PagedKVError)):
        suite.test_family_batch_matches_transformers(
            MUTANTS[mutant], golden_checkpoints, preset, "v1", 16, "cpu"
        )


@pytest.mark.spec("GLD-053")
def test_served_context_check_fails_on_an_unscaled_runner(
    golden_checkpoints: GoldenCheckpoints,
) -> None:
    suite = GoldenFamilySuite()
    with pytest.raises(AssertionError):
        suite.test_scaled_rope_serves_the_scaled_context(
            MUTANTS["unscaled_context"], golden_checkpoints, "yarn"
        )
