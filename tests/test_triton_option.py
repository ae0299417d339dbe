"""``RunnerOptions.attention`` (ENG-199): the Triton store in the reference store's place where
it can run, refused with its reason where it cannot."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.accel.cuda import attention_choice
from pagedkv.accel.cuda.attention_choice import attention_store
from pagedkv.accel.cuda.triton_store import TritonPagedStore
from pagedkv.backend import triton_backend
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore, StoreConfig
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint

TRITON = RunnerOptions(attention="triton")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Qwen3ForCausalLM:
    path = build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path_factory.mktemp("tied"))
    return load_model(path, dtype="float32", device="cpu")


def store_for(model: Qwen3ForCausalLM) -> TorchPagedStore:
    cfg = model.config
    return TorchPagedStore(
        StoreConfig(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            page_size=4,
            num_pages=8,
        )
    )


@pytest.mark.spec("ENG-199")
def test_an_unknown_attention_is_refused_naming_the_option() -> None:
    """Kills an option that takes any string and runs the reference (accepted and dropped)."""
    with pytest.raises(InvalidRequest, match="attention='flash'"):
        RunnerOptions(attention="flash")
    assert RunnerOptions().attention == "reference"


@pytest.mark.spec("ENG-199")
def test_triton_puts_its_store_over_the_given_pools_and_leaves_them_the_reference(
    model: Qwen3ForCausalLM,
) -> None:
    """The runner attends through a Triton store over the given store's pools; the given store
    stays a reference store, and a reference runner over the same model attends with it.
    Kills a choice that ignores the option, copies the pools, or changes the store given."""
    store = store_for(model)
    runner = ModelRunner.paged(model, store, TRITON)
    chosen = runner._store
    assert isinstance(chosen, TritonPagedStore)
    assert isinstance(chosen, PagedStore)
    assert chosen.reference is store
    assert chosen._layer(1)[0].data_ptr() == store.key_pool(1).data_ptr()
    assert attention_store(store, RunnerOptions()) is store
    assert isinstance(ModelRunner.paged(model, store)._store, TorchPagedStore)
    assert isinstance(triton_backend().create_paged_store(store.config), TritonPagedStore)


@pytest.mark.spec("ENG-199")
@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (RunnerOptions(attention="triton", compile=True), "compile compiles the reference"),
        (RunnerOptions(attention="triton", decode_layers=True), "decode_layers"),
    ],
    ids=["compile", "decode-layers"],
)
def test_triton_with_what_captures_the_reference_is_refused(
    model: Qwen3ForCausalLM, options: RunnerOptions, reason: str
) -> None:
    """Kills a runner that compiles or runs the C decode program over the reference attention
    while claiming Triton's."""
    with pytest.raises(InvalidRequest, match=reason):
        ModelRunner.paged(model, store_for(model), options)


@pytest.mark.spec("ENG-199")
def test_triton_where_there_are_no_pages_or_no_reference_pools_is_refused(
    model: Qwen3ForCausalLM,
) -> None:
    """A v0 runner keeps no pages; a store that is not the reference's has no pools to read.
    Kills a v0 runner that takes the option and ignores it."""
    with pytest.raises(InvalidRequest, match="v1"):
        ModelRunner.recompute(model, TRITON)
    with pytest.raises(InvalidRequest, match="TorchPagedStore"):
        attention_store(TritonPagedStore(store_for(model)), TRITON)


@pytest.mark.spec("ENG-199")
def test_triton_on_a_device_other_than_cuda_is_refused() -> None:
    """A pool on the ``meta`` device (no data, another device than the CPU): refused naming
    CUDA. Kills a choice that launches on whatever device the pool is on."""
    store = TorchPagedStore(StoreConfig(1, 1, 4, 2, 2, device="meta"))
    with pytest.raises(InvalidRequest, match="runs on a CUDA device, not on meta"):
        attention_store(store, TRITON)


@pytest.mark.spec("ENG-199")
def test_triton_not_installed_is_refused(
    model: Qwen3ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kills a choice that fails with an ImportError instead of the option's error."""
    found = importlib.util.find_spec

    def without_triton(name: str, *args: Any) -> Any:
        return None if name == "triton" else found(name, *args)

    monkeypatch.setattr(attention_choice.importlib.util, "find_spec", without_triton)
    with pytest.raises(InvalidRequest, match="triton is not installed"):
        ModelRunner.paged(model, store_for(model), TRITON)


@pytest.mark.spec("ENG-199")
def test_triton_on_a_cpu_pool_without_the_interpreter_is_refused(tmp_path: Path) -> None:
    """In a process whose kernels are defined for a GPU (``TRITON_INTERPRET=0``), a CPU pool is
    refused naming the interpreter. Kills a choice that launches GPU kernels on CPU tensors."""
    if torch.cuda.is_available():
        pytest.skip("the check needs a machine whose kernels cannot run on its GPU")
    script = (
        "from pagedkv.accel.cuda.attention_choice import attention_store\n"
        "from pagedkv.engine.runner_options import RunnerOptions\n"
        "from pagedkv.errors import InvalidRequest\n"
        "from pagedkv.interfaces import PagedStore, StoreConfig\n"
        "from pagedkv.store.paged_store import TorchPagedStore\n"
        "store = TorchPagedStore(StoreConfig(1, 1, 4, 2, 2))\n"
        "try:\n"
        "    attention_store(store, RunnerOptions(attention='triton'))\n"
        "except InvalidRequest as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert "runs only under Triton's interpreter" in done.stdout, done.stderr
