"""What each tensor-parallel rank holds of a model, checked in one process (no workers): the
blocks of every parameter against the whole model, K/V head replication, the models a group
cannot split, and reads of blocks only (specs/tensor-parallel.md, TP-001..005, TP-024)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401  (autouse: one torch thread)

from pagedkv.backend import ReferenceBackend
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest, UnsupportedModel
from pagedkv.interfaces import AttentionBatch
from pagedkv.model import loader
from pagedkv.model.checkpoint_layout import ShardedPiece
from pagedkv.model.config import ModelConfig
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.step_attention import RecomputeStepAttention
from pagedkv.model.tensor_parallel import ShardLayout
from pagedkv.parallel.launch import device_type
from pagedkv.plan import StepPlan
from pagedkv.testing.tiny_qwen3 import TinySpec, build_tiny_checkpoint, preset_spec

#: (preset, ranks): every dense preset at 2 ranks, the replicated-K/V preset at 2 and 3, and
#: both MoE expert layouts at 2.
CASES = [
    ("tied-gqa2", 2),
    ("untied-mha", 2),
    ("untied-gqa4-wide", 2),
    ("tied-gqa4-bias", 2),
    ("tp3-kv1", 2),
    ("tp3-kv1", 3),
    ("moe-top2-norm", 2),
    ("moe-mixed-dense", 2),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-layout")
    names = {preset for preset, _ in CASES}
    return {name: build_tiny_checkpoint(preset_spec(name), root / name) for name in names}


def expected_block(
    name: str, whole: dict[str, torch.Tensor], config: ModelConfig, layout: ShardLayout
) -> torch.Tensor:
    """What rank ``layout.rank`` must hold of parameter ``name``, cut from the whole model's
    parameters by the rules of TP-001 and TP-002 (written here independently of the loader)."""
    r, d = layout.rank, config.head_dim
    tensor = whole[name]
    q = layout.num_heads * d
    kv = layout.num_kv_heads * d
    kv0 = layout.kv_head_start * d
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        qs, ks = config.q_size, config.kv_size
        return torch.cat(
            [
                tensor[r * q : (r + 1) * q],
                tensor[qs + kv0 : qs + kv0 + kv],
                tensor[qs + ks + kv0 : qs + ks + kv0 + kv],
            ]
        )
    if name.endswith("o_proj.weight"):
        return tensor[:, r * q : (r + 1) * q]
    if name.endswith("mlp.gate_up_proj.weight"):
        rows, full = layout.intermediate, config.intermediate_size
        return torch.cat(
            [tensor[r * rows : (r + 1) * rows], tensor[full + r * rows : full + (r + 1) * rows]]
        )
    if name.endswith("mlp.down_proj.weight"):
        return tensor[:, r * layout.intermediate : (r + 1) * layout.intermediate]
    if name.endswith("experts.gate_up_proj"):
        rows = layout.moe_intermediate
        full = tensor.shape[1] // 2
        return torch.cat(
            [
                tensor[:, r * rows : (r + 1) * rows],
                tensor[:, full + r * rows : full + (r + 1) * rows],
            ],
            dim=1,
        )
    if name.endswith("experts.down_proj"):
        rows = layout.moe_intermediate
        return tensor[:, :, r * rows : (r + 1) * rows]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        block = tensor[layout.vocab_start : layout.vocab_stop]
        padding = layout.vocab_rows - block.shape[0]
        return torch.cat([block, torch.zeros(padding, block.shape[1], dtype=block.dtype)])
    return tensor  # replicated: norms, the router, o_proj's bias


@pytest.mark.spec("TP-001", "TP-002")
@pytest.mark.parametrize(("preset", "size"), CASES, ids=[f"{p}-tp{n}" for p, n in CASES])
def test_each_rank_holds_its_blocks(checkpoints: dict[str, Path], preset: str, size: int) -> None:
    path = checkpoints[preset]
    whole_model = load_model(path)
    whole = dict(whole_model.named_parameters())
    config = whole_model.config
    for rank in range(size):
        shard = load_model(path, tp_rank=rank, tp_size=size)
        layout = shard.layout
        assert layout == ShardLayout.of(config, rank, size)
        assert layout.num_heads * size == config.num_attention_heads
        for name, param in shard.named_parameters():
            expected = expected_block(name, whole, config, layout)
            assert param.shape == expected.shape, name
            assert torch.equal(param, expected), f"rank {rank} of {size}: {name}"
        attention = shard.model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (
            layout.num_heads,
            layout.num_kv_heads,
        )


@pytest.mark.spec("TP-002")
@pytest.mark.parametrize(
    ("kv_heads", "size", "held", "first_heads"),
    [
        (4, 2, 2, [0, 2]),  # split: two heads each
        (2, 2, 1, [0, 1]),  # split: one head each
        (2, 4, 1, [0, 0, 1, 1]),  # replicated twice
        (1, 3, 1, [0, 0, 0]),  # replicated three times
        (8, 4, 2, [0, 2, 4, 6]),
    ],
)
def test_kv_heads_split_or_replicated(
    kv_heads: int, size: int, held: int, first_heads: list[int]
) -> None:
    config = ModelConfig.from_dict(
        {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 24,
            "num_key_value_heads": kv_heads,
            "head_dim": 8,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        }
    )
    layouts = [ShardLayout.of(config, r, size) for r in range(size)]
    assert [x.num_kv_heads for x in layouts] == [held] * size
    assert [x.kv_head_start for x in layouts] == first_heads
    assert [x.vocab_start for x in layouts] == [min(r * -(-100 // size), 100) for r in range(size)]
    assert layouts[-1].vocab_stop == 100


def _config(**fields: object) -> ModelConfig:
    raw: dict[str, object] = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    raw.update(fields)
    return ModelConfig.from_dict(raw)


@pytest.mark.spec("TP-003")
@pytest.mark.parametrize(
    ("fields", "size", "named"),
    [
        ({}, 4, "num_attention_heads=6"),
        ({"num_attention_heads": 6, "num_key_value_heads": 2}, 3, "num_key_value_heads=2"),
        (
            {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 90},
            4,
            "intermediate_size=90",
        ),
    ],
)
def test_unsplittable_models_are_refused(fields: dict[str, object], size: int, named: str) -> None:
    with pytest.raises(UnsupportedModel) as info:
        ShardLayout.of(_config(**fields), 0, size)
    assert named in str(info.value)
    assert f"tensor_parallel_size={size}" in str(info.value)


@pytest.mark.spec("TP-003")
def test_unsplittable_experts_and_bad_sizes_are_refused(tmp_path: Path) -> None:
    spec = TinySpec(experts=4, moe_intermediate=30, intermediate=128, seed=5)
    path = build_tiny_checkpoint(spec, tmp_path / "moe")
    with pytest.raises(UnsupportedModel, match="moe_intermediate_size=30"):
        load_model(path, tp_rank=0, tp_size=4)
    for size in (0, -1):
        with pytest.raises(InvalidRequest, match="tensor_parallel_size"):
            ShardLayout.of(_config(), 0, size)
    with pytest.raises(InvalidRequest, match="rank 2"):
        ShardLayout.of(_config(), 2, 2)
    with pytest.raises(InvalidRequest, match="tensor_parallel_size"):
        ReferenceBackend(tensor_parallel_size=0).create_model_runner(
            str(path), num_pages=4, page_size=4
        )


@pytest.mark.spec("TP-004")
@pytest.mark.parametrize("preset", ["tp3-kv1", "moe-top2-norm"])
def test_a_rank_reads_only_its_blocks(
    checkpoints: dict[str, Path], preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: dict[str, tuple[int, ...]] = {}
    read = loader._read

    def recording(handle: loader._Handle, piece: ShardedPiece, path: Path) -> torch.Tensor:
        tensor = read(handle, piece, path)
        reads[piece.tensor] = max(reads.get(piece.tensor, ()), tuple(tensor.shape))
        assert tuple(tensor.shape) == _block_shape(piece), piece.tensor  # the block only
        return tensor

    monkeypatch.setattr(loader, "_read", recording)
    shard = load_model(checkpoints[preset], tp_rank=1, tp_size=2)
    layout, config = shard.layout, shard.config
    d = config.head_dim
    q_proj = reads["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj[0] * 2 == config.num_attention_heads * d  # half of the whole tensor
    assert reads["model.layers.0.self_attn.q_proj.weight"] == (
        layout.num_heads * d,
        config.hidden_size,
    )
    assert reads["model.layers.0.self_attn.o_proj.weight"] == (
        config.hidden_size,
        layout.num_heads * d,
    )
    assert reads["model.embed_tokens.weight"][0] == layout.vocab_stop - layout.vocab_start
    assert reads["model.norm.weight"] == (config.hidden_size,)  # replicated: whole
    if config.moe is not None:
        assert reads["model.layers.0.mlp.experts.0.down_proj.weight"] == (
            config.hidden_size,
            layout.moe_intermediate,
        )


def _block_shape(piece: ShardedPiece) -> tuple[int, ...]:
    """The shape of ``piece.source``'s block of the whole tensor."""
    shape = list(piece.shape)
    for dim, span in enumerate(piece.source):
        start, stop, _ = span.indices(piece.shape[dim])
        shape[dim] = stop - start
    return tuple(shape)


