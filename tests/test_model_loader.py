"""Checkpoint loading: config parsing, single-file and sharded safetensors, typed errors."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.errors import CheckpointError, InvalidRequest, UnsupportedModel
from pagedkv.model.config import ModelConfig
from pagedkv.model.loader import checkpoint_tensors, load_model
from pagedkv.testing.tiny_qwen3 import (
    PRESETS,
    build_hf_model,
    build_tiny_checkpoint,
    one_torch_thread,
)

TENSOR = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and much faster on a loaded machine."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(PRESETS["untied-mha"], tmp_path_factory.mktemp("untied"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(PRESETS["tied-gqa4-bias"], tmp_path_factory.mktemp("tied"))


def copy_of(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path: Path, **changes: torch.Tensor | None) -> None:
    """Rewrite model.safetensors with tensors replaced, added or (``None``) removed."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, file, metadata={"format": "pt"})


def base_config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }


# -- loading ------------------------------------------------------------------------------------


@pytest.mark.spec("GLD-001")
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_loads_every_tensor_of_a_checkpoint(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    model = load_model(path)
    reference = build_hf_model(PRESETS["untied-mha" if which == "untied" else "tied-gqa4-bias"])
    expected = dict(reference.named_parameters())
    ours = checkpoint_tensors(model, expected)
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    assert (model.lm_head is None) == (which == "tied")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.spec("GLD-007")
def test_merged_projections_load_part_by_part_or_whole(untied: Path, tmp_path: Path) -> None:
    """q/k/v and gate/up fill their rows of the merged weights in order; a checkpoint storing
    the merged tensor loads it whole; a missing part is named."""
    model = load_model(untied)
    stored = load_file(untied / "model.safetensors")
    attention = model.model.layers[1].self_attn
    q, k, v = attention.qkv_proj.weight.split(attention.qkv_proj.sizes)
    prefix = "model.layers.1.self_attn"
    assert torch.equal(q, stored[f"{prefix}.q_proj.weight"])
    assert torch.equal(k, stored[f"{prefix}.k_proj.weight"])
    assert torch.equal(v, stored[f"{prefix}.v_proj.weight"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, stored["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, stored["model.layers.0.mlp.up_proj.weight"])

    merged = copy_of(untied, tmp_path)
    parts = [stored[f"{prefix}.{p}_proj.weight"] for p in "qkv"]
    edit_tensors(
        merged,
        **{f"{prefix}.{p}_proj.weight".replace(".", "__"): None for p in "qkv"},
        **{f"{prefix}.qkv_proj.weight".replace(".", "__"): torch.cat(parts)},
    )
    for a, b in zip(load_model(merged).parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)

    edit_tensors(merged, **{f"{prefix}.qkv_proj.weight".replace(".", "__"): None})
    with pytest.raises(CheckpointError, match=re.escape(f"{prefix}.v_proj.weight")):
        load_model(merged)


@pytest.mark.spec("GLD-001")
def test_loads_a_sharded_checkpoint(untied: Path, tmp_path: Path) -> None:
    path = copy_of(untied, tmp_path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, path / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_model(path)
    single = load_model(untied)
    for (name, a), (_, b) in zip(
        sharded.named_parameters(), single.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name

    # a shard the index names but which is missing
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_model(path)


@pytest.mark.spec("GLD-005")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_loads_in_the_requested_dtype(untied: Path, dtype: str) -> None:
    model = load_model(untied, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.spec("GLD-005")
def test_unknown_dtype_is_invalid(untied: Path) -> None:
    with pytest.raises(InvalidRequest, match="int8"):
        load_model(untied, dtype="int8")


@pytest.mark.spec("GLD-005")
def test_unusable_device_is_invalid(untied: Path) -> None:
    with pytest.raises(InvalidRequest, match="device"):
        load_model(untied, device="warp-drive")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match="CUDA"):
            load_model(untied, device="cuda")


@pytest.mark.spec("GLD-001")
def test_tied_checkpoint_that_also_stores_the_head_loads(tied: Path, tmp_path: Path) -> None:
    path = copy_of(tied, tmp_path)
    embed = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    edit_tensors(path, lm_head__weight=embed.clone())
    model = load_model(path)
    assert model.lm_head is None


# -- checkpoint errors ------------------------------------------------------------------------


@pytest.mark.spec("GLD-003")
def test_missing_tensor_is_named(untied: Path, tmp_path: Path) -> None:
    path = copy_of(untied, tmp_path)
    edit_tensors(path, **{TENSOR.replace(".", "__"): None})
    with pytest.raises(CheckpointError, match=f"missing tensor.*'{re.escape(TENSOR)}'"):
        load_model(path)


@pytest.mark.spec("GLD-003")
def test_missing_head_of_an_untied_checkpoint_is_named(untied: Path, tmp_path: Path) -> None:
    path = copy_of(untied, tmp_path)
    edit_tensors(path, lm_head__weight=None)
    with pytest.raises(CheckpointError, match=re.escape("'lm_head.weight'")):
        load_model(path)


@pytest.mark.spec("GLD-003")
def test_wrong_shape_names_tensor_expected_and_found(untied: Path, tmp_path: Path) -> None:
    path = copy_of(untied, tmp_path)
    edit_tensors(path, **{TENSOR.replace(".", "__"): torch.zeros(63, 64)})
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert TENSOR in message
    assert "[63, 64]" in message
    assert "[64, 64]" in message


@pytest.mark.spec("GLD-003")
def test_unexpected_tensors_are_named(untied: Path, tmp_path: Path) -> None:
    path = copy_of(untied, tmp_path)
    edit_tensors(path, model__layers__7__mlp__up_proj__weight=torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match=re.escape("model.layers.7.mlp.up_proj.weight")):
        load_model(path)


@pytest.mark.spec("GLD-002")
def test_missing_directory_config_or_weights_name_the_path(untied: Path, tmp_path: Path) -> None:
    absent = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match="nowhere"):
        load_model(absent)
    path = copy_of(untied, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=re.escape("model.safetensors")):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape("config.json")):
        load_model(path)


@pytest.mark.spec("GLD-002")
def test_corrupt_weight_file_is_a_checkpoint_error(untied: Path, tmp_path: Path) -> None:
    path = copy_of(untied, tmp_path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=re.escape("model.safetensors")):
        load_model(path)


# -- config errors -----------------------------------------------------------------------------


@pytest.mark.spec("GLD-004")
def test_unknown_architecture_is_unsupported(untied: Path, tmp_path: Path) -> None:
    path = copy_of(untied, tmp_path)
    edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModel, match=r"architectures.*LlamaForCausalLM"):
        load_model(path)
    edit_config(path, architectures=["Qwen3ForCausalLM"], model_type="llama")
    with pytest.raises(UnsupportedModel, match=r"model_type.*llama"):
        load_model(path)


@pytest.mark.spec("GLD-004")
@pytest.mark.parametrize(
    "field", ["hidden_size", "vocab_size", "num_hidden_layers", "rms_norm_eps", "model_type"]
)
def test_missing_field_is_named(untied: Path, tmp_path: Path, field: str) -> None:
    path = copy_of(untied, tmp_path)
    edit_config(path, **{field: None})
    with pytest.raises(CheckpointError, match=field) as info:
        load_model(path)
    assert not isinstance(info.value, UnsupportedModel)


@pytest.mark.spec("GLD-004")
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4}}, "dynamic"),
        (
            {"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"type": "longrope"}},
            "rope_scaling.rope_type",
        ),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ],
)
def test_unsupported_options_are_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedModel, match=field):
        ModelConfig.from_dict(base_config() | changes)


