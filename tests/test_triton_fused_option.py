"""``RunnerOptions.fused_ops`` (ENG-220): the Triton norms, rotations and SwiGLU activations in
a copy of the model where they can run, the same greedy tokens as the reference modules, and
refused with the reason where they cannot run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from test_runner_options import generate, paged_runner

from pagedkv.accel.cuda import fused_choice, fused_modules
from pagedkv.accel.cuda.fused_choice import fused_ops_model
from pagedkv.accel.cuda.fused_modules import TritonMoeExperts, TritonRMSNorm, TritonSwiGLUMLP
from pagedkv.accel.cuda.rotary_table import TableRotaryEmbedding
from pagedkv.accel.cuda.triton_substitute import has_triton_substitutes
from pagedkv.accel.static_decode import resolve_cuda_graphs
from pagedkv.backend import triton_backend
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.model.layers import RMSNorm, SwiGLUMLP
from pagedkv.model.loader import load_model
from pagedkv.model.moe import Qwen3MoeExperts
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint, preset_spec

FUSED = RunnerOptions(fused_ops="triton")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Qwen3ForCausalLM:
    return load_model(checkpoint, dtype="float32", device="cpu")


@pytest.mark.spec("ENG-220")
def test_an_unknown_fused_ops_is_refused_naming_the_option() -> None:
    """Kills an option that takes any string and runs the reference (accepted and dropped)."""
    with pytest.raises(InvalidRequest, match="fused_ops='cuda'"):
        RunnerOptions(fused_ops="cuda")
    assert RunnerOptions().fused_ops == "reference"
    assert triton_backend().runner_options.fused_ops == "triton"


@pytest.mark.spec("ENG-220", "ENG-161")
def test_triton_substitutes_every_norm_and_mlp_in_a_copy(model: Qwen3ForCausalLM) -> None:
    """A v0 runner's model holds a Triton substitute for each of the layers' four norms, their
    MLP and the final norm, and the rotary table (ENG-232), over the given model's own weights;
    the given model keeps its reference modules, and a reference runner over it runs them.
    Kills a choice that ignores the option, mutates the model given, or copies the weights."""
    runner = ModelRunner.recompute(model, FUSED)
    layers = model.config.num_hidden_layers
    modules = list(runner.model.modules())
    assert sum(isinstance(m, TritonRMSNorm) for m in modules) == 4 * layers + 1
    assert sum(isinstance(m, TritonSwiGLUMLP) for m in modules) == layers
    assert isinstance(runner.model.rotary, TableRotaryEmbedding)
    assert not any(type(m) in (RMSNorm, SwiGLUMLP, RotaryEmbedding) for m in modules)
    assert not has_triton_substitutes(model)
    norm = runner.model.model.norm.weight
    assert norm.data_ptr() == model.model.norm.weight.data_ptr()
    assert not has_triton_substitutes(ModelRunner.recompute(model).model)


@pytest.mark.spec("ENG-220")
def test_triton_fused_ops_generate_the_reference_tokens(checkpoint: Path) -> None:
    """Over the reference store, greedy float32 tokens with the Triton modules equal those of
    the reference modules (float32 differs by a few units in the last place at most). Kills
    any kernel far enough off to move a greedy token, and a runner that drops the option on
    its v1 path."""
    fused = paged_runner(checkpoint, FUSED)
    assert has_triton_substitutes(fused.model)
    assert isinstance(fused._store, TorchPagedStore)
    assert generate(fused) == generate(paged_runner(checkpoint))


@pytest.mark.spec("ENG-233")
def test_triton_runs_every_moe_experts_activation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In an MoE model every expert block is substituted, every expert an engine step runs
    has its activation launched as the SwiGLU kernel (counted by wrapping it), and the greedy
    float32 tokens are the reference modules'. Kills a choice that leaves the experts to the
    reference (0 launches) and an activation that swaps gate and up (tokens move)."""
    checkpoint = build_tiny_checkpoint(preset_spec("moe-top2-norm"), tmp_path)
    kernel = fused_modules.swiglu
    widths: list[int] = []

    def counted(gate_up: torch.Tensor) -> torch.Tensor:
        widths.append(gate_up.shape[1])
        return kernel(gate_up)

    monkeypatch.setattr(fused_modules, "swiglu", counted)
    fused = paged_runner(checkpoint, FUSED)
    modules = list(fused.model.modules())
    layers = fused.model.config.num_hidden_layers
    assert sum(isinstance(m, TritonMoeExperts) for m in modules) == layers
    assert not any(type(m) is Qwen3MoeExperts for m in modules)
    tokens = generate(fused)
    experts = fused.model.config.moe
    assert experts is not None
    assert len(widths) >= layers
    assert set(widths) == {2 * experts.moe_intermediate_size}
    assert tokens == generate(paged_runner(checkpoint))


