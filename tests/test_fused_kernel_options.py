"""The runner options of the fused layer kernels, ``fused_norms`` (ENG-116) and
``fused_swiglu`` (ENG-159): on where the kernel builds, refused where it cannot run, and the
same greedy tokens either way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from test_runner_options import generate, paged_runner
from torch import nn

from pagedkv.accel.cpu.fused_norms import has_fused_norms
from pagedkv.accel.cpu.fused_swiglu import has_fused_swiglu
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.model.loader import load_model
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint

#: (option, the check that a model runs the kernel, the layers the kernel fuses).
KERNELS = [
    pytest.param("fused_norms", has_fused_norms, "norms", id="fused_norms"),
    pytest.param("fused_swiglu", has_fused_swiglu, "MLPs", id="fused_swiglu"),
]


def options(option: str, value: bool) -> RunnerOptions:
    return replace(RunnerOptions(), **{option: value})


@pytest.mark.spec("ENG-116", "ENG-159", "ENG-111")
@pytest.mark.parametrize(("option", "fused", "layers"), KERNELS)
def test_the_runner_fuses_where_it_can_and_refuses_what_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    option: str,
    fused: Callable[[nn.Module], bool],
    layers: str,
) -> None:
    checkpoint = build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path / "tied")
    for dtype in ("float32", "bfloat16"):
        assert fused(paged_runner(checkpoint, dtype=dtype).model)
    assert not fused(paged_runner(checkpoint, dtype="float16").model)
    assert not fused(paged_runner(checkpoint, options(option, False)).model)
    with pytest.raises(InvalidRequest, match=rf"{option}: .*float16"):
        paged_runner(checkpoint, options(option, True), dtype="float16")
    model = paged_runner(checkpoint).model
    with pytest.raises(InvalidRequest, match=f"{option}=False on a model whose {layers}"):
        ModelRunner.recompute(model, options(option, False))
    with pytest.raises(InvalidRequest, match=rf"{option}: .*CPU, the model is on meta"):
        ModelRunner.recompute(load_model(checkpoint).to("meta"), options(option, True))
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", "no-such-compiler")
    assert not fused(paged_runner(checkpoint).model)
    with pytest.raises(InvalidRequest, match=f"{option}: no C compiler"):
        ModelRunner.recompute(load_model(checkpoint), options(option, True))


@pytest.mark.spec("ENG-116", "ENG-159", "ENG-110")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("option", "fused", "layers"), KERNELS)
def test_the_fused_kernel_generates_the_unfused_tokens(
    tmp_path: Path, dtype: str, option: str, fused: Callable[[nn.Module], bool], layers: str
) -> None:
    """Greedy tokens with and without the fused kernel are the same, token for token
    (bfloat16: GLD-016's tolerance, and these prompts' margins are far above one step)."""
    path = build_tiny_checkpoint(PRESETS["untied-gqa4-wide"], tmp_path / dtype, dtype=dtype)

    def run(on: bool) -> list[list[int]]:
        runner = paged_runner(path, options(option, on), dtype=dtype)
        assert fused(runner.model) == on
        return generate(runner)

    assert run(True) == run(False)
