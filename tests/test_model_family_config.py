"""The Qwen3 family's configs and checkpoints: RoPE variants, Qwen3-MoE fields and expert
tensors, the served context, and the config keys refused rather than ignored (GLD-030..)."""

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

from pagedkv.backend import ReferenceBackend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.runner import ModelRunner
from pagedkv.errors import CheckpointError, UnsupportedModel
from pagedkv.model.config import ModelConfig
from pagedkv.model.config_keys import INERT_KEYS, MOE_INERT_KEYS
from pagedkv.model.loader import checkpoint_tensors, load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.rope import inverse_frequencies
from pagedkv.testing.tiny_qwen3 import (
    FAMILY_PRESETS,
    build_hf_model,
    build_tiny_checkpoint,
    one_torch_thread,
)

EXPERT = "model.layers.1.mlp.experts"

#: Released checkpoints' config.json (Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B on the Hub).
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B: dict[str, Any] = {
    **{k: v for k, v in QWEN3_8B.items() if k not in ("max_window_layers",)},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
#: Qwen3's documented way to reach 131,072 tokens.
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and much faster on a loaded machine."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = FAMILY_PRESETS["moe-mixed-dense"]
    return build_tiny_checkpoint(spec, tmp_path_factory.mktemp("moe"))


def dense(**changes: Any) -> dict[str, Any]:
    """A small dense Qwen3 config with ``changes`` (``None`` removes a key)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1e6,
    }
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


def moe(**changes: Any) -> dict[str, Any]:
    """A small Qwen3-MoE config with ``changes``."""
    base = dense(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    base |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


# -- RoPE ---------------------------------------------------------------------------------------


@pytest.mark.spec("GLD-030")
def test_rope_forms_are_read_as_transformers_reads_them() -> None:
    legacy = ModelConfig.from_dict(dense(rope_scaling={"type": "linear", "factor": 2.0}))
    assert (legacy.rope.rope_type, legacy.rope.factor, legacy.rope.theta) == ("linear", 2.0, 1e6)
    new = ModelConfig.from_dict(
        dense(rope_theta=None, rope_parameters={"rope_theta": 5e5, **QWEN3_YARN})
    )
    assert (new.rope.rope_type, new.rope.theta, new.rope.factor) == ("yarn", 5e5, 4.0)
    assert new.rope.original_max_position_embeddings == 32768
    # rope_scaling wins over rope_parameters (they must not disagree), theta from the top level
    both = ModelConfig.from_dict(
        dense(rope_parameters={"rope_type": "yarn", "factor": 4.0}, rope_scaling=QWEN3_YARN)
    )
    assert both.rope.rope_type == "yarn"
    # yarn without original_max_position_embeddings: max_position_embeddings, as transformers
    bare = ModelConfig.from_dict(dense(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    assert bare.rope.original_max_position_embeddings == 4096
    # a top-level original_max_position_embeddings takes precedence, as in transformers
    top = dense(rope_scaling=QWEN3_YARN, original_max_position_embeddings=1024)
    assert ModelConfig.from_dict(top).rope.original_max_position_embeddings == 1024
    yarn = ModelConfig.from_dict(
        dense(
            rope_scaling={
                **QWEN3_YARN,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "attention_factor": 1.5,
                "truncate": False,
            }
        )
    ).rope
    assert (yarn.beta_fast, yarn.beta_slow, yarn.mscale, yarn.mscale_all_dim) == (16, 2, 1, 0.5)
    assert (yarn.attention_factor, yarn.truncate) == (1.5, False)
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope = ModelConfig.from_dict(dense(rope_scaling={"rope_type": "llama3", **llama3})).rope
    assert (rope.low_freq_factor, rope.high_freq_factor) == (1.0, 4.0)
    proportional = {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    rope = ModelConfig.from_dict(dense(rope_scaling=proportional)).rope
    assert (rope.partial_rotary_factor, rope.factor) == (0.25, 1.0)


@pytest.mark.spec("GLD-031")
@pytest.mark.parametrize(
    ("rope", "error", "names"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, UnsupportedModel, "'dynamic'"),
        ({"rope_type": "longrope", "factor": 2.0}, UnsupportedModel, "'longrope'"),
        ({"rope_type": "mrope"}, UnsupportedModel, "rope_scaling.rope_type"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, UnsupportedModel, "beta_fast"),
        ({"rope_type": "default", "factor": 2.0}, UnsupportedModel, "rope_scaling.factor"),
        (
            {"rope_type": "yarn", "partial_rotary_factor": 0.5, "factor": 2.0},
            UnsupportedModel,
            "partial_rotary_factor",
        ),
        ({"rope_type": "yarn"}, CheckpointError, "rope_scaling.factor"),
        ({"rope_type": "linear", "factor": -1}, CheckpointError, "rope_scaling.factor"),
        ({"rope_type": "yarn", "factor": 2.0, "truncate": "no"}, CheckpointError, "truncate"),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0.5},
            CheckpointError,
            "original_max_position_embeddings",
        ),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
            CheckpointError,
            "high_freq_factor",
        ),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
            CheckpointError,
            "high_freq_factor",
        ),
    ],
)
def test_rope_refusals_name_the_field(
    rope: dict[str, Any], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=re.escape(names)) as info:
        ModelConfig.from_dict(dense(rope_scaling=rope))
    assert "\n" not in str(info.value)
    if error is CheckpointError:
        assert not isinstance(info.value, UnsupportedModel)


@pytest.mark.spec("GLD-031")
def test_rope_scaling_and_rope_parameters_must_agree() -> None:
    """transformers silently drops ``rope_parameters`` when ``rope_scaling`` is set."""
    with pytest.raises(UnsupportedModel, match=r"rope_parameters\.rope_theta"):
        ModelConfig.from_dict(
            dense(rope_theta=None, rope_parameters={"rope_theta": 5e5}, rope_scaling=QWEN3_YARN)
        )
    with pytest.raises(UnsupportedModel, match=r"rope_parameters\.rope_type"):
        ModelConfig.from_dict(
            dense(rope_parameters={"rope_type": "default"}, rope_scaling=QWEN3_YARN)
        )
    with pytest.raises(CheckpointError, match="rope_theta"):
        ModelConfig.from_dict(dense(rope_theta=None, rope_scaling=QWEN3_YARN))


def hf_rope(rope: dict[str, Any], head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """transformers' own inverse frequencies and attention factor for ``rope``."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=dict(rope),
    )
    if rope["rope_type"] == "default":
        theta = config.rope_parameters["rope_theta"]
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (theta**exponents), 1.0
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    return inv_freq, float(factor)


