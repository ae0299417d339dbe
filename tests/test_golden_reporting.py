"""GLD-022: a first divergence is reported with transformers' top-2 margin, never hidden."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv_conformance.golden_harness import GoldenCheckpoints, golden_prompts
from pagedkv_conformance.suite_golden import assert_same_tokens


@pytest.mark.spec("GLD-022")
def test_divergence_reports_the_margin(tmp_path: Path) -> None:
    checkpoints = GoldenCheckpoints(tmp_path)
    prompts = golden_prompts(256)[:1]
    expected = checkpoints.expected("tied-gqa2")[:1]
    wrong = [list(expected[0])]
    wrong[0][3] = (wrong[0][3] + 1) % 256
    where = ("tied-gqa2", "float32", "cpu")
    assert_same_tokens(expected, expected, prompts, checkpoints, where)  # equal: passes
    with pytest.raises(pytest.fail.Exception, match=r"generated token 3.*top-2 logit margin"):
        assert_same_tokens(wrong, expected, prompts, checkpoints, where)
    # A 16-bit allowance above the margin tolerates the divergence as a near-tie.
    assert_same_tokens(wrong, expected, prompts, checkpoints, where, margin_allowance=1e9)