@pytest.mark.spec("GLD-004")
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": "32"}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_parameters": None}, "rope_theta"),
        ({"eos_token_id": "eos"}, "eos_token_id"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ],
)
def test_invalid_fields_are_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(CheckpointError, match=field) as info:
        ModelConfig.from_dict({k: v for k, v in (base_config() | changes).items() if v is not None})
    assert not isinstance(info.value, UnsupportedModel)


@pytest.mark.spec("GLD-004")
def test_config_forms_and_defaults() -> None:
    new = ModelConfig.from_dict(base_config() | {"eos_token_id": [1, 2], "dtype": "bfloat16"})
    assert new.rope_theta == 1e6
    assert new.eos_token_id == (1, 2)
    assert new.dtype == "bfloat16"
    assert not new.tie_word_embeddings
    legacy = base_config()
    del legacy["rope_parameters"], legacy["head_dim"], legacy["num_key_value_heads"]
    legacy |= {
        "rope_theta": 5000,
        "torch_dtype": "float16",
        "eos_token_id": 7,
        "rope_scaling": None,
    }
    old = ModelConfig.from_dict(legacy)
    assert old.rope_theta == 5000.0
    assert old.head_dim == 32 // 4
    assert old.num_key_value_heads == 4
    assert old.eos_token_id == (7,)
    assert old.dtype == "float16"


@pytest.mark.spec("GLD-004")
def test_config_of_a_transformers_checkpoint(untied: Path) -> None:
    config = ModelConfig.from_dir(untied)
    spec = PRESETS["untied-mha"]
    assert (config.vocab_size, config.hidden_size, config.head_dim) == (
        spec.vocab,
        spec.hidden,
        spec.head_dim,
    )
    assert config.rope_theta == spec.rope_theta
    assert config.tie_word_embeddings is False