ROPES: list[dict[str, Any]] = [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.5},
    {"rope_type": "yarn", "rope_theta": 1e6, **QWEN3_YARN},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 24},
    {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 8.0,
        "original_max_position_embeddings": 24,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 0.5, "original_max_position_embeddings": 64},
    {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "attention_factor": 1.25,
    },
    {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    {"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5},
    {"rope_type": "proportional", "rope_theta": 1e4},
]


@pytest.mark.spec("GLD-034")
@pytest.mark.parametrize("rope", ROPES, ids=lambda r: str(r["rope_type"]))
@pytest.mark.parametrize("head_dim", [16, 128])
def test_frequencies_equal_transformers(rope: dict[str, Any], head_dim: int) -> None:
    config = ModelConfig.from_dict(
        dense(
            head_dim=head_dim,
            rope_theta=None,
            rope_parameters=rope,
            max_position_embeddings=40960,
        )
    )
    ours, our_factor = inverse_frequencies(config.rope, head_dim)
    theirs, their_factor = hf_rope(rope, head_dim, 40960)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, theirs.float())
    assert our_factor == pytest.approx(their_factor, rel=1e-12)


@pytest.mark.spec("GLD-033")
@pytest.mark.parametrize(
    ("rope", "served"),
    [
        (None, 40960),
        (QWEN3_YARN, 131072),
        ({"rope_type": "linear", "factor": 2.0}, 81920),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 8192,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            40960,
        ),
    ],
)
def test_served_context_follows_the_scaling(rope: dict[str, Any] | None, served: int) -> None:
    config = ModelConfig.from_dict(QWEN3_8B | {"rope_scaling": rope})
    assert config.max_position_embeddings == 40960
    assert config.max_positions == served


