"""Accelerations substitute modules in a copy of the model and never change the model a runner
is given (ENG-161)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_runner_options import generate
from torch import nn

from pagedkv.accel.cpu.builder import build_cpu_model
from pagedkv.accel.cpu.decode_layers import decode_program
from pagedkv.accel.cpu.fused_norms import has_fused_norms
from pagedkv.accel.cpu.packed_linear import has_packed_gemv, is_packed
from pagedkv.accel.substitution import as_subclass, substituted_copy
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.model.layers import Linear, RMSNorm
from pagedkv.model.loader import load_model
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint

#: A module's class, its attributes by name (tensors by identity) and its parameters.
Snapshot = dict[str, tuple[type, dict[str, object], list[int]]]


def snapshot(model: nn.Module) -> Snapshot:
    """What a runner could change of ``model``'s modules."""

    def held(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return id(value)
        if isinstance(value, dict):
            return {key: held(item) for key, item in value.items()}
        return value if isinstance(value, (int, float, str, bool, type(None))) else id(value)

    return {
        name: (type(m), {k: held(v) for k, v in vars(m).items()}, [id(p) for p in m.parameters()])
        for name, m in model.named_modules()
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path_factory.mktemp("tied"))


@pytest.mark.spec("ENG-161")
def test_runners_with_every_option_leave_the_model_they_are_given_as_it_was(
    checkpoint: Path,
) -> None:
    """Runners built on one model, with every CPU acceleration and with none, run it; the model
    keeps every module's class, attributes and tensors, and its own runner's tokens."""
    model = load_model(checkpoint)
    before = snapshot(model)
    accelerated = ModelRunner.for_model(model, num_pages=64, page_size=5)
    plain_options = RunnerOptions(
        pack_weights=False, fused_norms=False, fused_swiglu=False, packed_gemv=False
    )
    plain = ModelRunner.for_model(model, num_pages=64, page_size=5, options=plain_options)
    if not (is_packed(accelerated.model) and has_fused_norms(accelerated.model)):
        pytest.skip("no CPU acceleration runs here (no oneDNN or no C compiler)")
    tokens = generate(accelerated)
    assert generate(plain) == tokens
    assert snapshot(model) == before
    assert not is_packed(model)
    assert not has_fused_norms(model)
    assert all(type(m).__module__.startswith(("pagedkv.model", "torch")) for m in model.modules())
    # The accelerated model is another tree: no module of the reference is in it.
    ours = {id(m) for m in model.modules()}
    assert not ours & {id(m) for m in accelerated.model.modules()}
    if has_packed_gemv(accelerated.model):
        assert decode_program(accelerated.model) is not None


def test_a_copy_shares_tensors_and_keeps_a_module_held_twice_one() -> None:
    """The copy holds the same parameters, and a module held under two names stays one module
    (as a tied submodule must); a substitute takes its place under both."""
    shared = RMSNorm(4, 1e-6)
    tree = nn.ModuleDict({"a": shared, "b": shared, "c": Linear(4, 3)})

    class Marked(RMSNorm):
        pass

    copy = substituted_copy(tree, lambda m: as_subclass(m, Marked) if type(m) is RMSNorm else None)
    assert isinstance(copy, nn.ModuleDict)
    assert copy["a"] is copy["b"]
    assert isinstance(copy["a"], Marked)
    assert copy["a"].weight is shared.weight
    assert copy["c"] is not tree["c"]
    assert copy["c"].weight is tree["c"].weight
    assert type(tree["a"]) is RMSNorm
    copy["c"].register_parameter("bias", None)  # the copy's own parameter dict
    assert tree["c"].bias is not None


def test_a_substitute_must_be_a_subclass() -> None:
    with pytest.raises(TypeError, match="Linear does not substitute RMSNorm"):
        as_subclass(RMSNorm(4, 1e-6), Linear)


def test_the_builder_refuses_a_built_model_it_would_have_to_unfuse(checkpoint: Path) -> None:
    """A built model has no plain norms left: asking it for none is refused, not ignored."""
    built = ModelRunner.recompute(load_model(checkpoint)).model
    if not has_fused_norms(built):
        pytest.skip("the fused norms do not build here")
    with pytest.raises(Exception, match="fused_norms=False on a model"):
        build_cpu_model(built, None, RunnerOptions(fused_norms=False), static=False)