class _OtherRank:
    """Collectives of a rank other than 0 as its model sees them: sums pass through (the
    numbers are not checked here), the gather gives it nothing."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return None


@pytest.mark.spec("TP-005")
def test_other_ranks_get_empty_logits(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["tied-gqa2"]
    config = ModelConfig.from_dir(path)
    model: Qwen3ForCausalLM = load_model(path, tp_rank=1, tp_size=2, collectives=_OtherRank())
    assert model.config == config
    ids = torch.tensor([3, 4, 5, 9, 1], dtype=torch.int64)
    plan = StepPlan(
        input_ids=ids,
        positions=torch.tensor([0, 1, 2, 0, 1]),
        attention=AttentionBatch(
            query_start=torch.tensor([0, 3, 5]), context_lens=torch.tensor([3, 2]), page_tables=None
        ),
        logits_indices=torch.tensor([2, 4]),
    )
    with torch.inference_mode():
        logits = model(plan, RecomputeStepAttention.prepare(plan))
    assert logits.shape == (2, 0)


@pytest.mark.spec("TP-024")
def test_options_a_group_cannot_honour_are_refused(checkpoints: dict[str, Path]) -> None:
    path = str(checkpoints["tied-gqa2"])
    for options, name in (
        (RunnerOptions(compile=True), "compile"),
        (RunnerOptions(cuda_graphs=True), "cuda_graphs"),
    ):
        backend = ReferenceBackend(tensor_parallel_size=2, runner_options=options)
        with pytest.raises(InvalidRequest, match=name):
            backend.create_model_runner(path, num_pages=8, page_size=4)
    with pytest.raises(InvalidRequest, match="cuda:1"):
        device_type("cuda:1", 2)
    with pytest.raises(InvalidRequest, match="not device"):
        device_type("meta", 2)
    assert device_type("cpu", 2) == "cpu"
    assert device_type("cuda", 2) == "cuda"