@pytest.mark.spec("ENG-220")
@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (RunnerOptions(fused_ops="triton", compile=True), "compile compiles the reference"),
        (RunnerOptions(fused_ops="triton", fused_norms=True), "fused_norms and fused_swiglu"),
        (RunnerOptions(fused_ops="triton", fused_swiglu=True), "fused_norms and fused_swiglu"),
        (RunnerOptions(fused_ops="triton", decode_layers=True), "decode_layers"),
    ],
    ids=["compile", "fused-norms", "fused-swiglu", "decode-layers"],
)
def test_triton_with_what_runs_other_modules_is_refused(
    checkpoint: Path, options: RunnerOptions, reason: str
) -> None:
    """Kills a runner that compiles, captures or runs the C kernels of the same modules while
    claiming Triton's."""
    with pytest.raises(InvalidRequest, match=reason):
        paged_runner(checkpoint, options)


@pytest.mark.spec("ENG-220", "ENG-161")
def test_a_model_another_runner_fused_keeps_its_kernels_or_is_refused(
    model: Qwen3ForCausalLM,
) -> None:
    """A model with the CPU's C norms is refused by ``"triton"``; one with the Triton modules
    is refused by ``"reference"`` (its plain modules are gone) and kept by ``"triton"``. Kills
    a choice that substitutes over another room's substitutes or silently keeps them."""
    c_fused = ModelRunner.recompute(model).model
    with pytest.raises(InvalidRequest, match="fused in C"):
        ModelRunner.recompute(c_fused, FUSED)
    triton_fused = ModelRunner.recompute(model, FUSED).model
    with pytest.raises(InvalidRequest, match="fused_ops='reference' on a model"):
        ModelRunner.recompute(triton_fused)
    again = ModelRunner.recompute(triton_fused, FUSED).model
    assert sum(isinstance(m, TritonSwiGLUMLP) for m in again.modules()) == len(model.model.layers)


@pytest.mark.spec("ENG-220")
def test_triton_not_installed_or_off_cuda_is_refused(
    model: Qwen3ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model on the ``meta`` device (another device than the CPU) is refused naming CUDA,
    and a process without triton names it. Kills a choice that launches on whatever device
    the model is on, or fails with an ImportError instead of the option's error."""
    with torch.device("meta"):
        meta = Qwen3ForCausalLM(model.config)
    with pytest.raises(InvalidRequest, match="runs on a CUDA device, not on meta"):
        fused_ops_model(meta, FUSED)
    found = importlib.util.find_spec

    def without_triton(name: str, *args: Any) -> Any:
        return None if name == "triton" else found(name, *args)

    monkeypatch.setattr(fused_choice.importlib.util, "find_spec", without_triton)
    with pytest.raises(InvalidRequest, match="triton is not installed"):
        fused_ops_model(model, FUSED)


@pytest.mark.spec("ENG-220", "ENG-205")
def test_cuda_graphs_left_unset_are_on_with_triton_fused_ops() -> None:
    """For a whole model on a CUDA device over the reference store (a stand-in: only its
    device and layout are read), unset ``cuda_graphs`` resolve on with the reference modules
    and with the Triton ones alike (their kernels read no value on the host, so the fixed-shape
    steps capture them). Kills a default that leaves fused steps eager on CUDA."""
    cuda = SimpleNamespace(
        parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]),
        layout=SimpleNamespace(size=1),
    )
    store = TorchPagedStore.__new__(TorchPagedStore)
    stand_in = cast(Qwen3ForCausalLM, cuda)
    assert resolve_cuda_graphs(RunnerOptions(), stand_in, store).cuda_graphs is True
    assert resolve_cuda_graphs(FUSED, stand_in, store).cuda_graphs is True


@pytest.mark.spec("ENG-220")
def test_triton_on_a_cpu_model_without_the_interpreter_is_refused(checkpoint: Path) -> None:
    """In a process whose kernels are defined for a GPU (``TRITON_INTERPRET=0``), a model on
    the CPU is refused naming the interpreter. Kills a choice that launches GPU kernels on CPU
    tensors."""
    if torch.cuda.is_available():
        pytest.skip("the check needs a machine whose kernels cannot run on its GPU")
    script = (
        "import sys\n"
        "from pagedkv.accel.cuda.fused_choice import fused_ops_model\n"
        "from pagedkv.engine.runner_options import RunnerOptions\n"
        "from pagedkv.errors import InvalidRequest\n"
        "from pagedkv.model.loader import load_model\n"
        "try:\n"
        "    fused_ops_model(load_model(sys.argv[1]), RunnerOptions(fused_ops='triton'))\n"
        "except InvalidRequest as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "runs only under Triton's interpreter" in done.stdout, done.stderr