@pytest.mark.spec("GLD-033")
def test_the_engine_caps_max_model_len_at_the_served_context(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(FAMILY_PRESETS["yarn"], tmp_path)
    runner = ModelRunner.from_model_dir(path, num_pages=8, page_size=16)
    assert runner.max_positions == 128  # 4 x 32, past max_position_embeddings (40)
    backend = ReferenceBackend()
    engine = backend.create_engine(runner, EngineConfig(num_pages=8, max_model_len=4096))
    assert engine.max_model_len == 128
    engine = backend.create_engine(runner, EngineConfig(num_pages=8, max_model_len=100))
    assert engine.max_model_len == 100


# -- config keys ----------------------------------------------------------------------------------


@pytest.mark.spec("GLD-035")
@pytest.mark.parametrize(
    "released", [QWEN3_8B, QWEN3_30B_A3B, QWEN3_30B_A3B | {"rope_scaling": QWEN3_YARN}]
)
def test_released_configs_build_the_parameters_transformers_builds(
    released: dict[str, Any],
) -> None:
    """Every key of the released configs is used or inert, and the model built on the meta
    device has exactly transformers' parameter names and shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = ModelConfig.from_dict(released)
    with torch.device("meta"):
        ours = Qwen3ForCausalLM(config)
        hf_config = AutoConfig.for_model(**released)
        theirs = AutoModelForCausalLM.from_config(hf_config)
    expected = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in checkpoint_tensors(ours, expected).items()}
    assert shapes == expected


@pytest.mark.spec("GLD-035")
@pytest.mark.parametrize(
    ("config", "key"),
    [
        (dense(quantization_config={"quant_method": "awq"}), "quantization_config"),
        (dense(num_experts=8), "num_experts"),  # a MoE field on a dense model
        (dense(output_router_logits=False), "output_router_logits"),
        (moe(some_new_option=True), "some_new_option"),
        (dense(is_encoder_decoder=True), "is_encoder_decoder"),
    ],
)
def test_unknown_keys_are_refused_by_name(config: dict[str, Any], key: str) -> None:
    with pytest.raises(UnsupportedModel, match=re.escape(repr(key))):
        ModelConfig.from_dict(config)


@pytest.mark.spec("GLD-035")
def test_inert_keys_change_nothing() -> None:
    inert: dict[str, Any] = {key: None for key in INERT_KEYS} | {"_name_or_path": "x"}
    inert |= {"attention_dropout": 0.3, "use_cache": False, "is_encoder_decoder": False}
    assert ModelConfig.from_dict(dense() | inert) == ModelConfig.from_dict(dense())
    moe_inert = {key: 1 for key in MOE_INERT_KEYS}
    assert ModelConfig.from_dict(moe() | moe_inert) == ModelConfig.from_dict(moe())


# -- Qwen3-MoE config -------------------------------------------------------------------------


@pytest.mark.spec("GLD-040")
def test_moe_fields_and_layer_kinds() -> None:
    config = ModelConfig.from_dict(
        moe(num_experts=None, num_local_experts=6, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert config.model_type == "qwen3_moe"
    assert config.moe is not None
    assert (config.moe.num_experts, config.moe.num_experts_per_tok) == (6, 2)
    assert [config.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    assert config.moe.norm_topk_prob is False
    assert ModelConfig.from_dict(dense()).moe is None


@pytest.mark.spec("GLD-040")
@pytest.mark.parametrize(
    ("changes", "error", "names"),
    [
        ({"architectures": ["Qwen3ForCausalLM"]}, UnsupportedModel, "architectures"),
        ({"num_experts": None}, CheckpointError, "num_experts"),
        ({"num_local_experts": 4}, CheckpointError, "num_local_experts"),
        ({"num_experts_per_tok": 9}, CheckpointError, "num_experts_per_tok"),
        ({"moe_intermediate_size": None}, CheckpointError, "moe_intermediate_size"),
        ({"decoder_sparse_step": 0}, CheckpointError, "decoder_sparse_step"),
        ({"mlp_only_layers": [4]}, CheckpointError, "mlp_only_layers"),
        ({"norm_topk_prob": "yes"}, CheckpointError, "norm_topk_prob"),
    ],
)
def test_moe_config_errors_name_the_field(
    changes: dict[str, Any], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names) as info:
        ModelConfig.from_dict(moe(**changes))
    if error is CheckpointError:
        assert not isinstance(info.value, UnsupportedModel)
    with pytest.raises(UnsupportedModel, match="architectures"):
        ModelConfig.from_dict(dense(architectures=["Qwen3MoeForCausalLM"]))


# -- Qwen3-MoE checkpoints ----------------------------------------------------------------------


@pytest.mark.spec("GLD-042")
def test_per_expert_tensors_load_into_the_stacked_experts(moe_dir: Path) -> None:
    """The checkpoint stores experts one tensor each (as save_pretrained writes them); the
    loaded stacked parameters equal transformers' in-memory ones bit for bit."""
    stored = load_file(moe_dir / "model.safetensors")
    assert f"{EXPERT}.0.gate_proj.weight" in stored
    assert f"{EXPERT}.gate_up_proj" not in stored
    theirs = dict(build_hf_model(FAMILY_PRESETS["moe-mixed-dense"]).named_parameters())
    ours = checkpoint_tensors(load_model(moe_dir), theirs)
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.spec("GLD-042")
def test_stacked_expert_tensors_load_too(moe_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "stacked"
    shutil.copytree(moe_dir, path)
    tensors = load_file(path / "model.safetensors")
    experts = FAMILY_PRESETS["moe-mixed-dense"].experts
    gate_up = [
        torch.cat([tensors.pop(f"{EXPERT}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")])
        for e in range(experts)
    ]
    down = [tensors.pop(f"{EXPERT}.{e}.down_proj.weight") for e in range(experts)]
    tensors[f"{EXPERT}.gate_up_proj"] = torch.stack(gate_up)
    tensors[f"{EXPERT}.down_proj"] = torch.stack(down)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    for a, b in zip(load_model(path).parameters(), load_model(moe_dir).parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.spec("GLD-042")
def test_expert_tensor_errors_name_the_tensor(moe_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "broken"
    shutil.copytree(moe_dir, path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    name = f"{EXPERT}.5.up_proj.weight"
    good = tensors.pop(name)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}'")):
        load_model(path)
    save_file(tensors | {name: good[:-1]}, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(name)) as info:
        load_model(path)
    assert str(list(good.shape)) in str(info.value)
    extra = {name: good, f"{EXPERT}.6.up_proj.weight": good.clone()}
    save_file(tensors | extra, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{EXPERT}.6.up_proj.weight")):
        load_model(path)


@pytest.mark.spec("GLD-040")
def test_a_moe_checkpoints_config_round_trips(moe_dir: Path) -> None:
    """transformers 5 writes ``num_local_experts``; it is read as ``num_experts``."""
    raw = json.loads((moe_dir / "config.json").read_text())
    config = ModelConfig.from_dir(moe_dir)
    assert config.moe is not None
    assert config.moe.num_experts == raw.get("num_local_experts", raw.get("num_experts"))
    assert config.moe.mlp_only_layers == tuple(raw["mlp_only_layers"])
